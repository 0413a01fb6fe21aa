"""``prefix_cache_unsalted``: a prefix cache shared by tenants without per-tenant salting lets
one tenant probe, by timing, whether another sent a prefix (and reuse its KV).
``prefix_cache_cross_tenant``: the same exposure actually happening, seen by the probe."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Annotated

import msgspec

from engine_probe import events as ev
from policies.facts import BatchFacts, DeploymentFacts, NodeConfig, TimerFacts
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
        "min_tenants tenants (default 2)."
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
        return self._eval(rule, all_configs(facts), dict(facts.deployments))


class CrossTenantParams(msgspec.Struct, forbid_unknown_fields=True):
    #: also fire when the hit was salted: salts shared across tenants defeat salting
    include_salted: bool = True


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
        found: dict[tuple[str, str, str, str, str], list[int]] = {}
        for e in facts.of(ev.PrefixCacheHit):
            if not e.cross_tenant or (e.salted and not p.include_salted):
                continue
            salted = "true" if e.salted else "false"
            key = (e.deployment_id, e.node, e.reader_tenant, e.owner_tenant or "", salted)
            found.setdefault(key, []).append(e.pages)
        for (dep, node, reader, owner, salted), pages in found.items():
            yield rule.signal(
                "event",
                {
                    "deployment_id": dep,
                    "node": node,
                    "reader_tenant": reader,
                    "owner_tenant": owner,
                    "salted": salted,
                },
                value=float(sum(pages)),
                count=len(pages),
                annotations={
                    "summary": f"{len(pages)} prefix-cache hit(s) on {dep} node {node}: tenant "
                    f"{reader} was served {sum(pages)} block(s) tenant {owner} computed"
                    + (" (with a cache salt: the tenants share a salt)" if salted == "true" else "")
                },
            )
