"""``context_pressure``: prompts near or over the context a deployment can safely hold."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from math import inf
from typing import Annotated, cast

import msgspec

from engine_probe import events as ev
from policies.facts import BatchFacts
from policies.kinds.base import RuleKind
from policies.limits import LimitInForce, configured_only, limit_in_force, with_configured
from policies.rule import Rule
from policies.signals import Severity, Signal

Ratio = Annotated[float, msgspec.Meta(gt=0, le=10)]

_REQUEST_EVENTS = (ev.RequestAdmitted, ev.RequestRejected, ev.RequestFinished)
RequestEvent = ev.RequestAdmitted | ev.RequestRejected | ev.RequestFinished


class ContextPressureParams(msgspec.Struct, forbid_unknown_fields=True):
    warn_ratio: Ratio = 0.8
    critical_ratio: Ratio = 1.0


class ContextPressure(RuleKind):
    name = "context_pressure"
    params = ContextPressureParams
    default_severity = "warning"
    mode = "event"
    default_resolve_after_s = 3600.0
    description = (
        "Prompt tokens >= warn_ratio of the limit in force per model and route (critical "
        "at >= critical_ratio, unless the limit is verified and the prompt was refused): the "
        "verified safe context, or for deployments without a current one min(advertised "
        "context, pool capacity), labelled verified=false (policies.limits decides it for "
        "every part of kvwatch)."
    )

    def check(self, params: ContextPressureParams) -> None:
        if params.critical_ratio < params.warn_ratio:
            raise ValueError("critical_ratio: must be >= warn_ratio")

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: ContextPressureParams = rule.params
        # Most prompts are far below any bound: compare each with its (deployment, model)'s
        # threshold, worked out once, before doing anything else with it.
        bounds: dict[tuple[str, str], tuple[float, LimitInForce | None]] = {}
        worst: dict[tuple[str, str], tuple[int, str, str | None, LimitInForce, datetime]] = {}
        refused: set[tuple[str, str]] = set()  # refused, and not answered after all
        for no in facts.of(ev.RequestRejected):
            refused.add((no.deployment_id, no.request_id))
        for done in facts.of(ev.RequestFinished):
            refused.discard((done.deployment_id, done.request_id))
        for e in cast(list[RequestEvent], facts.of(*_REQUEST_EVENTS)):
            tokens, model = e.prompt_tokens, e.model_id
            if tokens is None or not model:
                continue
            key = (e.deployment_id, model)
            b = bounds.get(key)
            if b is None:
                d = facts.deployments.get(e.deployment_id)
                lim = limit_in_force(d, model, now) if d is not None else None
                # A limit of 0 (a failed verification left nothing known safe) measures
                # nothing: verification_failed is the alert that says so.
                b = bounds[key] = (
                    (p.warn_ratio * lim.tokens, lim) if lim and lim.tokens else (inf, lim)
                )
            held = getattr(e, "limit_tokens", None)
            if held and b[1] is not None:
                # A guard in front of the deployment held the prompt to its own configured
                # limit: the same decision, with that limit among its inputs.
                lim = with_configured(b[1], held)
                if lim.tokens:
                    b = (p.warn_ratio * lim.tokens, lim)
            elif held and b[1] is None:
                lim = configured_only(e.deployment_id, model, held)
                b = (p.warn_ratio * held, lim)
            if tokens < b[0] or b[1] is None:
                continue
            rid = (e.deployment_id, e.request_id)  # a request counts once, at its largest
            seen = worst.get(rid)
            if seen is None or tokens > seen[0]:
                worst[rid] = (tokens, model, e.route, b[1], e.ts)
        groups: dict[
            tuple[str, str, str, str, Severity], list[tuple[int, LimitInForce, datetime]]
        ] = {}
        for (dep, request), (tokens, model, route, lim, at) in worst.items():
            safe = lim.tokens or 0
            over = tokens >= p.critical_ratio * safe
            # Over a verified limit and refused: the refusal a passing verification showed
            # to be clean did its work; demand past the limit is worth a warning, not a page.
            # Unverified, a refusal may still have moved KV (the incident's path): critical.
            clean = lim.verified and (dep, request) in refused
            severity: Severity = "critical" if over and not clean else rule.severity
            key5 = (dep, model, route or "none", "true" if lim.verified else "false", severity)
            groups.setdefault(key5, []).append((tokens, lim, at))
        for group, sized in groups.items():
            dep, model, route_label, verified_label, severity = group
            top, lim, _ = max(sized, key=lambda t: t[0] / (t[1].tokens or 1))
            safe = lim.tokens or 1
            sizes = [t for t, _, _ in sized]
            yield rule.signal(
                "event",
                {
                    "deployment_id": dep,
                    "model_id": model,
                    "route": route_label,
                    "verified": verified_label,
                },
                severity=severity,
                value=round(top / safe, 4),
                count=len(sizes),
                occurred_at=max(at for _, _, at in sized),
                annotations={
                    "summary": (
                        f"{len(sizes)} prompt(s) to {model}"
                        + (f" on route {route_label}" if route_label != "none" else "")
                        + f" reached {top / safe:.0%} of the limit in force, {lim.text} "
                        f"(largest {top:,} tokens)"
                    ),
                    "safe_context_tokens": str(safe),
                    "limit_source": lim.source,
                    "limit": lim.text,
                    "max_prompt_tokens": str(top),
                },
            )
