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
        "canary (canary mode). Cross-tenant reads open an incident. previous_tenant: for a "
        "ledger read, the tenant of the request whose write to those pages the probe's page "
        "ledger last recorded ('none': no write recorded since the pool was created; "
        "'unknown': a writer whose tenant the ledger does not know, taken as another "
        "tenant); for a canary, the canary's tenant."
    )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: StaleReadParams = rule.params
        found: dict[tuple[str, str, str, str, str], list[int]] = {}
        latest: dict[tuple[str, str, str, str, str], datetime] = {}
        canaries: set[tuple[str, str, str, str, str]] = set()
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
                canaries.add(key)
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
                    "summary": _summary(
                        dep,
                        node,
                        reader,
                        prev,
                        len(pages),
                        sum(pages),
                        crossing,
                        canary=(dep, node, reader, prev, cross) in canaries,
                    )
                },
            )


def _summary(
    dep: str,
    node: str,
    reader: str,
    prev: str,
    reads: int,
    pages: int,
    crossing: bool,
    *,
    canary: bool,
) -> str:
    """The alert's line. Its previous tenant is the page ledger's record, never the engine's:
    the tenant of the request whose write to those pages the probe last recorded. A write
    the probe did not record (an engine path it does not hook, or the live tests' injected
    fault) leaves the earlier writer named, or none, while the pages hold the unrecorded
    writer's KV: the line says whose record it is, so nobody reads it as the engine's."""
    head = f"{reads} stale read(s) on {dep} node {node}: tenant {reader} read {pages} page(s)"
    tail = " (cross-tenant exposure)" if crossing else ""
    if canary:
        owner = f"tenant {prev}'s" if prev != "unknown" else "a canary of a tenant not known"
        return f"{head} holding {owner} canary{tail}"
    if prev == "none":
        return (
            f"{head} the probe's page ledger holds no write of since the pool was created "
            f"(previous tenant: none){tail}"
        )
    writer = f"tenant {prev}" if prev != "unknown" else "a tenant the ledger cannot name"
    return (
        f"{head} last written, as the probe's page ledger recorded, by {writer} (the "
        f"previous tenant: the ledger's last recorded writer, which the engine's own block "
        f"tables may not name){tail}"
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
