"""vLLM's ``vllm.general_plugins`` entry point (see pyproject.toml).

vLLM calls :func:`register` in every process it starts (the API server, the engine core,
the workers), possibly more than once. It reads the ``KVWATCH_*`` settings; without
``KVWATCH_COLLECTOR_URL`` it returns at once and changes nothing. With it, it patches the v1
``Scheduler`` class so that every scheduler built afterwards gets a
:class:`~engine_probe.adapters.vllm.adapter.VllmAdapter`. Only the engine-core process builds a
scheduler, so only it configures a probe and exports events; the other processes import
nothing but this module, its node module and kvwatch's settings. In the API server it also
remembers the server's address for the engine cores (their node ids) and publishes
``kvwatch:node_info`` beside vLLM's metrics (see :mod:`engine_probe.adapters.vllm.node`).

Bad settings, and a vLLM whose scheduler is not where this plugin looks, are logged, and
the engine runs without the probe: an observability plugin must not keep an inference
server from starting (vLLM does not catch what a plugin's ``register`` raises).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("engine_probe.vllm")  # its name before the move: log filters use it
#: The plugin's lines in vLLM's own log (vLLM's logging handles the ``vllm`` loggers only).
vllm_log = logging.getLogger("vllm.kvwatch")

_PATCHED: Final = "_kvwatch_patched"
# on an OutputProcessor during process_outputs: request id → output tokens kept, of the
# requests it finished
_KEPT: Final = "_kvwatch_kept"
#: Set to "0" to keep the plugin off while the other KVWATCH_* settings stay exported.
ENABLE_VAR: Final = "KVWATCH_VLLM_PROBE"

# TEST ONLY: the positive control's fault injection (engine_probe.adapters.common).


def register() -> None:
    """Patch vLLM's scheduler when a collector is configured; idempotent. Never raises:
    vLLM calls it unguarded at the start of every process it runs."""
    try:
        _register()
    except Exception as exc:
        vllm_log.warning(
            "kvwatch: KVWATCH_COLLECTOR_URL is set but the probe cannot attach: could not "
            "patch vLLM's scheduler (%s: %s); vLLM runs without the probe",
            type(exc).__name__,
            exc,
            exc_info=True,
        )


def _register() -> None:
    if os.environ.get(ENABLE_VAR, "1").strip() == "0":
        return
    if not os.environ.get("KVWATCH_COLLECTOR_URL", "").strip():
        return
    from engine_probe.adapters.vllm.node import install_node_info, remember_server

    # In the API server, before it starts the engine cores: they inherit its address.
    remember_server()
    try:
        install_node_info(_node_override())
    except Exception:
        log.warning("kvwatch: could not publish the node ids in /metrics", exc_info=True)
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _PATCHED, False):
        return
    original_init = Scheduler.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _attach(self)

    # setattr: a subclass built later (AsyncScheduler) inherits the patched __init__
    setattr(Scheduler, "__init__", __init__)  # noqa: B010
    setattr(Scheduler, _PATCHED, True)
    try:
        _mark_stop_string_aborts()
    except Exception:
        log.warning(
            "kvwatch: could not patch vLLM's output processor; stop-string finishes will "
            "be reported as aborted",
            exc_info=True,
        )


def _mark_stop_string_aborts() -> None:
    """In vLLM's front end (the API server; ``LLM`` in-process): vLLM's output processor
    finds stop strings (the engine core has no detokenizer) and has the engine core abort
    those requests, as it does for a client that left. Add to that same abort message one
    :func:`~engine_probe.adapters.vllm.stop_mark` per such request, with the output tokens
    the front end kept (its ``usage.completion_tokens``), so that the engine core's adapter
    reports it completed. Same message, so ordered with the abort however vLLM's engine
    core batches aborts; a scheduler skips ids it does not hold. (vLLM's data-parallel
    load-balancing client drops ids it did not send: there they stay aborted.)"""
    from vllm.v1.engine.output_processor import OutputProcessor

    from engine_probe.adapters.vllm import stop_mark

    if getattr(OutputProcessor, _PATCHED, False):
        return
    process_outputs = OutputProcessor.process_outputs
    finish_request = OutputProcessor._finish_request

    @functools.wraps(finish_request)
    def _finish_request(self: Any, req_state: Any) -> None:
        kept = getattr(self, _KEPT, None)
        if kept is not None:
            # (a pooling request has no detokenizer, and no stop strings)
            with contextlib.suppress(Exception):
                kept[req_state.request_id] = req_state.detokenizer.num_output_tokens()
        finish_request(self, req_state)

    @functools.wraps(process_outputs)
    def _process_outputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        kept: dict[str, int] = {}
        setattr(self, _KEPT, kept)
        try:
            out = process_outputs(self, *args, **kwargs)
        finally:
            setattr(self, _KEPT, None)
        aborts = out.reqs_to_abort
        if aborts:
            try:
                aborts.extend([stop_mark(r, kept[r]) for r in aborts if r in kept])
            except Exception:
                log.warning("kvwatch: could not mark stop-string finishes", exc_info=True)
        return out

    setattr(OutputProcessor, "_finish_request", _finish_request)  # noqa: B010
    setattr(OutputProcessor, "process_outputs", _process_outputs)  # noqa: B010
    setattr(OutputProcessor, _PATCHED, True)


def _attach(scheduler: Any) -> None:
    try:
        from engine_probe.adapters.defaults import describe_journal, plugin_settings
        from engine_probe.adapters.vllm.adapter import attach
        from engine_probe.probe import configure_probe, get_probe

        probe = get_probe()
        if not probe.enabled:
            probe = configure_probe(plugin_settings())
        if not probe.enabled:
            vllm_log.warning(
                "kvwatch: KVWATCH_COLLECTOR_URL is set but the probe cannot attach: the "
                "probe is disabled after configuration (%s); vLLM runs without it",
                probe.stats(),
            )
            return
        from engine_probe.adapters.vllm.node import node_of

        settings = getattr(probe, "settings", None)
        node = node_of(scheduler.vllm_config, getattr(settings, "node_id", None))
        adapter = attach(scheduler, node=node, **_test_faults())
        vllm_log.info(
            "kvwatch: probe attached to vLLM's %s (probe id %s): collector %s, deployment "
            "%s, node %s; hooked %s; page ledger %s; %s",
            type(scheduler).__name__,
            _id(probe),
            redact_url(getattr(settings, "collector_url", None)),
            adapter.deployment_id or getattr(settings, "deployment_id", "?"),
            adapter.node,
            ", ".join(adapter.hooked),
            (
                f"on ({adapter.num_blocks} blocks of {adapter.block_size} tokens)"
                if adapter.ledger is not None
                else "off (several KV cache groups: no stale-read checks)"
            ),
            describe_journal(probe),
        )
    except Exception as exc:
        vllm_log.warning(
            "kvwatch: KVWATCH_COLLECTOR_URL is set but the probe cannot attach (%s: %s); "
            "vLLM runs without it",
            type(exc).__name__,
            exc,
            exc_info=True,
        )


def _node_override() -> str | None:
    """KVWATCH_NODE_ID, checked as the probe's settings check it; None when unset or bad
    (the probe's own settings then say what is wrong, in the engine core)."""
    from engine_probe.settings import ProducerSettings

    try:
        return ProducerSettings().node_id
    except ValueError:
        return None


def _test_faults() -> dict[str, Any]:
    """The adapter's test-only fault options (see ``adapters.common.TEST_FAULTS_VAR``)."""
    from engine_probe.adapters.common import test_faults  # imports msgspec: not at load

    return test_faults(vllm_log)


def redact_url(url: str | None) -> str:
    """``url`` without credentials: user info and query string replaced by ``***``."""
    if not url:
        return "(none)"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        netloc = f"***@{host}" if "@" in parts.netloc else host
        query = "***" if parts.query else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return "(unparseable)"


def _id(probe: Any) -> str:
    return str(getattr(probe, "probe_id", "?"))
