"""The SGLang adapter: SGLang's own allocator, pool and transfer calls → page ledger → events.

Two parts, joined here: :mod:`~engine_probe.adapters.sglang.hooks` patches SGLang (what is
hooked, and what each hook reads) and :mod:`~engine_probe.adapters.sglang.bookkeeping`
keeps the requests, tenants, request rows and one page ledger per watched KV pool, and sends
the events (its module docstring holds the page mapping). :class:`SGLangAdapter` is that
bookkeeping, fed by its hooks; :func:`attach` builds one and watches a node.

Nothing here stores or sends prompt or completion text: only token counts and ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from engine_probe.adapters.sglang.bookkeeping import PoolTracker, Role
from engine_probe.adapters.sglang.hooks import (
    FAKE_BOOTSTRAP_HOST,
    HEALTH_CHECK_PREFIX,
    SGLangHooks,
    attachable_kv_pool,
    default_tenant_of,
    engine_config,
)
from engine_probe.events import EngineConfig
from engine_probe.probe import BaseProbe

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "HEALTH_CHECK_PREFIX",
    "SGLangAdapter",
    "attach",
    "default_tenant_of",
]


class SGLangAdapter(PoolTracker):
    """Feeds SGLang's KV bookkeeping into one :class:`~engine_probe.ledger.PageLedger` per
    watched pool and emits kvwatch events through ``probe`` (default: the process's probe).

    Invariants: those of :class:`~engine_probe.adapters.sglang.bookkeeping.PoolTracker`
    (a request handle is stable per request id across nodes, so a transfer from the prefill
    pool to the decode pool is one request on both sides); hooks never raise into SGLang (a
    failure is logged and counted in ``counters["hook_errors"]``), and never change what
    SGLang's method returns.

    ``tenant_of``, ``zeroize_on_free``, ``pool_sample_every``, ``pool_sample_interval_s`` and
    ``model_id`` are read at each use: setting them takes effect at once.
    """

    def __init__(
        self,
        probe: BaseProbe | None = None,
        *,
        deployment_id: str | None = None,
        model_id: str = "unknown",
        tenant_of: Callable[[Any], str | None] = default_tenant_of,
        zeroize_on_free: bool = False,
        request_capacity: int = 1 << 16,
        pool_sample_every: int = 16,
        pool_sample_interval_s: float = 1.0,
        test_lose_kv_write_of_tenant: str | None = None,
    ) -> None:
        if pool_sample_every < 1 or pool_sample_interval_s <= 0:
            raise ValueError("pool_sample_every must be >= 1 and pool_sample_interval_s > 0")
        super().__init__(
            probe,
            deployment_id=deployment_id,
            model_id=model_id,
            request_capacity=request_capacity,
            test_lose_kv_write_of_tenant=test_lose_kv_write_of_tenant,
        )
        self.pool_sample_every = pool_sample_every
        # a prefill server runs few, long forwards: the interval keeps its samples coming
        self.pool_sample_interval_s = pool_sample_interval_s
        self.tenant_of = tenant_of
        self.zeroize_on_free = zeroize_on_free
        self._hooks = SGLangHooks(self)

    def watch(
        self,
        *,
        req_to_token_pool: Any,
        allocator: Any,
        role: Role = "both",
        node: str | None = None,
        advertised_context: int | None = None,
        tp_size: int = 1,
        kv_destinations: Mapping[str, Any] | None = None,
        prefix_caching: bool = False,
    ) -> str:
        """Hook one node's ``ReqToTokenPool`` and token allocator (and the allocator's KV
        pool); returns the node's name. Emits ``engine.config`` and a ``pool.sample``;
        ``kv_destinations``: where KV goes past the pool
        (:func:`engine_probe.kv_destinations.sglang_destinations`); ``prefix_caching``: the
        radix cache is on (SGLang's default; ``--disable-radix-cache`` turns it off).

        Watching a ``ReqToTokenPool`` already watched (a speculative-decoding draft runner
        shares the target's pool and allocator) returns the existing node's name and hooks
        nothing twice."""
        known = self._hooks.node_of(req_to_token_pool)
        if known is not None:
            return known.pool.name
        kv_pool = attachable_kv_pool(req_to_token_pool, allocator)
        ps = int(allocator.page_size)
        size = int(allocator.size)
        with self._lock:
            name = node or f"{role}-{len(self._pools)}"
            device = getattr(kv_pool, "device", "cpu")
            pool = self.add_pool(name, role, device=device, size=size, page_size=ps)
            self._hooks.watch(pool, req_to_token_pool, allocator, kv_pool)
        self._reporter.emit(
            EngineConfig,
            model_id=self.model_id,
            node=name,
            role=role,
            pool_capacity_tokens=size,
            page_size=ps,
            tp_size=tp_size,
            disaggregated=role != "both",
            prefix_caching=prefix_caching,
            **engine_config(req_to_token_pool, kv_pool, advertised_context),
            **(kv_destinations or {}),
        )
        self.sample_pools()
        return name

    def sample_pools(self) -> None:
        """One ``pool.sample`` per watched node, from its allocator's free count."""
        self._hooks.sample_all()

    def detach(self) -> None:
        """Undo every hook (instances and classes); the ledgers stay readable."""
        with self._lock:
            self._hooks.detach()

    def watch_transfer_classes(self, *classes: type) -> None:
        """Hook the disaggregation senders and receivers: ``classes``, or every subclass of
        SGLang's ``BaseKVSender``/``BaseKVReceiver`` imported so far (the fake backend's
        always)."""
        self._hooks.watch_transfer_classes(*classes)

    def check_reads(self, node: str, req_pool_indices: Tensor, seq_lens: Tensor) -> None:
        """Check that each row's request read only what it wrote: slots
        ``req_to_token[row, :seq_len]`` (what attention gathers for the row) of the node
        named ``node``. Emits the step's ``page.reuse`` and any ``page.stale_read``. Called
        by the attention hook (see :meth:`~PoolTracker.check_batch`)."""
        st = self._hooks.node_named(node)
        if st is None:
            raise KeyError(node)
        self.check_batch(st.pool, st.r2t.req_to_token, req_pool_indices, seq_lens)


def attach(
    *,
    req_to_token_pool: Any,
    allocator: Any,
    role: Role = "both",
    node: str | None = None,
    probe: BaseProbe | None = None,
    **options: Any,
) -> SGLangAdapter:
    """One call: build an :class:`SGLangAdapter` (``options`` as its keywords) and watch one
    node's ``ReqToTokenPool`` and allocator. Watch more nodes with
    :meth:`SGLangAdapter.watch`."""
    adapter = SGLangAdapter(probe, **options)
    adapter.watch(req_to_token_pool=req_to_token_pool, allocator=allocator, role=role, node=node)
    return adapter
