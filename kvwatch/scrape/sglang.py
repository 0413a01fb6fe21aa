"""SGLang's ``/metrics`` (plus, optionally, ``/server_info``) → node figures.

What SGLang writes (``sglang.srt.observability.metrics_collector``): once at start
(``emit_constants``) ``sglang:max_total_num_tokens`` (the KV pool, in tokens),
``sglang:context_len`` (the advertised context), ``sglang:page_size``, ``sglang:num_pages``;
with every stats log ``sglang:token_usage`` (0..1) and the absolute
``sglang:kv_used_tokens`` / ``sglang:kv_available_tokens``; from the tokenizer manager
``sglang:prompt_tokens_total`` and ``sglang:prompt_tokens_histogram``. Scheduler series are
labelled ``model_name``, ``engine_type`` (prefill, decode, unified), ``tp_rank``,
``pp_rank``, ``moe_ep_rank`` and, with data parallelism, ``dp_rank``: one node per
``dp_rank``, read from its lowest tensor/pipeline rank (every rank of a data-parallel
group holds the same number of token slots).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from engine_probe.events import Role
from kvwatch.scrape.errors import MalformedMetrics, NotThatEngine
from kvwatch.scrape.exposition import (
    Exposition,
    Series,
    as_ratio,
    as_tokens,
    histogram,
)
from kvwatch.scrape.figures import (
    UNKNOWN,
    NodeFigures,
    PromptFigures,
    Scrape,
    prompt_figures,
    rank_node,
    short_name,
)

MARKER: Final = "sglang:max_total_num_tokens"
_ROLE: Final[dict[str, Role]] = {"prefill": "prefill", "decode": "decode"}
_RANKS: Final = ("pp_rank", "tp_rank", "moe_ep_rank")


def translate(
    exp: Exposition,
    *,
    node_prefix: str,
    role: Role | None = None,
    server_info: Any = None,
) -> Scrape:
    """The figures of every data-parallel group in ``exp``. ``server_info``: the decoded
    ``/server_info`` document (version, KV dtype, quantization, TP size, CUDA graphs,
    radix cache), else those are "unknown" (CUDA graphs and radix cache: False) or read from
    metrics where SGLang writes them (TP size)."""
    pools = exp.series(MARKER)
    if not pools:
        raise NotThatEngine(
            f"{MARKER} not found at {exp.source}: is this an SGLang server started with "
            "--enable-metrics (and has it finished starting)?"
        )
    groups: dict[str, list[Series]] = {}
    for s in pools:
        groups.setdefault(s.labels.get("dp_rank", ""), []).append(s)
    info = server_info if isinstance(server_info, dict) else {}
    nodes: list[NodeFigures] = []
    for dp in sorted(groups, key=lambda r: (len(r), r)):
        lead = min(groups[dp], key=_rank_order)
        node = rank_node(node_prefix, dp)
        nodes.append(_node(exp, lead, groups[dp], node, role, info))
    prompts = _prompts(exp, node_prefix if len(nodes) > 1 else nodes[0].node, nodes)
    return Scrape("sglang", exp.source, tuple(nodes), prompts)


def _rank_order(s: Series) -> tuple[int, ...]:
    return tuple(int(v) if (v := s.labels.get(r, "0")).isdigit() else 0 for r in _RANKS)


def _same(exp: Exposition, name: str, labels: Mapping[str, str]) -> Series | None:
    return next((s for s in exp.series(name) if s.labels == labels), None)


def _required(exp: Exposition, name: str, lead: Series) -> int:
    s = _same(exp, name, lead.labels)
    if s is None:
        raise MalformedMetrics(f"{name} not found at {exp.source} beside {MARKER}")
    return as_tokens(s.value, name, exp.source)


def _node(
    exp: Exposition,
    lead: Series,
    group: list[Series],
    node: str,
    role: Role | None,
    info: dict[str, Any],
) -> NodeFigures:
    capacity = as_tokens(lead.value, MARKER, exp.source)
    used_s = _same(exp, "sglang:kv_used_tokens", lead.labels)
    free_s = _same(exp, "sglang:kv_available_tokens", lead.labels)
    usage_s = _same(exp, "sglang:token_usage", lead.labels)
    if used_s is not None and free_s is not None:
        # Exact counts; slots held by evictable radix-cache entries are neither.
        used = min(as_tokens(used_s.value, "sglang:kv_used_tokens", exp.source), capacity)
        free = min(
            as_tokens(free_s.value, "sglang:kv_available_tokens", exp.source), capacity - used
        )
    elif usage_s is not None:
        used = round(as_ratio(usage_s.value, "sglang:token_usage", exp.source) * capacity)
        free = capacity - used
    else:
        # Usage gauges appear with the first stats log: before it, nothing has run.
        used, free = 0, capacity
    engine_type = lead.labels.get("engine_type", "")
    kv_dtype = info.get("kv_cache_dtype")
    dtype = info.get("dtype") if kv_dtype in (None, "auto") else kv_dtype
    tp = info.get("tp_size")
    return NodeFigures(
        node=node,
        role=role or _ROLE.get(engine_type, "both"),
        model_id=lead.labels.get("model_name") or UNKNOWN,
        engine="sglang",
        engine_version=short_name(info.get("version")),
        advertised_context=_required(exp, "sglang:context_len", lead),
        pool_capacity_tokens=capacity,
        page_size=_required(exp, "sglang:page_size", lead),
        dtype=short_name(dtype if isinstance(dtype, str) else None),
        used_tokens=used,
        free_tokens=free,
        quantization=short_name(quant)
        if isinstance(quant := info.get("quantization"), str)
        else None,
        tp_size=tp
        if isinstance(tp, int) and tp >= 1
        else len({s.labels.get("tp_rank") for s in group}),
        # Only /server_info says: sglang:is_cuda_graph is whether the last batch ran as a
        # graph (0 for every prefill), and a figure that flips would resend engine.config.
        cuda_graphs=info.get("disable_cuda_graph") is False,
        disaggregated=engine_type in _ROLE,
        prefix_caching=not info["disable_radix_cache"]
        if isinstance(info.get("disable_radix_cache"), bool)
        else False,
    )


def _prompts(exp: Exposition, node: str, nodes: list[NodeFigures]) -> tuple[PromptFigures, ...]:
    """The tokenizer manager's counters are per server, not per data-parallel rank: one
    entry, compared against the smallest pool."""
    model = nodes[0].model_id
    totals = exp.series("sglang:prompt_tokens_total")
    total = (
        sum(as_tokens(s.value, "sglang:prompt_tokens_total", exp.source) for s in totals)
        if totals
        else None
    )
    hist = histogram(exp, "sglang:prompt_tokens_histogram", lambda s: True)
    capacity = min(n.pool_capacity_tokens for n in nodes)
    return (prompt_figures(node, model, total, hist, capacity),)
