"""vLLM's ``/metrics`` (plus ``/v1/models`` and ``/version``) → node figures.

What vLLM writes, per engine core (``engine`` label, one per data-parallel rank):
``vllm:cache_config_info`` (an info gauge whose labels are the CacheConfig's fields:
``block_size``, ``num_gpu_blocks``, ``cache_dtype``, ``enable_prefix_caching`` and, in
0.32, ``kv_cache_size_tokens``), ``vllm:kv_cache_usage_perc`` (0..1),
``vllm:prompt_tokens_total`` and the ``vllm:request_prompt_tokens`` histogram.
The advertised context (``max_model_len``) is not a metric: it comes from the OpenAI
``/v1/models`` listing (``max_model_len`` of the served model); the version from
``/version``. Pool capacity = ``kv_cache_size_tokens`` (else ``num_gpu_blocks`` x
``block_size``); used = usage x capacity.

Node ids follow ``engine_probe.node``: the target's prefix for engine 0, ``PREFIX/dpN`` for
engine N. Where kvwatch's vLLM plugin runs inside, it publishes ``kvwatch:node_info`` per
engine core (``node``, ``role``, ``kv_dtype``): its node id (unless ``--node`` was given) and
its resolved KV dtype (vLLM's ``cache_dtype`` says ``auto`` for "the model's") are taken from
it, so the scrape and the probe name one engine alike.

A server holding several KV pools behind one endpoint (refengine's disaggregated pair) labels
each pool's ``vllm:cache_config_info`` and ``vllm:kv_cache_usage_perc`` with ``node`` (and
``role``: prefill, decode or both); each becomes a node of its own, ``PREFIX/NODE``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from engine_probe.events import Role
from engine_probe.kv_destinations import vllm_offloading_flags
from engine_probe.node import NODE_INFO
from kvwatch.scrape.errors import MalformedMetrics, NotThatEngine
from kvwatch.scrape.exposition import (
    Exposition,
    Series,
    as_bool,
    as_ratio,
    as_tokens,
    histogram,
)
from kvwatch.scrape.figures import (
    UNKNOWN,
    NodeFigures,
    PromptFigures,
    Scrape,
    id_from,
    prompt_figures,
    rank_node,
    short_name,
)

MARKER: Final = "vllm:cache_config_info"
_USAGE: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name
_PROMPTS_TOTAL: Final = "vllm:prompt_tokens_total"
_PROMPTS_HIST: Final = "vllm:request_prompt_tokens"
_POOL_ROLES: Final[dict[str, Role]] = {"prefill": "prefill", "decode": "decode"}


_ACTIVITY: Final = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:generation_tokens_total",
)


def activity(exp: Exposition) -> tuple[float, float]:
    """(requests finished, tokens computed: prompt tokens not served from the prefix cache
    plus generated ones), cumulative, summed over every engine core of the server: what
    ``kvwatch kv-events`` weighs a silent KV-event stream against. Missing counters read 0
    (an engine that reports none proves no traffic)."""
    done, prompt, cached, generated = (sum(x.value for x in exp.series(name)) for name in _ACTIVITY)
    return done, prompt - cached + generated


def translate(
    exp: Exposition,
    *,
    node_prefix: str,
    role: Role | None = None,
    models: Any = None,
    version: Any = None,
    models_source: str = "/v1/models",
    node_given: bool = False,
) -> Scrape:
    """The figures of every engine core in ``exp``.

    ``models``: the decoded ``/v1/models`` document (needed for the advertised context);
    ``version``: the decoded ``/version`` document (else the version is "unknown").
    ``node_given``: ``node_prefix`` is the operator's (--node), not derived: it wins over
    the node ids ``kvwatch:node_info`` publishes.
    """
    infos = exp.series(MARKER)
    if not infos:
        raise NotThatEngine(
            f"{MARKER} not found at {exp.source}: is this a vLLM server with metrics on "
            "(and has its engine finished starting)?"
        )
    usage_name = next((n for n in _USAGE if n in exp), None)
    if usage_name is None:
        raise MalformedMetrics(f"{_USAGE[0]} not found at {exp.source}")
    usage = {_key(s): s for s in exp.series(usage_name)}
    by_engine = {_key(s): s for s in infos}
    engine_version = short_name(_field(version, "version")) if version is not None else UNKNOWN
    published = {s.labels.get("engine", "0"): s.labels for s in exp.series(NODE_INFO)}
    nodes, prompts = [], []
    for key in sorted(by_engine, key=_engine_order):
        idx, pool = key
        info = by_engine[key]
        mine = published.get(idx, {}) if pool is None else {}
        node = rank_node(node_prefix, idx)
        if pool is not None and len(by_engine) > 1:
            node = f"{node}/{id_from(pool, 'pool')}"
        elif mine.get("node") and not node_given:
            node = mine["node"]  # what the probe inside reports it as
        selector = f"{{engine={idx!r}" + (f", node={pool!r}}}" if pool else "}")
        where = MARKER + selector
        node_role = (
            role
            or _POOL_ROLES.get(info.labels.get("role", ""))
            or _POOL_ROLES.get(mine.get("role", ""), "both")
        )
        block_size = as_tokens(
            _label(info, "block_size", where, exp), f"{where} block_size", exp.source
        )
        capacity = _capacity(info, block_size, where, exp)
        use = usage.get(key)
        shown = usage_name + selector
        if use is None:
            raise MalformedMetrics(f"{shown} not found at {exp.source}")
        model = use.labels.get("model_name") or ""
        used = round(as_ratio(use.value, shown, exp.source) * capacity)
        nodes.append(
            NodeFigures(
                node=node,
                role=node_role,
                model_id=model or UNKNOWN,
                engine="vllm",
                engine_version=engine_version,
                advertised_context=_max_model_len(models, model, models_source),
                pool_capacity_tokens=capacity,
                page_size=max(block_size, 1),
                dtype=short_name(mine.get("kv_dtype") or info.labels.get("cache_dtype")),
                **_published_settings(mine),
                used_tokens=used,
                free_tokens=capacity - used,
                prefix_caching=as_bool(info.labels.get("enable_prefix_caching", "")),
                disaggregated=node_role in ("prefill", "decode"),
                kv_destinations=vllm_offloading_flags(
                    info.labels.get("kv_offloading_size"),
                    info.labels.get("kv_offloading_backend", "native"),
                ),
            )
        )
        if pool is None or node_role != "decode":  # the prompts are counted once, at prefill
            prompts.append(_prompts(exp, idx, node, model or UNKNOWN, capacity))
    return Scrape("vllm", exp.source, tuple(nodes), tuple(prompts))


def _published_settings(labels: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``kvwatch:node_info`` adds (none where it is absent): the probe's
    quantization, TP size and CUDA graphs, which vLLM's metrics do not say."""
    if not labels:
        return {}
    out: dict[str, Any] = {"quantization": short_name(labels["quantization"])
                           if labels.get("quantization") else None}  # fmt: skip
    if labels.get("tp_size", "").isdigit() and int(labels["tp_size"]) >= 1:
        out["tp_size"] = int(labels["tp_size"])
    if labels.get("cuda_graphs") in ("true", "false"):
        out["cuda_graphs"] = labels["cuda_graphs"] == "true"
    return out


