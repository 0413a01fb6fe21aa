"""The case register of one incident as one JSON document: its logged facts, each party's
notification status (:func:`collector.cases.status.party_status`) and the decision register.
What ``GET /v1/incidents/{id}/case``, ``kvwatch incidents case`` and the dashboard show."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Any

from collector.cases.register import decisions_for
from collector.cases.status import duty, incident_facts, party_status
from collector.db import Database
from collector.settings import Settings
from collector.timefmt import iso


def case_view(
    db: Database, settings: Settings, incident_id: int, *, now: datetime
) -> dict[str, Any]:
    with db.read() as conn:
        inc = incident_facts(conn, incident_id)
        parties = party_status(conn, incident_id, settings, now=now)
        decisions = decisions_for(conn, incident_id)
    return {
        "incident_id": incident_id,
        "role": settings.operator_role,
        "awareness_at": iso(inc.awareness_at),
        "deadline_at": iso(inc.deadline_at),
        # the operator's own clock: what "notify by" means for this role
        "duty": asdict(duty(settings, inc, parties)),
        "parties": [asdict(p) for p in parties],
        "decisions": [asdict(d) for d in decisions],
    }
