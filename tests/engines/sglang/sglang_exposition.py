"""SGLang 0.5.23's own metric classes, set the way SGLang sets them, rendered as the
Prometheus text its ``/metrics`` serves.

``SchedulerMetricsCollector.emit_constants`` (pool size, context length, page size: once at
start) and ``log_stats`` (occupancy: every stats interval) per scheduler, one scheduler per
data-parallel rank (``dp_rank`` label) as SGLang runs them; ``TokenizerMetricsCollector``
observes each finished request's prompt. Imported by ``test_sglang_metrics.py``; also a
program the main suite runs with ``.venv-sglang/bin/python`` (``tests/test_scrape.py``, see
``main``).

figures: ``model_name``, ``engine_type`` (unified, prefill, decode), ``prompts`` (prompt
lengths of finished requests) and either the pool figures themselves
(``max_total_num_tokens``, ``context_len``, ``page_size``, ``kv_used_tokens``,
``kv_available_tokens``, optional ``kv_evictable_tokens`` and ``is_cuda_graph`` (whether
the last batch ran as a CUDA graph); without ``kv_used_tokens`` no stats are logged) or
``dp_ranks``: a list of them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from typing import Any

from prometheus_client import REGISTRY, generate_latest


def _stub_torchvision() -> None:
    """SGLang's model registry imports torchvision at import time; PyPI's torchvision does
    not import beside the CPU torch, and nothing on the metrics path uses it."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return

    class Anything(type):
        def __getattr__(cls, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything(name, (), {})

    class Module(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything(name, (), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec: Any) -> types.ModuleType:
            module = Module(spec.name)
            module.__path__ = []
            module.__version__ = "0.0.0"
            return module

        def exec_module(self, module: types.ModuleType) -> None:
            pass

    sys.meta_path.insert(0, Finder())


def render(figures: dict[str, Any]) -> str:
    """SGLang's exposition for ``figures`` (see the module docstring). Each call builds the
    collectors afresh on the default registry and takes them off it afterwards."""
    _stub_torchvision()
    from sglang.srt.observability.metrics_collector import (
        SchedulerMetricsCollector,
        SchedulerStats,
        TokenizerMetricsCollector,
    )
    from sglang.srt.runtime_context import get_context

    ranks = figures.get("dp_ranks") or [figures]
    base = {
        "model_name": figures["model_name"],
        "engine_type": figures.get("engine_type", "unified"),
        "tp_rank": 0,
        "pp_rank": 0,
        "moe_ep_rank": 0,
    }
    if "dp_ranks" in figures:
        base["dp_rank"] = 0
    ctx = get_context()
    # SGLang's classes register on the default registry; what they add is taken off again
    # below (the registry lists its collectors only in this attribute).
    before = set(REGISTRY._collector_to_names)
    with ctx.override_server_args(model_path=figures["model_name"]):
        try:
            scheduler = SchedulerMetricsCollector(labels=dict(base), server_args=ctx.server_args)
            tokenizer = TokenizerMetricsCollector(
                labels={"model_name": base["model_name"], "engine_type": base["engine_type"]}
            )
            for rank, f in enumerate(ranks):
                # One scheduler process per data-parallel rank, each with its own labels;
                # SGLang's multiprocess registry merges their series the same way.
                if "dp_rank" in base:
                    scheduler.labels = {**base, "dp_rank": rank}
                capacity = f["max_total_num_tokens"]
                scheduler.emit_constants(
                    max_total_num_tokens=capacity,
                    max_total_num_tokens_swa=None,
                    weight_memory_usage_gb=1.0,
                    kv_cache_memory_usage_gb=2.0,
                    graph_memory_usage_gb={},
                    max_running_requests_under_SLO=None,
                    page_size=f["page_size"],
                    num_pages=capacity // f["page_size"],
                    context_len=f["context_len"],
                    startup_available_gpu_memory_gb=10.0,
                )
                if f.get("kv_used_tokens") is None:
                    continue  # no stats logged yet: a server that has run nothing
                used, free = f["kv_used_tokens"], f["kv_available_tokens"]
                evictable = f.get("kv_evictable_tokens", 0)
                usage = used / capacity if capacity else 0.0
                scheduler.log_stats(
                    SchedulerStats(
                        token_usage=usage,
                        full_token_usage=usage,
                        num_used_tokens=used,
                        kv_used_tokens=used,
                        kv_available_tokens=free,
                        kv_evictable_tokens=evictable,
                        is_cuda_graph=f.get("is_cuda_graph", 0),
                    )
                )
            for prompt in figures.get("prompts", []):
                tokenizer.observe_one_finished_request(
                    labels=tokenizer.labels,
                    prompt_tokens=prompt,
                    generation_tokens=1,
                    cached_tokens=0,
                    e2e_latency=0.1,
                    has_grammar=False,
                )
            return generate_latest(REGISTRY).decode()
        finally:
            for added in set(REGISTRY._collector_to_names) - before:
                REGISTRY.unregister(added)


def server_info(**server_args: Any) -> dict[str, Any]:
    """What SGLang's ``GET /server_info`` answers for a server started with ``server_args``:
    its own ``build_server_info`` plus the version, as its HTTP handler adds it (live
    scheduler state left out)."""
    _stub_torchvision()
    from sglang.srt.runtime_context import get_context
    from sglang.srt.utils.common import build_server_info
    from sglang.version import __version__

    ctx = get_context()
    with ctx.override_server_args(**server_args):
        doc = build_server_info(ctx.server_args, {})
    doc["version"] = __version__
    loaded: dict[str, Any] = json.loads(json.dumps(doc, default=str))
    return loaded


def main() -> None:
    """stdin: {"variants": {name: figures}, "server_args": {...}}; stdout, one line:
    {"exposition": {name: text}, "server_info": {...}}."""
    spec = json.load(sys.stdin)
    exposition = {name: render(figures) for name, figures in spec["variants"].items()}
    info = server_info(**spec["server_args"])
    print(json.dumps({"exposition": exposition, "server_info": info}))


if __name__ == "__main__":
    main()
