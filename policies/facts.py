"""What rules are evaluated over: a batch of new events, or the state the timer sees, plus
what is known about the deployments involved. Built by the collector, read-only here."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from functools import cached_property
from itertools import pairwise
from typing import Literal, TypeVar

from engine_probe import events as ev

E = TypeVar("E", bound=ev.Event)

# The engine settings a verification was measured under: a change to any invalidates it,
# and a change between two engine.config events is drift.
VERIFIED_SETTINGS = (
    "engine_version",
    "pool_capacity_tokens",
    "quantization",
    "tp_size",
    "cuda_graphs",
)


#: KV dtypes that say "not resolved": vLLM's metrics show ``auto`` (the model's dtype) and a
#: scrape that cannot tell says ``unknown``. Never a disagreement between nodes.
UNRESOLVED_DTYPES = frozenset({"auto", "unknown"})
# vLLM names connectors "<Family>Connector" or "<Family>ConnectorV1".
_CONNECTOR_SUFFIX = re.compile(r"_?connector(_?v\d+)?$")


def connector_family(name: str) -> str:
    """A KV connector's family, lower-case: ``LMCacheConnectorV1`` -> ``lmcache``,
    ``LMCacheMPConnector`` -> ``lmcachemp``, ``OffloadingConnector`` -> ``offloading``,
    ``lmcache`` -> ``lmcache``: what an advisory's ``connector`` names, either way."""
    low = name.lower()
    return _CONNECTOR_SUFFIX.sub("", low) or low


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """The engine configuration one node of a deployment last reported.

    ``dtype``: the KV cache's dtype as reported (``auto`` or ``unknown`` where a producer
    could not resolve it: see :data:`UNRESOLVED_DTYPES`). ``stopped``: the collector knows the probe
    that reported this config gone (it said it stopped, was replaced on its node, or fell
    silent past the bound: ``collector.lost``) and the node reported nothing newer: the node
    is gone (rules comparing live nodes leave it out); a config folded in
    from a new event is never stopped.
    """

    deployment_id: str
    node: str
    role: str
    engine: str
    engine_version: str
    model_id: str
    advertised_context: int
    pool_capacity_tokens: int
    dtype: str
    quantization: str | None
    tp_size: int
    cuda_graphs: bool
    disaggregated: bool
    prefix_caching: bool
    prefix_cache_salting: bool
    ts: datetime
    kv_connector: str | None = None
    kv_connector_version: str | None = None
    kv_tiers: tuple[ev.KvTier, ...] = ()
    stopped: bool = False

    @classmethod
    def from_event(cls, e: ev.EngineConfig) -> NodeConfig:
        return cls(**{f.name: getattr(e, f.name) for f in fields(cls) if f.name != "stopped"})

    def kv_connector_family(self) -> str | None:
        """The KV connector's family (:func:`connector_family`), or None without one."""
        return connector_family(self.kv_connector) if self.kv_connector else None

    def changed(
        self, other: NodeConfig, names: Iterable[str] = VERIFIED_SETTINGS
    ) -> dict[str, tuple[object, object]]:
        """``{setting: (self's, other's)}`` for the settings that differ."""
        out = {}
        for name in names:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out[name] = (a, b)
        return out


VerificationResult = Literal["pass", "fail", "error"]


