"""``stale_page_read`` and ``rejected_prefill_kv_transfer``: the incident itself, seen inside
the engine."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Literal

import msgspec

from engine_probe import events as ev
from policies.facts import BatchFacts
from policies.kinds.base import RuleKind
from policies.rule import Rule
from policies.signals import Signal


def _flag(value: bool) -> str:
    return "true" if value else "false"


class StaleReadParams(msgspec.Struct, forbid_unknown_fields=True):
    open_incident: Literal["cross_tenant", "always", "never"] = "cross_tenant"
    include_canary: bool = True


class StalePageRead(RuleKind):
    name = "stale_page_read"
    params = StaleReadParams
    default_severity = "critical"
    mode = "event"
    default_resolve_after_s = 24 * 3600.0
    description = (
        "A request read KV pages it did not write (the page ledger) or another tenant's "
        "canary (canary mode). Cross-tenant reads open an incident."
    )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: StaleReadParams = rule.params
        found: dict[tuple[str, str, str, str, str], list[int]] = {}
        latest: dict[tuple[str, str, str, str, str], datetime] = {}
        kinds = (ev.PageStaleRead, ev.CanaryHit) if p.include_canary else (ev.PageStaleRead,)
        for e in facts.of(*kinds):
            # e.cross_tenant: the contract's one definition (events.crosses_tenants)
            if isinstance(e, ev.PageStaleRead):
                prev = e.previous_tenant
                key = (
                    e.deployment_id,
                    e.node,
                    e.reader_tenant,
                    prev or "none",
                    _flag(e.cross_tenant),
                )
                found.setdefault(key, []).append(len(e.page_ids))
                latest[key] = max(e.ts, latest.get(key, e.ts))
            elif isinstance(e, ev.CanaryHit):
                prev = e.canary_tenant
                crossed = _flag(e.cross_tenant)
                key = (e.deployment_id, e.node, e.reader_tenant, prev or "unknown", crossed)
                found.setdefault(key, []).append(max(1, len(e.page_ids)))
                latest[key] = max(e.ts, latest.get(key, e.ts))
        for (dep, node, reader, prev, cross), pages in found.items():
            crossing = cross == "true"
            opens = p.open_incident == "always" or (p.open_incident == "cross_tenant" and crossing)
            yield rule.signal(
                "event",
                {
                    "deployment_id": dep,
                    "node": node,
                    "reader_tenant": reader,
                    "previous_tenant": prev,
                    "cross_tenant": cross,
                },
                value=float(sum(pages)),
                count=len(pages),
                opens_incident=opens,
                occurred_at=latest[(dep, node, reader, prev, cross)],
                annotations={
                    "summary": (
                        f"{len(pages)} stale read(s) on {dep} node {node}: tenant {reader} read "
                        f"{sum(pages)} page(s) last written by "
                        + (f"tenant {prev}" if prev not in ("none", "unknown") else "nobody known")
                        + (" (cross-tenant exposure)" if crossing else "")
                    )
                },
            )


class RejectedPrefillKvTransfer(RuleKind):
    name = "rejected_prefill_kv_transfer"
    default_severity = "critical"
    mode = "event"
    default_resolve_after_s = 24 * 3600.0
    description = (
        "Prefill rejected a request and its KV was transferred to decode anyway (the "
        "incident's rejection path): decode will read pages prefill never wrote."
    )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        found: dict[tuple[str, str, str], list[ev.KvTransfer]] = {}
        for e in facts.of(ev.KvTransfer):
            if e.prefill_rejected:
                found.setdefault((e.deployment_id, e.from_node, e.to_node), []).append(e)
        for (dep, src, dst), transfers in found.items():
            tenants = sorted({t.tenant for t in transfers})
            yield rule.signal(
                "event",
                {"deployment_id": dep, "from_node": src, "to_node": dst},
                value=float(sum(t.pages for t in transfers)),
                count=len(transfers),
                occurred_at=max(t.ts for t in transfers),
                annotations={
                    "summary": (
                        f"{len(transfers)} rejected prefill(s) on {dep} still transferred KV "
                        f"from {src} to {dst} (tenants: {', '.join(tenants)})"
                    )
                },
            )
