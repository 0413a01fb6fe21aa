"""The incident's own facts as evidence: when kvwatch became aware of it (``awareness_at``)
and its notification deadline (``deadline_at``).

Both are written to the audit log when the incident opens (``incident.opened``'s detail) and
every later change goes through :func:`set_fact`, with who and why, logged as
``incident.fact_changed`` with the old and the new value.

Invariant: for every incident, the database's ``awareness_at`` and ``deadline_at`` equal the
latest values the audit log records for it. :func:`check` (run by ``kvwatch audit verify``
and ``GET /v1/audit/verify`` after the chain check) names the incident and the field where
they differ: a database edit that bypassed :func:`set_fact`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, get_args

import msgspec
from sqlalchemy import BigInteger, Connection, select, type_coerce, update

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput, NotFound
from collector.timefmt import iso, parse_iso, to_micros

Field = Literal["awareness_at", "deadline_at"]
FIELDS: tuple[Field, ...] = get_args(Field)
OPENED = "incident.opened"
CHANGED = "incident.fact_changed"
_TEXT_MAX = 2000


@dataclass(frozen=True, slots=True)
class Logged:
    """A fact's latest logged value and the audit entry that logged it."""

    value: str
    entry_id: int


@dataclass(frozen=True, slots=True)
class FactProblem:
    incident_id: int
    field: str
    problem: str


def set_fact(
    conn: Connection,
    incident_id: int,
    field: str,
    at_us: int,
    *,
    why: str,
    by: str,
    now_us: int,
) -> dict[str, Any]:
    """Change ``field`` of the incident to ``at_us`` in the caller's transaction and log it
    (old and new value, who, why). Validated before anything is written: a known field, a
    reason and a person, and awareness never after the deadline."""
    if field not in FIELDS:
        raise InvalidInput(
            f"field {field!r}: not an incident fact (one of {', '.join(FIELDS)})",
            {"field": field},
        )
    why, by = why.strip(), by.strip()
    if not why:
        raise InvalidInput("why: say why the fact changes (it is kept in the audit log)")
    if not by:
        raise InvalidInput("by: name the person who changes it")
    if len(why) > _TEXT_MAX:
        raise InvalidInput(f"why: at most {_TEXT_MAX} characters")
    i = m.Incident
    row = conn.execute(
        select(
            type_coerce(i.awareness_at, BigInteger).label("awareness_at"),
            type_coerce(i.deadline_at, BigInteger).label("deadline_at"),
        ).where(i.id == incident_id)
    ).one_or_none()
    if row is None:
        raise NotFound(f"no incident {incident_id}")
    values = {"awareness_at": row.awareness_at, "deadline_at": row.deadline_at, field: at_us}
    if values["awareness_at"] > values["deadline_at"]:
        raise InvalidInput(
            f"{field} {iso(at_us)}: awareness ({iso(values['awareness_at'])}) would fall after "
            f"the deadline ({iso(values['deadline_at'])})",
            {"field": field},
        )
    old = iso(getattr(row, field))
    conn.execute(update(i).where(i.id == incident_id).values({field: at_us}))
    detail = {"field": field, "old": old, "new": iso(at_us), "why": why}
    was = logged(conn, incident_id).get(incident_id, {}).get(field)
    if was is not None and was.value != old:
        # The database had been edited outside kvwatch: the trail says so, so that this
        # change cannot pass for an ordinary one.
        detail["logged_before"] = was.value
    audit.append(
        conn,
        now_us=now_us,
        actor=by,
        action=CHANGED,
        subject=f"incident:{incident_id}",
        detail=detail,
    )
    return {"incident_id": incident_id, "by": by, "at": iso(now_us), **detail}


def logged(conn: Connection, incident_id: int | None = None) -> dict[int, dict[str, Logged]]:
    """Every incident's facts as the audit log last records them. An opening logged before
    ``awareness_at`` was in its detail gives the entry's own time (the incident was opened
    at awareness). A redacted detail records nothing (the fact is then unknown)."""
    a = m.AuditEntry
    q = select(
        a.id, type_coerce(a.ts, BigInteger).label("ts"), a.action, a.subject, a.detail
    ).where(a.action.in_((OPENED, CHANGED)), a.subject.like("incident:%"))
    if incident_id is not None:
        q = q.where(a.subject == f"incident:{incident_id}")
    rows = conn.execute(q.order_by(a.id))
    out: dict[int, dict[str, Logged]] = {}
    for r in rows:
        try:
            incident_id = int(str(r.subject).removeprefix("incident:"))
            detail = msgspec.json.decode(r.detail or "{}")
        except (ValueError, msgspec.DecodeError):
            continue
        if not isinstance(detail, dict) or "redacted_by_entry" in detail:
            continue
        facts = out.setdefault(incident_id, {})
        if r.action == OPENED:
            facts["awareness_at"] = Logged(str(detail.get("awareness_at") or iso(r.ts)), r.id)
            if detail.get("deadline_at"):
                facts["deadline_at"] = Logged(str(detail["deadline_at"]), r.id)
        elif detail.get("field") in FIELDS and detail.get("new"):
            facts[detail["field"]] = Logged(str(detail["new"]), r.id)
    return out


def check(conn: Connection) -> list[FactProblem]:
    """Every incident whose awareness or deadline in the database is not what the audit log
    last records for it, by incident id and field."""
    i = m.Incident
    facts = logged(conn)
    problems: list[FactProblem] = []
    rows = conn.execute(
        select(
            i.id,
            type_coerce(i.awareness_at, BigInteger).label("awareness_at"),
            type_coerce(i.deadline_at, BigInteger).label("deadline_at"),
        ).order_by(i.id)
    )
    for r in rows:
        known = facts.get(r.id)
        if known is None:
            problems.append(
                FactProblem(r.id, "incident", "the audit log never recorded its opening")
            )
            continue
        for field in FIELDS:
            have = iso(getattr(r, field))
            was = known.get(field)
            if was is None:
                problems.append(FactProblem(r.id, field, "no value of it is logged"))
            elif have != was.value:
                problems.append(
                    FactProblem(
                        r.id,
                        field,
                        f"the database holds {have}; the audit log's latest value is "
                        f"{was.value} (entry {was.entry_id}): changed without "
                        "`kvwatch incidents set-…`",
                    )
                )
    return problems


def describe(problems: list[FactProblem]) -> str:
    """One line naming each incident and field that differs."""
    return "; ".join(f"incident {p.incident_id} {p.field}: {p.problem}" for p in problems)


class FactService:
    """:func:`set_fact` in a transaction of its own (the CLI's and the API's)."""

    def __init__(self, db: Database):
        self.db = db

    def set(
        self, incident_id: int, field: str, at: datetime, *, why: str, by: str, now: datetime
    ) -> dict[str, Any]:
        with self.db.write() as conn:
            return set_fact(
                conn, incident_id, field, to_micros(at), why=why, by=by, now_us=to_micros(now)
            )


def as_logged(
    conn: Connection, incident_id: int, awareness_us: int, deadline_us: int
) -> tuple[int, int]:
    """The incident's (awareness, deadline) in µs as the audit log last records them; the
    database's values stand in only for a fact never logged (or redacted). What reports and
    notification due times are computed from: a database edit does not move them."""
    known = logged(conn, incident_id).get(incident_id, {})
    aw, dl = known.get("awareness_at"), known.get("deadline_at")
    return (
        to_micros(parse_iso(aw.value)) if aw else awareness_us,
        to_micros(parse_iso(dl.value)) if dl else deadline_us,
    )
