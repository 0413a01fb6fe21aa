"""Notifications: which alert changes are announced, grouped how, and when again. Each is a
document written to the outbox (:mod:`collector.notify.outbox`) in the caller's transaction;
the dispatcher delivers it later.

Owns: grouping firing/resolved changes by the rule pack's ``group_by`` labels (silenced
alerts left out, pending never sent), repeats of unacknowledged firing alerts, the periodic
re-send to Alertmanager endpoints, incident notices and the reminders before an incident's
deadline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from collector.alerting import docs
from collector.alerting import repository as repo
from collector.installation import INSTANCE_LABEL, Identity
from collector.notify.outbox import DEFAULT_MAX_PER_MINUTE, enqueue
from collector.notify.payloads import incident_labels
from collector.runbooks import runbook_url
from collector.timefmt import as_micros, iso
from policies import Rule, RuleSet, severity_rank
from policies.signals import fingerprint

# Alertmanager ends an alert at its endsAt unless it is sent again (the sender sets endsAt an
# hour ahead): every firing alert is re-sent to Alertmanager endpoints this often, as
# Prometheus re-sends every minute.
ALERTMANAGER_RESEND_S = 60.0

# (event type, group key) -> (the group's labels, its alerts)
Groups = dict[tuple[str, str], tuple[dict[str, str], list[Any]]]


@dataclass(slots=True)
class Change:
    """An alert that changed state in a pass, with its rule: what notifications are made of."""

    alert: Any  # the row after the change
    transition: str
    rule: Rule


class Notifier:
    """``identity``: the installation's name and dashboard, stamped on every document as it
    is queued (see :mod:`collector.installation`)."""

    def __init__(
        self,
        rules: RuleSet,
        identity: Identity | None = None,
        max_per_minute: int = DEFAULT_MAX_PER_MINUTE,
    ):
        self.rules = rules
        self.identity = identity or Identity()
        self.max_per_minute = max_per_minute  # alert notifications per endpoint, then a digest
        self._am_resent_us = 0

    def _alerts(self, conn: Connection, rows: Sequence[Any]) -> list[dict[str, Any]]:
        """The contract's AlertDocs as sent: labelled with the installation, fingerprinted
        over those labels, linked to the dashboard and the rule's runbook."""
        instance = self.identity.instance(conn)
        out = []
        for a in rows:
            d = docs.notification_alert(docs.alert_doc(a))
            d["labels"] = {**d["labels"], INSTANCE_LABEL: instance}
            d["fingerprint"] = fingerprint(d["labels"])
            d["url"] = self.identity.alert_url(a.id)
            d["runbook_url"] = self._runbook(a.rule, a.kind)
            out.append(d)
        return out

    def _incident(self, conn: Connection, inc: Any, remind: int | None) -> dict[str, Any]:
        d = docs.incident_doc(inc, remind)
        d["instance"] = self.identity.instance(conn)
        d["fingerprint"] = fingerprint(incident_labels(d))
        d["url"] = self.identity.incident_url(inc.id)
        rule = self.rules.rule(inc.cause_rule)
        d["runbook_url"] = self._runbook(inc.cause_rule, rule.kind if rule else None)
        return d

    def _runbook(self, rule_name: str, kind: str | None) -> str | None:
        rule = self.rules.rule(rule_name)
        if rule is None and kind is not None:  # a rule removed from the packs: its kind's
            rule = Rule(name=rule_name, kind=kind, severity="info", params=None)
        return None if rule is None else runbook_url(rule, self.identity.dashboard_url)

    def notify(
        self, conn: Connection, changes: Sequence[Change], now_us: int, kind: str | None = None
    ) -> int:
        """One notification per (group, transition): grouped as Alertmanager groups, by the
        rule pack's ``group_by`` labels. Silenced alerts are left out; pending is not sent."""
        wanted = [c for c in changes if c.transition in ("firing", "resolved")]
        if not wanted:
            return 0
        silences = repo.active_silences(conn, now_us)
        groups: Groups = {}
        for c in wanted:
            labels = json.loads(c.alert.labels)
            if repo.silenced(labels, silences):
                continue
            key, chosen = docs.group_key(labels, c.rule.group_by)
            groups.setdefault((kind or f"alert.{c.transition}", key), (chosen, []))[1].append(
                c.alert
            )
        return self._send_groups(conn, groups, now_us)

    def _send_groups(
        self,
        conn: Connection,
        groups: Groups,
        now_us: int,
    ) -> int:
        sent = 0
        for (event_type, key), (chosen, alerts) in groups.items():
            severity = max((a.severity for a in alerts), key=severity_rank)
            doc = {
                "type": event_type,
                "created_at": iso(now_us),
                "instance": self.identity.instance(conn),
                "group_key": key,
                "group_labels": chosen,
                "alerts": self._alerts(conn, alerts),
                "incident": None,
            }
            sent += enqueue(
                conn, doc, severity=severity, now_us=now_us, max_per_minute=self.max_per_minute
            )
            for a in alerts:
                repo.update_alert(conn, a.id, {"last_notified_at": now_us})
        return sent

    def repeats(self, conn: Connection, now_us: int) -> int:
        """Firing, unacknowledged, unsilenced alerts not notified for their repeat interval."""
        silences = repo.active_silences(conn, now_us)
        groups: Groups = {}
        for a in repo.active_alerts(conn):
            rule = self.rules.rule(a.rule)
            if a.state != "firing" or a.acked_at is not None or rule is None:
                continue
            last = as_micros(a.last_notified_at or a.fired_at or a.active_since)
            if now_us - last < rule.repeat_interval_s * 1e6:
                continue
            labels = json.loads(a.labels)
            if repo.silenced(labels, silences):
                continue
            key, chosen = docs.group_key(labels, rule.group_by)
            groups.setdefault(("alert.repeat", key), (chosen, []))[1].append(a)
        return self._send_groups(conn, groups, now_us)

    def resend_to_alertmanager(self, conn: Connection, now_us: int) -> int:
        """Every firing, unsilenced alert again, to Alertmanager endpoints only (their own
        repeat and grouping apply there; acknowledging is a kvwatch notion)."""
        if now_us - self._am_resent_us < ALERTMANAGER_RESEND_S * 1e6:
            return 0
        self._am_resent_us = now_us
        silences = repo.active_silences(conn, now_us)
        firing = [
            a
            for a in repo.active_alerts(conn)
            if a.state == "firing" and not repo.silenced(json.loads(a.labels), silences)
        ]
        sent = 0
        # each open incident too: its alert would expire there after the horizon
        for inc in repo.open_incidents(conn):
            sent += self.incident(conn, inc.id, "incident.repeat", now_us, kinds=("alertmanager",))
        if not firing:
            return sent
        doc: dict[str, Any] = {
            "type": "alert.repeat",
            "created_at": iso(now_us),
            "instance": self.identity.instance(conn),
            "group_key": None,
            "group_labels": {},
            "alerts": self._alerts(conn, firing),
            "incident": None,
        }
        severity = max((a.severity for a in firing), key=severity_rank)
        return sent + enqueue(conn, doc, severity=severity, now_us=now_us, kinds=("alertmanager",))

    def incident(
        self,
        conn: Connection,
        incident_id: int,
        event_type: str,
        now_us: int,
        remind: int | None = None,
        *,
        kinds: tuple[str, ...] | None = None,
    ) -> int:
        """A notice about one incident (opened, closed, a reminder) with its alerts;
        ``kinds`` limits it to those endpoint kinds (the re-send to Alertmanager)."""
        inc = repo.get_incident(conn, incident_id)
        doc = {
            "type": event_type,
            "created_at": iso(now_us),
            "instance": self.identity.instance(conn),
            "group_key": None,
            "group_labels": {"deployment_id": inc.deployment_id},
            "alerts": self._alerts(conn, repo.incident_alerts(conn, incident_id)),
            "incident": self._incident(conn, inc, remind),
        }
        return enqueue(conn, doc, severity="critical", now_us=now_us, kinds=kinds)

    def reminders(self, conn: Connection, now_us: int) -> int:
        """Open incidents' reminders that have come due before their deadlines."""
        sent = 0
        for inc in repo.open_incidents(conn):
            rule = self.rules.rule(inc.cause_rule)
            reminders = rule.reminders_before_s if rule else ()
            done = set(json.loads(inc.reminders_sent))
            deadline = as_micros(inc.deadline_at)
            due = [int(r) for r in reminders if int(r) not in done and now_us >= deadline - r * 1e6]
            if not due:
                continue
            # the nearest one due speaks for any skipped (a collector down through several)
            nearest = min(due)
            repo.update_incident(
                conn, inc.id, {"reminders_sent": json.dumps(sorted(done | set(due), reverse=True))}
            )
            sent += self.incident(conn, inc.id, "incident.reminder", now_us, nearest)
        return sent