@dataclass(frozen=True, slots=True)
class VerificationFact:
    """The latest verification of one model on one deployment.

    ``result`` is the verdict: ``pass``, ``fail`` (the endpoint was found unsafe: a
    cross-tenant leak, an acceptance above an earlier rejection, a 5xx, partial text) or
    ``error`` (the run could not reach a verdict; it says nothing about the endpoint). A
    failure's ``leak_pairs`` name tenants (``owner->reader``) and ``smallest_leaking_prompt``
    the shortest prompt that leaked; never any text. ``last_passed_at``: the latest passing
    verification of the same model, however old (None: never passed). The prefix-cache
    verdict is apart from ``result``: a shared prefix cache leaks no answer text, so it
    fails no context verdict (it fires ``prefix_cache_unsalted``)."""

    deployment_id: str
    model_id: str
    passed: bool
    verified_safe_context: int | None
    engine_version: str | None
    pool_capacity_tokens: int | None
    quantization: str | None
    tp_size: int | None
    cuda_graphs: bool | None
    verified_at: datetime
    verification_id: int | None = None
    result: VerificationResult | None = None
    leaks: int = 0
    leak_pairs: tuple[str, ...] = ()
    smallest_leaking_prompt: int | None = None
    findings_by_kind: Mapping[str, int] = field(default_factory=dict)
    last_passed_at: datetime | None = None
    #: the prefix-cache phase's verdict (``isolated``, ``shared_across_tenants``,
    #: ``caching_off``, ``inconclusive``; None: not checked) and, when shared, the pairs
    #: (``owner->reader``) whose prefixes crossed; never text
    prefix_cache_verdict: str | None = None
    prefix_shared_pairs: tuple[str, ...] = ()
    #: the phase's eviction round (``isolated``, ``shared_across_tenants``, ``not_reached``,
    #: ``skipped``; None: not run): whether a prefix that left the pool came back to others
    prefix_tier_verdict: str | None = None
    #: a pair shared although each tenant sent its own cache_salt: the salt did not isolate
    #: (an engine, a tier or a router dropped it)
    prefix_salt_defeated: bool = False

    @property
    def verdict(self) -> VerificationResult:
        if self.result is not None:
            return self.result
        return "pass" if self.passed else "fail"

    def stale_against(self, cfg: NodeConfig) -> dict[str, tuple[object, object]]:
        """Settings that changed since the verification (``{name: (verified, now)}``);
        settings the verification did not record are not compared."""
        out = {}
        for name in VERIFIED_SETTINGS:
            then = getattr(self, name)
            now = getattr(cfg, name)
            if then is not None and then != now:
                out[name] = (then, now)
        return out


def verified_nodes(configs: Iterable[NodeConfig], model_id: str) -> list[NodeConfig]:
    """The nodes a verification of ``model_id`` is compared with: those serving it that a
    prompt must fit in (prefill or monolithic). A decode node's pool is sized separately in a
    disaggregated deployment, so comparing the verified pool with it would call every
    verification stale at once."""
    serving = [c for c in configs if c.model_id == model_id]
    return [c for c in serving if c.role != "decode"] or serving


@dataclass(frozen=True, slots=True)
class DeploymentFacts:
    """One deployment: each node's latest config, the latest verification per model (and
    the latest passing and decided ones), how many tenants it has served, and the pack's
    maximum verification age: everything :func:`policies.limits.limit_in_force` decides
    from."""

    deployment_id: str
    configs: Mapping[str, NodeConfig] = field(default_factory=dict)
    verifications: Mapping[str, VerificationFact] = field(default_factory=dict)
    tenant_count: int = 0
    #: per model, the latest passing verification and the latest with a verdict (pass or
    #: fail), where they are not the latest one (``verifications``); missing entries are
    #: read from ``verifications`` when it qualifies
    passing: Mapping[str, VerificationFact] = field(default_factory=dict)
    decided: Mapping[str, VerificationFact] = field(default_factory=dict)
    #: the rule pack's maximum verification age (``verification_missing_or_stale``'s
    #: ``max_age``), which the limit in force applies; None: no maximum
    max_verification_age_s: float | None = None
    #: an incident of the deployment is open (a leak was seen, whatever a verification
    #: said); loaded where a rule weighs it (a batch with configs, the timer)
    open_incident: bool = False

    def prefill_pool_tokens(self) -> int | None:
        """The smallest pool a prompt must fit in: the prefill (or monolithic) nodes'."""
        pools = [c.pool_capacity_tokens for c in self.configs.values() if c.role != "decode"]
        return min(pools) if pools else None

    def advertised_context(self, model_id: str | None = None) -> int | None:
        adv = [
            c.advertised_context
            for c in self.configs.values()
            if model_id is None or c.model_id == model_id
        ]
        return min(adv) if adv else None


@dataclass(frozen=True, slots=True)
class PrefixHitFact:
    """One cross-tenant prefix-cache hit in a reader tenant's recent history (what
    ``prefix_probe_suspected`` weighs): when, whose blocks (the owner tenant), how many
    prompt tokens the hit served, and the reading request's prompt tokens (None when not
    known). Counts only: a prefix's text is never known to the collector."""

    ts: datetime
    owner_tenant: str
    tokens: int
    prompt_tokens: int | None


