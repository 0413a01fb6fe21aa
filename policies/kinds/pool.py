"""``pool_below_advertised`` and ``pool_headroom``: a KV pool against the context the API
accepts (the incident's first link: 681,280 tokens of pool under a 1,048,576 context)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from typing import Annotated

import msgspec

from engine_probe import events as ev
from policies.facts import BatchFacts, DeploymentFacts, NodeConfig, TimerFacts
from policies.kinds.base import RuleKind
from policies.limits import limit_in_force, small_pool_mitigated
from policies.rule import Rule
from policies.signals import Severity, Signal


def touched_configs(facts: BatchFacts) -> Iterator[NodeConfig]:
    """The current config of every node an engine.config event in the batch reported."""
    seen = set()
    for e in facts.of(ev.EngineConfig):
        if (e.deployment_id, e.node) not in seen:
            seen.add((e.deployment_id, e.node))
            d = facts.deployments.get(e.deployment_id)
            cfg = d.configs.get(e.node) if d else None
            if cfg is not None:
                yield cfg


def all_configs(facts: TimerFacts) -> Iterator[NodeConfig]:
    for d in facts.deployments.values():
        yield from d.configs.values()


def _labels(c: NodeConfig) -> dict[str, str]:
    return {"deployment_id": c.deployment_id, "node": c.node, "role": c.role}


class PoolBelowAdvertised(RuleKind):
    name = "pool_below_advertised"
    default_severity = "critical"
    mode = "state"
    description = (
        "A node's KV pool holds fewer tokens than the advertised context: critical, the "
        "incident's first link; a warning where the deployment's limit in force for the "
        "node's model is verified and fits the pool (a passing verification showed that "
        "prompts past it are refused cleanly: the context is overstated, not unsafe)."
    )

    def _eval(
        self,
        rule: Rule,
        configs: Iterable[NodeConfig],
        deployments: Mapping[str, DeploymentFacts],
        now: datetime,
    ) -> Iterator[Signal]:
        for c in configs:
            below = c.pool_capacity_tokens < c.advertised_context
            d = deployments.get(c.deployment_id)
            lim = limit_in_force(d, c.model_id, now) if below and d and c.model_id else None
            # the rule's own severity where the pack lowered it: a pack's choice stands
            mitigated = rule.severity == "critical" and small_pool_mitigated(
                lim, c.pool_capacity_tokens, d is not None and d.open_incident
            )
            summary = (
                f"node {c.node} ({c.role}) of {c.deployment_id}: KV pool "
                f"{c.pool_capacity_tokens} tokens "
                + ("<" if below else ">=")
                + f" advertised context {c.advertised_context}"
            )
            if mitigated and lim is not None:
                summary += (
                    f"; prompts past the pool are refused: {lim.text}, so the advertised "
                    "context is overstated, not unsafe"
                )
            notes = {
                "summary": summary,
                "recommendation": "size the pool to at least 2x the advertised context, "
                "or lower the advertised context to what is verified",
            }
            severity: Severity = "warning" if mitigated else rule.severity
            states = [(severity, below)]
            if rule.severity == "critical":
                # severity is a label: the alert of the other one (before a verification
                # passed, or after it went stale) resolves, a no-op where there is none
                states.append(("critical" if mitigated else "warning", False))
            for sev, firing in states:
                yield rule.signal(
                    "state",
                    _labels(c),
                    firing=firing,
                    severity=sev,
                    value=float(c.pool_capacity_tokens),
                    annotations=notes,
                )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, touched_configs(facts), facts.deployments, now)

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, all_configs(facts), facts.deployments, now)


class HeadroomParams(msgspec.Struct, forbid_unknown_fields=True):
    factor: Annotated[float, msgspec.Meta(ge=1, le=100)] = 2.0


class PoolHeadroom(RuleKind):
    name = "pool_headroom"
    params = HeadroomParams
    default_severity = "warning"
    mode = "state"
    description = (
        "A node's pool holds the advertised context but less than factor x it (default 2x): "
        "two long prompts cannot be resident at once. Pools below the context itself are "
        "pool_below_advertised's."
    )

    def _eval(self, rule: Rule, configs: Iterable[NodeConfig]) -> Iterator[Signal]:
        factor = rule.params.factor
        for c in configs:
            want = factor * c.advertised_context
            short = c.advertised_context <= c.pool_capacity_tokens < want
            yield rule.signal(
                "state",
                _labels(c),
                firing=short,
                value=round(c.pool_capacity_tokens / c.advertised_context, 4),
                annotations={
                    "summary": (
                        f"node {c.node} of {c.deployment_id}: pool {c.pool_capacity_tokens} "
                        f"tokens is {c.pool_capacity_tokens / c.advertised_context:.2f}x the "
                        f"advertised context (want >= {factor:g}x)"
                    )
                },
            )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, touched_configs(facts))

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, all_configs(facts))
