"""The SGLang adapter's hooks: what patches SGLang (the given instances, and class-wide the
transfer classes and the attention backend base class, once per adapter; all undone by
:meth:`SGLangHooks.detach`) and reads SGLang's objects into the plain values and tensors
:class:`~engine_probe.adapters.sglang.bookkeeping.PoolTracker` keeps. None touches the host
while a CUDA graph is captured.

* ``ReqToTokenPool.alloc(reqs)``: a request gets a row → it is known (request id, tenant,
  bootstrap room); ``request.admitted`` on a prefill (or non-disaggregated) node.
* allocator ``alloc``/``alloc_extend``/``alloc_decode``: the pages handed out ("fresh").
* ``ReqToTokenPool.write((row, cols), slots)`` and, for extend, the module function
  ``write_cache_indices`` (its Triton kernel never calls ``write``: the rows are read back):
  slots bound to the row's request (see the bookkeeping's ``bind``).
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
  written only the pages whose mark is gone (:meth:`SGLangHooks._on_poll`).
* ``Req.set_finish_with_abort`` (class-wide): ``request.rejected`` with the prompt length
  before SGLang swaps the prompt for its one-token placeholder.

Every hook runs SGLang's own call whatever the adapter does, and never changes what it
returns; the adapter's work runs under a :class:`~engine_probe.adapters.guard.HookGuard`
(an exception is logged and counted in ``counters["hook_errors"]``, never raised into
SGLang).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import Tensor

from engine_probe.adapters.guard import HookGuard
from engine_probe.adapters.sglang.bookkeeping import NewRequest, Pool
from engine_probe.adapters.sglang.errors import NotAttachableError
from engine_probe.canary import SENTINEL

if TYPE_CHECKING:
    from engine_probe.adapters.sglang.adapter import SGLangAdapter

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "HEALTH_CHECK_PREFIX",
    "SGLangHooks",
    "attachable_kv_pool",
    "default_tenant_of",
    "engine_config",
]

log = logging.getLogger("engine_probe.sglang")  # its name before the move: log filters use it

_MARK: Final = "__kvwatch_wrapped__"
#: the rid prefix of SGLang's own health-check generations (``sglang.srt.constants``)
HEALTH_CHECK_PREFIX: Final = "HEALTH_CHECK"
#: the bootstrap host of SGLang's fake transfers (health checks, warm-up; ``disaggregation.
#: utils.FAKE_BOOTSTRAP_HOST``): nothing is sent to them
FAKE_BOOTSTRAP_HOST: Final = "2.2.2.2"
#: where a transfer object keeps its bootstrap room (from its ``__init__``)
_ROOM: Final = "_kvwatch_room"
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


def attachable_kv_pool(req_to_token_pool: Any, allocator: Any) -> Any:
    """The allocator's KV pool, once the objects are the SGLang classes the hooks wrap
    (:class:`NotAttachableError` if not)."""
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
    return kv_pool


def engine_config(
    req_to_token_pool: Any, kv_pool: Any, advertised_context: int | None
) -> dict[str, Any]:
    """The ``engine.config`` fields SGLang's objects decide (the pool's are the adapter's):
    version, advertised context (else the request table's width), dtype."""
    context = advertised_context or int(req_to_token_pool.req_to_token.shape[1])
    return {
        "engine": "sglang",
        "engine_version": _sglang_version(),
        "advertised_context": max(1, context),
        "dtype": str(getattr(kv_pool, "dtype", "unknown")).removeprefix("torch."),
    }


@dataclass(eq=False)
class _Node:
    """One watched node's SGLang objects (its KV pool and request table), beside the
    bookkeeping's :class:`~engine_probe.adapters.sglang.bookkeeping.Pool`."""

    pool: Pool
    r2t: Any
    allocator: Any
    kv_pool: Any
    first_layer: int
    #: inside ``write_cache_indices``: its own hook binds the batch, not ``write``
    batch_binding: bool = False
    #: eager forwards seen, and when the pool was last sampled (``time.monotonic``)
    forwards: int = 0
    sampled_at: float = 0.0


class SGLangHooks:
    """The wrappers on SGLang's objects and classes for one adapter, and what they read.

    Invariants: each class-wide method is wrapped once (a wrapper is marked, and a marked
    method is left alone); with ``outermost``, only the outermost of nested calls of one
    wrapped method on one object (an override calling its base's through ``super()``) runs
    the hooks, per thread; :meth:`detach` undoes every wrapping, last first."""

    def __init__(self, adapter: SGLangAdapter) -> None:
        self.adapter = adapter
        self._guard = HookGuard(
            adapter.counters, "hook_errors", log, "kvwatch SGLang hook %s failed"
        )
        self._nodes: dict[int, _Node] = {}  # id(req_to_token_pool) -> node
        self._restore: list[Callable[[], None]] = []
        self._calls = threading.local()  # per thread: the outermost wrapped calls running
        self._class_hooks = False

    # -- nodes -----------------------------------------------------------------------------

    def node_of(self, req_to_token_pool: Any) -> _Node | None:
        return self._nodes.get(id(req_to_token_pool))

    def node_named(self, name: str) -> _Node | None:
        return next((n for n in self._nodes.values() if n.pool.name == name), None)

    def watch(self, pool: Pool, req_to_token_pool: Any, allocator: Any, kv_pool: Any) -> None:
        """Hook one node's request table, allocator and KV pool, kept by ``pool`` (and,
        the first time, the classes)."""
        st = _Node(
            pool=pool,
            r2t=req_to_token_pool,
            allocator=allocator,
            kv_pool=kv_pool,
            first_layer=int(getattr(kv_pool, "start_layer", 0) or 0),
        )
        self._nodes[id(req_to_token_pool)] = st
        self._hook_node(st)
        self._install_class_hooks()

    def sample_all(self) -> None:
        for st in list(self._nodes.values()):
            self._sample(st)

    def _sample(self, st: _Node, now: float | None = None) -> None:
        st.sampled_at = time.monotonic() if now is None else now
        self.adapter.sample(st.pool, int(st.allocator.size), int(st.allocator.available_size()))

    def detach(self) -> None:
        """Undo every hook (instances and classes)."""
        while self._restore:
            self._restore.pop()()
        self._class_hooks = False

    # -- installation ----------------------------------------------------------------------

    def _wrap_instance(self, obj: Any, name: str, after: Callable[..., None]) -> None:
        """``obj.name(*a, **k)`` runs SGLang's method, then ``after(result, *a, **k)``."""
        original = getattr(obj, name)
        hooks = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            with hooks._guard.at(name):
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
        hooks = self

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if outermost:
                calls: set[tuple[int, str]] = hooks._calls.__dict__.setdefault("on", set())
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
                with hooks._guard.at(name):
                    before(obj, *args, **kwargs)
            result = original(obj, *args, **kwargs)
            if after is not None:
                with hooks._guard.at(name):
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
                    allocator, name, lambda out, *_a, **_k: self.adapter.handed_out(st.pool, out)
                )
        if st.pool.page_size > 1 and hasattr(allocator, "_release_page_ids"):
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
        hooks = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                with hooks._guard.at(name):
                    before(*args, **kwargs)
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                if after is not None:
                    with hooks._guard.at(name):
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

    # -- requests --------------------------------------------------------------------------

    def _handle(self, req: Any) -> int:
        """The request's handle (see the bookkeeping's ``handle``)."""
        rid = _rid(req)
        return self.adapter.handle(
            rid, getattr(req, "bootstrap_room", None), lambda: self._describe(req, rid)
        )

    def _describe(self, req: Any, rid: str) -> NewRequest:
        return NewRequest(
            tenant=self.adapter.tenant_of(req),
            internal=rid.startswith(HEALTH_CHECK_PREFIX) or _fake_transfer(req),
            salted=bool(getattr(req, "cache_salt", None)),
        )

    def _on_rows(self, st: _Node, rows: list[int] | None, reqs: list[Any]) -> None:
        if rows is None:
            return
        adapter = self.adapter
        for row, req in zip(rows, reqs, strict=True):
            new = not adapter.knows(_rid(req))
            handle = self._handle(req)
            adapter.row_taken(st.pool, int(row), handle)
            if new:
                sp = getattr(req, "sampling_params", None)
                adapter.admitted(
                    st.pool, handle, _prompt_tokens(req), getattr(sp, "max_new_tokens", None)
                )

    def _on_abort(self, req: Any, error_msg: str = "", *args: Any, **kwargs: Any) -> None:
        """Before SGLang swaps the prompt for one token: the request's real length."""
        handle = self._handle(req)
        too_long = "exceeds" in error_msg or "longer" in error_msg
        self.adapter.rejected(
            handle,
            reason="pool_exhausted" if too_long else "other",
            prompt_tokens=_prompt_tokens(req),
            limit_tokens=_limit_from(error_msg),
        )

    def _on_finished(self, st: _Node, req: Any) -> None:
        """A row given back: finished, or retracted (SGLang's ``retract_decode`` releases
        its row and KV; the request comes back under the same handle)."""
        handle = self._handle(req)
        done = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
        rid, room = _rid(req), getattr(req, "bootstrap_room", None)
        if done is None:
            self.adapter.rows_freed(st.pool, handle, rid=rid, room=room, status=None)
            return
        self.adapter.rows_freed(
            st.pool,
            handle,
            rid=rid,
            room=room,
            status=_finish_status(type(done).__name__),
            prompt_tokens=_prompt_tokens(req),
            completion_tokens=len(getattr(req, "output_ids", ())),
        )

    # -- pages -----------------------------------------------------------------------------

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
        self.adapter.bind(st.pool, rows.expand(n), cols.expand(n), slots)

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
            self.adapter.bind(st.pool, torch.cat(rows), torch.cat(cols), torch.cat(slots).long())

    def _on_free(self, st: _Node, index: Tensor) -> None:
        if index.numel() == 0:
            return
        pages = index.reshape(-1).long()
        if st.pool.page_size == 1 or st.allocator.page_size == 1:
            pages = torch.unique(pages)
        pages = pages.to(st.pool.ledger.device)
        zeroize = self.adapter.zeroize_on_free
        if zeroize:
            _zero_pages(st.kv_pool, pages, st.pool.page_size)
        self.adapter.freed(st.pool, pages, zeroize)

    def _on_write(self, st: _Node, layer: Any, loc_info: Any, kwargs: dict[str, Any]) -> None:
        layer_id = kwargs.get("layer_id_override")
        if layer_id is None:
            layer_id = getattr(layer, "layer_id", st.first_layer)
        if layer_id != st.first_layer:
            return  # every layer writes the same slots: account for them once
        if _capturing():
            # inside a CUDA graph capture: a host sync would invalidate it; decode writes
            # are recorded from alloc_for_decode instead (replays run no Python)
            self.adapter.counters["capture_skipped"] += 1
            return
        self.adapter.record_write(st.pool, getattr(loc_info, "loc", loc_info))

    def _on_decode_slots(self, out_cache_loc: Any, batch: Any, *args: Any, **kw: Any) -> None:
        """``alloc_for_decode`` (the scheduler, outside any graph): the slots the decode
        forward will write, recorded now, because a replayed CUDA graph runs no hook."""
        st = self._nodes.get(id(getattr(batch, "req_to_token_pool", None)))
        if st is not None:
            self.adapter.record_write(st.pool, out_cache_loc)
            # a replayed CUDA graph's forward runs no hook: decode's samples come from here
            now = time.monotonic()
            if now - st.sampled_at >= self.adapter.pool_sample_interval_s:
                self._sample(st, now)

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
        adapter = self.adapter
        if _capturing():
            adapter.counters["capture_skipped"] += 1
            return  # the check syncs with the host: it would invalidate the capture
        mode = getattr(batch, "forward_mode", None)
        if mode is not None and mode.is_idle():
            return
        st.forwards += 1
        now = time.monotonic()
        if (
            st.forwards % adapter.pool_sample_every == 0
            or now - st.sampled_at >= adapter.pool_sample_interval_s
        ):
            self._sample(st, now)
        adapter.check_reads(st.pool.name, batch.req_pool_indices, batch.seq_lens)

    # -- disaggregation --------------------------------------------------------------------

    def _on_transfer_init(self, obj: Any, *args: Any, **kwargs: Any) -> None:
        room = kwargs.get("bootstrap_room", args[2] if len(args) > 2 else None)
        obj.__dict__[_ROOM] = room

    def _on_metadata(self, receiver: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        """Before the receiver tells prefill where to write: the decode pages of the room.
        Where the sender is another process, the pages are kept on the receiver itself (a
        second receiver of the same room, SGLang's health checks' room 0, must not settle
        them) and each gets an arrival mark (see :meth:`_on_poll`), painted, and on CUDA
        synchronised, before prefill can know the page exists."""
        room = receiver.__dict__.get(_ROOM)
        if room is None:
            return
        pages = torch.as_tensor(kv_indices if hasattr(kv_indices, "shape") else list(kv_indices))
        pages = pages.reshape(-1).long()
        adapter = self.adapter
        handle = adapter.announced(room, pages)
        dst = self._node_by_role("decode")
        if handle is None or dst is None:
            return
        marked = False
        reported = adapter.reported(handle)
        if not reported:
            pass  # SGLang's own health checks and warm-up: nothing real is sent to them
        elif _markable(receiver, dst.kv_pool, kwargs):
            marked = _paint_arrival_marks(dst.kv_pool, pages, dst.pool.page_size)
        if not marked and reported:
            adapter.counters["arrivals_unchecked"] += 1
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
            missing = _arrival_marks_left(dst.kv_pool, pages, dst.pool.page_size)
            self.adapter.counters["pages_not_arrived"] += int(missing.sum())
            pages = pages[~missing]
        self.adapter.arrived(dst.pool, handle, pages)

    def _on_send(self, sender: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        room = sender.__dict__.get(_ROOM, getattr(sender, "bootstrap_room", None))
        src_pages = torch.as_tensor(kv_indices).reshape(-1).long()
        # send(kv_indices, state_indices=None, num_kv_tokens=None): args from state_indices
        num_tokens = kwargs.get("num_kv_tokens", args[1] if len(args) > 1 else None)
        self.adapter.sent(room, src_pages, num_tokens if isinstance(num_tokens, int) else None)

    def _node_by_role(self, role: str) -> _Node | None:
        return next((n for n in self._nodes.values() if n.pool.role == role), None)


def _rid(req: Any) -> str:
    return str(getattr(req, "rid", "") or f"anon-{id(req)}")


def _finish_status(reason: str) -> str:
    """The wire's finish status of SGLang's finish reason (its class name)."""
    return "aborted" if "ABORT" in reason else "length" if "LENGTH" in reason else "completed"


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