#: How far back, and how many of a reader's cross-tenant prefix hits at most, a batch's
#: ``prefix_history`` reaches: the loader's bounds, which no rule's window may exceed.
PREFIX_HISTORY_S = 3600.0
PREFIX_HISTORY_MAX = 1000


@dataclass(frozen=True, slots=True)
class SeqGapFact:
    probe_id: str
    deployment_id: str
    first_seq: int
    last_seq: int


@dataclass(frozen=True, slots=True)
class ProbeFact:
    """What the collector knows of one probe: when it was first and last heard from, and
    when it said it stopped (``probe.stopped``; None while it runs).

    The rest is evidence that a quiet probe *should* be sending (``telemetry_gap`` tells a
    silent probe from an idle one by it), loaded only for probes quiet long enough to need
    it and for their deployments' other probes (:func:`timer_facts` in the collector):

    - ``in_flight``: requests of its deployment admitted in the last minutes before it went
      quiet (and after it started) that never finished nor were rejected;
    - ``sample_period_s``: it sampled its pool on a clock, every this many seconds (see
      :func:`clock_period`), None when it did not (or never sampled);
    - ``scrape_error``: the collector scrapes this probe's engine itself and its latest
      scrapes failed (the error).

    ``lost``: how many of its requests the collector closed as lost because it went away
    (``gone_reason``: probe_stopped, probe_replaced, probe_silent; None while it runs).
    """

    probe_id: str
    deployment_id: str
    last_seen: datetime
    first_seen: datetime | None = None
    stopped_at: datetime | None = None
    in_flight: int = 0
    sample_period_s: float | None = None
    scrape_error: str | None = None
    lost: int = 0
    gone_reason: str | None = None


def clock_period(samples: Sequence[tuple[float, int]]) -> float | None:
    """The period, in seconds, of pool samples taken on a clock, or None.

    ``samples``: one node's latest pool samples, latest first, as (time in seconds, used
    tokens). A clock it is when there are at least four, their gaps are within a factor of
    two of one another, and the pool did not change across them: an engine's own sampler
    samples every so many engine steps, and steps happen only while requests fill or drain
    the pool, so a regular beat over an unchanging pool is a scraper or a timer that keeps
    sampling with no traffic. The period is the longest gap."""
    if len(samples) < 4 or len({used for _, used in samples}) != 1:
        return None
    times = [t for t, _ in samples]
    gaps = [a - b for a, b in pairwise(times)]
    if min(gaps) <= 0 or max(gaps) > 2 * min(gaps):
        return None
    return max(gaps)


def superseded(probes: Iterable[ProbeFact]) -> dict[str, str]:
    """probe id -> the probe that took its place: a later probe of the same deployment and
    the same id root (the same engine on the same host, restarted: see
    ``events.probe_root``) first heard from at or after the older one was last heard from.

    Two probes running side by side (replicas on one host, a forked worker) overlap in time,
    so neither supersedes the other; a probe that went quiet while its sibling kept running
    is not superseded either: its engine did not come back."""
    by_root: dict[tuple[str, str], list[ProbeFact]] = {}
    for p in probes:
        root = ev.probe_root(p.probe_id)
        if root is not None and p.first_seen is not None:
            by_root.setdefault((p.deployment_id, root), []).append(p)
    out: dict[str, str] = {}
    for group in by_root.values():
        group.sort(key=lambda p: (p.first_seen, p.probe_id))
        for i, old in enumerate(group):
            later = (q for q in group[i + 1 :] if q.first_seen and q.first_seen >= old.last_seen)
            successor = next(later, None)
            if successor is not None:
                out[old.probe_id] = successor.probe_id
    return out


@dataclass(frozen=True, slots=True)
class VerificationRunFact:
    """A verification announced on a deployment: from ``started_at`` until ``until`` (its
    finish, else its announced end), the requests and page events of ``tenants`` alone are
    its own prompts (``collector.models.VerificationRun``)."""

    deployment_id: str
    tenants: frozenset[str]
    started_at: datetime
    until: datetime


