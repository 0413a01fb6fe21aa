"""A vLLM engine's node id and KV dtype, as :mod:`engine_probe.node` rules them.

What each vLLM process knows: the API server knows its ``--host``/``--port`` (its command
line) but builds no scheduler; the engine core builds the scheduler and knows its
data-parallel rank and KV-connector role (its ``vllm_config``) but not the API server's
address. So the plugin's ``register()``, which vLLM runs in the API server before it starts
the engine cores, puts the address in the environment (:data:`SERVER_VAR`); the engine
cores inherit it, and :func:`node_of` reads it there.

The API server also publishes, beside vLLM's ``vllm:cache_config_info``, one
``kvwatch:node_info`` series per engine core (labels ``engine``: the rank, as vLLM's
metrics label it, ``node``, ``role``, and the settings vLLM's metrics do not say or say
unresolved, :func:`kv_settings`: ``kv_dtype``, ``quantization``, ``tp_size``,
``cuda_graphs``): ``kvwatch scrape`` and ``kvwatch kv-events --target`` read it, so they
name the node, and report its config, exactly as the probe inside does, whatever address
they reach the server by (a node whose config flipped between two producers' versions
would be config drift).

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, Final

from engine_probe.node import INFO_LABELS, NODE_INFO, node_id, server_base

log = logging.getLogger("engine_probe.vllm")

#: Private: the API server's address, JSON ``{"host": ..., "port": ...}``, for the engine
#: cores it starts (set by the plugin in the API server, read in the engine core).
SERVER_VAR: Final = "_KVWATCH_VLLM_SERVER"
_ROLES: Final = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_PATCHED: Final = "_kvwatch_node_info"
_gauge: list[Any] = []  # the one kvwatch:node_info gauge of this process, once made


def _is_server(argv: Sequence[str]) -> bool:
    """Whether ``argv`` starts vLLM's OpenAI server (``vllm serve``, ``python -m
    vllm.entrypoints.openai.api_server``): only then are --host/--port its address (a
    script using ``LLM`` has a command line of its own)."""
    if not argv:
        return False
    prog = argv[0].replace("\\", "/")
    if prog.endswith("vllm/entrypoints/openai/api_server.py"):
        return True
    name = prog.rsplit("/", 1)[-1]
    serving = len(argv) > 1 and argv[1] == "serve"
    return serving and (name == "vllm" or prog.endswith("vllm/entrypoints/cli/main.py"))


def server_from_argv(argv: Sequence[str]) -> tuple[str | None, int | None] | None:
    """(host, port) of the vLLM server ``argv`` starts (vLLM's defaults: no host, port
    8000; no port with ``--uds``), or None when ``argv`` starts no vLLM server or its
    address cannot be read from it."""
    if not _is_server(argv):
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", default=None)
    try:
        known, _ = parser.parse_known_args(list(argv[1:]))
    except (argparse.ArgumentError, SystemExit):
        return None
    return known.host, None if known.uds else known.port


def remember_server(argv: Sequence[str] | None = None) -> None:
    """In vLLM's API server: put its address where the engine cores it starts find it
    (:data:`SERVER_VAR`). Once per process tree: an address already there (this is an
    engine core, or register() ran before) is kept."""
    if os.environ.get(SERVER_VAR):
        return
    found = server_from_argv(sys.argv if argv is None else argv)
    if found is not None:
        os.environ[SERVER_VAR] = json.dumps({"host": found[0], "port": found[1]})


def server_address() -> tuple[str | None, int | None]:
    """The API server's (host, port) the plugin remembered; (None, None) without one."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        doc = json.loads(os.environ.get(SERVER_VAR, ""))
        port = doc.get("port")
        host = doc.get("host")
        return (
            host if isinstance(host, str) else None,
            port if isinstance(port, int) and not isinstance(port, bool) else None,
        )
    return None, None


def role_of(cfg: Any) -> str:
    """prefill, decode or both: the KV connector's role (no connector: both)."""
    kv = getattr(cfg, "kv_transfer_config", None)
    if kv is None:
        return "both"
    return _ROLES.get(str(getattr(kv, "kv_role", "kv_both")), "both")


