"""The policy pass: the rule packs evaluated over an ingested batch (in the batch's
transaction) or on the timer; each signal advances its alert, stored with its transition;
the changes are notified and incidents opened, all in the same transaction.

The timer's pass also resolves quiet alerts, fires pending ones, and sends repeats, the
Alertmanager re-send and incident reminders; one replica at a time runs it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import Connection, text

from collector import deployment_facts as F
from collector.alerting import incidents
from collector.alerting import repository as repo
from collector.alerting.facts_cache import FactsCache
from collector.alerting.notifications import Change, Notifier
from collector.db import Database
from collector.timefmt import as_datetime, as_micros, to_micros
from engine_probe import events as ev
from policies import (
    AlertState,
    BatchFacts,
    BusFact,
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
)
from policies.evaluate import RuleHealth
from policies.facts import index_by_type, without_verification_traffic
from policies.kinds.prefix import needs_prefix_history
from policies.kinds.telemetry import probe_evidence_after
from policies.limits import verification_max_age_s

_TIMER_LOCK = 0x6B7677_0002  # pg advisory lock: one timer pass at a time across replicas


@dataclass(slots=True)
class PassResult:
    signals: int = 0
    changes: list[Change] = field(default_factory=list)
    notifications: int = 0
    incidents_opened: list[int] = field(default_factory=list)
    errors: list[RuleHealth] = field(default_factory=list)
    # what a batch stored, for the facts cache once it commits (FactsCache.committed)
    new_tenants: set[tuple[str, str]] = field(default_factory=set)
    configs: dict[tuple[str, str], NodeConfig] = field(default_factory=dict)


def _state(r: Any) -> AlertState:
    return AlertState(
        fingerprint=r.fingerprint,
        state=r.state,
        mode=r.mode,
        active_since=as_datetime(r.active_since),
        last_seen_at=as_datetime(r.last_seen_at),
        fired_at=None if r.fired_at is None else as_datetime(r.fired_at),
        resolved_at=None if r.resolved_at is None else as_datetime(r.resolved_at),
        occurrences=r.occurrences,
        value=r.value,
        acked=r.acked_at is not None,
    )


class Evaluator:
    def __init__(self, db: Database, rules: RuleSet, facts: FactsCache, notifier: Notifier):
        self.db = db
        self.rules = rules
        # the pack's, fixed with it: every limit in force this evaluator decides applies it
        self.max_verification_age_s = verification_max_age_s(rules.enabled())
        self.facts = facts
        self.notifier = notifier
        #: the ingest bus's latest reading, for the timer's ``bus_lag`` rule (set by the app
        #: when it runs with a bus; the bus is not in the database)
        self.bus_facts: Callable[[], BusFact | None] | None = None

    def on_batch(
        self,
        conn: Connection,
        events: Sequence[ev.Event],
        prior: dict[tuple[str, str], NodeConfig],
        gaps: Sequence[SeqGapFact],
        now: datetime,
    ) -> PassResult:
        """Evaluate a batch's new events (already stored in ``conn``'s transaction), but a
        verification's own prompts (:func:`policies.facts.without_verification_traffic`)."""
        now_us = to_micros(now)
        deps = {e.deployment_id for e in events}
        if events:
            stamps = [to_micros(e.ts) for e in events]
            runs = F.verification_runs(conn, deps, min(stamps), max(stamps))
            if runs:
                events = without_verification_traffic(events, runs)
        by_type = index_by_type(events)
        pairs = F.tenant_pairs(by_type)
        new_tenants = self.facts.new_tenants(pairs)
        F.remember_tenants(conn, new_tenants, now_us)
        config_events = by_type.get(ev.EngineConfig, [])
        configs = F.fold_configs(prior, config_events)
        # tenant counts matter only to rules that look at configs: read them when some came
        tenants = F.tenant_counts(conn, deps) if config_events else {}
        incidents = F.open_incident_deployments(conn, deps) if config_events else set()
        # the readers of cross-tenant prefix hits: their recent history, if a rule weighs it
        hits = cast(list[ev.PrefixCacheHit], by_type.get(ev.PrefixCacheHit, []))
        readers = {(e.deployment_id, e.reader_tenant) for e in hits if e.cross_tenant}
        history = (
            F.prefix_history(conn, readers, max(to_micros(e.ts) for e in hits))
            if readers and needs_prefix_history(self.rules.enabled())
            else {}
        )
        facts = BatchFacts(
            by_type=by_type,
            events=events,
            deployments=F.deployment_facts(
                configs,
                self.facts.verifications(deps),
                tenants,
                deps,
                self.max_verification_age_s,
                incidents,
            ),
            prior_configs=prior,
            seq_gaps=gaps,
            prefix_history=history,
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
            facts = F.timer_facts(
                conn,
                now,
                probe_evidence_after(self.rules.enabled()),
                self.max_verification_age_s,
            )
            if self.bus_facts is not None:
                facts = dataclasses.replace(facts, bus=self.bus_facts())
            evaluation = evaluate_timer(self.rules, facts, now)
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
            result.notifications += self.notifier.notify(conn, tick_changes, now_us)
            result.notifications += self.notifier.repeats(conn, now_us)
            result.notifications += self.notifier.reminders(conn, now_us)
            result.notifications += self.notifier.resend_to_alertmanager(conn, now_us)
            return result

    def _orphan(self, r: Any) -> Rule:
        """A stand-in for the rule of an alert whose rule was removed from the packs."""
        return Rule(name=r.rule, kind=r.kind, severity=r.severity, params=None)

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
            # A state alert asks once, as it fires: its condition is re-signalled on every
            # pass, and an incident an operator closed must not reopen while it still holds.
            asks = s.mode == "event" or step.transition == "firing"
            if s.opens_incident and s.firing and after.state == "firing" and asks:
                incident_asks.append((after, s, rule))
        repo.update_alerts(conn, quiet)
        result.changes = changes
        result.notifications = self.notifier.notify(conn, changes, now_us)
        for alert, s, rule in incident_asks:
            opened = incidents.open_or_link(conn, alert, s, rule, now_us, self.notifier)
            if opened is not None:
                result.incidents_opened.append(opened)
        incidents.link_firing(conn, changes, now_us)
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
            "active_since": as_micros(a.active_since),
            "fired_at": as_micros(a.fired_at),
            "resolved_at": as_micros(a.resolved_at),
            "last_seen_at": as_micros(a.last_seen_at),
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
