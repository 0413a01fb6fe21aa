"""The SGLang adapter's bookkeeping: requests, tenants, request rows, KV pools → page
ledgers → events, from plain values and tensors (:mod:`~engine_probe.adapters.sglang.hooks`
reads them out of SGLang's objects; nothing here imports SGLang or reads its objects).

Page mapping. SGLang addresses KV by *token slot* (``out_cache_loc``; ``req_to_token`` rows
hold slots). A paged allocator hands out whole pages of ``page_size`` slots (slot = page *
page_size + offset); a token allocator is the same with ``page_size == 1``. One
:class:`~engine_probe.ledger.PageLedger` per KV pool (:class:`Pool`), with **ledger page =
SGLang page** and **ledger slot = the token's offset in its page**, ``num_pages = size //
page_size + 1`` (slots ``[0, size + page_size)``: SGLang keeps slot 0 / page 0 as the padding
target). So a disaggregation transfer, which SGLang addresses in pages, maps page for page.

Ownership comes from the request rows: SGLang's allocators never learn which request a slot
is for. A page handed out by the allocator (or one the ledger holds free) becomes the own of
the request whose row it is bound into; a page another request owns, bound into a row, is a
grant (a radix-cache prefix): the row's reads of it are checked as its owner's
(:meth:`PoolTracker.bind`). Writes are recorded by the pages' owners; a batch's reads,
``req_to_token[row, :seq_len]`` for every row, are checked in one ledger call
(:meth:`PoolTracker.check_batch`).

Disaggregation, by bootstrap room: the receiver announces the decode pages, the sender sends
the prefill pages of each chunk; within one process each chunk is a ``kv.transfer`` and a
ledger transfer of exactly the pages sent. Where the sender is another process, both sides
name the request ``pd-<room>`` (the id they share), and the decode side records as written
only the pages the hooks found arrived (:meth:`PoolTracker.arrived`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final, Literal

import torch
from torch import Tensor

from engine_probe.adapters.common import UNKNOWN, StaleReadEmitter, safe_id
from engine_probe.adapters.registry import Bounded, RequestRegistry
from engine_probe.adapters.reporting import Reporter, Reporting, RequestIds
from engine_probe.events import KvTransfer, PoolSample
from engine_probe.ledger import PageLedger
from engine_probe.probe import BaseProbe

__all__ = ["NewRequest", "Pool", "PoolTracker", "Role"]

Role = Literal["prefill", "decode", "both"]

# The ledger's tenant handles are non-negative: requests of an unknown tenant share this one,
# whose name is "unknown" (never a real tenant's index: tenant names are numbered from 0).
_NO_TENANT: Final = 1 << 40


@dataclass
class Pool:
    """One watched KV pool and its request table's rows: a prefill, decode or monolithic
    node."""

    name: str
    role: Role
    ledger: PageLedger
    page_size: int
    rows: dict[int, int] = field(default_factory=dict)  # req_to_token row -> request handle
    reuse: list[int] = field(default_factory=lambda: [0, 0, 0])
    #: per page: handed out by the allocator and not bound to a row since (only such a
    #: page, or one the ledger holds free, becomes the binding request's own)
    fresh: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    #: row -> per column, the handle whose write a read of that column is checked as (a
    #: radix-cache prefix bound into the row: the page's owner), or -1 (the row's request)
    grants: dict[int, Tensor] = field(default_factory=dict)


@dataclass
class _Room:
    """One disaggregated transfer within this process, by bootstrap room: the decode pages
    announced by the receiver and how many pages the sender has sent so far."""

    dst_pages: Tensor | None = None
    sent: int = 0


@dataclass(frozen=True, slots=True)
class NewRequest:
    """What registering a request needs beyond its id and room."""

    #: the tenant as the engine names it (made a wire id here), None if unknown
    tenant: str | None
    #: one of the engine's own (a health check, a warm-up's fake transfer): its pages are
    #: tracked, its own events are not sent (see :meth:`PoolTracker.reported`)
    internal: bool
    #: it carried a cache salt (SGLang keys its radix cache by it)
    salted: bool


class PoolTracker(Reporting):
    """Feeds SGLang's KV bookkeeping, as the hooks read it, into one ledger per watched
    pool and emits kvwatch events through ``probe`` (default: the process's probe).

    Invariants: a request handle is stable per request id across pools while the request is
    not finished (so a transfer from the prefill pool to the decode pool is one request on
    both sides) and never reused; every map kept per request or room is bounded
    (``request_capacity``, oldest out first: a request whose decode side is another process
    never finishes here). Registering a request is atomic (``_lock``): SGLang's transfer
    threads call hooks too.
    """

    def __init__(
        self,
        probe: BaseProbe | None,
        *,
        deployment_id: str | None,
        model_id: str,
        request_capacity: int,
        test_lose_kv_write_of_tenant: str | None,
    ) -> None:
        # Request handles (never reused: two requests never look like one to a ledger), the
        # names a stale read may still report after the request finished, and the tenants
        # (clients' strings, SGLang's extra_key may be a random salt per request: an evicted
        # tenant is interned again under a new handle); bounded, oldest out first. TEST ONLY
        # (the plugin's KVWATCH_TEST_FAULT_INJECTION, engine_probe.adapters.common): the
        # first request of test_lose_kv_write_of_tenant gets its KV writes left out of the
        # ledger, a stale read to be caught (the positive control of the live tests).
        self._registry = RequestRegistry(request_capacity, test_lose_kv_write_of_tenant)
        self.model_id = model_id
        self._lock = threading.RLock()
        self._pools: list[Pool] = []  # in the order watched
        # request id -> handle, of the requests not finished yet (dropped when the last node
        # here finishes one)
        self._handles: Bounded[str, int] = Bounded(request_capacity)
        # Bounded: a request that never finishes here (its decode node is another process)
        # must not grow them forever; the oldest entries go first.
        self._by_room: Bounded[Hashable, int] = Bounded(request_capacity)  # room -> handle
        self._rejected: Bounded[int, None] = Bounded(request_capacity)  # aborted at intake
        self._health_checks: Bounded[int, None] = Bounded(request_capacity)
        # the requests that carried a cache_salt (SGLang keys its radix cache by it)
        self._salted: Bounded[int, None] = Bounded(request_capacity)
        self._rooms: Bounded[Hashable, _Room] = Bounded(request_capacity)
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
        self._stale = StaleReadEmitter(
            self._reporter.emit, self.counters, self._registry.names, self._registry.tenants.name
        )

    # -- public ----------------------------------------------------------------------------

    @property
    def ledgers(self) -> dict[str, PageLedger]:
        return {p.name: p.ledger for p in self._pools}

    # -- pools -----------------------------------------------------------------------------

    def add_pool(
        self, name: str, role: Role, *, device: torch.device | str, size: int, page_size: int
    ) -> Pool:
        """A pool of ``size`` slots in pages of ``page_size``, its ledger on ``device``."""
        pages = size // page_size + 1
        ledger = PageLedger(pages, device=device, name=name, page_size=page_size)
        pool = Pool(
            name=name,
            role=role,
            ledger=ledger,
            page_size=page_size,
            fresh=torch.zeros(pages, dtype=torch.bool, device=ledger.device),
        )
        self._pools.append(pool)
        return pool

    def sample(self, pool: Pool, capacity: int, free: int) -> None:
        """One ``pool.sample``: ``free`` of ``capacity`` slots free."""
        free = min(capacity, free)
        self._reporter.emit(
            PoolSample,
            node=pool.name,
            role=pool.role,
            capacity_tokens=capacity,
            used_tokens=capacity - free,
            free_tokens=free,
        )

    # -- requests --------------------------------------------------------------------------

    def knows(self, rid: str) -> bool:
        """Whether request ``rid`` has a handle (admitted here and not finished)."""
        return rid in self._handles

    def handle(self, rid: str, room: Hashable, describe: Callable[[], NewRequest]) -> int:
        """The handle of request ``rid`` (stable while it is not finished; never reused),
        registered with what ``describe`` says of it if it is new; ``room``: its bootstrap
        room (an int, where it has one), which pairs its transfers."""
        with self._lock:
            handle = self._handles.get(rid)
            if handle is None:
                new = describe()
                tenant = new.tenant
                handle = self._registry.add(
                    self._wire_id(rid, room, new.internal),
                    None if tenant is None else safe_id(tenant, "tenant"),
                )
                self._handles[rid] = handle
                if new.internal:
                    self._health_checks[handle] = None
                if new.salted:
                    self._salted[handle] = None
            if isinstance(room, int):
                self._by_room[room] = handle
            return handle

    def reported(self, handle: int | None) -> bool:
        """Whether the request's own events (admitted, finished, rejected, transfers) are
        sent: not for SGLang's health checks (``/health`` runs a one-token generation every
        few seconds on each server) nor its start-up warm-up (a fake transfer); their pages
        are still tracked in the ledger."""
        return handle is None or handle not in self._health_checks

    def row_taken(self, pool: Pool, row: int, handle: int) -> None:
        """``handle``'s request got ``row`` of ``pool``'s request table."""
        pool.rows[row] = handle
        pool.grants.pop(row, None)

    def admitted(self, pool: Pool, handle: int, prompt_tokens: int, max_tokens: int | None) -> None:
        """A request new here took a row: admitted, where its prompt is (not on decode)."""
        if pool.role != "decode" and self.reported(handle):
            self._reporter.admitted(
                self._ids(handle),
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                node=pool.name,
            )

    def rejected(
        self, handle: int, *, reason: str, prompt_tokens: int, limit_tokens: int | None
    ) -> None:
        """The request was refused at intake (its finish reports it aborted)."""
        self._rejected[handle] = None
        if not self.reported(handle):
            return
        self._reporter.rejected(
            self._ids(handle),
            reason=reason,
            prompt_tokens=prompt_tokens,
            limit_tokens=limit_tokens,
            node=self._pool_name("prefill"),
        )

    def rows_freed(
        self,
        pool: Pool,
        handle: int,
        *,
        rid: str,
        room: Hashable,
        status: str | None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        """``handle``'s rows of ``pool`` given back. Only a finished request (``status``, the
        wire's) finishes: a retracted one (None: SGLang's ``retract_decode`` releases its
        row and KV) comes back under the same handle."""
        for row, h in list(pool.rows.items()):
            if h == handle:
                del pool.rows[row]
                pool.grants.pop(row, None)
        if status is None:
            return  # retracted, not finished
        if pool.role == "prefill" and self._pool_by_role("decode") is not None:
            return  # the request finishes on its decode node, watched here too
        rejected = handle in self._rejected
        health_check = not self.reported(handle)
        self._stale.forget(handle)
        self._forget(handle, room)
        if self._handles.get(rid) == handle:
            del self._handles[rid]
        if pool.role == "prefill" or health_check:
            return  # the request finishes on its decode node (another process)
        self._reporter.finished(
            self._ids(handle),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            status="aborted" if rejected else status,
            node=pool.name,
        )

    # -- pages -----------------------------------------------------------------------------

    def handed_out(self, pool: Pool, slots: object) -> None:
        """The allocator handed out ``slots``: their pages may become a request's own when
        bound to its row (see :meth:`bind`)."""
        if isinstance(slots, Tensor) and slots.numel():
            pages = torch.div(slots.reshape(-1).long(), pool.page_size, rounding_mode="floor")
            pool.fresh[pages.to(pool.fresh.device)] = True

    def bind(self, st: Pool, rows: Tensor, cols: Tensor, slots: Tensor) -> None:
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

    def freed(self, pool: Pool, pages: Tensor, zeroized: bool) -> None:
        """The allocator freed ``pages`` (``zeroized``: their K/V rows zeroed first)."""
        pool.ledger.free(pages.to(pool.ledger.device), zeroized=zeroized)

    def record_write(self, st: Pool, loc: object) -> None:
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

    def check_batch(
        self, st: Pool, table: Tensor, req_pool_indices: Tensor, seq_lens: Tensor
    ) -> None:
        """Check that each row's request read only what it wrote: slots ``table[row,
        :seq_len]`` (``table``: the pool's ``req_to_token``; what attention gathers for the
        row). Emits the step's ``page.reuse`` and any ``page.stale_read``.

        Vectorised over the batch: every token read is one (page, reader, upto) triple, so
        the check is one ledger call and one host sync (plus reading the rows and the
        longest length); only a stale read costs more (the report)."""
        self._flush_reuse(st)
        rows = req_pool_indices.reshape(-1).tolist()
        handles = [st.rows.get(int(r), -1) for r in rows]
        if not rows or max(handles) < 0:
            return
        self.counters["reads_checked"] += sum(h >= 0 for h in handles)
        dev = st.ledger.device
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

    # -- disaggregation --------------------------------------------------------------------

    def announced(self, room: Hashable, pages: Tensor) -> int | None:
        """The receiver of ``room`` announced the decode ``pages`` it will receive into. The
        handle of the room's request when its sender is another process (this one holds the
        decode pool and not the prefill one): the hooks then check which pages arrive (see
        :meth:`arrived`); else None (both halves here: the sender's hook moves the ledger's
        pages)."""
        self._room(room).dst_pages = pages
        dst = self._pool_by_role("decode")
        if dst is None or self._pool_by_role("prefill") is not None:
            return None
        return self._by_room.get(room)

    def arrived(self, dst: Pool, handle: int, pages: Tensor) -> None:
        """``pages`` of the decode pool ``dst``, announced for ``handle``, were overwritten
        by the transfer: written by the request (those it still owns)."""
        pages = pages.to(dst.ledger.device)
        pages = pages[dst.ledger.owner_of(pages) == handle]
        # TEST ONLY: the control's writes are lost
        if pages.numel() and self._registry.lost != handle:
            dst.ledger.write(pages, handle)

    def sent(self, room: Hashable, src_pages: Tensor, num_tokens: int | None) -> None:
        """The sender of ``room`` sent the prefill ``src_pages`` (``num_tokens`` tokens,
        where it says): the next chunk of the decode pages the receiver announced."""
        handle = self._by_room.get(room) if room is not None else None
        n = int(src_pages.numel())
        src = self._pool_by_role("prefill")
        dst = self._pool_by_role("decode")
        state = self._room(room) if room is not None else _Room()
        offset, state.sent = state.sent, state.sent + n
        rid, tenant = self._request_names(handle)
        ps = src.page_size if src is not None else 1
        self.counters["transfers"] += 1
        if self.reported(handle):
            self._reporter.emit(
                KvTransfer,
                request_id=rid,
                tenant=tenant,
                from_node=src.name if src is not None else "prefill",
                to_node=dst.name if dst is not None else "decode",
                pages=n,
                tokens=int(num_tokens) if num_tokens is not None else n * ps,
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

    # -- internals -------------------------------------------------------------------------

    def _wire_id(self, rid: str, room: Hashable, internal: bool) -> str:
        """The request id the events carry. SGLang's prefill and decode servers each name a
        request with an id of their own; what both share is the bootstrap room the router
        gives it. So where this process holds only one side of a disaggregated pair, the
        request is ``pd-<room>`` on both sides and the collector joins its halves into one
        request; elsewhere it is SGLang's ``rid``."""
        roles = {p.role for p in self._pools}
        split = bool(roles & {"prefill", "decode"}) and not {"prefill", "decode"} <= roles
        if split and isinstance(room, int) and not internal:
            return f"pd-{room}"
        return safe_id(rid, "req")

    def _request_names(self, handle: int | None) -> tuple[str, str]:
        return (UNKNOWN, UNKNOWN) if handle is None else self._registry.names(handle)

    def _tenant_of_handle(self, handle: int) -> int:
        """The ledger tenant of a request handle (unknown tenants share ``_NO_TENANT``)."""
        tenant = self._registry.tenant_handle(handle)
        return tenant if tenant >= 0 else _NO_TENANT

    def _ids(self, handle: int) -> RequestIds:
        """What the request events of ``handle`` name."""
        rid, tenant = self._request_names(handle)
        return RequestIds(rid, tenant, self.model_id)

    def _report_hits(self, st: Pool, row: int, owners: Tensor, pages: Tensor) -> None:
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

    def _flush_reuse(self, st: Pool) -> None:
        step = self.counters["reads_checked"]
        if self._reporter.page_reuse(node=st.name, role=st.role, step=step, counts=st.reuse):
            st.reuse = [0, 0, 0]

    def _room(self, room: Hashable) -> _Room:
        state = self._rooms.get(room)
        if state is None:
            state = self._rooms[room] = _Room()
        return state

    def _forget(self, handle: int, room: Hashable) -> None:
        """A request done on its last node: drop what pairs its transfers."""
        self._rejected.pop(handle, None)
        self._health_checks.pop(handle, None)
        self._salted.pop(handle, None)
        if room is not None:
            self._rooms.pop(room, None)
            if self._by_room.get(room) == handle:
                del self._by_room[room]

    def _pool_by_role(self, role: str) -> Pool | None:
        return next((p for p in self._pools if p.role == role), None)

    def _pool_name(self, role: str) -> str | None:
        st = self._pool_by_role(role) or self._pool_by_role("both")
        return st.name if st is not None else None
