"""``verification_missing_or_stale`` and ``config_drift``: the verified safe context holds only
for the engine settings it was measured under."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import msgspec

from engine_probe import events as ev
from policies.durations import parse_duration
from policies.facts import (
    UNRESOLVED_DTYPES,
    VERIFIED_SETTINGS,
    BatchFacts,
    DeploymentFacts,
    NodeConfig,
    TimerFacts,
)
from policies.kinds.base import RuleKind
from policies.limits import limit_in_force
from policies.rule import Rule
from policies.signals import Signal
from policies.verdict import failure_text

DRIFT_SETTINGS = (
    *VERIFIED_SETTINGS,
    "advertised_context",
    "disaggregated",
    "prefix_caching",
    "prefix_cache_salting",
    "model_id",
    "engine",
    "dtype",
)
#: What the nodes of one deployment serving one model in one role must agree on (a replica
#: with prefix caching off, or salting on, or another KV dtype or pool size, is not the
#: deployment its siblings' verification and alerts describe).
BETWEEN_SETTINGS = ("prefix_caching", "prefix_cache_salting", "dtype", "pool_capacity_tokens")


def _changes(changed: dict[str, tuple[object, object]]) -> str:
    return ", ".join(f"{k}: {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items()))


class StaleParams(msgspec.Struct, forbid_unknown_fields=True):
    #: a passing verification older than this no longer holds (a duration such as 90d;
    #: None: no maximum): the limit in force (policies.limits) falls back as for drift
    max_age: Any = None
    max_age_s: float | None = None


class VerificationMissingOrStale(RuleKind):
    name = "verification_missing_or_stale"
    params = StaleParams
    default_severity = "warning"
    mode = "state"
    description = (
        "A model a deployment serves has no passing verification, or it is stale: the "
        "engine version, pool capacity, quantization, TP size or CUDA-graph setting changed "
        "since it, the prefill pool is now smaller than the context it verified, or it is "
        "older than max_age (the limit in force says so too)."
    )

    def check(self, params: StaleParams) -> None:
        if params.max_age is not None:
            try:
                if parse_duration(params.max_age) <= 0:
                    raise ValueError("must be longer than 0s")
            except ValueError as exc:
                raise ValueError(f"max_age: {exc}") from None

    def prepare(self, params: StaleParams, base_dir: Any) -> StaleParams:
        if params.max_age is None:
            return params
        return msgspec.structs.replace(params, max_age_s=parse_duration(params.max_age))

    def _eval(
        self, rule: Rule, deployments: Iterable[DeploymentFacts], now: datetime
    ) -> Iterator[Signal]:
        for d in deployments:
            models = sorted({c.model_id for c in d.configs.values()})
            for model in models:
                v = d.verifications.get(model)
                limit = limit_in_force(d, model, now)
                if v is None:
                    problem = "no verification"
                elif not v.passed:
                    problem = "the latest verification did not pass"
                elif limit.stale:
                    problem = f"stale: {limit.stale_text}"
                else:
                    problem = ""
                yield rule.signal(
                    "state",
                    {"deployment_id": d.deployment_id, "model_id": model},
                    firing=bool(problem),
                    annotations={
                        "summary": f"{model} on {d.deployment_id}: "
                        + (problem or "verified, and nothing changed since"),
                        "limit": limit.text,
                    },
                )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        touched = {e.deployment_id for e in facts.of(ev.EngineConfig)}
        return self._eval(
            rule, (facts.deployments[d] for d in sorted(touched) if d in facts.deployments), now
        )

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, facts.deployments.values(), now)


class DriftParams(msgspec.Struct, forbid_unknown_fields=True):
    settings: list[str] = msgspec.field(default_factory=lambda: list(VERIFIED_SETTINGS))
    #: what the live nodes of one deployment, model and role must agree on (empty: not
    #: compared)
    between_nodes: list[str] = msgspec.field(default_factory=lambda: list(BETWEEN_SETTINGS))


def _differ(name: str, values: set[object]) -> bool:
    if name == "dtype":
        values = values - UNRESOLVED_DTYPES
    return len(values) > 1


def disagreements(
    configs: Iterable[NodeConfig], settings: Sequence[str]
) -> dict[tuple[str, str], dict[str, dict[str, object]]]:
    """(model, role) -> {setting: {node: its value}} for the settings on which the live
    (not ``stopped``) nodes serving that model in that role disagree. Unresolved KV
    dtypes (``auto``) disagree with nothing."""
    groups: dict[tuple[str, str], list[NodeConfig]] = {}
    for c in configs:
        if not c.stopped:
            groups.setdefault((c.model_id, c.role), []).append(c)
    out: dict[tuple[str, str], dict[str, dict[str, object]]] = {}
    for key, nodes in groups.items():
        for name in settings:
            values = {c.node: getattr(c, name) for c in sorted(nodes, key=lambda c: c.node)}
            if _differ(name, set(values.values())):
                out.setdefault(key, {})[name] = values
    return out


class ConfigDrift(RuleKind):
    name = "config_drift"
    params = DriftParams
    default_severity = "warning"
    mode = "event"
    default_resolve_after_s = 24 * 3600.0
    description = (
        "A setting (default: engine version, pool capacity, quantization, TP size, CUDA "
        "graphs) changed between two engine.config events of one node; or the live nodes "
        "of one deployment serving one model in one role disagree (default: on prefix "
        "caching, salting, KV dtype or pool size), a state that fires while they disagree."
    )

    def check(self, params: DriftParams) -> None:
        unknown = sorted(set(params.settings) - set(DRIFT_SETTINGS))
        if unknown:
            raise ValueError(f"settings: unknown {unknown}; known: {list(DRIFT_SETTINGS)}")
        if not params.settings:
            raise ValueError("settings: must name at least one setting")
        unknown = sorted(set(params.between_nodes) - set(DRIFT_SETTINGS))
        if unknown:
            raise ValueError(f"between_nodes: unknown {unknown}; known: {list(DRIFT_SETTINGS)}")

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._between(rule, facts.deployments.values())

    def _between(self, rule: Rule, deployments: Iterable[DeploymentFacts]) -> Iterator[Signal]:
        """One state signal per (deployment, model, role) that has two or more live nodes
        (or an open disagreement to resolve): firing while they disagree. The labels stay
        the same whichever nodes disagree; the annotations name them."""
        names = rule.params.between_nodes
        if not names:
            return
        for d in deployments:
            live: dict[tuple[str, str], list[str]] = {}
            for c in d.configs.values():
                if not c.stopped:
                    live.setdefault((c.model_id, c.role), []).append(c.node)
            found = disagreements(d.configs.values(), names)
            groups = {(c.model_id, c.role) for c in d.configs.values()}
            for model, role in sorted(groups):
                nodes = sorted(live.get((model, role), []))
                diff = found.get((model, role), {})
                labels = {
                    "deployment_id": d.deployment_id,
                    "model_id": model,
                    "role": role,
                }
                where = f"{model} ({role}) on {d.deployment_id}"
                if diff:
                    said = "; ".join(
                        f"{name}: " + ", ".join(f"{n}={v}" for n, v in by_node.items())
                        for name, by_node in diff.items()
                    )
                    summary = f"the nodes of {where} disagree: {said}"
                else:
                    summary = f"the {len(nodes)} live node(s) of {where} agree"
                yield rule.signal(
                    "state",
                    labels,
                    firing=bool(diff),
                    value=float(len(diff)),
                    annotations={
                        "summary": summary,
                        "nodes": ",".join(nodes),
                        "changed": ",".join(sorted(diff)),
                    },
                )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        touched = {e.deployment_id for e in facts.of(ev.EngineConfig)}
        yield from self._between(
            rule, (facts.deployments[d] for d in sorted(touched) if d in facts.deployments)
        )
        yield from self._over_time(rule, facts)

    def _over_time(self, rule: Rule, facts: BatchFacts) -> Iterator[Signal]:
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


class FailedParams(msgspec.Struct, forbid_unknown_fields=True):
    # A leak the verifier provoked with synthetic tenants is evidence that real tenants'
    # prompts may have crossed the same way since the last passing verification.
    open_incident: bool = True


class VerificationFailed(RuleKind):
    name = "verification_failed"
    params = FailedParams
    default_severity = "critical"
    mode = "state"
    description = (
        "The latest verification of a model found the endpoint unsafe: a cross-tenant leak, "
        "an acceptance above an earlier rejection, a 5xx or partial text. A passing "
        "verification resolves it; a leak opens an incident (open_incident)."
    )

    def _eval(self, rule: Rule, deployments: Iterable[DeploymentFacts]) -> Iterator[Signal]:
        p: FailedParams = rule.params
        for d in deployments:
            for model, v in sorted(d.verifications.items()):
                if v.verdict == "error":
                    continue  # no verdict: whatever holds, holds
                labels = {"deployment_id": d.deployment_id, "model_id": model}
                if v.verdict == "pass":
                    yield rule.signal(
                        "state",
                        labels,
                        firing=False,
                        annotations={
                            "summary": f"{model} on {d.deployment_id}: verification "
                            f"{v.verification_id} passed"
                        },
                    )
                    continue
                since = (
                    v.last_passed_at.strftime("%Y-%m-%dT%H:%M:%SZ")
                    if v.last_passed_at is not None
                    else None
                )
                found = ", ".join(f"{k}: {n}" for k, n in sorted(v.findings_by_kind.items()))
                notes = {
                    "summary": f"{model} on {d.deployment_id}: {failure_text(v)}",
                    "verification_id": str(v.verification_id),
                    "leaks": str(v.leaks),
                    "leak_pairs": " ".join(v.leak_pairs) or "none",
                    "findings": found or "none",
                    "examine_since": since or "ever (no verification passed before)",
                }
                if v.smallest_leaking_prompt is not None:
                    notes["smallest_leaking_prompt_tokens"] = str(v.smallest_leaking_prompt)
                leaked = bool(v.leaks or v.leak_pairs)
                if leaked:
                    # Real tenants' prompts as long as the leaking one may have crossed since
                    # the last passing verification: the breach report of that window.
                    notes["runbook"] = (
                        "Examine the requests since the last passing verification: kvwatch "
                        f"report breach --model {model} --deployment {d.deployment_id} "
                        f"--since {since or 'FIRST_REQUEST'} --until NOW "
                        f"--min-prompt-tokens {v.smallest_leaking_prompt or 1} --out breach/"
                    )
                yield rule.signal(
                    "state",
                    labels,
                    value=float(v.smallest_leaking_prompt or 0),
                    opens_incident=p.open_incident and leaked,
                    annotations=notes,
                )

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, facts.deployments.values())
