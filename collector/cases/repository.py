"""Writing the case register's rows (the reading is :mod:`collector.cases.register`'s).
Every function runs in the caller's transaction, beside the audit entry that records it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Connection, insert, select, type_coerce, update

from collector import models as m


def insert_notification(conn: Connection, values: dict[str, Any]) -> int:
    n = m.IncidentNotification
    return int(conn.execute(insert(n).values(**values).returning(n.id)).scalar_one())


def notification(conn: Connection, notice_id: str) -> Any:
    """The row of ``notice_id`` (times in µs), locked on PostgreSQL; None when unknown."""
    n = m.IncidentNotification
    q = select(
        n.id,
        n.incident_id,
        n.party_kind,
        n.party,
        n.notice_id,
        n.notice_sha256,
        n.notice,
        n.signature,
        n.state,
        type_coerce(n.prepared_at, BigInteger).label("prepared_at"),
        type_coerce(n.approved_at, BigInteger).label("approved_at"),
        type_coerce(n.sent_at, BigInteger).label("sent_at"),
        type_coerce(n.acknowledged_at, BigInteger).label("acknowledged_at"),
        type_coerce(n.deletion_confirmed_at, BigInteger).label("deletion_confirmed_at"),
    ).where(n.notice_id == notice_id)
    if conn.dialect.name == "postgresql":
        q = q.with_for_update()
    return conn.execute(q).one_or_none()


def advance(conn: Connection, notice_id: str, state: str, values: dict[str, Any]) -> bool:
    """Set ``values`` when the notice is still in ``state`` (a concurrent step that got there
    first makes this a no-op, reported as False)."""
    n = m.IncidentNotification
    done = conn.execute(
        update(n).where(n.notice_id == notice_id, n.state == state).values(**values)
    )
    return bool(done.rowcount)


def set_deletion_confirmed(conn: Connection, notice_id: str, at_us: int) -> bool:
    n = m.IncidentNotification
    done = conn.execute(
        update(n)
        .where(n.notice_id == notice_id, n.deletion_confirmed_at.is_(None))
        .values(deletion_confirmed_at=at_us)
    )
    return bool(done.rowcount)


def insert_decision(conn: Connection, values: dict[str, Any]) -> int:
    d = m.IncidentDecision
    return int(conn.execute(insert(d).values(**values).returning(d.id)).scalar_one())


def decision(conn: Connection, decision_id: int) -> Any:
    d = m.IncidentDecision
    return conn.execute(select(d.id, d.incident_id).where(d.id == decision_id)).one_or_none()


def superseded_by(conn: Connection, decision_id: int) -> int | None:
    d = m.IncidentDecision
    return conn.execute(select(d.id).where(d.supersedes == decision_id).limit(1)).scalar()


def incident_exists(conn: Connection, incident_id: int) -> bool:
    return (
        conn.execute(select(m.Incident.id).where(m.Incident.id == incident_id)).first() is not None
    )
