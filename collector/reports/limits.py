"""The limits card of a deployment, ready to publish: per model, the limit in force
(:mod:`policies.limits`, its source and staleness, as every other view shows it), the verdict
in plain words (verified safe context and when, ``UNSAFE: cross-tenant leak at ≥ N tokens
…``, or not verified), the advertised context, the pool capacity of each node, the verified
safe context with its date and engine version (the latest passing verification), and why
that verification is stale, if it is; an open incident on the deployment comes first. JSON
and Markdown here; the PDF in :mod:`collector.reports.limits_pdf`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import Connection, select

from collector import models as m
from collector.alerting.repository import open_incident_for
from collector.db import Database
from collector.errors import NotFound
from collector.limits import Limits
from collector.timefmt import iso
from policies.facts import NodeConfig, VerificationFact


def deployment_exists(conn: Connection, deployment_id: str) -> bool:
    return (
        conn.execute(select(m.Deployment.id).where(m.Deployment.id == deployment_id)).first()
        is not None
    )


class LimitsService:
    def __init__(self, db: Database, limits: Limits):
        self.db = db
        self.limits = limits

    def card(
        self, deployment_id: str, now: datetime, *, name_tenants: bool = True
    ) -> dict[str, Any]:
        """``name_tenants=False`` (a tenant-scoped reader): the leaking tenant pairs are left
        out, their count kept (``leak_pairs`` empty, ``leak_pairs_count``)."""
        card = self._card(deployment_id, now)
        for model in card["models"]:
            latest = model.get("latest_verification")
            if latest is not None:
                latest["leak_pairs_count"] = len(latest["leak_pairs"])
                if not name_tenants:
                    latest["leak_pairs"] = []
        return card

    def _card(self, deployment_id: str, now: datetime) -> dict[str, Any]:
        with self.db.read() as conn:
            if not deployment_exists(conn, deployment_id):
                raise NotFound(f"no deployment {deployment_id!r}", {"deployment_id": deployment_id})
            facts, limits = self.limits.facts_and_limits(conn, {deployment_id}, now)
            incident = open_incident_for(conn, deployment_id)
        d = facts[deployment_id]
        nodes = sorted(d.configs.values(), key=lambda c: (c.model_id, c.role, c.node))
        out_models = []
        for (_, model), lim in sorted(limits.items()):
            mine = [c for c in nodes if c.model_id == model]
            v = d.passing.get(model) or _if_passed(d.verifications.get(model))
            last = d.verifications.get(model)
            stale_settings: dict[str, dict[str, Any]] = {}
            for reason in lim.stale_reasons:
                for ch in reason.changes:
                    stale_settings.setdefault(ch.node, {})[ch.setting] = {
                        "verified": ch.verified,
                        "now": ch.now,
                    }
            out_models.append(
                {
                    "model_id": model,
                    "advertised_context": lim.advertised_context if mine else None,
                    "pool_capacity_per_node": {
                        c.node: {"role": c.role, "capacity_tokens": c.pool_capacity_tokens}
                        for c in mine
                    },
                    "prefill_pool_tokens": lim.prefill_pool_tokens if mine else None,
                    "limit_in_force": lim.as_json(),
                    "verified": None
                    if v is None
                    else {
                        "safe_context": v.verified_safe_context,
                        "verified_at": iso(v.verified_at),
                        "engine_version": v.engine_version,
                        "pool_capacity_tokens": v.pool_capacity_tokens,
                        "quantization": v.quantization,
                        "tp_size": v.tp_size,
                        "cuda_graphs": v.cuda_graphs,
                    },
                    "stale": None if v is None or not mine else bool(lim.stale),
                    "stale_reasons": [r.text for r in lim.stale_reasons],
                    "stale_settings": stale_settings,
                    "latest_verification_failed": bool(last is not None and not last.passed),
                    "latest_verification": _latest(last),
                    "verdict": {
                        "status": lim.verdict.status,
                        "text": lim.verdict.text,
                        "verification_id": lim.verdict.verification_id,
                    },
                }
            )
        return {
            "deployment_id": deployment_id,
            "generated_at": iso(now),
            # ahead of every verdict: a passing verification says nothing about a leak seen
            # in production since, and "not verified" alone reads as harmless
            "open_incident": None if incident is None else _incident(incident),
            "nodes": [
                {
                    "node": c.node,
                    "role": c.role,
                    "model_id": c.model_id,
                    "engine": c.engine,
                    "engine_version": c.engine_version,
                    "advertised_context": c.advertised_context,
                    "pool_capacity_tokens": c.pool_capacity_tokens,
                    "dtype": c.dtype,
                    "prefix_caching": c.prefix_caching,
                    "prefix_cache_salting": c.prefix_cache_salting,
                    "prefix_cache": prefix_cache_text(c),
                    "kv_connector": c.kv_connector,
                    "kv_connector_version": c.kv_connector_version,
                    "kv_tiers": [msgspec.structs.asdict(t) for t in c.kv_tiers],
                    "kv_offload": kv_offload_text(c),
                    "running": not c.stopped,
                    "config_since": iso(c.ts),
                }
                for c in nodes
            ],
            "models": out_models,
        }


def _incident(r: Any) -> dict[str, Any]:
    opened, deadline = iso(r.opened_at), iso(r.deadline_at)
    return {
        "id": r.id,
        "title": r.title,
        "opened_at": opened,
        "deadline_at": deadline,
        "text": f"OPEN INCIDENT #{r.id}: {r.title}, opened {opened}, deadline {deadline}",
    }


def prefix_cache_text(c: NodeConfig) -> str:
    """The node's prefix cache as the card, the fleet and the dashboard say it."""
    if not c.prefix_caching:
        return "off"
    return "on, salted" if c.prefix_cache_salting else "on, shared unsalted"


