"""The SGLang adapter: SGLang's own allocator, pool and transfer calls → page ledger → events.

Page mapping. SGLang addresses KV by *token slot* (``out_cache_loc``; ``req_to_token`` rows
hold slots). A :class:`PagedTokenToKVPoolAllocator` hands out whole pages of ``page_size``
slots (slot = page * page_size + offset); a :class:`TokenToKVPoolAllocator` is the same with
``page_size == 1``. One :class:`PageLedger` per KV pool, with **ledger page = SGLang page**
and **ledger slot = the token's offset in its page**, ``num_pages = size // page_size + 1``
(slots ``[0, size + page_size)``: SGLang keeps slot 0 / page 0 as the padding target). So a
disaggregation transfer, which SGLang addresses in pages, maps page for page.

What is hooked (wrapped on the given instances; the transfer classes and the attention
backend base class are wrapped class-wide, once per adapter; :meth:`SGLangAdapter.detach`
restores everything; none touches the host while a CUDA graph is captured):

* ``ReqToTokenPool.alloc(reqs)``: a request gets a row → it is known (request id, tenant,
  bootstrap room); ``request.admitted`` on a prefill (or non-disaggregated) node.
* allocator ``alloc``/``alloc_extend``/``alloc_decode``: the pages handed out ("fresh").
* ``ReqToTokenPool.write((row, cols), slots)`` and, for extend, the module function
  ``write_cache_indices`` (its Triton kernel never calls ``write``: the rows are read back):
  slots bound to the row's request. A fresh page (or one the ledger holds free) becomes the
  request's own in the ledger (ownership comes from the row: SGLang's allocators never learn
  which request a slot is for); a page another request owns is a grant (a radix-cache
  prefix): the row's reads of it are checked as its owner's.
* ``ReqToTokenPool.free(req)``: ``request.finished`` if the request is finished (a retracted
  one only gives its row back).
* ``alloc_for_decode``: decode's slots recorded as written (a replayed CUDA graph runs no
  hook); ``Req.__init__``: the prompt length before any auto-truncation.
* allocator frees (``TokenToKVPoolAllocator.free``; ``PagedTokenToKVPoolAllocator.
  _release_page_ids``, where every paged free ends): pages freed, not zeroized, unless the
  adapter zeroizes them (``zeroize_on_free``: it zeroes the K/V rows itself first).
* ``MHATokenToKVPool.set_kv_buffer``: the slots written (once per forward, on the pool's
  first layer), by the pages' owner.
* ``AttentionBackend.forward`` (class-wide): after the pool's first layer ran, the batch's
  reads, ``req_to_token[row, :seq_len]`` for every row, are checked: a read of a slot its
  reader did not write in this generation is a ``page.stale_read`` naming the previous
  writer.
* ``AttentionBackend.forward`` also counts each node's eager forwards: every
  ``pool_sample_every`` of them, or at the first after ``pool_sample_interval_s`` since
  the last (and at watch), a ``pool.sample`` from the allocator.
* ``BaseKVSender``/``BaseKVReceiver`` subclasses (class-wide, and each class SGLang's
  ``get_kv_class`` hands out, with the bases it inherits from): the receiver's
  ``send_metadata`` gives the decode pages, the sender's ``send`` the prefill pages of one
  chunk; paired by bootstrap room, each chunk is a ``kv.transfer`` and a ledger transfer of
  exactly the pages sent, so decode pages nobody sent stay unwritten. When the sender is
  another process (separate prefill and decode servers), the decode side marks the pages it
  announces and, when the receiver's ``poll`` says the transfer succeeded, records as
  written only the pages whose mark is gone (:meth:`SGLangAdapter._on_poll`); both sides
  then name the request ``pd-<bootstrap room>``, the id they share.
* ``Req.set_finish_with_abort`` (class-wide): ``request.rejected`` with the prompt length
  before SGLang swaps the prompt for its one-token placeholder.

Nothing here stores or sends prompt or completion text: only token counts and ids.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch
from torch import Tensor

from engine_probe.adapters.common import UNKNOWN, StaleReadEmitter, safe_id
from engine_probe.adapters.guard import HookGuard
from engine_probe.adapters.registry import Bounded, RequestRegistry
from engine_probe.adapters.reporting import Reporter, RequestIds
from engine_probe.adapters.sglang.errors import NotAttachableError
from engine_probe.canary import SENTINEL
from engine_probe.events import (
    EngineConfig,
    KvTransfer,
    PoolSample,
)
from engine_probe.ledger import PageLedger
from engine_probe.probe import BaseProbe

__all__ = ["SGLangAdapter", "attach", "default_tenant_of"]

log = logging.getLogger("engine_probe.sglang")  # its name before the move: log filters use it

Role = Literal["prefill", "decode", "both"]
_MARK: Final = "__kvwatch_wrapped__"
#: the rid prefix of SGLang's own health-check generations (``sglang.srt.constants``)
HEALTH_CHECK_PREFIX: Final = "HEALTH_CHECK"
#: the bootstrap host of SGLang's fake transfers (health checks, warm-up; ``disaggregation.
#: utils.FAKE_BOOTSTRAP_HOST``): nothing is sent to them
FAKE_BOOTSTRAP_HOST: Final = "2.2.2.2"
#: where a receiver keeps (request handle, announced pages, marked) until its poll settles
_ARRIVALS: Final = "_kvwatch_arrivals"
#: ``KVPoll.Success`` and ``KVPoll.Failed`` (``sglang.srt.disaggregation.base.conn``: plain ints)
_POLL_SUCCESS: Final = 4
_POLL_FAILED: Final = 0


def default_tenant_of(req: Any) -> str | None:
    """A request's tenant: its ``routing_key``, else its ``extra_key`` (the prefix-cache
    salt, per tenant where salting is on), else ``None`` (reported as "unknown")."""
    for attr in ("routing_key", "extra_key"):
        value = getattr(req, attr, None)
        if isinstance(value, str) and value:
            return value
    return None


@dataclass
class _Node:
    """One KV pool and its request table: a prefill, decode or monolithic node."""

    name: str
    role: Role
    r2t: Any
    allocator: Any
    kv_pool: Any
    ledger: PageLedger
    page_size: int
    first_layer: int
    rows: dict[int, int] = field(default_factory=dict)  # req_to_token row -> request handle
    reuse: list[int] = field(default_factory=lambda: [0, 0, 0])
    #: per page: handed out by the allocator and not bound to a row since (only such a
    #: page, or one the ledger holds free, becomes the binding request's own)
    fresh: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    #: row -> per column, the handle whose write a read of that column is checked as (a
    #: radix-cache prefix bound into the row: the page's owner), or -1 (the row's request)
    grants: dict[int, Tensor] = field(default_factory=dict)
    #: inside ``write_cache_indices``: its own hook binds the batch, not ``write``
    batch_binding: bool = False
    #: eager forwards seen, and when the pool was last sampled (``time.monotonic``)
    forwards: int = 0
    sampled_at: float = 0.0


@dataclass
class _Room:
    """One disaggregated transfer within this process, by bootstrap room: the decode pages
    announced by the receiver and how many pages the sender has sent so far."""

    dst_pages: Tensor | None = None
    sent: int = 0


class SGLangAdapter:
    """Feeds SGLang's KV bookkeeping into one :class:`PageLedger` per watched pool and
    emits kvwatch events through ``probe`` (default: the process's probe).

    Invariants: a request handle is stable per request id across nodes (so a transfer from
    the prefill pool to the decode pool is one request on both sides); hooks never raise
    into SGLang (a failure is logged and counted in ``counters["hook_errors"]``), and never
    change what SGLang's method returns.
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
        self.pool_sample_every = pool_sample_every
        # a prefill server runs few, long forwards: the interval keeps its samples coming
        self.pool_sample_interval_s = pool_sample_interval_s
        # Request handles (never reused: two requests never look like one to a ledger), the
        # names a stale read may still report after the request finished, and the tenants
        # (clients' strings, SGLang's extra_key may be a random salt per request: an evicted
        # tenant is interned again under a new handle); bounded, oldest out first. TEST ONLY
        # (the plugin's KVWATCH_TEST_FAULT_INJECTION, engine_probe.adapters.common): the
        # first request of test_lose_kv_write_of_tenant gets its KV writes left out of the
        # ledger, a stale read to be caught (the positive control of the live tests).
        self._registry = RequestRegistry(request_capacity, test_lose_kv_write_of_tenant)
        self.model_id = model_id
        self.tenant_of = tenant_of
        self.zeroize_on_free = zeroize_on_free
        self._request_capacity = request_capacity
        self._lock = threading.RLock()
        self._nodes: dict[int, _Node] = {}  # id(req_to_token_pool) -> node
        # request id -> handle, of the requests not finished yet (dropped when the last node
        # here finishes one)
        self._handles: Bounded[str, int] = Bounded(request_capacity)
        # Bounded: a request that never finishes here (its decode node is another process)
        # must not grow them forever; the oldest entries go first.
        self._by_room: Bounded[int, int] = Bounded(request_capacity)  # room -> handle
        self._rejected: Bounded[int, None] = Bounded(request_capacity)  # aborted at intake
        self._health_checks: Bounded[int, None] = Bounded(request_capacity)
        # the requests that carried a cache_salt (SGLang keys its radix cache by it)
        self._salted: Bounded[int, None] = Bounded(request_capacity)
        self._rooms: Bounded[int, _Room] = Bounded(request_capacity)
        self._restore: list[Callable[[], None]] = []
        self._calls = threading.local()  # per thread: the outermost wrapped calls running
        self._class_hooks = False
        self.counters: dict[str, int] = {
            "stale_reads": 0,
            "transfers": 0,
            "hook_errors": 0,
            "reads_checked": 0,
            "capture_skipped": 0,
            "prefix_hits_cross_tenant": 0,
            "prefix_hits_same_tenant": 0,
            "pages_not_arrived": 0,
            "arrivals_unchecked": 0,
        }
        self._reporter = Reporter(probe, deployment_id, self.counters)
        # a hook's failure never reaches SGLang: logged, counted in counters["hook_errors"]
        self._guard = HookGuard(self.counters, "hook_errors", log, "kvwatch SGLang hook %s failed")
        self._stale = StaleReadEmitter(
            self._reporter.emit, self.counters, self._registry.names, self._registry.tenants.name
        )

    # -- public ----------------------------------------------------------------------------

    @property
    def probe(self) -> BaseProbe:
        return self._reporter.probe

    @property
    def deployment_id(self) -> str | None:
        return self._reporter.deployment_id

    @property
    def ledgers(self) -> dict[str, PageLedger]:
        return {n.name: n.ledger for n in self._nodes.values()}

    def watch(
        self,
        *,
        req_to_token_pool: Any,
        allocator: Any,
        role: Role = "both",
        node: str | None = None,
        advertised_context: int | None = None,
        tp_size: int = 1,
    ) -> str:
        """Hook one node's ``ReqToTokenPool`` and token allocator (and the allocator's KV
        pool); returns the node's name. Emits ``engine.config`` and a ``pool.sample``.

        Watching a ``ReqToTokenPool`` already watched (a speculative-decoding draft runner
        shares the target's pool and allocator) returns the existing node's name and hooks
        nothing twice."""
        known = self._nodes.get(id(req_to_token_pool))
        if known is not None:
            return known.name
        for obj, names in (
            (req_to_token_pool, ("alloc", "write", "free", "req_to_token")),
            (allocator, ("alloc", "free", "page_size", "size", "get_kvcache")),
        ):
            missing = [n for n in names if not hasattr(obj, n)]
            if missing:
                raise NotAttachableError(f"{type(obj).__name__} lacks {missing}")
        kv_pool = allocator.get_kvcache()
        if not hasattr(kv_pool, "set_kv_buffer"):
            raise NotAttachableError(f"{type(kv_pool).__name__} lacks set_kv_buffer")
        ps = int(allocator.page_size)
        size = int(allocator.size)
        with self._lock:
            name = node or f"{role}-{len(self._nodes)}"
            device = getattr(kv_pool, "device", "cpu")
            ledger = PageLedger(size // ps + 1, device=device, name=name, page_size=ps)
            st = _Node(
                name=name,
                role=role,
                r2t=req_to_token_pool,
                allocator=allocator,
                kv_pool=kv_pool,
                ledger=ledger,
                page_size=ps,
                first_layer=int(getattr(kv_pool, "start_layer", 0) or 0),
                fresh=torch.zeros(size // ps + 1, dtype=torch.bool, device=ledger.device),
            )
            self._nodes[id(req_to_token_pool)] = st
            self._hook_node(st)
            self._install_class_hooks()
        context = advertised_context or int(req_to_token_pool.req_to_token.shape[1])
        self._reporter.emit(
            EngineConfig,
            engine="sglang",
            engine_version=_sglang_version(),
            model_id=self.model_id,
            node=name,
            role=role,
            advertised_context=max(1, context),
            pool_capacity_tokens=size,
            page_size=ps,
            dtype=str(getattr(kv_pool, "dtype", "unknown")).removeprefix("torch."),
            tp_size=tp_size,
            disaggregated=role != "both",
        )
        self.sample_pools()
        return name

    def sample_pools(self) -> None:
        """One ``pool.sample`` per watched node, from its allocator's free count."""
        for st in list(self._nodes.values()):
            self._sample(st)

    def _sample(self, st: _Node, now: float | None = None) -> None:
        st.sampled_at = time.monotonic() if now is None else now
        cap = int(st.allocator.size)
        free = min(cap, int(st.allocator.available_size()))
        self._reporter.emit(
            PoolSample,
            node=st.name,
            role=st.role,
            capacity_tokens=cap,
            used_tokens=cap - free,
            free_tokens=free,
        )

    def detach(self) -> None:
        """Undo every hook (instances and classes); the ledgers stay readable."""
        with self._lock:
            while self._restore:
                self._restore.pop()()
            self._class_hooks = False

    # -- hooks: installation -----------------------------------------------------------------

    def _wrap_instance(self, obj: Any, name: str, after: Callable[..., None]) -> None:
        """``obj.name(*a, **k)`` runs SGLang's method, then ``after(result, *a, **k)``."""
        original = getattr(obj, name)
        adapter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            with adapter._guard.at(name):
                after(result, *args, **kwargs)
            return result

        setattr(obj, name, wrapper)

        def restore() -> None:
            obj.__dict__.pop(name, None)

        self._restore.append(restore)

    def _wrap_class(
        self,
        cls: type,
        name: str,
        before: Callable[..., None] | None = None,
        after: Callable[..., None] | None = None,
        *,
        outermost: bool = False,
    ) -> None:
        """Wrap ``cls.name`` (as defined on ``cls`` itself) class-wide. ``outermost``: where
        an override and the base method it calls through ``super()`` are both wrapped, only
        the outermost call on an object runs the hooks (a transfer is seen once)."""
        original = cls.__dict__.get(name)
        if original is None or getattr(original, _MARK, False):
            return
        adapter = self

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if outermost:
                calls: set[tuple[int, str]] = adapter._calls.__dict__.setdefault("on", set())
                token = (id(obj), name)
                if token in calls:
                    return original(obj, *args, **kwargs)
                calls.add(token)
                try:
                    return wrapper_body(obj, *args, **kwargs)
                finally:
                    calls.discard(token)
            return wrapper_body(obj, *args, **kwargs)

        def wrapper_body(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                with adapter._guard.at(name):
                    before(obj, *args, **kwargs)
            result = original(obj, *args, **kwargs)
            if after is not None:
                with adapter._guard.at(name):
                    after(obj, result, *args, **kwargs)
            return result

        setattr(wrapper, _MARK, True)
        wrapper.__name__ = name
        wrapper.__doc__ = getattr(original, "__doc__", None)
        setattr(cls, name, wrapper)
        self._restore.append(lambda: setattr(cls, name, original))

    def _hook_node(self, st: _Node) -> None:
        r2t, allocator = st.r2t, st.allocator
        self._wrap_instance(r2t, "alloc", lambda rows, reqs: self._on_rows(st, rows, reqs))
        self._wrap_instance(
            r2t, "write", lambda _r, idx, values: self._on_write_row(st, idx, values)
        )
        self._wrap_instance(r2t, "free", lambda _r, req: self._on_finished(st, req))
        for name in ("alloc", "alloc_extend", "alloc_decode"):
            if hasattr(allocator, name):
                self._wrap_instance(
                    allocator, name, lambda out, *_a, **_k: self._on_handed_out(st, out)
                )
        if st.page_size > 1 and hasattr(allocator, "_release_page_ids"):
            # every free of a paged allocator (free, free_page_ids, a free group's end)
            # releases through this one method, in page ids
            def on_release(_r: Any, *page_ids: Tensor) -> None:
                for pages in page_ids:
                    self._on_free(st, pages)

            self._wrap_instance(allocator, "_release_page_ids", on_release)
        else:
            # page_size 1: slots are pages; a free inside a free group is deferred and
            # comes back through free() at the group's end
            def on_free(_r: Any, index: Tensor) -> None:
                if allocator.free_group is None:
                    self._on_free(st, index)

            self._wrap_instance(allocator, "free", on_free)
        self._wrap_instance(
            st.kv_pool,
            "set_kv_buffer",
            lambda _r, layer, loc_info, *a, **k: self._on_write(st, layer, loc_info, k),
        )

    def _install_class_hooks(self) -> None:
        if self._class_hooks:
            return
        self._class_hooks = True
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
        from sglang.srt.managers import schedule_batch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache import allocation

        self._wrap_class(AttentionBackend, "forward", after=self._on_forward)
        self._wrap_class(Req, "set_finish_with_abort", before=self._on_abort)
        self._wrap_class(Req, "__init__", after=_note_prompt_length)
        # module functions, looked up by name at each call: extend binds its rows here
        # (a Triton kernel on CUDA, never through ReqToTokenPool.write); decode's slots are
        # allocated here, outside any CUDA graph the forward may replay
        self._wrap_function(
            allocation, "write_cache_indices", self._before_batch_bind, self._on_batch_bind
        )
        for module in (allocation, schedule_batch):  # schedule_batch imported it by name
            self._wrap_function(module, "alloc_for_decode", None, self._on_decode_slots)
        for name in ("utils", "prefill", "decode"):  # prefill and decode import it by name
            module = sys.modules.get(f"sglang.srt.disaggregation.{name}")
            if module is not None:
                self._wrap_function(module, "get_kv_class", None, self._on_kv_class)
        self.watch_transfer_classes()

    def _wrap_function(
        self,
        module: Any,
        name: str,
        before: Callable[..., None] | None,
        after: Callable[..., None] | None,
    ) -> None:
        """Wrap the module-level function ``module.name``: ``before(*a, **k)`` then the
        function, then ``after(result, *a, **k)``; ``after`` runs even if it raised."""
        original = getattr(module, name, None)
        if original is None or getattr(original, _MARK, False):
            return
        adapter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                with adapter._guard.at(name):
                    before(*args, **kwargs)
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                if after is not None:
                    with adapter._guard.at(name):
                        after(result, *args, **kwargs)

        setattr(wrapper, _MARK, True)
        wrapper.__name__ = name
        wrapper.__doc__ = getattr(original, "__doc__", None)
        setattr(module, name, wrapper)
        self._restore.append(lambda: setattr(module, name, original))

    def watch_transfer_classes(self, *classes: type) -> None:
        """Hook the disaggregation senders and receivers: ``classes``, or every subclass of
        SGLang's ``BaseKVSender``/``BaseKVReceiver`` imported so far (the fake backend's
        always)."""
        if not classes:
            import sglang.srt.disaggregation.fake.conn  # noqa: F401  (registers subclasses)
            from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender

            classes = (*_subclasses(BaseKVSender), *_subclasses(BaseKVReceiver))
        from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender

        # a class and every base it inherits a hooked method from (a backend's sender may
        # define send itself, or inherit CommonKVSender's)
        hooked = [
            c
            for cls in classes
            for c in cls.__mro__
            if issubclass(c, (BaseKVSender, BaseKVReceiver))
            and c not in (BaseKVSender, BaseKVReceiver)
        ]
        for cls in dict.fromkeys(hooked):
            self._wrap_class(cls, "__init__", before=self._on_transfer_init, outermost=True)
            self._wrap_class(cls, "send", before=self._on_send, outermost=True)
            self._wrap_class(cls, "send_metadata", before=self._on_metadata, outermost=True)
            if issubclass(cls, BaseKVReceiver):
                self._wrap_class(cls, "poll", after=self._on_poll, outermost=True)

    def _on_kv_class(self, result: Any, *args: Any, **kwargs: Any) -> None:
        """After SGLang's ``get_kv_class``: a sender or receiver class of the backend in use,
        whose module may have been imported only now (SGLang 0.5.21's Mooncake classes)."""
        from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender

        if isinstance(result, type) and issubclass(result, (BaseKVSender, BaseKVReceiver)):
            self.watch_transfer_classes(result)

    # -- hooks: requests -------------------------------------------------------------------

    def _handle(self, req: Any) -> int:
        """The request's handle (stable per request id while it is not finished; never
        reused), remembering its names."""
        rid = str(getattr(req, "rid", "") or f"anon-{id(req)}")
        with self._lock:
            handle = self._handles.get(rid)
            if handle is None:
                tenant = self.tenant_of(req)
                handle = self._registry.add(
                    self._wire_id(req, rid), None if tenant is None else safe_id(tenant, "tenant")
                )
                self._handles[rid] = handle
                if rid.startswith(HEALTH_CHECK_PREFIX) or _fake_transfer(req):
                    self._health_checks[handle] = None
                if getattr(req, "cache_salt", None):
                    self._salted[handle] = None
            room = getattr(req, "bootstrap_room", None)
            if isinstance(room, int):
                self._by_room[room] = handle
            return handle

    def _wire_id(self, req: Any, rid: str) -> str:
        """The request id the events carry. SGLang's prefill and decode servers each name a
        request with an id of their own; what both share is the bootstrap room the router
        gives it. So where this process holds only one side of a disaggregated pair, the
        request is ``pd-<room>`` on both sides and the collector joins its halves into one
        request; elsewhere it is SGLang's ``rid``."""
        room = getattr(req, "bootstrap_room", None)
        roles = {n.role for n in self._nodes.values()}
        split = bool(roles & {"prefill", "decode"}) and not {"prefill", "decode"} <= roles
        real = not rid.startswith(HEALTH_CHECK_PREFIX) and not _fake_transfer(req)
        if split and isinstance(room, int) and real:
            return f"pd-{room}"
        return safe_id(rid, "req")

    def _reported(self, handle: int | None) -> bool:
        """Whether the request's own events (admitted, finished, rejected, transfers) are
        sent: not for SGLang's health checks (``/health`` runs a one-token generation every
        few seconds on each server) nor its start-up warm-up (a fake transfer from
        ``FAKE_BOOTSTRAP_HOST``); their pages are still tracked in the ledger."""
        return handle is None or handle not in self._health_checks

    def _request_names(self, handle: int | None) -> tuple[str, str]:
        return (UNKNOWN, UNKNOWN) if handle is None else self._registry.names(handle)

    def _tenant_of_handle(self, handle: int) -> int:
        """The ledger tenant of a request handle (unknown tenants share ``_NO_TENANT``)."""
        tenant = self._registry.tenant_handle(handle)
        return tenant if tenant >= 0 else _NO_TENANT

    def _on_rows(self, st: _Node, rows: list[int] | None, reqs: list[Any]) -> None:
        if rows is None:
            return
        for row, req in zip(rows, reqs, strict=True):
            new = str(getattr(req, "rid", "") or f"anon-{id(req)}") not in self._handles
            handle = self._handle(req)
            st.rows[int(row)] = handle
            st.grants.pop(int(row), None)
            if new and st.role != "decode" and self._reported(handle):
                sp = getattr(req, "sampling_params", None)
                self._reporter.admitted(
                    self._ids(handle),
                    prompt_tokens=_prompt_tokens(req),
                    max_tokens=getattr(sp, "max_new_tokens", None),
                    node=st.name,
                )

    def _on_abort(self, req: Any, error_msg: str = "", *args: Any, **kwargs: Any) -> None:
        """Before SGLang swaps the prompt for one token: the request's real length."""
        handle = self._handle(req)
        self._rejected[handle] = None
        if not self._reported(handle):
            return
        too_long = "exceeds" in error_msg or "longer" in error_msg
        self._reporter.rejected(
            self._ids(handle),
            reason="pool_exhausted" if too_long else "other",
            prompt_tokens=_prompt_tokens(req),
            limit_tokens=_limit_from(error_msg),
            node=self._node_name("prefill"),
        )

    def _on_finished(self, st: _Node, req: Any) -> None:
        """A row given back. Only a finished request finishes: a retracted one (SGLang's
        ``retract_decode`` releases its row and KV) comes back under the same handle."""
        handle = self._handle(req)
        for row, h in list(st.rows.items()):
            if h == handle:
                del st.rows[row]
                st.grants.pop(row, None)
        done = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
        if done is None:
            return  # retracted, not finished
        if st.role == "prefill" and self._node_by_role("decode") is not None:
            return  # the request finishes on its decode node, watched here too
        rejected = handle in self._rejected
        health_check = not self._reported(handle)
        self._stale.forget(handle)
        self._forget(handle, getattr(req, "bootstrap_room", None))
        rid = str(getattr(req, "rid", "") or f"anon-{id(req)}")
        if self._handles.get(rid) == handle:
            del self._handles[rid]
        if st.role == "prefill" or health_check:
            return  # the request finishes on its decode node (another process)
        reason = type(done).__name__
        status = (
            "aborted"
            if rejected or "ABORT" in reason
            else "length"
            if "LENGTH" in reason
            else "completed"
        )
        self._reporter.finished(
            self._ids(handle),
            prompt_tokens=_prompt_tokens(req),
            completion_tokens=len(getattr(req, "output_ids", ())),
            status=status,
            node=st.name,
        )

    # -- hooks: pages ------------------------------------------------------------------------

    def _room(self, room: int) -> _Room:
        state = self._rooms.get(room)
        if state is None:
            state = self._rooms[room] = _Room()
        return state

    def _forget(self, handle: int, room: Any) -> None:
        """A request done on its last node: drop what pairs its transfers."""
        self._rejected.pop(handle, None)
        self._health_checks.pop(handle, None)
        self._salted.pop(handle, None)
        if room is not None:
            self._rooms.pop(room, None)
            if self._by_room.get(room) == handle:
                del self._by_room[room]

    def _on_handed_out(self, st: _Node, slots: Any) -> None:
        """The allocator handed out ``slots``: their pages may become a request's own when
        bound to its row (see :meth:`_bind`)."""
        if isinstance(slots, Tensor) and slots.numel():
            pages = torch.div(slots.reshape(-1).long(), st.page_size, rounding_mode="floor")
            st.fresh[pages.to(st.fresh.device)] = True

    def _on_write_row(self, st: _Node, index: Any, values: Any) -> None:
        """``ReqToTokenPool.write(index, values)``: ``(row, slice)`` (extend's fallback
        path, the radix cache's checkpoint, disaggregation's preallocation) or ``(rows,
        columns)`` tensors (decode: one slot per row)."""
        if st.batch_binding or not isinstance(values, Tensor) or values.numel() == 0:
            return
        slots = values.reshape(-1).long()
        n = slots.numel()
        row_index, cols_index = index if isinstance(index, tuple) else (index, None)
        rows = torch.as_tensor(row_index, dtype=torch.long).reshape(-1).cpu()
        if isinstance(cols_index, slice):
            first = cols_index.start or 0
            cols = torch.arange(first, first + n, dtype=torch.long)
        elif cols_index is None:
            cols = torch.arange(n, dtype=torch.long)
        else:
            cols = torch.as_tensor(cols_index, dtype=torch.long).reshape(-1).cpu()
        self._bind(st, rows.expand(n), cols.expand(n), slots)

    def _before_batch_bind(self, *args: Any, **kwargs: Any) -> None:
        st = self._nodes.get(id(_arg(args, kwargs, 10, "req_to_token_pool")))
        if st is not None:
            st.batch_binding = True

    def _on_batch_bind(self, _result: Any, *args: Any, **kwargs: Any) -> None:
        """After ``write_cache_indices`` (extend): each row's table ``[0, seq_len)`` is its
        prefix (its own earlier chunks, or radix-cache pages) then its new slots; read back
        from the table, so the Triton kernel and the fallback look alike."""
        st = self._nodes.get(id(_arg(args, kwargs, 10, "req_to_token_pool")))
        if st is None:
            return
        st.batch_binding = False
        rows_cpu = _arg(args, kwargs, 2, "req_pool_indices_cpu").reshape(-1).tolist()
        lens_cpu = _arg(args, kwargs, 6, "seq_lens_cpu").reshape(-1).tolist()
        table = st.r2t.req_to_token
        rows, cols, slots = [], [], []
        for row, n in zip(rows_cpu, lens_cpu, strict=True):
            n = min(int(n), int(table.shape[1]))
            if n <= 0:
                continue
            rows.append(torch.full((n,), int(row), dtype=torch.long))
            cols.append(torch.arange(n, dtype=torch.long))
            slots.append(table[int(row), :n])
        if slots:
            self._bind(st, torch.cat(rows), torch.cat(cols), torch.cat(slots).long())

    def _bind(self, st: _Node, rows: Tensor, cols: Tensor, slots: Tensor) -> None:
        """Slots bound into request rows (host ``rows``/``cols``, ``slots`` anywhere).

        A page the allocator handed out since it was last bound (or one the ledger holds
        free) becomes the row's request's own: allocated to it in the ledger, unless it
        already is (a page the request is still filling). A page owned by another request
        is a grant (a radix-cache prefix: SGLang never writes into a shared page): the row's
        reads of that column are checked as the owner's reads, so the owner's write makes
        them valid and the owner keeps its page."""
        dev = st.ledger.device
        handle_of = {r: st.rows.get(r, -1) for r in set(rows.tolist())}
        handles = torch.tensor([handle_of[r] for r in rows.tolist()], dtype=torch.long)
        bound = handles >= 0
        if not bool(bound.any()):
            return
        rows, cols, handles = rows[bound], cols[bound], handles[bound]
        pages = torch.div(slots.to(dev)[bound.to(dev)], st.page_size, rounding_mode="floor")
        handles_d = handles.to(dev)
        owners = st.ledger.owner_of(pages)
        fresh = st.fresh[pages] | (owners < 0)
        st.fresh[pages] = False
        new = fresh & (owners != handles_d)
        granted = ~fresh & (owners != handles_d)
        any_new, any_granted = torch.stack([new.any(), granted.any()]).tolist()  # one sync
        if any_new:
            for h in handles_d[new].unique().tolist():
                mine = torch.unique(pages[new & (handles_d == h)])
                counts = st.ledger.alloc(mine, h, self._tenant_of_handle(h))
                st.reuse[0] += counts.reused
                st.reuse[1] += counts.cross_tenant
                st.reuse[2] += counts.zeroized
        if not any_granted and not st.grants:
            return
        reader = torch.where(granted, owners, torch.full_like(owners, -1)).cpu()
        for row in handle_of:
            at = rows == row
            if not bool(at.any()):
                continue
            grant = st.grants.get(row)
            if grant is None and not bool((reader[at] >= 0).any()):
                continue  # no prefix of another request's in this row
            row_cols = cols[at]
            width = int(row_cols.max()) + 1
            if grant is None or grant.numel() < width:
                grown = torch.full((width,), -1, dtype=torch.long)
                if grant is not None:
                    grown[: grant.numel()] = grant.cpu()
                grant = grown
            grant = grant.cpu()
            newly = (reader[at] >= 0) & (grant[row_cols] != reader[at])
            if bool(newly.any()):
                self._report_hits(st, row, reader[at][newly], pages[at.to(dev)][newly.to(dev)])
            grant[row_cols] = reader[at]
            st.grants[row] = grant.to(dev)

    def _report_hits(self, st: _Node, row: int, owners: Tensor, pages: Tensor) -> None:
        """Columns of ``row`` newly bound to pages ``owners`` computed (a radix-cache
        prefix): a ``prefix_cache.hit`` per owner of another tenant, naming both requests
        (same-tenant hits are counted, not sent, as vLLM's adapter does)."""
        reader = st.rows.get(row)
        if reader is None:
            return
        reader_names = self._registry.names(reader)
        page_list = pages.cpu().tolist()
        by_owner: dict[int, list[int]] = {}
        for owner, page in zip(owners.tolist(), page_list, strict=True):
            by_owner.setdefault(owner, []).append(page)
        for owner, owned in by_owner.items():
            named = self._registry.known(owner)
            if named is None:
                continue  # its writer long forgotten: not known to be another tenant's
            self._reporter.prefix_hit(
                node=st.name,
                role=st.role,
                reader=reader_names,
                owner=named,
                pages=len(set(owned)),
                tokens=len(owned),
                # the reader carried a cache_salt, so the owner had the same one: the two
                # tenants share a salt (SGLang keys its radix cache by extra_key too, which
                # is not counted as a salt: it is the caller's request classification)
                salted=reader in self._salted,
            )

    def _on_free(self, st: _Node, index: Tensor) -> None:
        if index.numel() == 0:
            return
        pages = index.reshape(-1).long()
        if st.page_size == 1 or st.allocator.page_size == 1:
            pages = torch.unique(pages)
        pages = pages.to(st.ledger.device)
        if self.zeroize_on_free:
            _zero_pages(st.kv_pool, pages, st.page_size)
        st.ledger.free(pages, zeroized=self.zeroize_on_free)

    def _on_write(self, st: _Node, layer: Any, loc_info: Any, kwargs: dict[str, Any]) -> None:
        layer_id = kwargs.get("layer_id_override")
        if layer_id is None:
            layer_id = getattr(layer, "layer_id", st.first_layer)
        if layer_id != st.first_layer:
            return  # every layer writes the same slots: account for them once
        if _capturing():
            # inside a CUDA graph capture: a host sync would invalidate it; decode writes
            # are recorded from alloc_for_decode instead (replays run no Python)
            self.counters["capture_skipped"] += 1
            return
        self._record_write(st, getattr(loc_info, "loc", loc_info))

    def _on_decode_slots(self, out_cache_loc: Any, batch: Any, *args: Any, **kw: Any) -> None:
        """``alloc_for_decode`` (the scheduler, outside any graph): the slots the decode
        forward will write, recorded now, because a replayed CUDA graph runs no hook."""
        st = self._nodes.get(id(getattr(batch, "req_to_token_pool", None)))
        if st is not None:
            self._record_write(st, out_cache_loc)
            # a replayed CUDA graph's forward runs no hook: decode's samples come from here
            now = time.monotonic()
            if now - st.sampled_at >= self.pool_sample_interval_s:
                self._sample(st, now)

    def _record_write(self, st: _Node, loc: Any) -> None:
        """Slots ``loc`` written, each by its page's owner (free pages: padding, ignored)."""
        if not isinstance(loc, Tensor) or loc.numel() == 0:
            return
        loc = loc.reshape(-1).long().to(st.ledger.device)
        ps = st.page_size
        page_of = torch.div(loc, ps, rounding_mode="floor")
        pages, inverse = torch.unique(page_of, return_inverse=True)
        offsets = loc - page_of * ps
        start = torch.full_like(pages, ps).scatter_reduce(0, inverse, offsets, "amin")
        end = torch.zeros_like(pages).scatter_reduce(0, inverse, offsets + 1, "amax")
        owners = st.ledger.owner_of(pages)
        owned = owners >= 0  # writes into free pages (padding slots) validate nothing
        lost = self._registry.lost
        if lost is not None:
            owned &= owners != lost  # TEST ONLY: its writes are left out
        if not bool(owned.all()):
            pages, owners, start, end = pages[owned], owners[owned], start[owned], end[owned]
        if pages.numel():
            st.ledger.write(pages, owners, start=start, end=end)

    def _on_forward(self, backend: Any, _result: Any, *args: Any, **kwargs: Any) -> None:
        layer = kwargs.get("layer", args[3] if len(args) > 3 else None)
        batch = kwargs.get("forward_batch", args[4] if len(args) > 4 else None)
        if layer is None or batch is None:
            return
        r2t = getattr(batch, "req_to_token_pool", None) or getattr(
            backend, "req_to_token_pool", None
        )
        st = self._nodes.get(id(r2t))
        if st is None or getattr(layer, "layer_id", None) != st.first_layer:
            return
        if _capturing():
            self.counters["capture_skipped"] += 1
            return  # the check syncs with the host: it would invalidate the capture
        mode = getattr(batch, "forward_mode", None)
        if mode is not None and mode.is_idle():
            return
        st.forwards += 1
        now = time.monotonic()
        if (
            st.forwards % self.pool_sample_every == 0
            or now - st.sampled_at >= self.pool_sample_interval_s
        ):
            self._sample(st, now)
        self.check_reads(st.name, batch.req_pool_indices, batch.seq_lens)

    def check_reads(self, node: str, req_pool_indices: Tensor, seq_lens: Tensor) -> None:
        """Check that each row's request read only what it wrote: slots
        ``req_to_token[row, :seq_len]`` (what attention gathers for the row). Emits the
        step's ``page.reuse`` and any ``page.stale_read``. Called by the attention hook.

        Vectorised over the batch: every token read is one (page, reader, upto) triple, so
        the check is one ledger call and one host sync (plus reading the rows and the
        longest length); only a stale read costs more (the report)."""
        st = next((n for n in self._nodes.values() if n.name == node), None)
        if st is None:
            raise KeyError(node)
        self._flush_reuse(st)
        rows = req_pool_indices.reshape(-1).tolist()
        handles = [st.rows.get(int(r), -1) for r in rows]
        if not rows or max(handles) < 0:
            return
        self.counters["reads_checked"] += sum(h >= 0 for h in handles)
        dev = st.ledger.device
        table = st.r2t.req_to_token
        lens = seq_lens.reshape(-1).to(dev).long()
        width = min(int(lens.max()), int(table.shape[1]))
        if width <= 0:
            return
        index = torch.as_tensor(rows, dtype=torch.long, device=table.device)
        slots = table.index_select(0, index)[:, :width].to(dev).long()
        readers = torch.tensor(handles, dtype=torch.long, device=dev)[:, None].repeat(1, width)
        granted = False
        for i, row in enumerate(rows):
            grant = st.grants.get(int(row))
            if grant is not None and handles[i] >= 0:
                g = grant[:width]
                readers[i, : g.numel()] = torch.where(g >= 0, g, readers[i, : g.numel()])
                granted = True
        used = (torch.arange(width, device=dev)[None, :] < lens[:, None]) & (readers >= 0)
        which = torch.arange(len(rows), device=dev)[:, None].expand(-1, width)[used]
        slots, readers = slots[used], readers[used]
        ps = st.page_size
        pages = torch.div(slots, ps, rounding_mode="floor")
        upto = slots - pages * ps + 1
        if not bool(st.ledger.any_stale(pages, readers, upto)):
            return
        if not granted:
            reports = st.ledger.read(pages, readers, upto)
            self._stale.report(reports, node=st.name, role=st.role, dedupe=True)
            return
        # a granted read is checked as its owner's: report it as the row's request's
        stale = st.ledger.stale_mask(pages, readers, upto)
        for i in which[stale].unique().tolist():
            mine = stale & (which == i)
            reports = st.ledger.read(pages[mine], readers[mine], upto[mine])
            h = handles[i]
            self._stale.report(
                reports,
                node=st.name,
                role=st.role,
                dedupe=True,
                reader=(h, *self._request_names(h)),
            )

    def _flush_reuse(self, st: _Node) -> None:
        step = self.counters["reads_checked"]
        if self._reporter.page_reuse(node=st.name, role=st.role, step=step, counts=st.reuse):
            st.reuse = [0, 0, 0]

    # -- hooks: disaggregation ---------------------------------------------------------------

    def _on_transfer_init(self, obj: Any, *args: Any, **kwargs: Any) -> None:
        room = kwargs.get("bootstrap_room", args[2] if len(args) > 2 else None)
        obj.__dict__["_kvwatch_room"] = room

    def _on_metadata(self, receiver: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        """Before the receiver tells prefill where to write: the decode pages of the room.
        Where the sender is another process, the pages are kept on the receiver itself (a
        second receiver of the same room, SGLang's health checks' room 0, must not settle
        them) and each gets an arrival mark (see :meth:`_on_poll`), painted, and on CUDA
        synchronised, before prefill can know the page exists."""
        room = receiver.__dict__.get("_kvwatch_room")
        if room is None:
            return
        pages = torch.as_tensor(kv_indices if hasattr(kv_indices, "shape") else list(kv_indices))
        pages = pages.reshape(-1).long()
        self._room(room).dst_pages = pages
        dst = self._node_by_role("decode")
        if dst is None or self._node_by_role("prefill") is not None:
            return  # both halves here: the sender's hook moves the ledger's pages
        handle = self._by_room.get(room)
        if handle is None:
            return
        marked = False
        if not self._reported(handle):
            pass  # SGLang's own health checks and warm-up: nothing real is sent to them
        elif _markable(receiver, dst.kv_pool, kwargs):
            marked = _paint_arrival_marks(dst.kv_pool, pages, dst.page_size)
        if not marked and self._reported(handle):
            self.counters["arrivals_unchecked"] += 1
        receiver.__dict__[_ARRIVALS] = (handle, pages, marked)

    def _on_poll(self, receiver: Any, result: Any, *args: Any, **kwargs: Any) -> None:
        """After a receiver's poll: once the transfer has concluded, what arrived.

        SGLang's decode side learns only that prefill says the transfer is done (Success),
        not which pages prefill wrote: an aborted prefill that still signals success (the
        incident's SGLang before 0.5.22) leaves decode pages holding what they held before.
        So each announced page carries an arrival mark (the canary sentinel in its first
        slot's first K element of the first layer); a transfer overwrites whole pages, so a
        page whose mark is gone arrived, and is recorded as written by the request; a page
        still marked did not, and decode's reads of it are stale reads naming the page's
        previous writer. Unmarked pages (see :func:`_markable`; SGLang's own health checks
        and warm-up, whose fake transfers send nothing) count as arrived on Success
        (``counters["arrivals_unchecked"]`` counts the real requests among them)."""
        if result != _POLL_SUCCESS and result != _POLL_FAILED:
            return
        arrivals = receiver.__dict__.pop(_ARRIVALS, None)  # settled once
        dst = self._node_by_role("decode")
        if arrivals is None or dst is None:
            return
        handle, pages, marked = arrivals
        if result != _POLL_SUCCESS or pages.numel() == 0:
            return
        if marked:
            missing = _arrival_marks_left(dst.kv_pool, pages, dst.page_size)
            self.counters["pages_not_arrived"] += int(missing.sum())
            pages = pages[~missing]
        pages = pages.to(dst.ledger.device)
        pages = pages[dst.ledger.owner_of(pages) == handle]
        # TEST ONLY: the control's writes are lost
        if pages.numel() and self._registry.lost != handle:
            dst.ledger.write(pages, handle)

    def _on_send(self, sender: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        room = sender.__dict__.get("_kvwatch_room", getattr(sender, "bootstrap_room", None))
        handle = self._by_room.get(room) if room is not None else None
        src_pages = torch.as_tensor(kv_indices).reshape(-1).long()
        n = int(src_pages.numel())
        src = self._node_by_role("prefill")
        dst = self._node_by_role("decode")
        state = self._room(room) if room is not None else _Room()
        offset, state.sent = state.sent, state.sent + n
        rid, tenant = self._request_names(handle)
        # send(kv_indices, state_indices=None, num_kv_tokens=None): args from state_indices
        num_tokens = kwargs.get("num_kv_tokens", args[1] if len(args) > 1 else None)
        ps = src.page_size if src is not None else 1
        self.counters["transfers"] += 1
        if self._reported(handle):
            self._reporter.emit(
                KvTransfer,
                request_id=rid,
                tenant=tenant,
                from_node=src.name if src is not None else "prefill",
                to_node=dst.name if dst is not None else "decode",
                pages=n,
                tokens=int(num_tokens) if isinstance(num_tokens, int) else n * ps,
                prefill_rejected=handle in self._rejected,
            )
        if handle is None or src is None or dst is None or state.dst_pages is None or n == 0:
            return  # the other side is another process: its probe sees its half
        dst_pages = state.dst_pages[offset : offset + n]
        if dst_pages.numel() != n:
            dst_pages = dst_pages[: min(n, dst_pages.numel())]
            src_pages = src_pages[: dst_pages.numel()]
        reports = src.ledger.transfer(
            src_pages.to(src.ledger.device), dst.ledger, dst_pages.to(dst.ledger.device), handle
        )
        self._stale.report(reports, node=src.name, role=src.role, dedupe=False)

    # -- internals -----------------------------------------------------------------------------

    def _node_by_role(self, role: str) -> _Node | None:
        return next((n for n in self._nodes.values() if n.role == role), None)

    def _node_name(self, role: str) -> str | None:
        st = self._node_by_role(role) or self._node_by_role("both")
        return st.name if st is not None else None

    def _ids(self, handle: int) -> RequestIds:
        """What the request events of ``handle`` name."""
        rid, tenant = self._request_names(handle)
        return RequestIds(rid, tenant, self.model_id)


# The ledger's tenant handles are non-negative: requests of an unknown tenant share this one,
# whose name is "unknown" (never a real tenant's index: tenant names are numbered from 0).
_NO_TENANT: Final = 1 << 40


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never on a CPU build)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[at]


_PROMPT: Final = "_kvwatch_prompt_tokens"


def _note_prompt_length(req: Any, _result: Any, *args: Any, **kwargs: Any) -> None:
    """After ``Req.__init__``: the prompt's length before SGLang may truncate it
    (``--allow-auto-truncate``: ``validate_input_length`` cuts ``origin_input_ids``)."""
    req.__dict__[_PROMPT] = len(getattr(req, "origin_input_ids", ()) or ())


def _prompt_tokens(req: Any) -> int:
    """The request's prompt length as the client sent it."""
    noted = req.__dict__.get(_PROMPT) if hasattr(req, "__dict__") else None
    return int(noted) if noted is not None else len(req.origin_input_ids)


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _fake_transfer(req: Any) -> bool:
    return getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST


def _markable(receiver: Any, kv_pool: Any, kwargs: dict[str, Any]) -> bool:
    """Whether arrival marks can be read back exactly for this receive: KV going straight
    into the device pool (not a host destination; not through staging buffers, whose
    scatter into the pool may finish after the poll says Success) of a pool whose first
    axis is token slots (``nhd``: not ``hnd`` or ``vectorized_5d``, indexed by page)."""
    destination = kwargs.get("destination")
    if destination is not None and str(getattr(destination, "value", destination)) != "device":
        return False
    if getattr(getattr(receiver, "kv_mgr", None), "enable_staging", False):
        return False
    return getattr(kv_pool, "kv_cache_layout", "nhd") == "nhd"


def _first_k_buffer(kv_pool: Any) -> Tensor | None:
    buffers = getattr(kv_pool, "k_buffer", None)
    first = buffers[0] if buffers else None
    return first if isinstance(first, Tensor) and first.dtype.is_floating_point else None


def _paint_arrival_marks(kv_pool: Any, pages: Tensor, page_size: int) -> bool:
    """Write the canary sentinel into the first K element of each page's first slot, first
    layer; False if the pool has no such buffer (nothing painted)."""
    k = _first_k_buffer(kv_pool)
    if k is None or pages.numel() == 0:
        return k is not None
    k[_first_elements(k, pages * page_size)] = SENTINEL
    if k.is_cuda:
        # the write must land before prefill, told by the caller, can write the page (an
        # RDMA write is not ordered with this device's streams)
        torch.cuda.current_stream(k.device).synchronize()
    return True


def _arrival_marks_left(kv_pool: Any, pages: Tensor, page_size: int) -> Tensor:
    """Per page, whether its arrival mark is still there (nothing overwrote the page)."""
    k = _first_k_buffer(kv_pool)
    if k is None:
        return torch.zeros(pages.shape, dtype=torch.bool)
    return (k[_first_elements(k, pages * page_size)] == SENTINEL).cpu()


def _first_elements(k: Tensor, slots: Tensor) -> tuple[Tensor | int, ...]:
    """The index of the first element of each of ``slots``' rows in ``k`` (slot-major)."""
    return (slots.to(k.device), *([0] * (k.dim() - 1)))


def _zero_pages(kv_pool: Any, pages: Tensor, page_size: int) -> None:
    """Zero the K and V rows of every slot of ``pages`` in every layer (hardening)."""
    slots = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)
    for buffers in (getattr(kv_pool, "k_buffer", None), getattr(kv_pool, "v_buffer", None)):
        for buf in buffers or ():
            buf[slots.to(buf.device)] = 0


def _limit_from(message: str) -> int | None:
    """The limit SGLang names in its over-length message ("... maximum allowed length (N
    tokens)"), if it names one."""
    marker = "maximum allowed length ("
    at = message.find(marker)
    if at < 0:
        return None
    digits = message[at + len(marker) :].split(" ", 1)[0]
    return int(digits) if digits.isdigit() else None


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


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