def event_tenants(e: ev.Event) -> set[str]:
    """Every tenant an event names: its ``tenant``, or a page or cache event's reader and the
    tenant whose pages it read (the fields named ``*tenant``)."""
    names = (getattr(e, f, None) for f in type(e).__struct_fields__ if f.endswith("tenant"))
    return {n for n in names if isinstance(n, str) and n}


def without_verification_traffic(
    events: Sequence[ev.Event], runs: Sequence[VerificationRunFact]
) -> list[ev.Event]:
    """The events the rules evaluate: all but a verification's own traffic, an event of a
    run's deployment, within its time, whose tenants are all the run's (one tenant of the
    fleet's own among them and it is evaluated: a verification never hides another tenant's
    request or a read of another tenant's pages). Events naming no tenant (pool samples,
    configs) are always evaluated."""
    if not runs:
        return list(events)

    def own(e: ev.Event) -> bool:
        tenants = event_tenants(e)
        return bool(tenants) and any(
            r.deployment_id == e.deployment_id
            and r.started_at <= e.ts <= r.until
            and tenants <= r.tenants
            for r in runs
        )

    return [e for e in events if not own(e)]


def index_by_type(events: Iterable[ev.Event]) -> dict[type, list[ev.Event]]:
    """Events grouped by their type, each group in the order given."""
    index: dict[type, list[ev.Event]] = {}
    for e in events:
        index.setdefault(type(e), []).append(e)
    return index


@dataclass(frozen=True)
class BatchFacts:
    """A batch's *new* events (duplicates already removed: a re-sent batch changes nothing),
    the deployments they touch, each node's config as it was before the batch, and the seq
    gaps the batch revealed. ``of(EventType, ...)`` gives the batch's events of those types
    in batch order, indexed once per batch (rules ask for theirs instead of each scanning
    the whole batch)."""

    events: Sequence[ev.Event]
    deployments: Mapping[str, DeploymentFacts] = field(default_factory=dict)
    prior_configs: Mapping[tuple[str, str], NodeConfig] = field(default_factory=dict)
    seq_gaps: Sequence[SeqGapFact] = ()
    by_type: Mapping[type, list[ev.Event]] | None = None  # index_by_type(events), if known
    #: (deployment, reader tenant) -> its cross-tenant prefix hits of the last
    #: PREFIX_HISTORY_S, newest first, at most PREFIX_HISTORY_MAX, the batch's own included:
    #: loaded only for the readers of the batch's cross-tenant hits, and only when a rule
    #: needs it (``needs_prefix_history``)
    prefix_history: Mapping[tuple[str, str], Sequence[PrefixHitFact]] = field(default_factory=dict)

    @cached_property
    def _by_type(self) -> Mapping[type, list[ev.Event]]:
        return self.by_type if self.by_type is not None else index_by_type(self.events)

    def of(self, *types: type[E]) -> list[E]:
        """The batch's events of these types: grouped by type, each group in batch order."""
        if len(types) == 1:
            return self._by_type.get(types[0], [])  # type: ignore[return-value]
        return [e for t in types for e in self._by_type.get(t, [])]  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class TimerFacts:
    """What the timer sees: every known deployment and probe (with, for quiet probes, the
    evidence of :class:`ProbeFact`), and the ingest bus where there is one."""

    deployments: Mapping[str, DeploymentFacts] = field(default_factory=dict)
    probes: Sequence[ProbeFact] = ()
    bus: BusFact | None = None


@dataclass(frozen=True, slots=True)
class BusPartitionFact:
    """One partition of the ingest bus: how long its oldest batch not yet stored has waited
    (``lag_s``; 0 when none waits), how many wait, how many were handed out again."""

    partition: int
    lag_s: float
    pending: int
    redelivered: int


@dataclass(frozen=True, slots=True)
class BusFact:
    """The latest reading of the ingest bus (``collector.bus.monitor``): its stream, when it
    was read, and its partitions; ``error`` says why it could not be read (then no
    partitions)."""

    stream: str
    read_at: datetime
    partitions: Sequence[BusPartitionFact] = ()
    error: str | None = None