def kv_offload_text(c: NodeConfig) -> str:
    """Where the node's KV goes past its pool, as the card, the fleet and the dashboard
    say it: the connector and its version, then each tier with its size and whether its
    key carries the request's cache_salt (``salt dropped`` where the producer knows it
    does not)."""
    if not c.kv_connector and not c.kv_tiers:
        return "none reported"
    head = c.kv_connector or "offload"
    if c.kv_connector_version:
        head += f" {c.kv_connector_version}"
    tiers = []
    for t in c.kv_tiers:
        where = t.medium + (f" ({t.backend})" if t.backend else "")
        if t.capacity_bytes is not None:
            where += f" {_size(t.capacity_bytes)}"
        salt = {True: "salted", False: "salt dropped", None: "salt unknown"}[t.salted]
        tiers.append(f"{where}, {salt}")
    return f"{head}: {'; '.join(tiers)}" if tiers else f"{head}: no offload tier"


def _size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _if_passed(v: VerificationFact | None) -> VerificationFact | None:
    return v if v is not None and v.verdict == "pass" else None


def _latest(v: VerificationFact | None) -> dict[str, Any] | None:
    if v is None:
        return None
    return {
        "id": v.verification_id,
        "result": v.verdict,
        "verified_at": iso(v.verified_at),
        "leaks": v.leaks,
        "leak_pairs": list(v.leak_pairs),
        "smallest_leaking_prompt_tokens": v.smallest_leaking_prompt,
        "findings_by_kind": dict(v.findings_by_kind),
        "last_passed_at": iso(v.last_passed_at),
    }


def _n(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def to_markdown(card: dict[str, Any]) -> str:
    lines = [
        f"# Limits card: {card['deployment_id']}",
        "",
        f"Generated {card['generated_at']}.",
        "",
    ]
    # .get: a card stored or served before open incidents were shown has none
    incident = card.get("open_incident")
    if incident is not None:
        lines += [f"**{incident['text']}**", ""]
    for mod in card["models"]:
        v = mod["verified"]
        lines += [f"## Model `{mod['model_id']}`", ""]
        lines.append(f"- **{mod['verdict']['text']}**")
        lines.append(f"- Limit in force: **{mod['limit_in_force']['text']}**")
        last = mod["latest_verification"]
        if last is not None and last["leak_pairs"]:
            lines.append(
                f"- Leaking tenant pairs (owner → reader): {', '.join(last['leak_pairs'])}"
            )
        lines.append(f"- Advertised context: {_n(mod['advertised_context'])} tokens")
        if v is None:
            lines.append("- Verified safe context: **not verified** (no passing verification)")
        else:
            lines.append(
                f"- Verified safe context: **{_n(v['safe_context'])} tokens**, verified "
                f"{v['verified_at']} on engine version {v['engine_version'] or '—'}"
            )
        if mod["stale"]:
            lines.append(f"- Verification status: **stale** ({'; '.join(mod['stale_reasons'])})")
        elif mod["stale"] is False:
            lines.append("- Verification status: current")
        if mod["latest_verification_failed"] and mod["verdict"]["status"] not in (
            "unsafe",
            "failed",
        ):
            lines.append("- The latest verification attempt could not reach a verdict")
        if mod["pool_capacity_per_node"]:
            lines += ["", "| node | role | pool capacity (tokens) |", "| --- | --- | ---: |"]
            for node, p in mod["pool_capacity_per_node"].items():
                lines.append(f"| {node} | {p['role']} | {_n(p['capacity_tokens'])} |")
        else:
            lines.append("- No node of this model reports to kvwatch (watched from outside)")
        lines.append("")
    if card["nodes"]:
        lines += [
            "## Nodes",
            "",
            "| node | role | model | engine | advertised context | pool (tokens) | KV dtype "
            "| prefix cache | KV past the pool | since |",
            "| --- | --- | --- | --- | ---: | ---: | --- | --- | --- | --- |",
        ]
        for c in card["nodes"]:
            lines.append(
                f"| {c['node']}{'' if c['running'] else ' (stopped)'} | {c['role']} | "
                f"{c['model_id']} | {c['engine']} "
                f"{c['engine_version']} | {_n(c['advertised_context'])} | "
                f"{_n(c['pool_capacity_tokens'])} | {c['dtype']} | {c['prefix_cache']} | "
                f"{c['kv_offload']} | {c['config_since']} |"
            )
        lines.append("")
    return "\n".join(lines)
