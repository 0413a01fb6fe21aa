"""``verification_missing_or_stale`` and ``config_drift``: the verified safe context holds only
for the engine settings it was measured under."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime

import msgspec

from engine_probe import events as ev
from policies.facts import (
    VERIFIED_SETTINGS,
    BatchFacts,
    DeploymentFacts,
    NodeConfig,
    TimerFacts,
    verified_nodes,
)
from policies.kinds.base import RuleKind
from policies.rule import Rule
from policies.signals import Signal

DRIFT_SETTINGS = (
    *VERIFIED_SETTINGS,
    "advertised_context",
    "disaggregated",
    "prefix_caching",
    "prefix_cache_salting",
    "model_id",
    "engine",
)


def _changes(changed: dict[str, tuple[object, object]]) -> str:
    return ", ".join(f"{k}: {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items()))


class VerificationMissingOrStale(RuleKind):
    name = "verification_missing_or_stale"
    default_severity = "warning"
    mode = "state"
    description = (
        "A model a deployment serves has no passing verification, or the engine version, "
        "pool capacity, quantization, TP size or CUDA-graph setting changed since it."
    )

    def _eval(self, rule: Rule, deployments: Iterable[DeploymentFacts]) -> Iterator[Signal]:
        for d in deployments:
            models = sorted({c.model_id for c in d.configs.values()})
            for model in models:
                v = d.verifications.get(model)
                if v is None:
                    problem = "no verification"
                elif not v.passed:
                    problem = "the latest verification did not pass"
                else:
                    changed: dict[str, tuple[object, object]] = {}
                    for c in verified_nodes(d.configs.values(), model):
                        changed.update(v.stale_against(c))
                    problem = f"changed since verification ({_changes(changed)})" if changed else ""
                yield rule.signal(
                    "state",
                    {"deployment_id": d.deployment_id, "model_id": model},
                    firing=bool(problem),
                    annotations={
                        "summary": f"{model} on {d.deployment_id}: "
                        + (problem or "verified, and nothing changed since")
                    },
                )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        touched = {e.deployment_id for e in facts.of(ev.EngineConfig)}
        return self._eval(
            rule, (facts.deployments[d] for d in sorted(touched) if d in facts.deployments)
        )

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, facts.deployments.values())


class DriftParams(msgspec.Struct, forbid_unknown_fields=True):
    settings: list[str] = msgspec.field(default_factory=lambda: list(VERIFIED_SETTINGS))


class ConfigDrift(RuleKind):
    name = "config_drift"
    params = DriftParams
    default_severity = "warning"
    mode = "event"
    default_resolve_after_s = 24 * 3600.0
    description = (
        "A setting (default: engine version, pool capacity, quantization, TP size, CUDA "
        "graphs) changed between two engine.config events of one node."
    )

    def check(self, params: DriftParams) -> None:
        unknown = sorted(set(params.settings) - set(DRIFT_SETTINGS))
        if unknown:
            raise ValueError(f"settings: unknown {unknown}; known: {list(DRIFT_SETTINGS)}")
        if not params.settings:
            raise ValueError("settings: must name at least one setting")

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        current: dict[tuple[str, str], NodeConfig] = dict(facts.prior_configs)
        settings = rule.params.settings
        for e in sorted(facts.of(ev.EngineConfig), key=lambda e: (e.ts, e.seq)):
            cfg = NodeConfig.from_event(e)
            key = (e.deployment_id, e.node)
            before = current.get(key)
            current[key] = cfg
            if before is None:
                continue
            changed = before.changed(cfg, settings)
            if changed:
                yield rule.signal(
                    "event",
                    {"deployment_id": e.deployment_id, "node": e.node},
                    annotations={
                        "summary": (
                            f"node {e.node} of {e.deployment_id} changed: {_changes(changed)}"
                        ),
                        "changed": ",".join(sorted(changed)),
                    },
                    value=float(len(changed)),
                )