def dp_rank_of(cfg: Any) -> int:
    """This engine core's data-parallel rank (``data_parallel_index``: vLLM resets
    ``data_parallel_rank`` to 0 in the engine core of a dense model's rank)."""
    pc = cfg.parallel_config
    rank = getattr(pc, "data_parallel_index", None)
    return int(rank if rank is not None else getattr(pc, "data_parallel_rank", 0) or 0)


def node_of(cfg: Any, override: str | None = None, dp_rank: int | None = None) -> str:
    """The node id of the engine core of ``cfg`` (rank ``dp_rank``, default its own):
    ``override`` (KVWATCH_NODE_ID) or the API server's HOST:PORT plus the role, plus /dpN."""
    base = override or server_base(*server_address(), role=role_of(cfg))
    return node_id(base, dp_rank=dp_rank_of(cfg) if dp_rank is None else dp_rank)


def kv_dtype(cfg: Any) -> str:
    """The KV cache's dtype, resolved: ``--kv-cache-dtype`` unless it is ``auto``, which
    means the model's dtype (vLLM's ``vllm:cache_config_info`` shows ``auto``)."""
    cache = str(getattr(cfg.cache_config, "cache_dtype", "auto") or "auto")
    if cache != "auto":
        return cache[:64]
    return str(cfg.model_config.dtype).removeprefix("torch.")[:64]


def kv_settings(cfg: Any) -> dict[str, Any]:
    """The ``engine.config`` fields of ``cfg`` that vLLM's own metrics do not say, or say
    unresolved: the KV dtype, quantization, TP size, CUDA graphs (the probe's, and
    ``kvwatch:node_info``'s labels, so a scrape reports them alike)."""
    quant = getattr(cfg.model_config, "quantization", None)
    return {
        "dtype": kv_dtype(cfg),
        "quantization": str(quant)[:64] if quant else None,
        "tp_size": int(getattr(cfg.parallel_config, "tensor_parallel_size", 1) or 1),
        "cuda_graphs": _cuda_graphs(cfg),
    }


def _cuda_graphs(cfg: Any) -> bool:
    if cfg.model_config.enforce_eager:
        return False
    mode = getattr(cfg.compilation_config, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", "NONE") == "NONE":
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def install_node_info(override: str | None) -> None:
    """In the API server: publish :data:`NODE_INFO` when vLLM publishes its cache config
    (``PrometheusStatLogger.log_metrics_info``, once the engine cores are up). Idempotent;
    a failure costs the series only (logged), never vLLM's own metrics."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    if getattr(PrometheusStatLogger, _PATCHED, False):
        return
    original = PrometheusStatLogger.log_metrics_info

    @functools.wraps(original)
    def log_metrics_info(self: Any, type: str, config_obj: Any) -> None:
        original(self, type, config_obj)
        if type != "cache_config":
            return
        try:
            _publish(self, override)
        except Exception:
            log.warning("kvwatch: could not publish %s", NODE_INFO, exc_info=True)

    setattr(PrometheusStatLogger, "log_metrics_info", log_metrics_info)  # noqa: B010
    setattr(PrometheusStatLogger, _PATCHED, True)


def _publish(logger: Any, override: str | None) -> None:
    cfg = logger.vllm_config
    if not _gauge:
        _gauge.append(
            logger._gauge_cls(
                name=NODE_INFO,
                documentation="kvwatch: the node id, role and resolved KV dtype the probe "
                "reports each engine core under",
                multiprocess_mode="mostrecent",
                labelnames=list(INFO_LABELS),
            )
        )
    kv = kv_settings(cfg)
    labels = {
        "role": role_of(cfg),
        "kv_dtype": kv["dtype"],
        "quantization": kv["quantization"] or "",
        "tp_size": str(kv["tp_size"]),
        "cuda_graphs": "true" if kv["cuda_graphs"] else "false",
    }
    for index in logger.engine_indexes:
        node = node_of(cfg, override, dp_rank=int(index))
        _gauge[0].labels(engine=str(index), node=node, **labels).set(1)
