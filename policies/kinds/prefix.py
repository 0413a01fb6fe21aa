"""``prefix_cache_unsalted``: a prefix cache shared by tenants without per-tenant salting lets
one tenant probe, by timing, whether another sent a prefix (and reuse its KV).
``prefix_cache_cross_tenant``: the same exposure actually happening, seen by the probe."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import msgspec

from engine_probe import events as ev
from policies.durations import human_duration, parse_duration
from policies.facts import PREFIX_HISTORY_S, BatchFacts, DeploymentFacts, NodeConfig, TimerFacts
from policies.kinds.base import RuleKind
from policies.kinds.pool import all_configs, touched_configs
from policies.rule import Rule
from policies.signals import Signal


class PrefixParams(msgspec.Struct, forbid_unknown_fields=True):
    min_tenants: Annotated[int, msgspec.Meta(ge=1)] = 2


class PrefixCacheUnsalted(RuleKind):
    name = "prefix_cache_unsalted"
    params = PrefixParams
    default_severity = "warning"
    mode = "state"
    description = (
        "Prefix caching on, per-tenant salting off, on a deployment that has served at least "
        "min_tenants tenants (default 2); or the latest kvwatch verify of a model found one "
        "tenant served another's cached prefix (node 'endpoint')."
    )

    def _eval(
        self, rule: Rule, configs: Iterable[NodeConfig], deployments: dict[str, DeploymentFacts]
    ) -> Iterator[Signal]:
        for c in configs:
            d = deployments.get(c.deployment_id)
            tenants = d.tenant_count if d else 0
            shared = c.prefix_caching and not c.prefix_cache_salting
            yield rule.signal(
                "state",
                {"deployment_id": c.deployment_id, "node": c.node},
                firing=shared and tenants >= rule.params.min_tenants,
                value=float(tenants),
                annotations={
                    "summary": f"node {c.node} of {c.deployment_id} shares its prefix cache "
                    f"across {tenants} tenant(s) without per-tenant salting"
                },
            )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, touched_configs(facts), dict(facts.deployments))

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        yield from self._eval(rule, all_configs(facts), dict(facts.deployments))
        yield from self._verified(rule, facts.deployments.values())

    def _verified(self, rule: Rule, deployments: Iterable[DeploymentFacts]) -> Iterator[Signal]:
        """The same exposure proven from outside: the latest verification of a model found
        one tenant served another's cached prefix (``kvwatch verify``'s prefix-cache phase).
        Node ``endpoint``: the verifier sees the endpoint, not its nodes. A later verification
        that finds the model isolated (or caching off) resolves it."""
        for d in deployments:
            for model, v in sorted(d.verifications.items()):
                if v.prefix_cache_verdict is None or v.prefix_cache_verdict == "inconclusive":
                    continue
                shared = v.prefix_cache_verdict == "shared_across_tenants"
                pairs = ", ".join(p.replace("->", " to ") for p in v.prefix_shared_pairs)
                if v.prefix_tier_verdict == "shared_across_tenants":
                    pairs += ", after it left the pool: from an offload tier"
                if v.prefix_salt_defeated:
                    pairs += ", each with its own cache_salt: the salt did not isolate"
                yield rule.signal(
                    "state",
                    {"deployment_id": d.deployment_id, "node": "endpoint", "model_id": model},
                    firing=shared,
                    # salts were sent and did not isolate: not a configuration choice (an
                    # unsalted cache is one) but a defect that defeats the isolation asked for
                    severity="critical" if shared and v.prefix_salt_defeated else None,
                    value=float(len(v.prefix_shared_pairs)),
                    annotations={
                        "summary": f"kvwatch verify found {model} on {d.deployment_id} "
                        f"serving one tenant's cached prefix to another ({pairs}; "
                        f"verification {v.verification_id})"
                        if shared
                        else f"kvwatch verify found {model} on {d.deployment_id}: "
                        f"{v.prefix_cache_verdict} (verification {v.verification_id})"
                    },
                )


class CrossTenantParams(msgspec.Struct, forbid_unknown_fields=True):
    #: also fire when the hit was salted: salts shared across tenants defeat salting
    include_salted: bool = True
    #: also fire, critical, on a hit across cache salts, the same tenant's included: keys
    #: that carry salts cannot match so, so a cache or offload tier dropped the salt
    include_salt_mismatch: bool = True


class PrefixCacheCrossTenant(RuleKind):
    name = "prefix_cache_cross_tenant"
    params = CrossTenantParams
    default_severity = "warning"
    mode = "event"
    default_resolve_after_s = 24 * 3600.0
    description = (
        "A request was served KV blocks another tenant's request computed (a prefix-cache hit "
        "across tenants): a timing side channel on what the other tenant sent."
    )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: CrossTenantParams = rule.params
        found: dict[tuple[str, str, str, str, str, bool], list[int]] = {}
        tiers: dict[tuple[str, str, str, str, str, bool], set[str]] = {}
        for e in facts.of(ev.PrefixCacheHit):
            mismatch = e.salt_mismatch and p.include_salt_mismatch
            if not mismatch and (not e.cross_tenant or (e.salted and not p.include_salted)):
                continue
            salted = "true" if e.salted else "false"
            key = (e.deployment_id, e.node, e.reader_tenant, e.owner_tenant or "", salted, mismatch)
            found.setdefault(key, []).append(e.pages)
            if e.tier is not None:
                tiers.setdefault(key, set()).add(e.tier)
        for key, pages in found.items():
            dep, node, reader, owner, salted, mismatch = key
            labels = {
                "deployment_id": dep,
                "node": node,
                "reader_tenant": reader,
                "owner_tenant": owner,
                "salted": salted,
            }
            if mismatch:  # only then: the alerts these labels named before keep their identity
                labels["salt_mismatch"] = "true"
            where = tiers.get(key)
            if mismatch:
                how = " across cache salts: a cache or offload tier dropped the salt"
            elif salted == "true":
                how = " (with a cache salt: the tenants share a salt)"
            else:
                how = ""
            yield rule.signal(
                "event",
                labels,
                severity="critical" if mismatch else None,
                value=float(sum(pages)),
                count=len(pages),
                annotations={
                    "summary": f"{len(pages)} prefix-cache hit(s) on {dep} node {node}: tenant "
                    f"{reader} was served {sum(pages)} block(s) tenant {owner} computed"
                    + (f", loaded from the {'/'.join(sorted(where))} tier" if where else "")
                    + how
                },
            )


class ProbeParams(msgspec.Struct, forbid_unknown_fields=True):
    #: how far back a reader's hits on one owner's blocks are weighed (at most 1h: the
    #: collector loads no more history, PREFIX_HISTORY_S)
    window: Any = "10m"
    #: cross-tenant hits on the owner's blocks within the window
    min_hits: Annotated[int, msgspec.Meta(ge=2)] = 20
    #: distinct hit lengths among them: a prober extends the prefix it matched, a
    #: tenant reusing a template it shares with another hits the same length every time
    min_distinct_prefixes: Annotated[int, msgspec.Meta(ge=2)] = 5
    #: a request is short when its prompt runs at most this many tokens past the hit
    max_suffix_tokens: Annotated[int, msgspec.Meta(ge=0)] = 16
    #: the share of the hits that come from short requests
    min_short_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.8
    window_s: float = 600.0


class PrefixProbeSuspected(RuleKind):
    """The PromptPeek pattern: a reader tenant recovering another tenant's prompt from the
    prefix cache sends many short requests, each a guessed continuation of what it has
    matched so far, and so hits the owner's blocks again and again at growing lengths.
    Ordinary sharing looks otherwise: a tenant re-using its own system prompt hits its own
    blocks (no cross-tenant hit at all), and two tenants on one public template hit the
    same length each time, with long prompts of their own after it."""

    name = "prefix_probe_suspected"
    params = ProbeParams
    default_severity = "critical"
    mode = "event"
    default_resolve_after_s = 24 * 3600.0
    description = (
        "A tenant whose cross-tenant prefix-cache hits on one owner's blocks, within window, "
        "number at least min_hits, at min_distinct_prefixes or more distinct lengths, mostly "
        "(min_short_fraction) from short requests (at most max_suffix_tokens past the hit): "
        "someone probing the cache for another tenant's prompt, token by token."
    )

    def prepare(self, params: ProbeParams, base_dir: Path) -> ProbeParams:
        try:
            seconds = parse_duration(params.window)
        except ValueError as exc:
            raise ValueError(f"window: {exc}") from None
        if not 0 < seconds <= PREFIX_HISTORY_S:
            raise ValueError(f"window: must be more than 0 and at most {PREFIX_HISTORY_S:.0f}s")
        return msgspec.structs.replace(params, window_s=seconds)

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: ProbeParams = rule.params
        new: dict[tuple[str, str, str], list[ev.PrefixCacheHit]] = {}
        for e in facts.of(ev.PrefixCacheHit):
            if e.cross_tenant and e.owner_tenant:
                new.setdefault((e.deployment_id, e.reader_tenant, e.owner_tenant), []).append(e)
        window = timedelta(seconds=p.window_s)
        for (dep, reader, owner), hits in new.items():
            # The window ends at the batch's latest hit, not at the evaluation's now: a
            # replayed or delayed batch is weighed over its own time.
            end = max(e.ts for e in hits)
            past = [
                h
                for h in facts.prefix_history.get((dep, reader), ())
                if h.owner_tenant == owner and end - window <= h.ts <= end
            ]
            if len(past) < p.min_hits:
                continue
            lengths = {h.tokens for h in past}
            short = sum(
                1
                for h in past
                if h.prompt_tokens is not None and h.prompt_tokens - h.tokens <= p.max_suffix_tokens
            )
            fraction = short / len(past)
            if len(lengths) < p.min_distinct_prefixes or fraction < p.min_short_fraction:
                continue
            yield rule.signal(
                "event",
                {"deployment_id": dep, "reader_tenant": reader, "owner_tenant": owner},
                value=float(len(past)),
                count=len(hits),
                annotations={
                    "summary": f"tenant {reader} hit blocks tenant {owner} computed on {dep} "
                    f"{len(past)} times in {human_duration(p.window_s)}, at {len(lengths)} "
                    f"different lengths ({min(lengths):,} to {max(lengths):,} tokens), "
                    f"{fraction:.0%} from short requests: a prefix-cache probe for "
                    f"{owner}'s prompt is suspected",
                    "runbook": f"Salt {dep}'s prefix cache per tenant (the gateway's "
                    "--salt-prefix-cache per-tenant, or cache_salt), and review what "
                    f"{reader} sent.",
                },
            )


def needs_prefix_history(rules: Iterable[Rule]) -> bool:
    """Whether the collector must load a batch's ``prefix_history``: some enabled rule is a
    ``prefix_probe_suspected``."""
    return any(r.kind == PrefixProbeSuspected.name for r in rules)
