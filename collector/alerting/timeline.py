"""An incident's timeline: everything that happened to it and around it, in one ordered
list, for the API (``GET /v1/incidents/{id}/timeline``), ``kvwatch incidents timeline`` and
the dashboard's incident page alike.

What it merges, each from where it is recorded (nothing is kept twice):

* the audit log's entries under ``incident:<id>``: opened, acknowledged, owner, notes, links
  and unlinks, awareness and deadline changes, each party's notice steps, decisions, closed;
* the linked alerts' state changes (firing, resolved) from their transitions;
* notifications delivered about it (the outbox, per endpoint; the minutely re-send to
  Alertmanager is left out: it says nothing new);
* on its deployment, from a day before it opened until it closed (or now): verifications
  recorded and engine config changes (a node's pool, context or engine changed).

Entries are ordered by time, then, at one instant, causes before effects (configs,
verifications, alerts, the audit log, deliveries), then by id, so two reads give the same
list.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.alerting import repository as repo
from collector.errors import NotFound
from collector.timefmt import as_micros, iso

BEFORE_OPEN_S = 86_400  # deployment changes this long before the incident belong to its story
_US = 1_000_000


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of the timeline. ``kind``: the audit action (``incident.note``, ...),
    ``alert.firing``/``alert.resolved``, ``notification.sent``, ``verification`` or
    ``config.changed``; ``ref``: what it is about (``alert:7``, ``endpoint:pager``, ...)."""

    at: str
    kind: str
    actor: str
    text: str
    ref: str | None


def incident_timeline(conn: Connection, incident_id: int, now_us: int) -> list[dict[str, Any]]:
    inc = repo.get_incident(conn, incident_id)
    if inc is None:
        raise NotFound(f"no incident {incident_id}")
    opened, closed = as_micros(inc.opened_at), as_micros(inc.closed_at)
    end = closed if closed is not None else now_us
    start = opened - BEFORE_OPEN_S * _US
    # At one instant, causes before effects: a config, a verification, an alert firing, then
    # what the incident records of it (its opening), then the notices about that.
    rows: list[tuple[int, int, int, Entry]] = []
    rows += [(ts, 0, i, e) for ts, i, e in _configs(conn, inc.deployment_id, start, end)]
    rows += [(ts, 1, i, e) for ts, i, e in _verifications(conn, inc.deployment_id, start, end)]
    rows += [(ts, 2, i, e) for ts, i, e in _alert_changes(conn, incident_id)]
    rows += [(ts, 3, i, e) for ts, i, e in _audited(conn, incident_id)]
    rows += [(ts, 4, i, e) for ts, i, e in _deliveries(conn, incident_id, opened)]
    rows.sort(key=lambda r: r[:3])
    return [asdict(e) for *_, e in rows]


def _describe(action: str, detail: dict[str, Any]) -> str:
    d = detail
    match action:
        case "incident.opened":
            return (
                f"opened by alert {d.get('alert_id')} ({d.get('rule')}); "
                f"Art. 33 deadline {d.get('deadline_at')}"
            )
        case "incident.ack":
            return "acknowledged"
        case "incident.owner":
            return f"owner: {d.get('owner')}" + (
                f" (was {d['previous']})" if d.get("previous") else ""
            )
        case "incident.note":
            return str(d.get("text", ""))
        case "incident.link":
            why = f" ({d['why']})" if d.get("why") else ""
            return f"alert {d.get('alert_id')} linked{why}"
        case "incident.unlink":
            return f"alert {d.get('alert_id')} unlinked"
        case "case.export":
            return "case file exported"
        case "incident.close":
            return f"closed: {d.get('reason')}"
        case "incident.fact_changed":
            return f"{d.get('field')} moved from {d.get('old')} to {d.get('new')}: {d.get('why')}"
        case "incident.decision":
            return f"decision ({d.get('kind')}, {d.get('status')}): {d.get('what')}"
    if action.startswith("incident.notice_"):
        step = action.removeprefix("incident.notice_")
        return f"notice to {d.get('party', '?')} {step}"
    return action