def _key(s: Series) -> tuple[str, str | None]:
    """(engine index, KV pool): the pool is None where the server has one per engine."""
    return s.labels.get("engine", "0"), s.labels.get("node")


def _capacity(info: Series, block_size: int, where: str, exp: Exposition) -> int:
    """The pool in tokens: ``kv_cache_size_tokens`` where vLLM reports it (group-aware, right
    for hybrid models too), else ``num_gpu_blocks`` x ``block_size``."""
    sized = info.labels.get("kv_cache_size_tokens")
    if sized not in (None, "", "None"):
        return as_tokens(sized, f"{where} kv_cache_size_tokens", exp.source)
    blocks = _label(info, "num_gpu_blocks", where, exp)
    return as_tokens(blocks, f"{where} num_gpu_blocks", exp.source) * block_size


def _engine_order(key: tuple[str, str | None]) -> tuple[int, str, str]:
    idx, pool = key
    return (int(idx) if idx.isdigit() else 1 << 30, idx, pool or "")


def _label(s: Series, name: str, where: str, exp: Exposition) -> str:
    value = s.labels.get(name)
    if value is None or value in ("", "None"):
        raise MalformedMetrics(
            f"{where} at {exp.source} has no {name} (is the engine still starting?)"
        )
    return value


def _field(doc: Any, name: str) -> Any:
    return doc.get(name) if isinstance(doc, dict) else None


def _max_model_len(models: Any, model: str, source: str) -> int:
    """``max_model_len`` of ``model`` in a ``/v1/models`` listing (the only entry if the
    names differ, e.g. a metrics label that is a path)."""
    entries = _field(models, "data")
    if not isinstance(entries, list) or not entries:
        raise MalformedMetrics(
            f"vLLM's max_model_len is not among its metrics, and {source} listed no models"
        )
    chosen = [e for e in entries if isinstance(e, dict) and e.get("id") == model]
    if not chosen and len(entries) == 1:
        chosen = entries
    if not chosen:
        raise MalformedMetrics(f"{source} does not list the model {model!r} the metrics name")
    value = _field(chosen[0], "max_model_len")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MalformedMetrics(f"{source}: max_model_len of {model!r} is {value!r}")
    return value


def _prompts(exp: Exposition, idx: str, node: str, model: str, capacity: int) -> PromptFigures:
    def mine(s: Series) -> bool:
        return s.labels.get("engine", "0") == idx

    totals = [s for s in exp.series(_PROMPTS_TOTAL) if mine(s)]
    total = as_tokens(totals[0].value, _PROMPTS_TOTAL, exp.source) if totals else None
    return prompt_figures(node, model, total, histogram(exp, _PROMPTS_HIST, mine), capacity)
