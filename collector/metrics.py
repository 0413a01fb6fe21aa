"""Prometheus metrics of one collector app.

Ingest counters live in the process (each replica counts what it handled). Deployment
gauges are read from the database at scrape time, so every replica reports the same truth
and nothing is lost on restart.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, func, select

from collector import deployment_facts, queries
from collector import models as m
from collector.db import Database
from collector.errors import Unavailable
from collector.limits import Limits
from collector.lost_rows import REASONS as lost_reasons
from collector.rollups.buckets import bin_high, bin_of
from policies import VerificationFact

# Per deployment: the (model, route) series of the largest prompts; the rest are left out.
MAX_ROUTES = 20
MAX_PROBES = 100  # kvwatch_probe_missing_events series per scrape (the rest counted)
# Verifications looked back through, past runs that reached no verdict.


class CollectorMetrics:
    def __init__(
        self,
        db: Database,
        *,
        limits: Limits | None = None,
        max_deployments: int = 200,
        min_requests: int = 10,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.events = Counter(
            "kvwatch_ingest_events",
            "Events received, by result (accepted, duplicate).",
            ["result"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvwatch_ingest_rejected_batches",
            "Batches refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.rejected_events = Counter(
            "kvwatch_ingest_rejected_events",
            "Events in refused batches that could be counted, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "kvwatch_ingest_batch_seconds",
            "Time to decode, validate and store one batch.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.policy_failures = Counter(
            "kvwatch_policy_evaluation_failures",
            "Batches stored without policy evaluation because it failed (see the logs).",
            registry=self.registry,
        )
        self.rule_errors = Counter(
            "kvwatch_rule_errors",
            "Rule evaluations that raised, by rule (the rule is reported unhealthy).",
            ["rule"],
            registry=self.registry,
        )
        self.lost = Counter(
            "kvwatch_requests_lost",
            "Requests closed as lost because their probe is gone, by reason (probe_stopped, "
            "probe_replaced, probe_silent); a finish arriving later still replaces the status.",
            ["reason"],
            registry=self.registry,
        )
        for reason in lost_reasons:
            self.lost.labels(reason)
        # Pre-create the label sets so a scrape shows zeros instead of nothing.
        for r in ("accepted", "duplicate"):
            self.events.labels(r)
        self.registry.register(
            _DeploymentGauges(db, limits or Limits(db), max_deployments, min_requests)
        )
        self.registry.register(_AlertGauges(db))


class _AlertGauges(Collector):
    """Firing alerts by rule and severity, rule health and open incidents, read from the
    database at scrape time (every replica reports the same)."""

    def __init__(self, db: Database):
        self.db = db

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        firing = GaugeMetricFamily(
            "kvwatch_alerts_firing",
            "Alerts firing now, by rule and severity.",
            labels=["rule", "severity"],
        )
        pending = GaugeMetricFamily(
            "kvwatch_alerts_pending",
            "Alerts pending now, by rule and severity.",
            labels=["rule", "severity"],
        )
        health = GaugeMetricFamily(
            "kvwatch_rule_healthy",
            "1 if the rule's last evaluation succeeded, else 0.",
            labels=["rule", "kind"],
        )
        incidents = GaugeMetricFamily("kvwatch_incidents_open", "Incidents open now.")
        try:
            with self.db.read() as conn:
                for rule, severity, state, n in conn.execute(
                    select(m.Alert.rule, m.Alert.severity, m.Alert.state, func.count())
                    .where(m.Alert.state != "resolved")
                    .group_by(m.Alert.rule, m.Alert.severity, m.Alert.state)
                ):
                    (firing if state == "firing" else pending).add_metric([rule, severity], n)
                for rule, kind, h in conn.execute(
                    select(m.RuleHealth.rule, m.RuleHealth.kind, m.RuleHealth.health)
                ):
                    health.add_metric([rule, kind], 1 if h == "ok" else 0)
                incidents.add_metric(
                    [],
                    conn.execute(
                        select(func.count())
                        .select_from(m.Incident)
                        .where(m.Incident.state == "open")
                    ).scalar_one(),
                )
        except Unavailable:
            return
        yield from (firing, pending, health, incidents)


class _DeploymentGauges(Collector):
    """Per-deployment gauges, for at most ``max_deployments`` deployments (the most recently
    seen): /metrics is scraped often and its size must not grow with whatever names a batch
    brings. The deployments left out are counted (``kvwatch_metrics_deployments_omitted``).

    /metrics needs no token by default, so nothing here describes one request: the largest
    prompt of the hour is published rounded up to its 9%-wide size bin, and only for a
    deployment with at least ``min_requests`` requests in that hour."""

    def __init__(self, db: Database, limits: Limits, max_deployments: int, min_requests: int):
        self.db = db
        self.limits = limits
        self.max_deployments = max_deployments
        self.min_requests = min_requests
        self.max_routes = MAX_ROUTES
        self.max_probes = MAX_PROBES

    def describe(self) -> list[Metric]:
        return []  # dynamic: collected from the database at scrape time

    def collect(self) -> Iterator[Metric]:
        labels = ["deployment", "node", "role", "model"]
        adv = GaugeMetricFamily(
            "kvwatch_deployment_advertised_context_tokens",
            "Advertised context of the latest config.",
            labels=labels,
        )
        cap = GaugeMetricFamily(
            "kvwatch_deployment_pool_capacity_tokens",
            "KV pool capacity of the latest config.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "kvwatch_deployment_pool_used_tokens",
            "KV pool tokens in use at the last pool sample.",
            labels=["deployment", "node", "role"],
        )
        occ = GaugeMetricFamily(
            "kvwatch_deployment_pool_occupancy_ratio",
            "used/capacity at the last pool sample.",
            labels=["deployment", "node", "role"],
        )
        maxp = GaugeMetricFamily(
            "kvwatch_deployment_max_prompt_tokens_1h",
            "Largest prompt in the last hour, rounded up to its 9%-wide size bin; only with "
            f"at least {self.min_requests} requests in the hour.",
            labels=["deployment"],
        )
        omitted = GaugeMetricFamily(
            "kvwatch_metrics_deployments_omitted",
            f"Deployments whose series this scrape left out (over the {self.max_deployments} "
            "most recently seen; KVWATCH_METRICS_MAX_DEPLOYMENTS).",
        )
        route_maxp = GaugeMetricFamily(
            "kvwatch_deployment_route_max_prompt_tokens_1h",
            "Largest prompt in the last hour per model and route, rounded up to its 9%-wide "
            f"size bin; only with at least {self.min_requests} requests of that model and "
            f"route in the hour, and for the {self.max_routes} largest per deployment.",
            labels=["deployment", "model", "route"],
        )
        verified = GaugeMetricFamily(
            "kvwatch_deployment_verified_safe_context_tokens",
            "Verified safe context of the latest verification, when it passed.",
            labels=["deployment", "model"],
        )
        failed = GaugeMetricFamily(
            "kvwatch_deployment_verification_failed",
            "1 if the latest verification with a verdict failed (found the endpoint "
            "unsafe), 0 if it passed.",
            labels=["deployment", "model"],
        )
        passed_at = GaugeMetricFamily(
            "kvwatch_deployment_last_passed_verification_timestamp_seconds",
            "When the latest passing verification ran (Unix time).",
            labels=["deployment", "model"],
        )
        # The limit in force, the one decision the context_pressure rule measures prompts
        # against and the gateway enforces, so that Prometheus (and Grafana) draw the same
        # line kvwatch alerts on.
        safe = GaugeMetricFamily(
            "kvwatch_deployment_safe_context_tokens",
            "The limit in force (policies.limits): the verified safe context while it holds, "
            "else min(advertised context, prefill pool), tightened by a failed verification "
            "(0: every prompt refused). source: verified, pool, failed-verification; stale: "
            "a passing verification no longer holds (drift, pool below it, too old).",
            labels=["deployment", "model", "verified", "source", "stale"],
        )
        canary = GaugeMetricFamily(
            "kvwatch_deployment_canary_hits_1h",
            "Canary hits recorded in the last hour (by event time); also counted in "
            "kvwatch_deployment_stale_reads_1h.",
            labels=["deployment"],
        )
        stale = GaugeMetricFamily(
            "kvwatch_deployment_stale_reads_1h",
            "Stale page reads and canary hits recorded in the last hour (by event time).",
            labels=["deployment", "cross_tenant"],
        )
        rejected = GaugeMetricFamily(
            "kvwatch_deployment_rejected_prefill_transfers_1h",
            "KV transfers of requests prefill had rejected, in the last hour (the "
            "incident's path).",
            labels=["deployment"],
        )
        missing = GaugeMetricFamily(
            "kvwatch_probe_missing_events",
            f"Events a probe's seq numbers show as lost (open gaps), for the {self.max_probes} "
            "probes missing most.",
            labels=["probe", "deployment"],
        )
        probes_omitted = GaugeMetricFamily(
            "kvwatch_metrics_probes_omitted",
            "Probes with open gaps whose kvwatch_probe_missing_events series this scrape left "
            f"out (over the {self.max_probes} missing most).",
        )
        try:
            with self.db.read() as conn:
                d = m.Deployment
                ranked = conn.execute(select(d.id).order_by(d.last_seen.desc(), d.id)).scalars()
                everyone = list(ranked)
                kept = set(everyone[: self.max_deployments])
                omitted.add_metric([], len(everyone) - len(kept))
                for c in queries.latest_configs(conn):
                    if c.deployment_id not in kept:
                        continue
                    lv = [c.deployment_id, c.node, c.role, c.model_id]
                    adv.add_metric(lv, c.advertised_context)
                    cap.add_metric(lv, c.pool_capacity_tokens)
                for p in queries.latest_pool_samples(conn, sorted(kept)):
                    lv = [p.deployment_id, p.node, p.role]
                    used.add_metric(lv, p.used_tokens)
                    occ.add_metric(
                        lv, p.used_tokens / p.capacity_tokens if p.capacity_tokens else 0
                    )
                since = int((time.time() - 3600) * 1_000_000)
                per_dep: dict[str, tuple[int | None, int]] = {}
                per_route: dict[str, list[tuple[int, str, str]]] = {}
                for dep, model, route, mx, n in conn.execute(
                    select(
                        m.Request.deployment_id,
                        m.Request.model_id,
                        m.Request.route,
                        func.max(m.Request.prompt_tokens),
                        func.count(),
                    )
                    .where(m.Request.first_ts >= since)
                    .group_by(m.Request.deployment_id, m.Request.model_id, m.Request.route)
                ):
                    if dep not in kept:
                        continue
                    top, count = per_dep.get(dep, (None, 0))
                    if mx is not None and (top is None or mx > top):
                        top = int(mx)
                    per_dep[dep] = (top, count + n)
                    if mx is not None and model and n >= self.min_requests:
                        # route "none": the default pack's label for requests without one
                        per_route.setdefault(dep, []).append((int(mx), model, route or "none"))
                for dep, (top, count) in per_dep.items():
                    if top is not None and count >= self.min_requests:
                        maxp.add_metric([dep], _published(top))
                for dep, groups in per_route.items():
                    # the most pressed routes first: they are the ones an alert needs
                    for mx, model, route in sorted(groups, reverse=True)[: self.max_routes]:
                        route_maxp.add_metric([dep, model, route], _published(mx))
                self._safety(conn, kept, since, verified, failed, passed_at, stale, rejected)
                self._safe_context(conn, kept, since, safe, canary)
                gaps = [
                    (int(n), probe, dep)
                    for probe, dep, n in conn.execute(
                        select(
                            m.SeqGap.probe_id,
                            m.Probe.deployment_id,
                            func.sum(m.SeqGap.last_seq - m.SeqGap.first_seq + 1),
                        )
                        .join(m.Probe, m.Probe.probe_id == m.SeqGap.probe_id)
                        .group_by(m.SeqGap.probe_id, m.Probe.deployment_id)
                    )
                    if dep in kept
                ]
                # the probes missing most first: a flood of probe ids adds one count, not
                # a series each
                gaps.sort(key=lambda g: (-g[0], g[1]))
                for n, probe, dep in gaps[: self.max_probes]:
                    missing.add_metric([probe, dep], n)
                probes_omitted.add_metric([], max(0, len(gaps) - self.max_probes))
        except Unavailable:
            return  # the ingest counters still scrape while the database is down
        yield from (adv, cap, used, occ, maxp, route_maxp, missing, omitted, probes_omitted)
        yield from (verified, failed, passed_at, stale, rejected, safe, canary)

    def _safe_context(
        self,
        conn: Connection,
        kept: set[str],
        since: int,
        safe: GaugeMetricFamily,
        canary: GaugeMetricFamily,
    ) -> None:
        """The limit in force of each (deployment, model), as ``collector.limits`` serves it
        to every other reader; and the hour's canary hits, zeros included ("none this hour"
        is an answer, not missing data)."""
        now = datetime.now(UTC)
        for (dep, model), lim in self.limits.in_conn(conn, kept, now).items():
            if lim.tokens is not None:
                safe.add_metric(
                    [
                        dep,
                        model,
                        "true" if lim.verified else "false",
                        lim.source,
                        "true" if lim.stale else "false",
                    ],
                    lim.tokens,
                )
        hits = dict.fromkeys(kept, 0)
        pe = m.PageEvent
        for dep, n in conn.execute(
            select(pe.deployment_id, func.count())
            .where(pe.kind == "canary.hit", pe.ts >= since)
            .group_by(pe.deployment_id)
        ):
            if dep in kept:
                hits[dep] = n
        for dep, n in sorted(hits.items()):
            canary.add_metric([dep], n)

    def _safety(
        self,
        conn: Connection,
        kept: set[str],
        since: int,
        verified: GaugeMetricFamily,
        failed: GaugeMetricFamily,
        passed_at: GaugeMetricFamily,
        stale: GaugeMetricFamily,
        rejected: GaugeMetricFamily,
    ) -> None:
        """What the default pack's critical rules read, as gauges a Prometheus rule can
        compare: verdicts, stale reads and rejected prefills that transferred KV."""
        for (dep, model), v in sorted(_decided_verifications(conn, kept).items()):
            failed.add_metric([dep, model], 1 if v.verdict == "fail" else 0)
            if v.verdict == "pass" and v.verified_safe_context:
                verified.add_metric([dep, model], v.verified_safe_context)
            if v.last_passed_at is not None:
                passed_at.add_metric([dep, model], v.last_passed_at.timestamp())
        reads = {(dep, flag): 0 for dep in kept for flag in ("false", "true")}
        pe = m.PageEvent
        for dep, crossed, n in conn.execute(
            select(pe.deployment_id, pe.cross_tenant, func.count())
            .where(pe.kind.in_(("page.stale_read", "canary.hit")), pe.ts >= since)
            .group_by(pe.deployment_id, pe.cross_tenant)
        ):
            if dep in kept:
                reads[(dep, "true" if crossed else "false")] += n
        for (dep, flag), n in sorted(reads.items()):
            stale.add_metric([dep, flag], n)
        transfers = dict.fromkeys(kept, 0)
        for dep, n in conn.execute(
            select(pe.deployment_id, func.count())
            .where(
                pe.kind == "kv.transfer",
                pe.ts >= since,
                pe.detail.contains('"prefill_rejected":true'),
            )
            .group_by(pe.deployment_id)
        ):
            if dep in kept:
                transfers[dep] = n
        for dep, n in sorted(transfers.items()):
            rejected.add_metric([dep], n)


def _published(tokens: int) -> int:
    """A prompt size as /metrics may show it: rounded up to its 9%-wide size bin."""
    return math.ceil(bin_high(bin_of(tokens)))


def _decided_verifications(
    conn: Connection, deployments: set[str]
) -> dict[tuple[str, str], VerificationFact]:
    """The latest verification of each (deployment, model) that reached a verdict: a run
    that could not (``error``) changes nothing, as for the default pack's rules."""
    found = deployment_facts.verdicts(conn, deployments)
    out = {}
    for key, v in found.latest.items():
        if v.verdict == "error":
            v = found.decided.get(key, v)
        if v.verdict != "error":
            out[key] = v
    return out
