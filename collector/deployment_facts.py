"""What is known of each deployment, from the database (repository layer): its nodes' latest
configs, its verifications, the tenants it served and its probes. The policy engine evaluates
over these facts (:mod:`collector.alerting`); the limits card, the quarterly review and the
dashboard's safe-context lines read them too, and breach reports read the configs' and
verifications' whole history (:func:`config_history`, :func:`verification_history`).

Per batch, the cost is a few indexed queries for the deployments the batch touches: never a
scan of history.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select, text

from collector import models as m
from collector.timefmt import as_datetime, from_micros, to_micros
from engine_probe import events as ev
from policies import (
    DeploymentFacts,
    NodeConfig,
    PrefixHitFact,
    ProbeFact,
    TimerFacts,
    VerificationFact,
)
from policies.facts import (
    PREFIX_HISTORY_MAX,
    PREFIX_HISTORY_S,
    VerificationResult,
    VerificationRunFact,
    clock_period,
)

#: the longest a verification run may be announced for (``POST /v1/verification-runs``)
MAX_RUN_S = 3600.0
_CONFIG_HISTORY = 64  # per deployment: configs are stored only when they change


def _node_config(r: Any) -> NodeConfig:
    return NodeConfig(
        deployment_id=r.deployment_id,
        node=r.node,
        role=r.role,
        engine=r.engine,
        engine_version=r.engine_version,
        model_id=r.model_id,
        advertised_context=r.advertised_context,
        pool_capacity_tokens=r.pool_capacity_tokens,
        dtype=r.dtype,
        quantization=r.quantization,
        tp_size=r.tp_size,
        cuda_graphs=bool(r.cuda_graphs),
        disaggregated=bool(r.disaggregated),
        prefix_caching=bool(r.prefix_caching),
        prefix_cache_salting=bool(r.prefix_cache_salting),
        kv_connector=r.kv_connector,
        kv_connector_version=r.kv_connector_version,
        kv_tiers=ev.decode_tiers(r.kv_tiers),
        ts=as_datetime(r.ts),
    )


def node_configs(
    conn: Connection, deployments: Iterable[str] | None
) -> dict[tuple[str, str], NodeConfig]:
    """The latest config of every node of these deployments (all deployments: ``None``),
    ``stopped`` where the probe that reported it is gone (:func:`_gone`)."""
    t = m.DeploymentConfig.__table__
    out: dict[tuple[str, str], NodeConfig] = {}
    reporters: dict[tuple[str, str], str] = {}
    ids = (
        sorted(deployments)
        if deployments is not None
        else list(conn.execute(select(m.Deployment.id)).scalars())
    )
    for dep in ids:
        rows = conn.execute(
            select(t)
            .where(t.c.deployment_id == dep)
            .order_by(t.c.ts.desc(), t.c.id.desc())
            .limit(_CONFIG_HISTORY)
        )
        for r in rows:
            key = (r.deployment_id, r.node)
            if key not in out:
                out[key] = _node_config(r)
                reporters[key] = r.probe_id
    for key in _gone(conn, reporters):
        out[key] = replace(out[key], stopped=True)
    return out


def _gone(conn: Connection, reporters: dict[tuple[str, str], str]) -> list[tuple[str, str]]:
    """The nodes (of ``reporters``: node -> the probe of its latest stored config) that went
    away: the collector knows that probe gone (``Probe.gone_at``, the one decision of
    :mod:`collector.lost`: it said it stopped, a new probe replaced it on its node, or it
    has been silent past ``probe_lost_after_s``; vLLM's engine core never says it stopped),
    and no running probe of the deployment has its root (the same engine on the same host,
    restarted, reports an unchanged config, which is not stored again:
    ``DeploymentConfig``'s invariant)."""
    ids = sorted(set(reporters.values()))
    stopped: set[str] = set()
    for chunk in (ids[i : i + 500] for i in range(0, len(ids), 500)):
        stopped.update(
            conn.execute(
                select(m.Probe.probe_id).where(
                    m.Probe.probe_id.in_(chunk), m.Probe.gone_at.is_not(None)
                )
            ).scalars()
        )
    if not stopped:
        return []
    deps = sorted({d for (d, _), p in reporters.items() if p in stopped})
    running: set[tuple[str, str | None]] = {
        (d, ev.probe_root(p))
        for d, p in conn.execute(
            select(m.Probe.deployment_id, m.Probe.probe_id).where(
                m.Probe.deployment_id.in_(deps), m.Probe.gone_at.is_(None)
            )
        )
    }
    return [
        (d, node)
        for (d, node), p in reporters.items()
        if p in stopped and (ev.probe_root(p) is None or (d, ev.probe_root(p)) not in running)
    ]


@dataclass(frozen=True, slots=True)
class ConfigRecord:
    """One stored config of a node: the :class:`NodeConfig` the rules see, and what only the
    store keeps of it (the page size, the KV dtype, the hash that tells configs apart)."""

    config: NodeConfig
    page_size: int
    dtype: str
    config_hash: str


def config_history(conn: Connection, deployment_id: str) -> list[ConfigRecord]:
    """Every config the deployment's nodes have reported, oldest first. Configs are stored
    only when they change, so this grows with changes, not with time."""
    t = m.DeploymentConfig.__table__
    rows = conn.execute(
        select(t).where(t.c.deployment_id == deployment_id).order_by(t.c.ts, t.c.id)
    )
    return [ConfigRecord(_node_config(r), int(r.page_size), r.dtype, r.config_hash) for r in rows]


def _evidence(raw: str | None) -> dict[str, Any]:
    try:
        doc = json.loads(raw or "{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def verification_fact(r: Any, last_passed_at: datetime | None) -> VerificationFact:
    """A stored verification row as the rules see it. The verdict's details come from the
    evidence ``kvwatch verify`` uploads; an operator's record without them is a plain pass
    or fail."""
    evidence = _evidence(r.evidence)
    said = evidence.get("result")
    result: VerificationResult = "pass" if r.passed else "fail"
    if said == "error" and not r.passed:
        result = "error"
    pairs = evidence.get("leak_pairs")
    kinds = evidence.get("findings_by_kind")
    return VerificationFact(
        deployment_id=r.deployment_id,
        model_id=r.model_id,
        passed=bool(r.passed),
        verified_safe_context=r.verified_safe_context,
        engine_version=r.engine_version,
        pool_capacity_tokens=r.pool_capacity_tokens,
        quantization=r.quantization,
        tp_size=r.tp_size,
        cuda_graphs=r.cuda_graphs,
        verified_at=as_datetime(r.verified_at),
        verification_id=r.id,
        result=result,
        leaks=_int(evidence.get("leaks")) or 0,
        leak_pairs=tuple(str(p) for p in pairs[:50]) if isinstance(pairs, list) else (),
        smallest_leaking_prompt=_int(evidence.get("smallest_leaking_prompt_tokens")),
        findings_by_kind={str(k): n for k, n in kinds.items() if _int(n) is not None}
        if isinstance(kinds, dict)
        else {},
        last_passed_at=last_passed_at,
        **_prefix_fields(evidence.get("prefix_cache")),
    )


def _prefix_fields(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("verdict"), str):
        return {}
    pairs = doc.get("shared_pairs")
    shared = [
        f"{p['owner']}->{p['reader']}"
        for p in (pairs if isinstance(pairs, list) else [])[:50]
        if isinstance(p, dict)
        and isinstance(p.get("owner"), str)
        and isinstance(p.get("reader"), str)
    ]
    tier = doc.get("tier_verdict")
    salted = any(
        isinstance(p, dict) and p.get("salted") is True
        for p in (pairs if isinstance(pairs, list) else [])[:50]
    )
    return {
        "prefix_cache_verdict": doc["verdict"][:32],
        "prefix_shared_pairs": tuple(shared),
        "prefix_tier_verdict": tier[:32] if isinstance(tier, str) else None,
        "prefix_salt_defeated": salted,
    }


def verifications(
    conn: Connection, deployments: Iterable[str] | None, *, passed_only: bool = False
) -> dict[tuple[str, str], VerificationFact]:
    """The latest verification of each (deployment, model), with when the model last
    passed; ``passed_only``: the latest passing one."""
    t = m.Verification.__table__
    order = (t.c.verified_at.desc(), t.c.id.desc())
    q = select(t.c.deployment_id, t.c.model_id, t.c.passed, t.c.verified_at).order_by(*order)
    if passed_only:
        q = q.where(t.c.passed.is_(True))
    if deployments is not None:
        deps = sorted(deployments)
        if not deps:
            return {}
        q = q.where(t.c.deployment_id.in_(deps))
    # One pass over the narrow columns finds each key's latest row and latest pass; only
    # the latest rows are read whole (their evidence is parsed).
    latest_at: dict[tuple[str, str], Any] = {}
    passed_at: dict[tuple[str, str], datetime] = {}
    for r in conn.execute(q):
        key = (r.deployment_id, r.model_id)
        latest_at.setdefault(key, r.verified_at)
        if r.passed and key not in passed_at:
            passed_at[key] = as_datetime(r.verified_at)
    out: dict[tuple[str, str], VerificationFact] = {}
    for (dep, model), at in latest_at.items():
        cond = [t.c.deployment_id == dep, t.c.model_id == model, t.c.verified_at == at]
        if passed_only:
            cond.append(t.c.passed.is_(True))
        row = conn.execute(select(t).where(*cond).order_by(t.c.id.desc()).limit(1)).one()
        out[(dep, model)] = verification_fact(row, passed_at.get((dep, model)))
    return out


# How far back past runs that reached no verdict the latest decided one is looked for.
_LOOK_BACK = 50


@dataclass(frozen=True, slots=True)
class Verdicts:
    """The verifications a limit is decided from, per (deployment, model): the latest of
    any result, the latest passing one and the latest with a verdict (pass or fail), the
    last two only where they are not the latest (``DeploymentFacts``'s fallbacks)."""

    latest: dict[tuple[str, str], VerificationFact] = field(default_factory=dict)
    passing: dict[tuple[str, str], VerificationFact] = field(default_factory=dict)
    decided: dict[tuple[str, str], VerificationFact] = field(default_factory=dict)

    def of(self, deployment_id: str) -> Verdicts:
        def mine(
            d: dict[tuple[str, str], VerificationFact],
        ) -> dict[tuple[str, str], VerificationFact]:
            return {k: v for k, v in d.items() if k[0] == deployment_id}

        return Verdicts(mine(self.latest), mine(self.passing), mine(self.decided))

    def merge(self, other: Verdicts) -> None:
        self.latest.update(other.latest)
        self.passing.update(other.passing)
        self.decided.update(other.decided)


def verdicts(conn: Connection, deployments: Iterable[str] | None) -> Verdicts:
    """The latest, latest passing and latest decided verification of each (deployment,
    model): the latest's query, and one more read only for models whose latest did not pass
    (rare: they are failing or could not be verified)."""
    latest = verifications(conn, deployments)
    t = m.Verification.__table__
    out = Verdicts(latest=latest)
    for (dep, model), v in latest.items():
        if v.verdict == "pass":
            continue
        if v.last_passed_at is not None:
            row = conn.execute(
                select(t)
                .where(t.c.deployment_id == dep, t.c.model_id == model, t.c.passed.is_(True))
                .order_by(t.c.verified_at.desc(), t.c.id.desc())
                .limit(1)
            ).first()
            if row is not None:
                out.passing[(dep, model)] = verification_fact(row, v.last_passed_at)
        if v.verdict == "error":
            rows = conn.execute(
                select(t)
                .where(t.c.deployment_id == dep, t.c.model_id == model)
                .order_by(t.c.verified_at.desc(), t.c.id.desc())
                .limit(_LOOK_BACK)
            )
            decided = (
                f for r in rows if (f := verification_fact(r, v.last_passed_at)).verdict != "error"
            )
            found = next(decided, None)
            if found is not None:
                out.decided[(dep, model)] = found
    return out


@dataclass(frozen=True, slots=True)
class VerificationRecord:
    """One stored verification: the :class:`VerificationFact` the rules see, and who
    recorded it."""

    fact: VerificationFact
    created_by: str


def verification_history(conn: Connection, deployment_id: str) -> list[VerificationRecord]:
    """Every verification of the deployment, of any model, oldest first. Each fact's
    ``last_passed_at`` is the latest pass of its model up to and including it: what the rules
    would have seen had it been the latest."""
    t = m.Verification.__table__
    rows = conn.execute(
        select(t).where(t.c.deployment_id == deployment_id).order_by(t.c.verified_at, t.c.id)
    )
    out = []
    passed_at: dict[str, datetime] = {}
    for r in rows:
        if r.passed:
            passed_at[r.model_id] = as_datetime(r.verified_at)
        out.append(
            VerificationRecord(verification_fact(r, passed_at.get(r.model_id)), r.created_by)
        )
    return out


def tenant_pairs(by_type: Mapping[type, list[ev.Event]]) -> set[tuple[str, str]]:
    """(deployment, tenant) of every request event."""
    return {
        (e.deployment_id, e.tenant)  # type: ignore[attr-defined]
        for t in (ev.RequestAdmitted, ev.RequestRejected, ev.RequestFinished)
        for e in by_type.get(t, ())
    }


def remember_tenants(conn: Connection, pairs: set[tuple[str, str]], now_us: int) -> None:
    """Record which tenants each deployment served."""
    if not pairs:
        return
    mark = "?" if conn.dialect.name == "sqlite" else "%s"
    conn.exec_driver_sql(
        "INSERT INTO deployment_tenants (deployment_id, tenant, first_seen) "
        f"VALUES ({mark}, {mark}, {mark}) ON CONFLICT (deployment_id, tenant) DO NOTHING",
        [(d, t, now_us) for d, t in sorted(pairs)],
    )


def tenant_counts(conn: Connection, deployments: Iterable[str] | None) -> dict[str, int]:
    t = m.DeploymentTenant.__table__
    q = select(t.c.deployment_id, func.count()).group_by(t.c.deployment_id)
    if deployments is not None:
        q = q.where(t.c.deployment_id.in_(sorted(deployments)))
    return {d: n for d, n in conn.execute(q)}


def deployment_facts(
    configs: dict[tuple[str, str], NodeConfig],
    verified: Verdicts,
    tenants: dict[str, int],
    deployments: Iterable[str],
    max_verification_age_s: float | None = None,
    open_incidents: Iterable[str] = (),
) -> dict[str, DeploymentFacts]:
    out = {}
    incidents = set(open_incidents)
    for dep in deployments:
        out[dep] = DeploymentFacts(
            deployment_id=dep,
            configs={node: c for (d, node), c in configs.items() if d == dep},
            verifications={model: v for (d, model), v in verified.latest.items() if d == dep},
            tenant_count=tenants.get(dep, 0),
            passing={model: v for (d, model), v in verified.passing.items() if d == dep},
            decided={model: v for (d, model), v in verified.decided.items() if d == dep},
            max_verification_age_s=max_verification_age_s,
            open_incident=dep in incidents,
        )
    return out


def open_incident_deployments(conn: Connection, deployments: Iterable[str] | None) -> set[str]:
    """The deployments (of these; None: any) with an open incident."""
    i = m.Incident
    q = select(i.deployment_id).where(i.state == "open").distinct()
    if deployments is not None:
        q = q.where(i.deployment_id.in_(sorted(deployments)))
    return set(conn.execute(q).scalars())


def load(
    conn: Connection,
    deployments: Iterable[str] | None,
    max_verification_age_s: float | None,
    *,
    tenants: bool = False,
    incidents: bool = False,
) -> dict[str, DeploymentFacts]:
    """What is known of these deployments (every one: ``None``), as the rules see it:
    what every reader of the limit in force loads (``collector.limits``). ``tenants``,
    ``incidents``: also the tenant counts and which have an open incident (the timer's rules)."""
    deployments = None if deployments is None else set(deployments)
    configs = node_configs(conn, deployments)
    verified = verdicts(conn, deployments)
    deps = (
        set(deployments)
        if deployments is not None
        else {d for d, _ in configs}
        | {d for d, _ in verified.latest}
        | set(conn.execute(select(m.Deployment.id)).scalars())
    )
    counts = tenant_counts(conn, deps) if tenants else {}
    open_now = open_incident_deployments(conn, deployments) if incidents else set()
    return deployment_facts(configs, verified, counts, deps, max_verification_age_s, open_now)


def fold_configs(
    prior: dict[tuple[str, str], NodeConfig], events: Sequence[ev.Event]
) -> dict[tuple[str, str], NodeConfig]:
    """``prior`` with the batch's engine.config events applied (the latest by time wins, as
    the store decides what a node's config is)."""
    out = dict(prior)
    for e in events:
        if isinstance(e, ev.EngineConfig):
            key = (e.deployment_id, e.node)
            have = out.get(key)
            if have is None or e.ts >= have.ts:
                out[key] = NodeConfig.from_event(e)
    return out


# How a quiet probe's evidence is looked for (policies.kinds.telemetry.evidence). Request and
# sample times are the producers' clocks, last_seen the collector's: they are compared with
# some slack, and only over the minutes before the probe went quiet (an index range on time,
# never a scan of history).
_US = 1_000_000
_IN_FLIGHT_WINDOW_US = 15 * 60 * _US  # requests admitted this long before it went quiet
_CADENCE_WINDOW_US = 3600 * _US  # its pool samples this long before it went quiet
_CLOCK_SLACK_US = 5 * 60 * _US
_CADENCE_SAMPLES = 4


def prefix_history(
    conn: Connection, readers: Iterable[tuple[str, str]], until_us: int
) -> dict[tuple[str, str], list[PrefixHitFact]]:
    """Each (deployment, reader tenant)'s cross-tenant prefix-cache hits of the
    PREFIX_HISTORY_S before ``until_us``, newest first, at most PREFIX_HISTORY_MAX, with the
    reading request's prompt tokens (one indexed query per reader, bounded by the cap)."""
    out: dict[tuple[str, str], list[PrefixHitFact]] = {}
    since = until_us - round(PREFIX_HISTORY_S * _US)
    for dep, reader in sorted(set(readers)):
        rows = conn.execute(
            text(
                "SELECT pe.ts, pe.other_tenant, pe.detail, r.prompt_tokens FROM page_events pe "
                "LEFT JOIN requests r ON r.deployment_id = pe.deployment_id "
                "AND r.request_id = pe.request_id "
                "WHERE pe.deployment_id = :d AND pe.kind = 'prefix_cache.hit' "
                "AND pe.tenant = :t AND pe.cross_tenant AND pe.ts >= :lo AND pe.ts <= :hi "
                "ORDER BY pe.ts DESC LIMIT :n"
            ),
            {"d": dep, "t": reader, "lo": since, "hi": until_us, "n": PREFIX_HISTORY_MAX},
        ).all()
        out[(dep, reader)] = [
            PrefixHitFact(
                ts=from_micros(int(ts)),
                owner_tenant=owner or "",
                tokens=int(_evidence(detail).get("tokens") or 0),
                prompt_tokens=None if prompt is None else int(prompt),
            )
            for ts, owner, detail, prompt in rows
        ]
    return out


def timer_facts(
    conn: Connection,
    now: datetime | None = None,
    evidence_after_s: float | None = None,
    max_verification_age_s: float | None = None,
) -> TimerFacts:
    """Every deployment and every probe (bounded by how many exist, not by history). With
    ``now`` and ``evidence_after_s`` (``policies.kinds.telemetry.probe_evidence_after``),
    the probes quiet at least that long, and the other probes of their deployments, carry
    the evidence that they should be sending (see :class:`policies.ProbeFact`)."""
    facts = load(conn, None, max_verification_age_s, tenants=True, incidents=True)
    rows = list(
        conn.execute(
            text(
                "SELECT probe_id, deployment_id, first_seen, last_seen, stopped_at, "
                "lost_requests, gone_reason FROM probes ORDER BY probe_id"
            )
        )
    )
    found: dict[str, dict[str, Any]] = {}
    if now is not None and evidence_after_s is not None:
        found = _probe_evidence(conn, rows, to_micros(now) - round(evidence_after_s * _US))
    probes = [
        ProbeFact(
            probe_id=p,
            deployment_id=d,
            last_seen=as_datetime(seen),
            first_seen=as_datetime(first),
            stopped_at=as_datetime(stopped),
            lost=int(lost or 0),
            gone_reason=gone,
            **found.get(p, {}),
        )
        for p, d, first, seen, stopped, lost, gone in rows
    ]
    return TimerFacts(deployments=facts, probes=probes)


def _probe_evidence(
    conn: Connection, rows: Sequence[Any], quiet_since_us: int
) -> dict[str, dict[str, Any]]:
    """ProbeFact's evidence fields, by probe id: requests in flight for the running probes
    last heard from before ``quiet_since_us``; their scrape errors; and how every running
    probe of their deployments sampled its pool."""
    quiet = [r for r in rows if r.stopped_at is None and r.last_seen <= quiet_since_us]
    if not quiet:
        return {}
    out: dict[str, dict[str, Any]] = {}
    errors: dict[str, str | None] = {
        p: e
        for p, e in conn.execute(
            text("SELECT probe_id, last_error FROM scrape_targets WHERE failures > 0")
        )
    }
    for r in quiet:
        lo = max(r.first_seen - _CLOCK_SLACK_US, r.last_seen - _IN_FLIGHT_WINDOW_US)
        n = conn.execute(
            text(
                # lost: admitted, then closed by the collector because a probe went away
                "SELECT count(*) FROM requests WHERE deployment_id = :d "
                "AND status IN ('admitted', 'lost') AND first_ts >= :lo AND first_ts <= :hi"
            ),
            {"d": r.deployment_id, "lo": lo, "hi": r.last_seen + _CLOCK_SLACK_US},
        ).scalar_one()
        out[r.probe_id] = {"in_flight": int(n), "scrape_error": errors.get(r.probe_id) or None}
    deployments = {r.deployment_id for r in quiet}
    for r in rows:
        if r.stopped_at is None and r.deployment_id in deployments:
            period = _sample_period(conn, r)
            if period is not None:
                out.setdefault(r.probe_id, {})["sample_period_s"] = period
    return out


def _sample_period(conn: Connection, probe: Any) -> float | None:
    """The clock a probe sampled its pool on (``policies.facts.clock_period``), from the
    latest samples of the node it sampled last."""
    samples = conn.execute(
        text(
            "SELECT ts, node, used_tokens FROM pool_samples WHERE deployment_id = :d "
            "AND probe_id = :p AND ts >= :lo AND ts <= :hi ORDER BY ts DESC LIMIT :n"
        ),
        {
            "d": probe.deployment_id,
            "p": probe.probe_id,
            "lo": probe.last_seen - _CADENCE_WINDOW_US,
            "hi": probe.last_seen + _CLOCK_SLACK_US,
            "n": 4 * _CADENCE_SAMPLES,
        },
    ).all()
    if not samples:
        return None
    node = samples[0].node
    mine = [(s.ts / _US, int(s.used_tokens)) for s in samples if s.node == node]
    return clock_period(mine[:_CADENCE_SAMPLES])


def verification_runs(
    conn: Connection, deployments: Iterable[str], since_us: int, until_us: int
) -> list[VerificationRunFact]:
    """The verification runs of these deployments whose time overlaps [since, until]: the
    runs a batch's events may belong to (indexed by deployment and start; a run lasts at
    most ``MAX_RUN_S``, so an older start cannot reach the batch)."""
    deps = sorted(deployments)
    if not deps:
        return []
    t = m.VerificationRun.__table__
    rows = conn.execute(
        select(t.c.deployment_id, t.c.tenants, t.c.started_at, t.c.ends_at, t.c.finished_at).where(
            t.c.deployment_id.in_(deps),
            t.c.started_at <= until_us,
            t.c.started_at >= since_us - int(MAX_RUN_S * 1e6),
        )
    )
    out = []
    for r in rows:
        until = as_datetime(r.finished_at if r.finished_at is not None else r.ends_at)
        if to_micros(until) < since_us:
            continue
        out.append(
            VerificationRunFact(
                deployment_id=r.deployment_id,
                tenants=frozenset(json.loads(r.tenants)),
                started_at=as_datetime(r.started_at),
                until=until,
            )
        )
    return out
