"""The decision register (GDPR Art. 33(5)): decisions and measures recorded against an
incident, with who, when and why, each written to the audit log beside its row.

Invariants: append-only (a change of mind is a new decision that ``supersedes`` an earlier
one of the same incident, and a decision is superseded at most once); a decision is validated
whole before anything is written.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args

from collector import audit
from collector.cases import repository as repo
from collector.cases.register import Decision, decisions_for
from collector.db import Database
from collector.errors import InvalidInput, NotFound
from collector.timefmt import to_micros

Kind = Literal[
    "containment", "engine_upgrade", "deletion_request", "art34", "notification", "other"
]
KINDS: tuple[str, ...] = get_args(Kind)
STATUSES = ("done", "open")
ACTION = "incident.decision"
_TEXT_MAX = 4000
_NAME_MAX = 256


def _validate(kind: str, status: str, what: str, why: str, by: str) -> tuple[str, str, str]:
    if kind not in KINDS:
        raise InvalidInput(f"kind {kind!r}: one of {', '.join(KINDS)}", {"kind": kind})
    if status not in STATUSES:
        raise InvalidInput(f"status {status!r}: done or open", {"status": status})
    what, why, by = what.strip(), why.strip(), by.strip()
    for name, value, most in (
        ("what", what, _TEXT_MAX),
        ("why", why, _TEXT_MAX),
        ("by", by, _NAME_MAX),
    ):
        if not value:
            raise InvalidInput(f"{name}: must not be empty", {name: value})
        if len(value) > most:
            raise InvalidInput(f"{name}: at most {most} characters", {name: value[:40]})
    return what, why, by


class DecisionService:
    def __init__(self, db: Database):
        self.db = db

    def listing(self, incident_id: int) -> list[Decision]:
        with self.db.read() as conn:
            if not repo.incident_exists(conn, incident_id):
                raise NotFound(f"no incident {incident_id}")
            return decisions_for(conn, incident_id)

    def decide(
        self,
        incident_id: int,
        *,
        kind: str,
        status: str,
        what: str,
        why: str,
        by: str,
        now: datetime,
        supersedes: int | None = None,
    ) -> Decision:
        """Record a decision; returns it as the register reads it."""
        what, why, by = _validate(kind, status, what, why, by)
        now_us = to_micros(now)
        with self.db.write() as conn:
            if not repo.incident_exists(conn, incident_id):
                raise NotFound(f"no incident {incident_id}")
            if supersedes is not None:
                old = repo.decision(conn, supersedes)
                if old is None or old.incident_id != incident_id:
                    raise InvalidInput(
                        f"supersedes {supersedes}: no such decision of incident {incident_id}",
                        {"supersedes": supersedes},
                    )
                later = repo.superseded_by(conn, supersedes)
                if later is not None:
                    raise InvalidInput(
                        f"supersedes {supersedes}: already superseded by decision {later}",
                        {"supersedes": supersedes},
                    )
            values: dict[str, Any] = {
                "incident_id": incident_id,
                "ts": now_us,
                "actor": by,
                "kind": kind,
                "status": status,
                "what": what,
                "why": why,
                "supersedes": supersedes,
            }
            new_id = repo.insert_decision(conn, values)
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action=ACTION,
                subject=f"incident:{incident_id}",
                detail={
                    "decision_id": new_id,
                    "kind": kind,
                    "status": status,
                    "what": what,
                    "why": why,
                    "supersedes": supersedes,
                },
            )
            return next(d for d in decisions_for(conn, incident_id) if d.id == new_id)
