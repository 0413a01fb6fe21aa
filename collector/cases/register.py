"""Reading the case register: an incident's decisions and its notifications per party, as
plain frozen values every view (notices, reports, the dashboard, the case file) reads the
same way. Writing them is the register service's (steps are audit-logged there)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.timefmt import iso


@dataclass(frozen=True, slots=True)
class Decision:
    """A decision or measure (Art. 33(5)); ``status`` ``done`` or ``open``; ``superseded``:
    a later decision replaced it."""

    id: int
    incident_id: int
    at: str
    by: str
    kind: str
    status: str
    what: str
    why: str
    supersedes: int | None
    superseded: bool


@dataclass(frozen=True, slots=True)
class Notification:
    """One party's notice and how far it got (prepared, approved, sent, acknowledged)."""

    id: int
    incident_id: int
    party_kind: str
    party: str
    notice_id: str
    notice_sha256: str
    signature: str | None
    state: str
    prepared_at: str
    prepared_by: str
    approved_at: str | None
    approved_by: str | None
    sent_at: str | None
    sent_by: str | None
    channel: str | None
    acknowledged_at: str | None
    acknowledged_by: str | None
    deletion_confirmed_at: str | None


def decisions_for(conn: Connection, incident_id: int) -> list[Decision]:
    """The incident's decisions, oldest first."""
    d = m.IncidentDecision
    rows = conn.execute(
        select(
            d.id,
            d.incident_id,
            type_coerce(d.ts, BigInteger).label("ts"),
            d.actor,
            d.kind,
            d.status,
            d.what,
            d.why,
            d.supersedes,
        )
        .where(d.incident_id == incident_id)
        .order_by(d.ts, d.id)
    ).all()
    replaced = {r.supersedes for r in rows if r.supersedes is not None}
    return [
        Decision(
            id=r.id,
            incident_id=r.incident_id,
            at=iso(r.ts),
            by=r.actor,
            kind=r.kind,
            status=r.status,
            what=r.what,
            why=r.why,
            supersedes=r.supersedes,
            superseded=r.id in replaced,
        )
        for r in rows
    ]


_TIMES = ("prepared_at", "approved_at", "sent_at", "acknowledged_at", "deletion_confirmed_at")


def notifications_for(conn: Connection, incident_id: int) -> list[Notification]:
    """The incident's notifications, oldest first (a party may have several: a notice
    corrected and sent again)."""
    n = m.IncidentNotification
    cols = [
        type_coerce(getattr(n, c), BigInteger).label(c) if c in _TIMES else getattr(n, c)
        for c in Notification.__slots__
    ]
    rows = conn.execute(
        select(*cols).where(n.incident_id == incident_id).order_by(n.prepared_at, n.id)
    ).all()
    out = []
    for r in rows:
        values = dict(r._mapping)
        for c in _TIMES:
            values[c] = iso(values[c])
        out.append(Notification(**values))
    return out
