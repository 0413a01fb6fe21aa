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
restores everything):

* ``ReqToTokenPool.alloc(reqs)``: a request gets a row → it is known (request id, tenant,
  bootstrap room); ``request.admitted`` on a prefill (or non-disaggregated) node.
* ``ReqToTokenPool.write((row, cols), slots)``: slots bound to the row's request. Pages not
  yet owned by that request are allocated to it in the ledger (ownership comes from the row,
  because SGLang's allocators never learn which request a slot is for).
* ``ReqToTokenPool.free(req)``: ``request.finished``.
* allocator frees (``TokenToKVPoolAllocator.free``; ``PagedTokenToKVPoolAllocator.
  _release_page_ids``, where every paged free ends): pages freed, not zeroized, unless the
  adapter zeroizes them (``zeroize_on_free``: it zeroes the K/V rows itself first).
* ``MHATokenToKVPool.set_kv_buffer``: the slots written (once per forward, on the pool's
  first layer), by the pages' owner.
* ``AttentionBackend.forward`` (class-wide): after the pool's first layer ran, the batch's
  reads, ``req_to_token[row, :seq_len]`` for every row, are checked: a read of a slot its
  reader did not write in this generation is a ``page.stale_read`` naming the previous
  writer.
* ``BaseKVSender``/``BaseKVReceiver`` subclasses (class-wide): the receiver's
  ``send_metadata`` gives the decode pages, the sender's ``send`` the prefill pages of one
  chunk; paired by bootstrap room, each chunk is a ``kv.transfer`` and a ledger transfer of
  exactly the pages sent, so decode pages nobody sent stay unwritten.
* ``Req.set_finish_with_abort`` (class-wide): ``request.rejected`` with the prompt length
  before SGLang swaps the prompt for its one-token placeholder.

Nothing here stores or sends prompt or completion text: only token counts and ids.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import torch
from torch import Tensor

from engine_probe.adapter_common import chunks, safe_id
from engine_probe.events import (
    EngineConfig,
    Event,
    KvTransfer,
    PageReuse,
    PageStaleRead,
    PoolSample,
    RequestAdmitted,
    RequestFinished,
    RequestRejected,
)
from engine_probe.ledger import UNKNOWN_TENANT, PageLedger, StaleRead
from engine_probe.probe import BaseProbe, get_probe
from engine_probe.sglang.errors import NotAttachableError

__all__ = ["SGLangAdapter", "attach", "default_tenant_of"]

log = logging.getLogger("engine_probe.sglang")

Role = Literal["prefill", "decode", "both"]
_UNKNOWN: Final = "unknown"
_MARK: Final = "__kvwatch_wrapped__"
_K = TypeVar("_K")
_V = TypeVar("_V")


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


@dataclass
class _Room:
    """One disaggregated transfer, by bootstrap room: the decode pages announced by the
    receiver and how many pages the sender has sent so far."""

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
    ) -> None:
        self._probe = probe
        self.deployment_id = deployment_id
        self.model_id = model_id
        self.tenant_of = tenant_of
        self.zeroize_on_free = zeroize_on_free
        self._request_capacity = request_capacity
        self._lock = threading.RLock()
        self._nodes: dict[int, _Node] = {}  # id(req_to_token_pool) -> node
        self._handles: OrderedDict[str, int] = OrderedDict()  # request id -> handle
        self._names: dict[int, tuple[str, int]] = {}  # handle -> (wire id, tenant handle)
        self._tenant_handles: dict[str, int] = {}
        self._tenant_names: list[str] = []
        # Bounded: a request that never finishes here (its decode node is another process)
        # must not grow them forever; the oldest entries go first.
        self._by_room: _Bounded[int, int] = _Bounded(request_capacity)  # room -> handle
        self._rejected: _Bounded[int, None] = _Bounded(request_capacity)  # aborted at intake
        self._rooms: _Bounded[int, _Room] = _Bounded(request_capacity)
        self._seen_stale: dict[int, set[tuple[str, int, int | None, bool]]] = {}
        self._restore: list[Callable[[], None]] = []
        self._class_hooks = False
        self.counters: dict[str, int] = {
            "stale_reads": 0,
            "transfers": 0,
            "hook_errors": 0,
            "reads_checked": 0,
        }

    # -- public ----------------------------------------------------------------------------

    @property
    def probe(self) -> BaseProbe:
        return self._probe if self._probe is not None else get_probe()

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
        pool); returns the node's name. Emits ``engine.config`` and a ``pool.sample``."""
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
            )
            self._nodes[id(req_to_token_pool)] = st
            self._hook_node(st)
            self._install_class_hooks()
        context = advertised_context or int(req_to_token_pool.req_to_token.shape[1])
        self._emit(
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
            cap = int(st.allocator.size)
            free = min(cap, int(st.allocator.available_size()))
            self._emit(
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
            with adapter._guard(name):
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
    ) -> None:
        """Wrap ``cls.name`` (as defined on ``cls`` itself) class-wide."""
        original = cls.__dict__.get(name)
        if original is None or getattr(original, _MARK, False):
            return
        adapter = self

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                with adapter._guard(name):
                    before(obj, *args, **kwargs)
            result = original(obj, *args, **kwargs)
            if after is not None:
                with adapter._guard(name):
                    after(obj, result, *args, **kwargs)
            return result

        setattr(wrapper, _MARK, True)
        wrapper.__name__ = name
        wrapper.__doc__ = getattr(original, "__doc__", None)
        setattr(cls, name, wrapper)
        self._restore.append(lambda: setattr(cls, name, original))

    @contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        """A hook's failure must never reach SGLang: log it, count it, go on."""
        try:
            yield
        except Exception:
            self.counters["hook_errors"] += 1
            log.exception("kvwatch SGLang hook %s failed", where)

    def _hook_node(self, st: _Node) -> None:
        r2t, allocator = st.r2t, st.allocator
        self._wrap_instance(r2t, "alloc", lambda rows, reqs: self._on_rows(st, rows, reqs))
        self._wrap_instance(r2t, "write", lambda _r, idx, values: self._on_bind(st, idx, values))
        self._wrap_instance(r2t, "free", lambda _r, req: self._on_finished(st, req))
        if st.page_size > 1 and hasattr(allocator, "_release_page_ids"):
            # every free of a paged allocator (free, free_page_ids, a free group's end)
            # releases through this one method, in page ids
            self._wrap_instance(
                allocator, "_release_page_ids", lambda _r, pages: self._on_free(st, pages)
            )
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
        from sglang.srt.managers.schedule_batch import Req

        self._wrap_class(AttentionBackend, "forward", after=self._on_forward)
        self._wrap_class(Req, "set_finish_with_abort", before=self._on_abort)
        self.watch_transfer_classes()

    def watch_transfer_classes(self, *classes: type) -> None:
        """Hook the disaggregation senders and receivers: ``classes``, or every subclass of
        SGLang's ``BaseKVSender``/``BaseKVReceiver`` imported so far (the fake backend's
        always)."""
        if not classes:
            import sglang.srt.disaggregation.fake.conn  # noqa: F401  (registers subclasses)
            from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender

            classes = (*_subclasses(BaseKVSender), *_subclasses(BaseKVReceiver))
        for cls in classes:
            self._wrap_class(cls, "__init__", before=self._on_transfer_init)
            if "send" in cls.__dict__:
                self._wrap_class(cls, "send", before=self._on_send)
            if "send_metadata" in cls.__dict__:
                self._wrap_class(cls, "send_metadata", before=self._on_metadata)

    # -- hooks: requests -------------------------------------------------------------------

    def _handle(self, req: Any) -> int:
        """The request's handle (stable per request id), remembering its names."""
        rid = str(getattr(req, "rid", "") or f"anon-{id(req)}")
        with self._lock:
            handle = self._handles.get(rid)
            if handle is None:
                handle = len(self._names)
                self._handles[rid] = handle
                while len(self._handles) > self._request_capacity:
                    _, old = self._handles.popitem(last=False)
                    self._names.pop(old, None)
                tenant = self.tenant_of(req)
                self._names[handle] = (safe_id(rid, "req"), self._tenant_handle(tenant))
            room = getattr(req, "bootstrap_room", None)
            if isinstance(room, int):
                self._by_room[room] = handle
            return handle

    def _tenant_handle(self, tenant: str | None) -> int:
        if tenant is None:
            return UNKNOWN_TENANT
        h = self._tenant_handles.get(tenant)
        if h is None:
            h = self._tenant_handles[tenant] = len(self._tenant_names)
            self._tenant_names.append(safe_id(tenant, "tenant"))
        return h

    def _request_names(self, handle: int | None) -> tuple[str, str]:
        if handle is None:
            return _UNKNOWN, _UNKNOWN
        rid, tenant = self._names.get(handle, (f"handle-{handle}", UNKNOWN_TENANT))
        return rid, self._tenant_name(tenant)

    def _tenant_name(self, tenant: int | None) -> str:
        if tenant is None or tenant < 0 or tenant >= len(self._tenant_names):
            return _UNKNOWN
        return self._tenant_names[tenant]

    def _on_rows(self, st: _Node, rows: list[int] | None, reqs: list[Any]) -> None:
        if rows is None:
            return
        for row, req in zip(rows, reqs, strict=True):
            new = getattr(req, "rid", None) not in self._handles
            handle = self._handle(req)
            st.rows[int(row)] = handle
            if new and st.role != "decode":
                rid, tenant = self._request_names(handle)
                sp = getattr(req, "sampling_params", None)
                self._emit(
                    RequestAdmitted,
                    request_id=rid,
                    tenant=tenant,
                    model_id=self.model_id,
                    prompt_tokens=len(req.origin_input_ids),
                    max_tokens=getattr(sp, "max_new_tokens", None),
                    node=st.name,
                )

    def _on_abort(self, req: Any, error_msg: str = "", *args: Any, **kwargs: Any) -> None:
        """Before SGLang swaps the prompt for one token: the request's real length."""
        handle = self._handle(req)
        self._rejected[handle] = None
        rid, tenant = self._request_names(handle)
        prompt = len(req.origin_input_ids)
        too_long = "exceeds" in error_msg or "longer" in error_msg
        self._emit(
            RequestRejected,
            request_id=rid,
            tenant=tenant,
            model_id=self.model_id,
            reason="pool_exhausted" if too_long else "other",
            prompt_tokens=prompt,
            limit_tokens=_limit_from(error_msg),
            node=self._node_name("prefill"),
        )

    def _on_finished(self, st: _Node, req: Any) -> None:
        handle = self._handle(req)
        self._seen_stale.pop(handle, None)
        for row, h in list(st.rows.items()):
            if h == handle:
                del st.rows[row]
        if st.role == "prefill":
            return  # the request finishes on its decode node
        self._forget(handle, getattr(req, "bootstrap_room", None))
        rid, tenant = self._request_names(handle)
        reason = type(getattr(req, "finished_reason", None) or req.to_finish).__name__
        status = (
            "aborted"
            if handle in self._rejected or "ABORT" in reason
            else "length"
            if "LENGTH" in reason
            else "completed"
        )
        self._emit(
            RequestFinished,
            request_id=rid,
            tenant=tenant,
            model_id=self.model_id,
            prompt_tokens=len(req.origin_input_ids),
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
        if room is not None:
            self._rooms.pop(room, None)
            if self._by_room.get(room) == handle:
                del self._by_room[room]

    def _on_bind(self, st: _Node, index: Any, values: Any) -> None:
        """Slots written into request rows: their pages become the row's request's."""
        if not isinstance(values, Tensor) or values.numel() == 0:
            return
        row_index = index[0] if isinstance(index, tuple) else index
        slots = values.reshape(-1).long()
        if isinstance(row_index, int):
            rows = [row_index] * slots.numel()
        else:
            rows_t = torch.as_tensor(row_index).reshape(-1)
            if rows_t.numel() == 1:
                rows = [int(rows_t.item())] * slots.numel()
            else:
                rows = [int(r) for r in rows_t.expand(slots.numel()).tolist()]
        pages = torch.div(slots, st.page_size, rounding_mode="floor").to(st.ledger.device)
        handles = torch.tensor(
            [st.rows.get(r, -1) for r in rows], dtype=torch.long, device=st.ledger.device
        )
        fresh = (handles >= 0) & (st.ledger.owner_of(pages) != handles)
        if not bool(fresh.any()):
            return
        for h in handles[fresh].unique().tolist():
            mine = torch.unique(pages[fresh & (handles == h)])
            _, tenant = self._names.get(h, ("", UNKNOWN_TENANT))
            counts = st.ledger.alloc(mine, h, tenant if tenant >= 0 else _NO_TENANT)
            st.reuse[0] += counts.reused
            st.reuse[1] += counts.cross_tenant
            st.reuse[2] += counts.zeroized

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
        loc = getattr(loc_info, "loc", loc_info)
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
        mode = getattr(batch, "forward_mode", None)
        if mode is not None and mode.is_idle():
            return
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
        readers = torch.tensor(handles, dtype=torch.long, device=dev)[:, None].expand(-1, width)
        used = (torch.arange(width, device=dev)[None, :] < lens[:, None]) & (readers >= 0)
        slots, readers = slots[used], readers[used]
        ps = st.page_size
        pages = torch.div(slots, ps, rounding_mode="floor")
        upto = slots - pages * ps + 1
        if bool(st.ledger.any_stale(pages, readers, upto)):
            self._emit_stale(st, st.ledger.read(pages, readers, upto), dedupe=True)

    def _flush_reuse(self, st: _Node) -> None:
        reused, cross, zeroized = st.reuse
        if reused or zeroized:
            self._emit(
                PageReuse,
                node=st.name,
                role=st.role,
                step=self.counters["reads_checked"],
                reused_pages=reused,
                cross_tenant_pages=cross,
                zeroized_pages=zeroized,
            )
            st.reuse = [0, 0, 0]

    # -- hooks: disaggregation ---------------------------------------------------------------

    def _on_transfer_init(self, obj: Any, *args: Any, **kwargs: Any) -> None:
        room = kwargs.get("bootstrap_room", args[2] if len(args) > 2 else None)
        obj.__dict__["_kvwatch_room"] = room

    def _on_metadata(self, receiver: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        room = receiver.__dict__.get("_kvwatch_room")
        if room is None:
            return
        pages = torch.as_tensor(kv_indices if hasattr(kv_indices, "shape") else list(kv_indices))
        self._room(room).dst_pages = pages.reshape(-1).long()

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
        self._emit(
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
        self._emit_stale(src, reports, dedupe=False)

    # -- internals -----------------------------------------------------------------------------

    def _node_by_role(self, role: str) -> _Node | None:
        return next((n for n in self._nodes.values() if n.role == role), None)

    def _node_name(self, role: str) -> str | None:
        st = self._node_by_role(role) or self._node_by_role("both")
        return st.name if st is not None else None

    def _emit(self, event_type: type[Event], **fields: Any) -> None:
        self.probe.emit(event_type, deployment_id=self.deployment_id, **fields)

    def _emit_stale(self, st: _Node, reports: list[StaleRead], *, dedupe: bool) -> None:
        for r in reports:
            pages = list(dict.fromkeys(r.page_ids))  # a page read by several tokens: once
            if dedupe:
                seen = self._seen_stale.setdefault(r.reader_request, set())
                keys = [(st.name, p, r.previous_request, r.zeroized) for p in pages]
                pages = [p for p, key in zip(pages, keys, strict=True) if key not in seen]
                seen.update(keys)
                if not pages:
                    continue
            self.counters["stale_reads"] += 1
            reader_id, reader_tenant = self._request_names(r.reader_request)
            prev_id = prev_tenant = None
            if r.previous_request is not None:
                prev_id, prev_tenant = self._request_names(r.previous_request)
                if r.previous_tenant is not None and r.previous_tenant >= 0:
                    prev_tenant = self._tenant_name(r.previous_tenant)
            for chunk in chunks(pages):
                self._emit(
                    PageStaleRead,
                    node=st.name,
                    role=st.role,
                    read_kind=r.read_kind,
                    reader_request_id=reader_id,
                    reader_tenant=reader_tenant,
                    page_ids=chunk,
                    previous_request_id=prev_id,
                    previous_tenant=prev_tenant,
                    zeroized=r.zeroized,
                )


# The ledger's tenant handles are non-negative: requests of an unknown tenant share this one,
# whose name is "unknown" (never a real tenant's index: tenant names are numbered from 0).
_NO_TENANT: Final = 1 << 40


class _Bounded(OrderedDict[_K, _V]):
    """A dict that forgets its oldest entries beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key: _K, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


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
