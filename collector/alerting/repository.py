"""SQL for alerts, transitions, silences, incidents and rule health (SQLAlchemy Core)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Table, and_, bindparam, case, insert, select, update

from collector import models as m

A: Table = m.Alert.__table__  # type: ignore[assignment]
T: Table = m.AlertTransition.__table__  # type: ignore[assignment]
S: Table = m.Silence.__table__  # type: ignore[assignment]
INC: Table = m.Incident.__table__  # type: ignore[assignment]
H: Table = m.RuleHealth.__table__  # type: ignore[assignment]
RUN: Table = m.VerificationRun.__table__  # type: ignore[assignment]


def alerts_by_fingerprint(
    conn: Connection, fingerprints: Sequence[str], *, lock: bool = False
) -> dict[str, Any]:
    """The stored alerts of these fingerprints; ``lock``: row-locked for the transaction
    (PostgreSQL; SQLite has one writer), in fingerprint order so that two transactions never
    wait on each other in a cycle."""
    wanted = sorted(set(fingerprints))
    out = {}
    for chunk in range(0, len(wanted), 500):
        q = select(A).where(A.c.fingerprint.in_(wanted[chunk : chunk + 500]))
        if lock and conn.dialect.name == "postgresql":
            q = q.order_by(A.c.fingerprint).with_for_update()
        for r in conn.execute(q):
            out[r.fingerprint] = r
    return out


def update_alerts(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Several alerts' updates in one statement (every dict has the same keys and ``_id``)."""
    if not rows:
        return
    keys = [k for k in rows[0] if k != "_id"]
    stmt = update(A).where(A.c.id == bindparam("_id")).values({k: bindparam(k) for k in keys})
    conn.execute(stmt, list(rows))


def insert_alert(conn: Connection, values: dict[str, Any]) -> int:
    return int(conn.execute(insert(A).values(**values).returning(A.c.id)).scalar_one())


def update_alert(conn: Connection, alert_id: int, values: dict[str, Any]) -> None:
    conn.execute(update(A).where(A.c.id == alert_id).values(**values))


