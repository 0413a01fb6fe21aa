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
from policies.rule import Rule
from policies.safe_context import safe_context
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
        "Prompt tokens >= warn_ratio of the verified safe context per model and route "
        "(critical at >= critical_ratio); unverified deployments are measured against "
        "min(advertised context, pool capacity) and labelled verified=false."
    )

    def check(self, params: ContextPressureParams) -> None:
        if params.critical_ratio < params.warn_ratio:
            raise ValueError("critical_ratio: must be >= warn_ratio")

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: ContextPressureParams = rule.params
        # Most prompts are far below any bound: compare each with its (deployment, model)'s
        # threshold, worked out once, before doing anything else with it.
        bounds: dict[tuple[str, str], tuple[float, int, bool]] = {}
        worst: dict[tuple[str, str], tuple[int, str, str | None, int, bool, datetime]] = {}
        for e in cast(list[RequestEvent], facts.of(*_REQUEST_EVENTS)):
            tokens, model = e.prompt_tokens, e.model_id
            if tokens is None or not model:
                continue
            key = (e.deployment_id, model)
            b = bounds.get(key)
            if b is None:
                d = facts.deployments.get(e.deployment_id)
                safe, verified = safe_context(d, model) if d is not None else (None, False)
                b = bounds[key] = (p.warn_ratio * safe, safe, verified) if safe else (inf, 0, False)
            held = getattr(e, "limit_tokens", None)
            if held and not b[2] and (not b[1] or held < b[1]):
                # A guard in front of the deployment held the prompt to a smaller limit than
                # any the collector knows: measure against the guard's (unverified).
                b = (p.warn_ratio * held, held, False)
            if tokens < b[0]:
                continue
            rid = (e.deployment_id, e.request_id)  # a request counts once, at its largest
            seen = worst.get(rid)
            if seen is None or tokens > seen[0]:
                worst[rid] = (tokens, model, e.route, b[1], b[2], e.ts)
        groups: dict[tuple[str, str, str, str, Severity], list[tuple[int, int, datetime]]] = {}
        for (dep, _request), (tokens, model, route, safe, verified, at) in worst.items():
            severity: Severity = "critical" if tokens >= p.critical_ratio * safe else rule.severity
            key5 = (dep, model, route or "none", "true" if verified else "false", severity)
            groups.setdefault(key5, []).append((tokens, safe, at))
        for group, sized in groups.items():
            dep, model, route_label, verified_label, severity = group
            verified = verified_label == "true"
            top, safe, _ = max(sized, key=lambda ts: ts[0] / ts[1])
            sizes = [t for t, _, _ in sized]
            what = (
                "verified safe context"
                if verified
                else "unverified bound (min of advertised context and pool, or the gateway's "
                "configured safe context)"
            )
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
                        + f" reached {top / safe:.0%} of the {what} of {safe:,} tokens "
                        f"(largest {top:,} tokens)"
                    ),
                    "safe_context_tokens": str(safe),
                    "max_prompt_tokens": str(top),
                },
            )
