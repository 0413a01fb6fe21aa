"""The on-call engineer's actions on an incident: acknowledge it, give it an owner, add
notes, link and unlink alerts. Each runs in a write transaction of its own and is written to
the hash-chained audit log under ``incident:<id>``, which is what the incident's timeline
(:mod:`collector.alerting.timeline`) reads back: the audit entry is the record, so a note
or an acknowledgement can neither be lost from the timeline nor edited without ``kvwatch
audit verify`` saying so.

Also the one rule for which alerts belong to an incident without a person linking them
(:func:`link_related`): when it opens, the deployment's warning and critical alerts active
then or resolved within the hour before (the causes a stale read comes after: the pool
smaller than the context, rejected prefills that still transferred, prompts past the limit),
and any that fire on the deployment while it is open. An alert an operator unlinked is not
linked back to that incident.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, or_, select, update

from collector import audit
from collector.alerting import repository as repo
from collector.alerting.notifications import Notifier
from collector.alerting.queries import incident_with_alerts
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.timefmt import to_micros

NOTE_MAX = 4000
NAME_MAX = 256
# Alerts that resolved this long before an incident opened are still among its causes.
RELATED_BEFORE_S = 3600
_LINKED_SEVERITIES = ("warning", "critical")


def link_related(
    conn: Connection, incident_id: int, deployment_id: str, now_us: int, *, alert_ids: Any = None
) -> list[int]:
    """Link the deployment's causal alerts to its open incident (see the module's rule);
    ``alert_ids`` narrows it to those alerts (a pass's newly firing ones). Each link is
    audited as the collector's. Returns the ids linked."""
    a = repo.A
    since = now_us - RELATED_BEFORE_S * 1_000_000
    q = select(a.c.id).where(
        a.c.deployment_id == deployment_id,
        a.c.incident_id.is_(None),
        a.c.severity.in_(_LINKED_SEVERITIES),
        or_(a.c.unlinked_from.is_(None), a.c.unlinked_from != incident_id),
        or_(a.c.state == "firing", and_(a.c.state == "resolved", a.c.resolved_at >= since)),
    )
    if alert_ids is not None:
        q = q.where(a.c.id.in_(list(alert_ids)))
    ids = list(conn.execute(q.order_by(a.c.id)).scalars())
    if not ids:
        return []
    conn.execute(update(a).where(a.c.id.in_(ids)).values(incident_id=incident_id))
    for alert_id in ids:
        _log(
            conn,
            now_us,
            "kvwatch",
            "incident.link",
            incident_id,
            {"alert_id": alert_id, "why": "active on the deployment"},
        )
    return ids


def _log(
    conn: Connection,
    now_us: int,
    by: str,
    action: str,
    incident_id: int,
    detail: dict[str, Any] | None = None,
) -> None:
    """The step's record, under the incident: what its timeline reads."""
    audit.append(
        conn,
        now_us=now_us,
        actor=by,
        action=action,
        subject=f"incident:{incident_id}",
        detail=detail,
    )


def _text(value: str, field: str, limit: int) -> str:
    value = value.strip()
    if not value:
        raise InvalidInput(f"{field} must not be empty", {"field": field})
    if len(value) > limit:
        raise InvalidInput(f"{field} is longer than {limit} characters", {"field": field})
    if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise InvalidInput(f"{field} holds a character that cannot be stored", {"field": field})
    return value


class IncidentWorkflow:
    def __init__(self, db: Database, notifier: Notifier):
        self.db = db
        self.notifier = notifier

    def _open(self, conn: Connection, incident_id: int, doing: str) -> Any:
        inc = repo.get_incident(conn, incident_id, lock=True)
        if inc is None:
            raise NotFound(f"no incident {incident_id}")
        if inc.state != "open" and doing:
            raise Conflict(f"incident {incident_id} is closed; {doing} is for open incidents")
        return inc

    def ack(self, incident_id: int, by: str, now: datetime) -> dict[str, Any]:
        """Acknowledge: someone is on it. The first acknowledgement stands; receivers are told
        (``incident.acknowledged``), so a pager stops escalating."""
        by = _text(by, "by", NAME_MAX)
        now_us = to_micros(now)
        with self.db.write() as conn:
            inc = self._open(conn, incident_id, "acknowledging")
            if inc.acked_at is not None:
                return incident_with_alerts(conn, incident_id)
            repo.update_incident(conn, incident_id, {"acked_at": now_us, "acked_by": by})
            _log(conn, now_us, by, "incident.ack", incident_id)
            self.notifier.incident(conn, incident_id, "incident.acknowledged", now_us)
            return incident_with_alerts(conn, incident_id)

    def assign(self, incident_id: int, owner: str, by: str, now: datetime) -> dict[str, Any]:
        owner, by = _text(owner, "owner", NAME_MAX), _text(by, "by", NAME_MAX)
        now_us = to_micros(now)
        with self.db.write() as conn:
            inc = self._open(conn, incident_id, "assigning an owner")
            if inc.owner != owner:
                repo.update_incident(conn, incident_id, {"owner": owner})
                _log(
                    conn,
                    now_us,
                    by,
                    "incident.owner",
                    incident_id,
                    {"owner": owner, "previous": inc.owner},
                )
            return incident_with_alerts(conn, incident_id)

    def note(self, incident_id: int, text: str, by: str, now: datetime) -> dict[str, Any]:
        """A note, on an open or a closed incident (what was found after closing belongs in
        the record too)."""
        text, by = _text(text, "text", NOTE_MAX), _text(by, "by", NAME_MAX)
        now_us = to_micros(now)
        with self.db.write() as conn:
            self._open(conn, incident_id, "")
            _log(conn, now_us, by, "incident.note", incident_id, {"text": text})
            return incident_with_alerts(conn, incident_id)

    def link(self, incident_id: int, alert_id: int, by: str, now: datetime) -> dict[str, Any]:
        by = _text(by, "by", NAME_MAX)
        now_us = to_micros(now)
        with self.db.write() as conn:
            self._open(conn, incident_id, "linking alerts")
            a = repo.get_alert(conn, alert_id, lock=True)
            if a is None:
                raise NotFound(f"no alert {alert_id}")
            if a.incident_id == incident_id:
                return incident_with_alerts(conn, incident_id)
            if a.incident_id is not None:
                other = repo.get_incident(conn, a.incident_id)
                if other is not None and other.state == "open":
                    raise Conflict(
                        f"alert {alert_id} belongs to open incident {a.incident_id}; "
                        "unlink it there first"
                    )
            repo.update_alert(conn, alert_id, {"incident_id": incident_id, "unlinked_from": None})
            _log(conn, now_us, by, "incident.link", incident_id, {"alert_id": alert_id})
            return incident_with_alerts(conn, incident_id)

    def unlink(self, incident_id: int, alert_id: int, by: str, now: datetime) -> dict[str, Any]:
        by = _text(by, "by", NAME_MAX)
        now_us = to_micros(now)
        with self.db.write() as conn:
            inc = self._open(conn, incident_id, "unlinking alerts")
            a = repo.get_alert(conn, alert_id, lock=True)
            if a is None or a.incident_id != incident_id:
                raise NotFound(f"alert {alert_id} is not linked to incident {incident_id}")
            if alert_id == inc.first_alert_id:
                raise Conflict(
                    f"alert {alert_id} opened incident {incident_id}; it cannot be unlinked "
                    "(close the incident if it was a false alarm)"
                )
            repo.update_alert(conn, alert_id, {"incident_id": None, "unlinked_from": incident_id})
            _log(conn, now_us, by, "incident.unlink", incident_id, {"alert_id": alert_id})
            return incident_with_alerts(conn, incident_id)
