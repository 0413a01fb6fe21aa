"""The environment route: an SGLang general plugin (entry point group
``sglang.srt.plugins``, name ``kvwatch``, declared in kvwatch's ``pyproject.toml``).

SGLang calls :func:`register` early in every process it starts (engine, scheduler,
detokenizer) through ``sglang.srt.plugins.load_plugins()``, so plain
``python -m sglang.launch_server ...`` picks the probe up, in the scheduler processes that
own the KV pools too (a patch made by a wrapper script in the launching process would not
survive SGLang's spawned children). It does nothing unless ``KVWATCH_SGLANG_PROBE`` is
``1``/``true``; then it configures the process's probe from the ``KVWATCH_*`` environment
and, each time a ``ModelRunner`` allocates its KV pools, watches them
(``SGLANG_PLUGINS=kvwatch`` restricts SGLang to this plugin, as for any plugin).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final

log = logging.getLogger("engine_probe.sglang")  # its name before the move: log filters use it

ENV_FLAG: Final = "KVWATCH_SGLANG_PROBE"
_state: dict[str, Any] = {}


def enabled() -> bool:
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """SGLang's plugin entry point. Idempotent; never raises into SGLang."""
    if not enabled() or "adapter" in _state:
        return
    try:
        from sglang.srt.model_executor.model_runner import ModelRunner

        from engine_probe.adapters.common import test_faults
        from engine_probe.adapters.defaults import describe_journal, plugin_settings
        from engine_probe.adapters.sglang.adapter import SGLangAdapter
        from engine_probe.probe import configure_probe

        probe = configure_probe(plugin_settings())
        if probe.enabled:
            log.info(
                "kvwatch SGLang probe %s: %s", probe.stats()["probe_id"], describe_journal(probe)
            )
        adapter = SGLangAdapter(
            zeroize_on_free=os.environ.get("KVWATCH_SGLANG_ZEROIZE", "") in ("1", "true"),
            **test_faults(log),
        )
        original = ModelRunner.alloc_memory_pool

        def alloc_memory_pool(runner: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(runner, *args, **kwargs)
            try:
                _watch_runner(adapter, runner)
            except Exception:
                log.exception("kvwatch could not watch this SGLang ModelRunner")
            return result

        setattr(alloc_memory_pool, "__kvwatch_wrapped__", True)  # noqa: B010
        # setattr: mypy sees ModelRunner only where SGLang is installed
        setattr(ModelRunner, "alloc_memory_pool", alloc_memory_pool)  # noqa: B010
        _state["adapter"] = adapter
    except Exception:
        log.exception("kvwatch SGLang plugin failed to register; SGLang runs unprobed")


def _watch_runner(adapter: Any, runner: Any) -> None:
    from engine_probe.kv_destinations import sglang_destinations

    if getattr(runner, "is_draft_worker", False):
        return  # a speculative draft runner shares the target's pools (watched already)
    args = getattr(runner, "server_args", None)
    mode = str(getattr(args, "disaggregation_mode", "null") or "null")
    role = mode if mode in ("prefill", "decode") else "both"
    model = getattr(args, "served_model_name", None) or getattr(args, "model_path", None)
    if model:
        adapter.model_id = str(model)
    adapter.watch(
        req_to_token_pool=runner.req_to_token_pool,
        allocator=runner.token_to_kv_pool_allocator,
        role=role,
        node=_node(args, role, runner),
        advertised_context=getattr(getattr(runner, "model_config", None), "context_len", None),
        tp_size=int(getattr(runner, "tp_size", 1) or 1),
        kv_destinations=sglang_destinations(args),
        prefix_caching=args is not None and not getattr(args, "disable_radix_cache", False),
    )


def current_adapter() -> Any:
    """The adapter :func:`register` installed in this process, or None."""
    return _state.get("adapter")


def _node(args: Any, role: str, runner: Any) -> str:
    """The node id of this runner's pools by the rule of :mod:`engine_probe.node`:
    ``KVWATCH_NODE_ID`` or the server's HOST:PORT (plus /prefill or /decode), plus /tpN for
    tensor-parallel ranks 1 and up (each rank's scheduler watches its own share)."""
    from engine_probe.node import node_id, server_base
    from engine_probe.settings import ProducerSettings

    port = getattr(args, "port", None)
    base = ProducerSettings().node_id or server_base(
        getattr(args, "host", None), port if isinstance(port, int) else None, role
    )
    return node_id(base, tp_rank=int(getattr(runner, "tp_rank", 0) or 0))