def _audited(conn: Connection, incident_id: int) -> list[tuple[int, int, Entry]]:
    a = m.AuditEntry
    q = (
        select(a.id, type_coerce(a.ts, BigInteger).label("ts"), a.actor, a.action, a.detail)
        .where(a.subject == f"incident:{incident_id}")
        .order_by(a.id)
    )
    out = []
    for r in conn.execute(q):
        try:
            detail = json.loads(r.detail)
        except ValueError:
            detail = {}  # an erased detail: the entry stays, its words do not
        ref = (
            f"alert:{detail['alert_id']}"
            if isinstance(detail, dict) and "alert_id" in detail
            else None
        )
        text = _describe(r.action, detail if isinstance(detail, dict) else {})
        out.append((int(r.ts), int(r.id), Entry(iso(r.ts), r.action, r.actor, text, ref)))
    return out


def _alert_changes(conn: Connection, incident_id: int) -> list[tuple[int, int, Entry]]:
    t, al = m.AlertTransition, m.Alert
    q = (
        select(
            t.id,
            type_coerce(t.at, BigInteger).label("at"),
            t.to_state,
            t.actor,
            al.id.label("alert_id"),
            al.rule,
            al.severity,
        )
        .join(al, al.id == t.alert_id)
        .where(al.incident_id == incident_id, t.to_state.in_(("firing", "resolved")))
        .order_by(t.id)
    )
    return [
        (
            int(r.at),
            int(r.id),
            Entry(
                iso(r.at),
                f"alert.{r.to_state}",
                r.actor or "kvwatch",
                f"{r.rule} ({r.severity}) {r.to_state}",
                f"alert:{r.alert_id}",
            ),
        )
        for r in conn.execute(q)
    ]


def _deliveries(conn: Connection, incident_id: int, opened: int) -> list[tuple[int, int, Entry]]:
    o, e = m.OutboxMessage, m.NotifyEndpoint
    q = (
        select(
            o.id,
            o.event_type,
            o.data,
            type_coerce(o.delivered_at, BigInteger).label("delivered_at"),
            e.name,
        )
        .join(e, e.id == o.endpoint_id)
        .where(
            o.status == "delivered",
            o.event_type.like("incident.%"),
            o.event_type != "incident.repeat",
            type_coerce(o.created_at, BigInteger) >= opened,
        )
        .order_by(o.id)
    )
    out = []
    for r in conn.execute(q):
        inc = (json.loads(r.data).get("incident") or {}) if r.data else {}
        if inc.get("id") != incident_id:
            continue
        out.append(
            (
                int(r.delivered_at),
                int(r.id),
                Entry(
                    iso(r.delivered_at),
                    "notification.sent",
                    "kvwatch",
                    f"{r.event_type} delivered to {r.name}",
                    f"endpoint:{r.name}",
                ),
            )
        )
    return out


def _verifications(
    conn: Connection, deployment_id: str, start: int, end: int
) -> list[tuple[int, int, Entry]]:
    v = m.Verification
    at = type_coerce(v.created_at, BigInteger)
    q = (
        select(v.id, at.label("at"), v.model_id, v.passed, v.verified_safe_context, v.created_by)
        .where(v.deployment_id == deployment_id, at >= start, at <= end)
        .order_by(v.id)
    )
    return [
        (
            int(r.at),
            int(r.id),
            Entry(
                iso(r.at),
                "verification",
                r.created_by,
                f"verification of {r.model_id}: {'passed' if r.passed else 'failed'}"
                + (f", safe context {r.verified_safe_context}" if r.verified_safe_context else ""),
                f"verification:{r.id}",
            ),
        )
        for r in conn.execute(q)
    ]


def _configs(
    conn: Connection, deployment_id: str, start: int, end: int
) -> list[tuple[int, int, Entry]]:
    c = m.DeploymentConfig
    ts = type_coerce(c.ts, BigInteger)
    q = (
        select(
            c.id,
            ts.label("ts"),
            c.node,
            c.role,
            c.engine,
            c.engine_version,
            c.pool_capacity_tokens,
            c.advertised_context,
        )
        .where(c.deployment_id == deployment_id, ts >= start, ts <= end)
        .order_by(c.id)
    )
    return [
        (
            int(r.ts),
            int(r.id),
            Entry(
                iso(r.ts),
                "config.changed",
                "kvwatch",
                f"{r.node} ({r.role}): {r.engine} {r.engine_version}, pool "
                f"{r.pool_capacity_tokens} tokens, context {r.advertised_context}",
                f"node:{r.node}",
            ),
        )
        for r in conn.execute(q)
    ]
