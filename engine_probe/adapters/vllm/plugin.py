"""vLLM's ``vllm.general_plugins`` entry point (see pyproject.toml).

vLLM calls :func:`register` in every process it starts (the API server, the engine core,
the workers), possibly more than once. It reads the ``KVWATCH_*`` settings; without
``KVWATCH_COLLECTOR_URL`` it returns at once and changes nothing. With it, it patches the v1
``Scheduler`` class so that every scheduler built afterwards gets a
:class:`~engine_probe.adapters.vllm.adapter.VllmAdapter`. Only the engine-core process builds a
scheduler, so only it configures a probe and exports events; the other processes import
nothing but this module and kvwatch's settings.

Bad settings, and a vLLM whose scheduler is not where this plugin looks, are logged, and
the engine runs without the probe: an observability plugin must not keep an inference
server from starting (vLLM does not catch what a plugin's ``register`` raises).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Final

log = logging.getLogger("engine_probe.vllm")  # its name before the move: log filters use it

_PATCHED: Final = "_kvwatch_patched"
#: Set to "0" to keep the plugin off while the other KVWATCH_* settings stay exported.
ENABLE_VAR: Final = "KVWATCH_VLLM_PROBE"


def register() -> None:
    """Patch vLLM's scheduler when a collector is configured; idempotent. Never raises:
    vLLM calls it unguarded at the start of every process it runs."""
    try:
        _register()
    except Exception:
        log.exception("kvwatch: could not patch vLLM's scheduler; vLLM runs without the probe")


def _register() -> None:
    if os.environ.get(ENABLE_VAR, "1").strip() == "0":
        return
    if not os.environ.get("KVWATCH_COLLECTOR_URL", "").strip():
        return
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


def _attach(scheduler: Any) -> None:
    try:
        from engine_probe.adapters.vllm.adapter import attach
        from engine_probe.probe import configure_probe, get_probe
        from engine_probe.settings import ProbeSettings

        probe = get_probe()
        if not probe.enabled:
            probe = configure_probe(ProbeSettings())
        if not probe.enabled:
            return
        attach(scheduler)
        log.info("kvwatch: probe attached to the vLLM scheduler (probe id %s)", _id(probe))
    except Exception:
        log.exception("kvwatch: could not attach the probe; vLLM runs without it")


def _id(probe: Any) -> str:
    return str(getattr(probe, "probe_id", "?"))
