"""Incidents: an alert whose signal opens one is linked to its deployment's open incident,
or opens one, with a notification deadline from its rule. Opening is written to the audit log
and announced (:class:`~collector.alerting.notifications.Notifier`), in the caller's
transaction. Closing is an operator's action (:mod:`collector.alerting.commands`); reminders
are the notifier's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from collector import audit
from collector.alerting import repository as repo
from collector.alerting.incident_workflow import link_related
from collector.alerting.notifications import Change, Notifier
from collector.timefmt import iso
from policies import Rule, Signal


def open_or_link(
    conn: Connection, alert: Any, s: Signal, rule: Rule, now_us: int, notifier: Notifier
) -> int | None:
    """Link the alert to its deployment's open incident, or open one. Returns the id of
    an incident opened now."""
    dep = s.deployment_id or alert.deployment_id or "unknown"
    repo.lock_deployment(conn, dep)
    if alert.incident_id is not None:
        linked = repo.get_incident(conn, alert.incident_id)
        if linked is not None and linked.state == "open":
            return None
    current = repo.open_incident_for(conn, dep)
    if current is not None:
        repo.update_alert(conn, alert.id, {"incident_id": current.id})
        return None
    deadline = now_us + int(rule.incident_deadline_s * 1e6)
    incident_id = repo.insert_incident(
        conn,
        {
            "deployment_id": dep,
            "title": f"Suspected cross-tenant exposure on {dep} ({rule.name})",
            "state": "open",
            "cause_rule": rule.name,
            "first_alert_id": alert.id,
            "opened_at": now_us,
            "awareness_at": now_us,
            "deadline_at": deadline,
            "reminders_sent": "[]",
        },
    )
    repo.update_alert(conn, alert.id, {"incident_id": incident_id})
    audit.append(
        conn,
        now_us=now_us,
        actor="kvwatch",
        action="incident.opened",
        subject=f"incident:{incident_id}",
        detail={
            "deployment_id": dep,
            "alert_id": alert.id,
            "rule": rule.name,
            # The incident's facts as first known: collector.cases.facts checks the
            # database's values against these and every later logged change.
            "awareness_at": iso(now_us),
            "deadline_at": iso(deadline),
        },
    )
    # its causes on the deployment, before the notice that lists the incident's alerts
    link_related(conn, incident_id, dep, now_us)
    notifier.incident(conn, incident_id, "incident.opened", now_us)
    return incident_id


def link_firing(conn: Connection, changes: Sequence[Change], now_us: int) -> None:
    """Alerts that began firing in this pass on a deployment with an open incident join it
    (:func:`~collector.alerting.incident_workflow.link_related` decides which)."""
    by_dep: dict[str, list[int]] = {}
    for c in changes:
        a = c.alert
        if c.transition == "firing" and a.deployment_id and a.incident_id is None:
            by_dep.setdefault(a.deployment_id, []).append(a.id)
    for dep, ids in by_dep.items():
        current = repo.open_incident_for(conn, dep)
        if current is not None:
            link_related(conn, current.id, dep, now_us, alert_ids=ids)
