"""The alerting service: evaluates the rule packs on ingest and on a timer, advances alerts,
opens incidents and writes the notifications they cause, all in the caller's transaction.

Operators acknowledge alerts, silence them and close incidents through the same service (the
HTTP API and the CLI are thin layers over it); each such action is also written to the
hash-chained audit log.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, text

from collector import audit
from collector import deployment_facts as F
from collector.alerting import docs
from collector.alerting import repository as repo
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.models import from_micros, to_micros
from collector.notify.outbox import enqueue
from collector.timefmt import as_micros
from engine_probe import events as ev
from policies import (
    AlertState,
    BatchFacts,
    NodeConfig,
    Rule,
    RuleSet,
    SeqGapFact,
    Signal,
    Step,
    evaluate_batch,
    evaluate_timer,
    on_signal,
    on_tick,
    severity_rank,
)
from policies.evaluate import RuleHealth
from policies.facts import VERIFIED_SETTINGS, index_by_type

log = logging.getLogger("kvwatch.alerting")
_TIMER_LOCK = 0x6B7677_0002  # pg advisory lock: one timer pass at a time across replicas
LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


@dataclass(slots=True)
class Change:
    alert: Any  # the row after the change
    transition: str
    rule: Rule


@dataclass(slots=True)
class PassResult:
    signals: int = 0
    changes: list[Change] = field(default_factory=list)
    notifications: int = 0
    incidents_opened: list[int] = field(default_factory=list)
    errors: list[RuleHealth] = field(default_factory=list)
    # what a batch stored that the service remembers once it commits (see committed())
    new_tenants: set[tuple[str, str]] = field(default_factory=set)
    configs: dict[tuple[str, str], NodeConfig] = field(default_factory=dict)


def _dt(value: int | datetime) -> datetime:
    return from_micros(value) if isinstance(value, int) else value


def _state(r: Any) -> AlertState:
    return AlertState(
        fingerprint=r.fingerprint,
        state=r.state,
        mode=r.mode,
        active_since=_dt(r.active_since),
        last_seen_at=_dt(r.last_seen_at),
        fired_at=None if r.fired_at is None else _dt(r.fired_at),
        resolved_at=None if r.resolved_at is None else _dt(r.resolved_at),
        occurrences=r.occurrences,
        value=r.value,
        acked=r.acked_at is not None,
    )


def _us(dt: datetime | None) -> int | None:
    return None if dt is None else to_micros(dt)


# Alertmanager ends an alert at its endsAt unless it is sent again (the sender sets endsAt an
# hour ahead): every firing alert is re-sent to Alertmanager endpoints this often, as
# Prometheus re-sends every minute.
ALERTMANAGER_RESEND_S = 60.0


# How long a deployment's configs and verifications are reused between batches without
# reading them again. A batch carrying an engine.config always reads them fresh (drift is
# judged against what is stored); what another replica stored, or a verification posted
# elsewhere, is seen within this long (and by the timer's pass in any case).
FACTS_TTL_S = 5.0
_KNOWN_TENANTS_MAX = 100_000


class AlertingService:
    def __init__(self, db: Database, rules: RuleSet, *, facts_ttl_s: float = FACTS_TTL_S):
        self.db = db
        self.rules = rules
        self.facts_ttl_s = facts_ttl_s
        self._am_resent_us = 0
        # deployment -> (loaded at, its node configs, its verifications)
        self._facts: dict[
            str,
            tuple[float, dict[tuple[str, str], NodeConfig], dict[tuple[str, str], Any]],
        ] = {}
        self._known_tenants: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the ingest path

    def prior_configs(
        self, conn: Connection, events: Sequence[ev.Event]
    ) -> dict[tuple[str, str], NodeConfig]:
        """Each touched deployment's node configs before the batch (call before storing it):
        read fresh when the batch reports a config, else reused for ``facts_ttl_s``."""
        deps = {e.deployment_id for e in events}
        fresh = any(isinstance(e, ev.EngineConfig) for e in events)
        out: dict[tuple[str, str], NodeConfig] = {}
        stale = set()
        now = time.monotonic()
        with self._lock:
            for d in deps:
                hit = self._facts.get(d)
                if fresh or hit is None or now - hit[0] > self.facts_ttl_s:
                    stale.add(d)
                else:
                    out.update(hit[1])
        if stale:
            loaded = F.node_configs(conn, stale)
            verified = F.verifications(conn, stale)
            with self._lock:
                for d in stale:
                    mine = {k: v for k, v in loaded.items() if k[0] == d}
                    self._facts[d] = (now, mine, {k: v for k, v in verified.items() if k[0] == d})
            out.update(loaded)
        return out

    def _cached_verifications(self, deps: set[str]) -> dict[tuple[str, str], Any]:
        with self._lock:
            out: dict[tuple[str, str], Any] = {}
            for d in deps:
                hit = self._facts.get(d)
                if hit is not None:
                    out.update(hit[2])
            return out

    def _remember_configs(self, configs: dict[tuple[str, str], NodeConfig]) -> None:
        with self._lock:
            for (d, node), cfg in configs.items():
                hit = self._facts.get(d)
                if hit is not None:
                    hit[1][(d, node)] = cfg

    def committed(self, result: PassResult) -> None:
        """The batch ``result`` came from has committed: remember what it stored (before
        that, a rolled-back and retried batch would find it remembered and skip it)."""
        with self._lock:
            if len(self._known_tenants) > _KNOWN_TENANTS_MAX:
                self._known_tenants.clear()
            self._known_tenants |= result.new_tenants
        if result.configs:
            self._remember_configs(result.configs)

    def forget_facts(self, deployment_id: str | None = None) -> None:
        """Drop cached facts (all, or one deployment's): the next batch reads them again."""
        with self._lock:
            if deployment_id is None:
                self._facts.clear()
            else:
                self._facts.pop(deployment_id, None)

    def on_batch(
        self,
        conn: Connection,
        events: Sequence[ev.Event],
        prior: dict[tuple[str, str], NodeConfig],
        gaps: Sequence[SeqGapFact],
        now: datetime,
    ) -> PassResult:
        """Evaluate a batch's new events (already stored in ``conn``'s transaction)."""
        now_us = to_micros(now)
        deps = {e.deployment_id for e in events}
        by_type = index_by_type(events)
        pairs = F.tenant_pairs(by_type)
        with self._lock:  # committed() adds to it from other ingest threads
            new_tenants = pairs - self._known_tenants
        F.remember_tenants(conn, new_tenants, now_us)
        config_events = by_type.get(ev.EngineConfig, [])
        configs = F.fold_configs(prior, config_events)
        # tenant counts matter only to rules that look at configs: read them when some came
        tenants = F.tenant_counts(conn, deps) if config_events else {}
        facts = BatchFacts(
            by_type=by_type,
            events=events,
            deployments=F.deployment_facts(
                configs, self._cached_verifications(deps), tenants, deps
            ),
            prior_configs=prior,
            seq_gaps=gaps,
        )
        evaluation = evaluate_batch(self.rules, facts, now)
        result = self._apply(conn, evaluation.signals, now)
        result.new_tenants = new_tenants
        result.configs = configs if config_events else {}
        result.errors = [h for h in evaluation.health if not h.ok]
        if result.errors:
            repo.record_health(
                conn, [(h.rule, h.kind, h.ok, h.error) for h in result.errors], now_us
            )
        return result

    # ------------------------------------------------------------------ the timer

    def tick(self, now: datetime) -> PassResult | None:
        """Absence and state rules, quiet alerts resolving, pending ones firing, repeats and
        incident reminders. ``None`` when another replica is running its pass."""
        now_us = to_micros(now)
        with self.db.write() as conn:
            if (
                conn.dialect.name == "postgresql"
                and not conn.execute(
                    text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": _TIMER_LOCK}
                ).scalar()
            ):
                return None
            evaluation = evaluate_timer(self.rules, F.timer_facts(conn), now)
            result = self._apply(conn, evaluation.signals, now)
            repo.record_health(
                conn, [(h.rule, h.kind, h.ok, h.error) for h in evaluation.health], now_us
            )
            result.errors = [h for h in evaluation.health if not h.ok]
            ticked = []
            for r in repo.active_alerts(conn):
                rule = self.rules.rule(r.rule)
                step = on_tick(_state(r), rule, now)
                if step is not None and step.transition is not None:
                    ticked.append((r, step, rule))
            tick_changes = [
                Change(
                    self._store_step(conn, r, r.fingerprint, step, now_us, None),
                    step.transition or "",
                    rule or self._orphan(r),
                )
                for r, step, rule in ticked
            ]
            result.changes += tick_changes
            result.notifications += self._notify(conn, tick_changes, now_us)
            result.notifications += self._repeat(conn, now_us)
            result.notifications += self._remind(conn, now_us)
            result.notifications += self._resend_to_alertmanager(conn, now_us)
            return result

    def _orphan(self, r: Any) -> Rule:
        """A stand-in for the rule of an alert whose rule was removed from the packs."""
        return Rule(name=r.rule, kind=r.kind, severity=r.severity, params=None)

    # ------------------------------------------------------------------ applying signals

    def _apply(self, conn: Connection, signals: Sequence[Signal], now: datetime) -> PassResult:
        result = PassResult(signals=len(signals))
        if not signals:
            return result
        now_us = to_micros(now)
        # Existing alerts are locked for this transaction (replicas and the timer wait for
        # each other); two inserting the same new alert collide on its unique fingerprint,
        # and the loser's batch is retried, seeing the winner's row.
        rows = repo.alerts_by_fingerprint(conn, [s.fingerprint for s in signals], lock=True)
        quiet: list[dict[str, Any]] = []  # updates that change no state: written at once
        changes: list[Change] = []
        incident_asks: list[tuple[Any, Signal, Rule]] = []
        for s in signals:
            rule = self.rules.rule(s.rule)
            if rule is None:
                continue
            row = rows.get(s.fingerprint)
            step = on_signal(None if row is None else _state(row), s, rule, now)
            if step is None:
                continue
            after = self._store_step(conn, row, s.fingerprint, step, now_us, s, quiet)
            if step.transition is not None:
                changes.append(Change(after, step.transition, rule))
            if s.opens_incident and s.firing and after.state == "firing":
                incident_asks.append((after, s, rule))
        repo.update_alerts(conn, quiet)
        result.changes = changes
        result.notifications = self._notify(conn, changes, now_us)
        for alert, s, rule in incident_asks:
            opened = self._incident_for(conn, alert, s, rule, now_us)
            if opened is not None:
                result.incidents_opened.append(opened)
        return result

    def _store_step(
        self,
        conn: Connection,
        row: Any,
        fingerprint: str,
        step: Step,
        now_us: int,
        s: Signal | None,
        quiet: list[dict[str, Any]] | None = None,
    ) -> Any:
        """Store one step of an alert; updates without a transition go to ``quiet`` (when
        given) for the caller to write together."""
        a = step.alert
        values: dict[str, Any] = {
            "state": a.state,
            "active_since": _us(a.active_since),
            "fired_at": _us(a.fired_at),
            "resolved_at": _us(a.resolved_at),
            "last_seen_at": _us(a.last_seen_at),
            "occurrences": a.occurrences,
            "value": a.value,
            "updated_at": now_us,
        }
        if s is not None:
            values["annotations"] = json.dumps(dict(s.annotations), sort_keys=True)
        if step.transition in ("pending", "firing") and row is not None and row.state == "resolved":
            # a new episode: the old acknowledgement does not carry over
            values.update(acked_at=None, acked_by=None, ack_comment=None, incident_id=None)
        if step.transition == "resolved":
            values.update(acked_at=None, acked_by=None, ack_comment=None)
        if row is None:
            assert s is not None
            values.update(
                fingerprint=fingerprint,
                rule=s.rule,
                kind=s.kind,
                severity=s.severity,
                mode=s.mode,
                deployment_id=s.deployment_id,
                labels=json.dumps(dict(s.labels), sort_keys=True),
                annotations=json.dumps(dict(s.annotations), sort_keys=True),
                occurrences=a.occurrences,
            )
            alert_id = repo.insert_alert(conn, values)
            before: dict[str, Any] = {c.name: None for c in repo.A.columns}
        else:
            alert_id = row.id
            if quiet is not None and step.transition is None:
                quiet.append({**values, "_id": alert_id})
            else:
                repo.update_alert(conn, alert_id, values)
            before = dict(row._mapping)
        if step.transition is not None:
            repo.add_transition(
                conn,
                alert_id,
                now_us,
                None if row is None else row.state,
                step.transition,
                a.value,
                detail={"occurrences": a.occurrences},
            )
        # the row as stored now, without reading it back (times as µs or datetimes: every
        # reader of it takes both)
        return SimpleNamespace(**{**before, **values, "id": alert_id})

    # ------------------------------------------------------------------ notifications

    def _notify(
        self, conn: Connection, changes: Sequence[Change], now_us: int, kind: str | None = None
    ) -> int:
        """One notification per (group, transition): grouped as Alertmanager groups, by the
        rule pack's ``group_by`` labels. Silenced alerts are left out; pending is not sent."""
        wanted = [c for c in changes if c.transition in ("firing", "resolved")]
        if not wanted:
            return 0
        silences = repo.active_silences(conn, now_us)
        groups: dict[tuple[str, str], tuple[dict[str, str], list[Any]]] = {}
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
        groups: dict[tuple[str, str], tuple[dict[str, str], list[Any]]],
        now_us: int,
    ) -> int:
        sent = 0
        for (event_type, key), (chosen, alerts) in groups.items():
            severity = max((a.severity for a in alerts), key=severity_rank)
            doc = {
                "type": event_type,
                "created_at": docs.iso(now_us),
                "group_key": key,
                "group_labels": chosen,
                "alerts": [docs.notification_alert(docs.alert_doc(a)) for a in alerts],
                "incident": None,
            }
            sent += enqueue(conn, doc, severity=severity, now_us=now_us)
            for a in alerts:
                repo.update_alert(conn, a.id, {"last_notified_at": now_us})
        return sent

    def _repeat(self, conn: Connection, now_us: int) -> int:
        """Firing, unacknowledged, unsilenced alerts not notified for their repeat interval."""
        silences = repo.active_silences(conn, now_us)
        groups: dict[tuple[str, str], tuple[dict[str, str], list[Any]]] = {}
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

    def _resend_to_alertmanager(self, conn: Connection, now_us: int) -> int:
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
        if not firing:
            return 0
        doc: dict[str, Any] = {
            "type": "alert.repeat",
            "created_at": docs.iso(now_us),
            "group_key": None,
            "group_labels": {},
            "alerts": [docs.notification_alert(docs.alert_doc(a)) for a in firing],
            "incident": None,
        }
        severity = max((a.severity for a in firing), key=severity_rank)
        return enqueue(conn, doc, severity=severity, now_us=now_us, kinds=("alertmanager",))

    # ------------------------------------------------------------------ incidents

    def _incident_for(
        self, conn: Connection, alert: Any, s: Signal, rule: Rule, now_us: int
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
                "deadline_at": docs.iso(deadline),
            },
        )
        self._send_incident(conn, incident_id, "incident.opened", now_us)
        return incident_id

    def _send_incident(
        self,
        conn: Connection,
        incident_id: int,
        event_type: str,
        now_us: int,
        remind: int | None = None,
    ) -> int:
        inc = repo.get_incident(conn, incident_id)
        alerts = [
            docs.notification_alert(docs.alert_doc(a))
            for a in repo.incident_alerts(conn, incident_id)
        ]
        doc = {
            "type": event_type,
            "created_at": docs.iso(now_us),
            "group_key": None,
            "group_labels": {"deployment_id": inc.deployment_id},
            "alerts": alerts,
            "incident": docs.incident_doc(inc, remind),
        }
        return enqueue(conn, doc, severity="critical", now_us=now_us)

    def _remind(self, conn: Connection, now_us: int) -> int:
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
            sent += self._send_incident(conn, inc.id, "incident.reminder", now_us, nearest)
        return sent

    # ------------------------------------------------------------------ operator actions

    def ack(self, alert_id: int, by: str, comment: str | None, now: datetime) -> dict[str, Any]:
        now_us = to_micros(now)
        with self.db.write() as conn:
            a = repo.get_alert(conn, alert_id, lock=True)
            if a is None:
                raise NotFound(f"no alert {alert_id}")
            if a.state == "resolved":
                raise Conflict(f"alert {alert_id} is resolved; there is nothing to acknowledge")
            repo.update_alert(
                conn,
                alert_id,
                {"acked_at": now_us, "acked_by": by, "ack_comment": comment, "updated_at": now_us},
            )
            repo.add_transition(
                conn,
                alert_id,
                now_us,
                a.state,
                a.state,
                a.value,
                actor=by,
                detail={"ack": True, "comment": comment},
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="alert.ack",
                subject=f"alert:{alert_id}",
                detail={"comment": comment},
            )
            return docs.alert_doc(repo.get_alert(conn, alert_id))

    def silence(
        self,
        matchers: list[dict[str, Any]],
        starts_at: datetime,
        ends_at: datetime,
        by: str,
        comment: str,
        now: datetime,
    ) -> dict[str, Any]:
        if not matchers:
            raise InvalidInput("a silence needs at least one matcher", {"field": "matchers"})
        for i, mt in enumerate(matchers):
            if not LABEL_NAME.match(str(mt.get("name", ""))):
                raise InvalidInput(
                    f"matchers[{i}].name is not a label name", {"field": f"matchers[{i}].name"}
                )
            if mt.get("regex"):
                try:
                    re.compile(mt["value"])
                except re.error as exc:
                    raise InvalidInput(
                        f"matchers[{i}].value is not a regular expression: {exc}",
                        {"field": f"matchers[{i}].value"},
                    ) from None
        if ends_at <= starts_at:
            raise InvalidInput("ends_at must be after starts_at", {"field": "ends_at"})
        now_us = to_micros(now)
        with self.db.write() as conn:
            sid = repo.insert_silence(
                conn,
                {
                    "matchers": json.dumps(matchers, sort_keys=True),
                    "starts_at": to_micros(starts_at),
                    "ends_at": to_micros(ends_at),
                    "created_by": by,
                    "comment": comment,
                    "created_at": now_us,
                },
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="silence.create",
                subject=f"silence:{sid}",
                detail={"matchers": matchers, "ends_at": docs.iso_dt(ends_at), "comment": comment},
            )
            return docs.silence_doc(repo.get_silence(conn, sid), now_us)

    def expire_silence(self, silence_id: int, by: str, now: datetime) -> dict[str, Any]:
        now_us = to_micros(now)
        with self.db.write() as conn:
            s = repo.get_silence(conn, silence_id)
            if s is None:
                raise NotFound(f"no silence {silence_id}")
            if s.expired_at is None:
                repo.expire_silence(conn, silence_id, now_us)
                audit.append(
                    conn,
                    now_us=now_us,
                    actor=by,
                    action="silence.expire",
                    subject=f"silence:{silence_id}",
                )
            return docs.silence_doc(repo.get_silence(conn, silence_id), now_us)

    def close_incident(
        self, incident_id: int, by: str, reason: str, now: datetime
    ) -> dict[str, Any]:
        if not reason.strip():
            raise InvalidInput("closing an incident needs a reason", {"field": "reason"})
        now_us = to_micros(now)
        with self.db.write() as conn:
            inc = repo.get_incident(conn, incident_id, lock=True)
            if inc is None:
                raise NotFound(f"no incident {incident_id}")
            if inc.state == "closed":
                raise Conflict(f"incident {incident_id} is already closed")
            repo.update_incident(
                conn,
                incident_id,
                {"state": "closed", "closed_at": now_us, "closed_by": by, "close_reason": reason},
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="incident.close",
                subject=f"incident:{incident_id}",
                detail={"reason": reason},
            )
            self._send_incident(conn, incident_id, "incident.closed", now_us)
            return self.incident(incident_id, conn)

    # ------------------------------------------------------------------ reads

    def list_alerts(
        self,
        *,
        state: str | None = None,
        severity: str | None = None,
        rule: str | None = None,
        deployment_id: str | None = None,
        after_id: int | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            now_us = to_micros(datetime.now().astimezone())
            silences = repo.active_silences(conn, now_us)
            rows = repo.list_alerts(
                conn,
                state=state,
                severity=severity,
                rule=rule,
                deployment_id=deployment_id,
                after_id=after_id,
                limit=limit,
            )
            return [
                docs.alert_doc(r, silenced=repo.silenced(json.loads(r.labels), silences))
                for r in rows
            ]

    def alert(self, alert_id: int) -> dict[str, Any]:
        with self.db.read() as conn:
            r = repo.get_alert(conn, alert_id)
            if r is None:
                raise NotFound(f"no alert {alert_id}")
            out = docs.alert_doc(r)
            out["history"] = [
                {
                    "at": docs.iso(t.at),
                    "from": t.from_state,
                    "to": t.to_state,
                    "value": t.value,
                    "actor": t.actor,
                    "detail": json.loads(t.detail),
                }
                for t in repo.transitions(conn, alert_id)
            ]
            return out

    def list_silences(self) -> list[dict[str, Any]]:
        now_us = to_micros(datetime.now().astimezone())
        with self.db.read() as conn:
            return [docs.silence_doc(s, now_us) for s in repo.list_silences(conn)]

    def list_incidents(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return [docs.incident_doc(r) for r in repo.list_incidents(conn, state, limit)]

    def incident(self, incident_id: int, conn: Connection | None = None) -> dict[str, Any]:
        if conn is None:
            with self.db.read() as c:
                return self.incident(incident_id, c)
        r = repo.get_incident(conn, incident_id)
        if r is None:
            raise NotFound(f"no incident {incident_id}")
        out = docs.incident_doc(r)
        out["alerts"] = [docs.alert_doc(a) for a in repo.incident_alerts(conn, incident_id)]
        return out

    def add_verification(self, values: dict[str, Any], by: str, now: datetime) -> dict[str, Any]:
        """Record a verification (from ``kvwatch verify`` or an operator). The timer's next
        pass re-evaluates verification and context rules against it.

        A verification that does not say which engine settings it was measured under is tied
        to the deployment's current config of the nodes serving the model (a sweep against an
        endpoint cannot see them; the probes have reported them). Its safe context is clamped
        to the smallest prefill pool: a prompt longer than the pool is never safe, whatever a
        sweep saw (the evidence records the clamp)."""
        now_us = to_micros(now)
        row = dict(values)
        row["verified_at"] = to_micros(row.get("verified_at") or now)
        evidence = dict(row.get("evidence") or {})
        row.update(created_at=now_us, created_by=by)
        self.forget_facts(row["deployment_id"])
        with self.db.write() as conn:
            configs = [
                c
                for (d, _), c in F.node_configs(conn, {row["deployment_id"]}).items()
                if c.model_id == row["model_id"]
            ]
            if configs and all(row.get(k) is None for k in VERIFIED_SETTINGS):
                prefill = [c for c in configs if c.role != "decode"] or configs
                first = min(prefill, key=lambda c: c.pool_capacity_tokens)
                for k in VERIFIED_SETTINGS:
                    row[k] = getattr(first, k)
                evidence["settings_from"] = (
                    f"engine.config of node {first.node} at {docs.iso_dt(first.ts)}"
                )
            pools = [c.pool_capacity_tokens for c in configs if c.role != "decode"]
            safe = row.get("verified_safe_context")
            if safe is not None and pools and safe > min(pools):
                evidence["clamped_to_pool"] = {"measured": safe, "pool_capacity_tokens": min(pools)}
                row["verified_safe_context"] = min(pools)
            row["evidence"] = json.dumps(evidence, sort_keys=True)
            vid = repo.insert_verification(conn, row)
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="verification.add",
                subject=f"verification:{vid}",
                detail={
                    "deployment_id": row["deployment_id"],
                    "model_id": row["model_id"],
                    "passed": row["passed"],
                },
            )
            return docs.verification_doc(repo.get_verification(conn, vid))

    def list_verifications(
        self, deployment_id: str | None, limit: int = 100
    ) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return [
                docs.verification_doc(v)
                for v in repo.list_verifications(conn, deployment_id, limit)
            ]

    def rules_health(self) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            health = repo.health(conn)
        out = []
        for r in self.rules.rules:
            h = health.get(r.name)
            out.append(
                {
                    "name": r.name,
                    "kind": r.kind,
                    "severity": r.severity,
                    "enabled": r.enabled,
                    "pack": r.pack,
                    "source": r.source,
                    "health": h.health if h else "unknown",
                    "last_error": h.last_error if h else None,
                    "last_error_at": docs.iso(h.last_error_at) if h else None,
                    "last_evaluated_at": docs.iso(h.last_evaluated_at) if h else None,
                    "errors": h.errors if h else 0,
                }
            )
        return out