def add_transition(
    conn: Connection,
    alert_id: int,
    at_us: int,
    from_state: str | None,
    to_state: str,
    value: float | None,
    actor: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    conn.execute(
        insert(T).values(
            alert_id=alert_id,
            at=at_us,
            from_state=from_state,
            to_state=to_state,
            value=value,
            actor=actor,
            detail=json.dumps(detail or {}, sort_keys=True),
        )
    )


def get_alert(conn: Connection, alert_id: int, *, lock: bool = False) -> Any:
    q = select(A).where(A.c.id == alert_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    return conn.execute(q).first()


def active_alerts(conn: Connection) -> list[Any]:
    return list(conn.execute(select(A).where(A.c.state != "resolved").order_by(A.c.id)))


def list_alerts(
    conn: Connection,
    *,
    state: str | None,
    severity: str | None,
    rule: str | None,
    deployment_id: str | None,
    after_id: int | None,
    limit: int,
) -> list[Any]:
    conds = []
    if state:
        conds.append(A.c.state == state)
    if severity:
        conds.append(A.c.severity == severity)
    if rule:
        conds.append(A.c.rule == rule)
    if deployment_id:
        conds.append(A.c.deployment_id == deployment_id)
    if after_id is not None:
        conds.append(A.c.id < after_id)
    q = select(A).where(and_(*conds)) if conds else select(A)
    return list(conn.execute(q.order_by(A.c.id.desc()).limit(limit)))


def transitions(conn: Connection, alert_id: int) -> list[Any]:
    return list(conn.execute(select(T).where(T.c.alert_id == alert_id).order_by(T.c.id)))


# -- silences -------------------------------------------------------------------------------


def active_silences(conn: Connection, now_us: int) -> list[Any]:
    return list(
        conn.execute(
            select(S).where(S.c.starts_at <= now_us, S.c.ends_at > now_us, S.c.expired_at.is_(None))
        )
    )


def silenced(labels: dict[str, str], silences: Iterable[Any]) -> bool:
    """Whether any silence matches: every matcher of it matches the labels."""
    for s in silences:
        ok = True
        for mt in json.loads(s.matchers):
            value = labels.get(mt["name"], "")
            if mt.get("regex"):
                ok = re.fullmatch(mt["value"], value) is not None
            else:
                ok = value == mt["value"]
            if not ok:
                break
        if ok:
            return True
    return False


def insert_silence(conn: Connection, values: dict[str, Any]) -> int:
    return int(conn.execute(insert(S).values(**values).returning(S.c.id)).scalar_one())


def list_silences(conn: Connection) -> list[Any]:
    return list(conn.execute(select(S).order_by(S.c.id.desc()).limit(1000)))


def get_silence(conn: Connection, silence_id: int) -> Any:
    return conn.execute(select(S).where(S.c.id == silence_id)).first()


def expire_silence(conn: Connection, silence_id: int, now_us: int) -> None:
    conn.execute(update(S).where(S.c.id == silence_id).values(expired_at=now_us))


# -- incidents ------------------------------------------------------------------------------


def lock_deployment(conn: Connection, deployment_id: str) -> None:
    """One incident per deployment at a time, across replicas."""
    if conn.dialect.name == "postgresql":
        conn.execute(
            select(m.Deployment.id).where(m.Deployment.id == deployment_id).with_for_update()
        )


def open_incident_for(conn: Connection, deployment_id: str) -> Any:
    return conn.execute(
        select(INC)
        .where(INC.c.deployment_id == deployment_id, INC.c.state == "open")
        .order_by(INC.c.id)
        .limit(1)
    ).first()


def get_incident(conn: Connection, incident_id: int, *, lock: bool = False) -> Any:
    q = select(INC).where(INC.c.id == incident_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    return conn.execute(q).first()


def insert_incident(conn: Connection, values: dict[str, Any]) -> int:
    return int(conn.execute(insert(INC).values(**values).returning(INC.c.id)).scalar_one())


def update_incident(conn: Connection, incident_id: int, values: dict[str, Any]) -> None:
    conn.execute(update(INC).where(INC.c.id == incident_id).values(**values))


def open_incidents(conn: Connection) -> list[Any]:
    return list(conn.execute(select(INC).where(INC.c.state == "open").order_by(INC.c.id)))


def list_incidents(conn: Connection, state: str | None, limit: int) -> list[Any]:
    q = select(INC)
    if state:
        q = q.where(INC.c.state == state)
    return list(conn.execute(q.order_by(INC.c.id.desc()).limit(limit)))


def incident_alerts(conn: Connection, incident_id: int) -> list[Any]:
    return list(conn.execute(select(A).where(A.c.incident_id == incident_id).order_by(A.c.id)))


# -- rule health ----------------------------------------------------------------------------


def record_health(
    conn: Connection, rows: Sequence[tuple[str, str, bool, str | None]], now_us: int
) -> None:
    """Upsert each rule's health: (rule, kind, ok, error)."""
    existing = {
        r.rule: r for r in conn.execute(select(H).where(H.c.rule.in_([r[0] for r in rows])))
    }
    for rule, kind, ok, error in rows:
        have = existing.get(rule)
        if have is None:
            conn.execute(
                insert(H).values(
                    rule=rule,
                    kind=kind,
                    health="ok" if ok else "error",
                    last_error=error,
                    last_error_at=None if ok else now_us,
                    last_evaluated_at=now_us,
                    errors=0 if ok else 1,
                )
            )
        else:
            values: dict[str, Any] = {
                "kind": kind,
                "health": "ok" if ok else "error",
                "last_evaluated_at": now_us,
            }
            if not ok:
                values.update(last_error=error, last_error_at=now_us, errors=H.c.errors + 1)
            conn.execute(update(H).where(H.c.rule == rule).values(**values))


def health(conn: Connection) -> dict[str, Any]:
    return {r.rule: r for r in conn.execute(select(H))}


# -- verifications --------------------------------------------------------------------------

V: Table = m.Verification.__table__  # type: ignore[assignment]


def insert_verification(conn: Connection, values: dict[str, Any]) -> int:
    return int(conn.execute(insert(V).values(**values).returning(V.c.id)).scalar_one())


def insert_verification_run(conn: Connection, values: dict[str, Any]) -> Any:
    t = RUN
    rid = conn.execute(insert(t).values(**values).returning(t.c.id)).scalar_one()
    return conn.execute(select(t).where(t.c.id == rid)).one()


def get_verification_run(conn: Connection, run_id: int) -> Any:
    return conn.execute(select(RUN).where(RUN.c.id == run_id)).first()


def finish_verification_run(
    conn: Connection, run_id: int, deployment_id: str, verification_id: int | None, now_us: int
) -> bool:
    """Set the run's end to now (at most its announced end), once, with the verification it
    recorded (None: it reached no verdict); False when no unfinished run of that id and
    deployment exists."""
    t = RUN
    done = conn.execute(
        update(t)
        .where(
            t.c.id == run_id,
            t.c.deployment_id == deployment_id,
            t.c.finished_at.is_(None),
        )
        .values(
            finished_at=case((t.c.ends_at < now_us, t.c.ends_at), else_=now_us),
            verification_id=verification_id,
        )
    )
    return done.rowcount == 1


def list_verifications(conn: Connection, deployment_id: str | None, limit: int) -> list[Any]:
    q = select(V)
    if deployment_id:
        q = q.where(V.c.deployment_id == deployment_id)
    return list(conn.execute(q.order_by(V.c.verified_at.desc(), V.c.id.desc()).limit(limit)))


def get_verification(conn: Connection, verification_id: int) -> Any:
    return conn.execute(select(V).where(V.c.id == verification_id)).first()
