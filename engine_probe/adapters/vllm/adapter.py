"""The vLLM adapter: a v1 ``Scheduler``'s KV cache decisions → page ledger → probe events.

``attach(scheduler)`` wraps methods of one scheduler instance (its class is untouched):
``add_request``, ``schedule``, ``finish_requests``, ``update_from_output``,
``_update_request_as_session`` (where vLLM has it) and its KV cache manager's
``allocate_slots``. Everything runs in the
engine-core process, on the scheduler's thread, in host memory; the model runner (another
process, or another device) is never touched.

Two parts, joined here: :mod:`~engine_probe.adapters.vllm.hooks` patches the scheduler and
reads vLLM's objects into plain values; :mod:`~engine_probe.adapters.vllm.bookkeeping` keeps
the requests, tenants, block tables and the page ledger, and sends the events (its module
docstring holds the ledger model).

Every event names the node (``node``; default :func:`~engine_probe.adapters.vllm.node.node_of`:
``KVWATCH_NODE_ID`` if the plugin passes it, else the API server's HOST:PORT, the role of a
disaggregated side and ``/dpN`` for data-parallel ranks 1 and up; see
:mod:`engine_probe.node`). What it emits, through the probe (``get_probe()`` unless one is
given):

* ``engine.config`` at attach: vLLM's version, the served model, ``max_model_len`` as the
  advertised context, blocks x block size as the pool capacity, dtype, quantization, TP
  size, CUDA graphs, prefix caching, and the KV connector's role (``kv_producer`` → prefill,
  ``kv_consumer`` → decode, ``kv_both`` → both; any connector → disaggregated);
* ``request.admitted`` when the engine core receives a request, ``request.finished`` when it
  leaves (token counts only, never text). A request with ``n > 1`` reaches the engine core
  as n children ``f"{i}_{parent}"`` with the same prompt: children 1..n-1 name child 0 in
  ``prompt_shared_with``, so the collector counts that prompt once. vLLM's front end ends
  a request whose output matched a stop string by aborting it (``FINISHED_ABORTED``, as
  for a client that left); the plugin marks those aborts in the front end
  (``engine_probe.adapters.vllm.STOP_MARK``, with the completion tokens the client's
  ``usage`` reports), and the adapter reports them ``completed`` with that count (the
  engine core may have generated more meanwhile). A streaming-input session (vLLM 0.32:
  each input chunk is an ``add_request`` with the session's id) is one request under one
  handle: its prompt tokens add up every chunk's, its completion tokens every chunk's
  output; closed by its client while it waits for input, vLLM aborts it, and the adapter
  reports ``completed``;
* ``pool.sample`` at attach and every ``pool_sample_every`` steps;
* ``page.reuse`` when allocations that handed out blocks still holding another request's
  KV are applied to the ledger (they are gathered: at most every ``flush_every`` steps,
  64 by default, before any read check, when the scheduler runs out of requests and at
  shutdown), with their summed counts;
* ``prefix_cache.hit`` when a request is admitted with blocks another tenant's request
  computed (``salted``: the request carried a ``cache_salt``, so the hit means the two
  tenants share a salt). Hits on the same tenant's blocks are counted, not sent: every turn
  of a conversation hits its own prefix, and no rule needs them; so are hits on blocks
  whose computing request is unknown (computed before the attach): not known to cross
  tenants;
* ``page.stale_read`` when a step reads blocks its request neither computed nor legitimately
  received (see :mod:`~engine_probe.adapters.vllm.bookkeeping`), naming the previous writer
  and its tenant.

Tenants
-------
The engine core sees no HTTP headers. The tenant is the per-request ``vllm_xargs`` key
``kvwatch_tenant`` (``SamplingParams.extra_args``; set by the client, or by a gateway in
front of vLLM), the route ``kvwatch_route``; without it the tenant is ``"unknown"``. The
tenant → ledger handle map keeps the ``handle_capacity`` most recently admitted tenants (the
strings are the clients'); a tenant seen again after its eviction gets a fresh handle, never
one another tenant holds, so at worst its blocks' reuse counts as cross-tenant.

Test-only fault injection (``test_lose_kv_write_of_tenant``, set by the plugin only under
its ``KVWATCH_TEST_FAULT_INJECTION`` flag): the first request of that tenant has its KV writes
left out of the ledger, so reads of those blocks are stale reads: the positive control of
kvwatch's live tests. Never in production.

Cost: the scheduler is Python and loops over blocks itself; the adapter adds, per
``allocate_slots`` call, two reads of the request's table length (more only when blocks
were added), and per scheduled request and step, a few dict operations (its own blocks'
owner, the gathered write); the ledger's torch calls come only with a flush (a few per
flush) and with the read checks of requests that need one (prefix-cache hits at
admission, KV loads, resumption after preemption). Measured by ``bench/vllm_overhead.py``
against the scheduler alone; see ``bench/README.md``.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from engine_probe.adapters.vllm.bookkeeping import BlockTracker
from engine_probe.adapters.vllm.hooks import (
    SchedulerHooks,
    SchedulerView,
    engine_config,
    read_shape,
)
from engine_probe.adapters.vllm.node import node_of
from engine_probe.events import EngineConfig
from engine_probe.probe import BaseProbe

__all__ = ["VllmAdapter", "attach"]

log = logging.getLogger("engine_probe.vllm")  # its name before the move: log filters use it

_ATTACHED: Final = "_kvwatch_adapter"


class VllmAdapter(BlockTracker):
    """Observer of one vLLM v1 ``Scheduler`` (see the module docstring): the bookkeeping
    (:class:`~engine_probe.adapters.vllm.bookkeeping.BlockTracker`, whose invariants hold)
    of that scheduler, fed by its hooks, which it installs."""

    def __init__(
        self,
        scheduler: Any,
        probe: BaseProbe | None = None,
        *,
        deployment_id: str | None = None,
        node: str | None = None,
        pool_sample_every: int = 16,
        ledger: bool = True,
        handle_capacity: int = 1 << 16,
        flush_every: int = 64,
        test_lose_kv_write_of_tenant: str | None = None,
    ) -> None:
        shape = read_shape(scheduler)
        if ledger and not shape.single_full_attention_group:
            log.warning(
                "kvwatch: %d KV cache group(s), not one of full attention; stale-read checks "
                "cover none of them",
                shape.kv_cache_groups,
            )
        view = SchedulerView(scheduler)
        super().__init__(
            view,
            probe,
            deployment_id=deployment_id,
            node=node if node is not None else node_of(scheduler.vllm_config),
            role=shape.role,
            model_id=shape.model_id,
            block_size=shape.block_size,
            num_blocks=shape.num_blocks,
            null_block=shape.null_block,
            ledger=ledger and shape.single_full_attention_group,
            pool_sample_every=pool_sample_every,
            flush_every=flush_every,
            handle_capacity=handle_capacity,
            test_lose_kv_write_of_tenant=test_lose_kv_write_of_tenant,
        )
        self.scheduler = scheduler
        #: what attach() wrapped (for the plugin's log line)
        self.hooked: list[str] = SchedulerHooks(scheduler, self, view).install()
        setattr(scheduler, _ATTACHED, self)
        self._reporter.emit(
            EngineConfig,
            model_id=shape.model_id,
            node=self.node,
            role=self.role,
            pool_capacity_tokens=self.num_blocks * self.block_size,
            page_size=self.block_size,
            **engine_config(scheduler),
        )
        self.sample_pool()


def attach(scheduler: Any, probe: BaseProbe | None = None, **options: Any) -> VllmAdapter:
    """Attach a :class:`VllmAdapter` to ``scheduler`` (``options`` as its keywords), once:
    a scheduler already attached keeps its adapter, which is returned."""
    existing = getattr(scheduler, _ATTACHED, None)
    if isinstance(existing, VllmAdapter):
        return existing
    return VllmAdapter(scheduler, probe, **options)
