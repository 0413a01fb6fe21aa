"""The page ledger: who owns, and who last wrote, every page of a KV pool.

One :class:`PageLedger` per KV pool, kept as int64 tensors on the pool's own device. The
engine adapter calls it when the engine allocates, writes, frees, transfers and reads pages.
A read is valid only if the reader's own request wrote the page in the page's current
allocation generation; anything else is a *stale read* (:class:`StaleRead`), reported with
the previous writer, i.e. the request and tenant whose KV the reader may have seen.

Every operation is vectorised over tensors of page ids; nothing loops over pages in Python.
The common case of :meth:`PageLedger.read` is one gather, one compare and one reduction,
followed by the one host sync needed to decide whether anything must be reported
(:meth:`PageLedger.stale_mask` skips the sync and the reduction).

This is the only module of ``engine_probe`` that imports torch; nothing in the package
imports it implicitly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import torch
from torch import Tensor

__all__ = [
    "FREE",
    "NEVER",
    "NOBODY",
    "UNKNOWN_TENANT",
    "PageIds",
    "PageLedger",
    "ReuseStats",
    "StaleRead",
]

FREE: Final = -1
"""Owner handle (request and tenant) of a free page."""
NEVER: Final = -1
"""Writer handle of a page never written since the pool was created."""
UNKNOWN_TENANT: Final = -1
"""Tenant of a request this ledger never saw allocate (see ``tenant_capacity``)."""
NOBODY: Final = -(2**63)
"""``valid_for`` of a page no read is valid for: int64's minimum, so that no reader handle
(non-negative; even a stray -1 from padding) can match it, and no guard op is needed."""

ReadKind = Literal["decode", "transfer"]
PageIds = Tensor | Sequence[int]
"""Page ids: an integer tensor (any shape, flattened) or a sequence of ints."""


@dataclass(frozen=True, slots=True)
class ReuseStats:
    """What the pages handed out by one :meth:`PageLedger.alloc` still held.

    ``reused``: pages still holding KV somebody wrote (not zeroized). ``cross_tenant``: of
    those, pages whose last writer belongs to another tenant than the new owner (an unknown
    writer tenant counts as another). ``zeroized``: pages zeroized on their last free.
    """

    reused: int
    cross_tenant: int
    zeroized: int


@dataclass(frozen=True, slots=True)
class StaleRead:
    """Pages one reader read without having written them in their current generation.

    Grouped by (reader, previous writer request and tenant, zeroized). ``previous_request``
    and ``previous_tenant`` are ``None`` when the pages were never written since the pool was
    created; ``previous_tenant`` is ``UNKNOWN_TENANT`` (-1) when the writer's tenant is not
    known to the ledger, and ``reader_tenant`` likewise. ``zeroized``: the pages were zeroized
    on free and not rewritten since, so they hold zeros, not the previous writer's KV.
    ``read_kind`` is ``"decode"`` (a block-table gather) or ``"transfer"`` (the source side of
    a KV transfer); ``pool`` is the name of the ledger that was read.
    """

    reader_request: int
    reader_tenant: int
    page_ids: list[int]
    previous_request: int | None
    previous_tenant: int | None
    zeroized: bool
    read_kind: str
    pool: str = "pool"

    @property
    def cross_tenant(self) -> bool:
        """True when another tenant's KV was exposed to the reader.

        Not for zeroized or never-written pages (they hold no one's KV); an unknown tenant on
        either side counts as another tenant.
        """
        if self.zeroized or self.previous_tenant is None:
            return False
        return (
            self.previous_tenant != self.reader_tenant
            or self.previous_tenant == UNKNOWN_TENANT
            or self.reader_tenant == UNKNOWN_TENANT
        )


def _check_handle(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int handle, got {value!r}")
    return value


class PageLedger:
    """Per-page ownership and provenance of one KV pool, as tensors on the pool's device.

    State, one int64 entry per page (bool for ``zeroized``)::

        owner_request, owner_tenant   current owner; FREE (-1) when the page is free
        generation                    allocation generation, +1 on every alloc of the page
        writer_request, writer_tenant last writer; NEVER (-1) if never written since creation
        writer_generation             generation of *this pool* in which that write happened;
                                      -1 if never written, or if the content was carried in
                                      by a transfer of a page that was not valid at the source
        zeroized                      zeroized on free and not written since
        valid_for                     the only request for which a read is valid, else NOBODY

    Invariants (checked by :meth:`check_invariants`):

    1. ``owner_request == FREE`` iff ``owner_tenant == FREE``.
    2. ``generation >= 0`` and ``writer_generation <= generation``.
    3. ``writer_request == NEVER`` implies ``writer_tenant == -1`` and
       ``writer_generation == -1``.
    4. ``valid_for == owner_request`` where the page is owned, was written by its owner in
       its current generation and is not zeroized; ``valid_for == NOBODY`` everywhere else.
       So a read of page ``p`` by request ``r`` is valid iff ``valid_for[p] == r``: the reader
       owns the page and wrote it in the page's current generation. Every other read is a
       stale read. Every operation maintains ``valid_for``, so that the hot path of
       :meth:`read` is one gather, one compare and one reduction.
    5. Free keeps the last writer (freed memory is not cleared); ``free(zeroized=True)`` sets
       ``zeroized``, which only a later full write clears. Alloc never changes the writer
       fields; a partial write never makes a page valid.

    Request and tenant handles are non-negative ints chosen by the adapter. The ledger
    remembers each request's tenant from its allocs (the last ``tenant_capacity`` requests,
    least recently allocating first out) to name the tenant of a reader or of a writer that
    wrote into a page it did not own. Page ids must be in ``[0, num_pages)`` (not checked:
    checking would cost a host sync on CUDA; out-of-range ids fail in torch's indexing).
    Within one call, ids should be distinct (duplicates are harmless except in the destination
    of :meth:`transfer` or in a write with several writers, where which one wins is
    unspecified).
    """

    def __init__(
        self,
        num_pages: int,
        device: torch.device | str = "cpu",
        name: str = "pool",
        *,
        tenant_capacity: int = 1 << 16,
    ) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if tenant_capacity < 1:
            raise ValueError("tenant_capacity must be >= 1")
        self.name = name
        self._num_pages = num_pages
        self._tenant_capacity = tenant_capacity
        self._tenants: OrderedDict[int, int] = OrderedDict()
        dev = torch.device(device)

        def filled(value: int) -> Tensor:
            return torch.full((num_pages,), value, dtype=torch.long, device=dev)

        self._owner_req = filled(FREE)
        self._owner_ten = filled(FREE)
        self._gen = filled(0)
        # The writer fields have one extra row, a sink at index num_pages: a partial write
        # scatters the pages it leaves unchanged there instead of gathering and re-writing
        # their old values. Everything else uses the num_pages-long views.
        sink_len = num_pages + 1
        self._writer_req_sink = torch.full((sink_len,), NEVER, dtype=torch.long, device=dev)
        self._writer_ten_sink = torch.full((sink_len,), -1, dtype=torch.long, device=dev)
        self._writer_gen_sink = torch.full((sink_len,), -1, dtype=torch.long, device=dev)
        self._zeroized_sink = torch.zeros((sink_len,), dtype=torch.bool, device=dev)
        self._writer_req = self._writer_req_sink[:num_pages]
        self._writer_ten = self._writer_ten_sink[:num_pages]
        self._writer_gen = self._writer_gen_sink[:num_pages]
        self._zeroized = self._zeroized_sink[:num_pages]
        self._valid_for = filled(NOBODY)  # no sink: out-of-range page ids fail here
        # torch.device("cuda") has no index; the tensors' device does.
        self.device: torch.device = self._valid_for.device

    # ------------------------------------------------------------------ accessors

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def owner_of(self, pages: PageIds) -> Tensor:
        """Owner request of each page (FREE = -1), an int64 tensor on the ledger's device."""
        return self._owner_req.index_select(0, self._index(pages))

    def owner_tenant_of(self, pages: PageIds) -> Tensor:
        """Owner tenant of each page (FREE = -1), an int64 tensor on the ledger's device."""
        return self._owner_ten.index_select(0, self._index(pages))

    def tenant_of(self, request: int) -> int:
        """The tenant this ledger last saw ``request`` allocate for, or UNKNOWN_TENANT."""
        return self._tenants.get(request, UNKNOWN_TENANT)

    def num_owned(self) -> int:
        """Pages currently allocated (one host sync)."""
        return int((self._owner_req >= 0).sum().item())

    def snapshot(self) -> dict[str, list[int]]:
        """The whole state as Python lists (for tests and debugging; copies to the host)."""
        return {
            "owner_request": self._owner_req.tolist(),
            "owner_tenant": self._owner_ten.tolist(),
            "generation": self._gen.tolist(),
            "writer_request": self._writer_req.tolist(),
            "writer_tenant": self._writer_ten.tolist(),
            "writer_generation": self._writer_gen.tolist(),
            "zeroized": [int(z) for z in self._zeroized.tolist()],
            "valid_for": self._valid_for.clamp(min=-1).tolist(),  # NOBODY shown as -1
        }

    def check_invariants(self) -> list[str]:
        """Names of the class invariants that do not hold (empty when all hold)."""
        owned = self._owner_req >= 0
        never = self._writer_req == NEVER
        expected_valid = torch.where(
            owned
            & (self._writer_req == self._owner_req)
            & (self._writer_gen == self._gen)
            & ~self._zeroized,
            self._owner_req,
            NOBODY,
        )
        checks = {
            "1 owner request/tenant free together": (
                (self._owner_req == FREE) != (self._owner_ten == FREE)
            ).any(),
            "2 generations": ((self._gen < 0) | (self._writer_gen > self._gen)).any(),
            "3 never-written pages have no writer tenant/generation": (
                never & ((self._writer_ten != -1) | (self._writer_gen != -1))
            ).any(),
            "4 valid_for": (self._valid_for != expected_valid).any(),
        }
        flags = torch.stack(list(checks.values())).tolist()
        return [name for name, bad in zip(checks, flags, strict=True) if bad]

    # ------------------------------------------------------------------ operations

    def alloc_counts(self, pages: PageIds, request: int, tenant: int) -> Tensor:
        """:meth:`alloc` without the host sync: returns the counts as an int64 tensor of
        shape (3,) on the ledger's device: ``[reused, cross_tenant, zeroized]``. Lets the
        adapter sum a whole step's allocations before syncing once."""
        _check_handle(request, "request")
        _check_handle(tenant, "tenant")
        p = self._index(pages)
        zeroized = self._zeroized.index_select(0, p)
        holds = (self._writer_req.index_select(0, p) != NEVER) & ~zeroized
        cross = holds & (self._writer_ten.index_select(0, p) != tenant)
        counts = torch.stack([holds.sum(), cross.sum(), zeroized.sum()])
        self._owner_req.index_fill_(0, p, request)
        self._owner_ten.index_fill_(0, p, tenant)
        self._gen.index_add_(0, p, torch.ones_like(p))
        self._valid_for.index_fill_(0, p, NOBODY)
        self._remember_tenant(request, tenant)
        return counts

    def alloc(self, pages: PageIds, request: int, tenant: int) -> ReuseStats:
        """Pages become owned by (request, tenant) in a new generation (nothing in them is
        valid for anyone until written). Returns what they still held (one host sync; see
        :meth:`alloc_counts` for the sync-free variant)."""
        reused, cross, zeroized = self.alloc_counts(pages, request, tenant).tolist()
        return ReuseStats(reused=reused, cross_tenant=cross, zeroized=zeroized)

    def write(
        self,
        pages: PageIds,
        request: Tensor | int,
        *,
        partial: bool | Tensor = False,
        tenant: Tensor | int | None = None,
    ) -> None:
        """``request`` wrote KV into these pages in their current generation.

        ``request`` is one handle, or an integer tensor of writer handles broadcastable to the
        shape of ``pages`` (a decode step: one page per request, each written by its own
        request, in one call).

        A full write (the default) covers each page from its first slot: the page now holds
        the writer's KV, valid for it if it owns the page. A write into a page owned by
        another request makes it invalid for its owner. The writer's tenant is the page
        owner's when the writer owns the page; otherwise (an engine writing into pages it does
        not own) ``tenant`` (an int or a tensor like ``request``) if given, else, for a single
        handle, the tenant the ledger remembers for it, else UNKNOWN_TENANT.

        ``partial`` (a bool, or a bool tensor broadcastable to the pages' shape): the write
        started past the page's first slot (a decode step or a prefill chunk appending to a
        partly filled page), so the earlier slots still hold what they held. A partial write
        validates nothing: a page already valid for the writer stays valid, a stale page stays
        stale and keeps naming its previous writer. Only a page valid for another request
        changes: it becomes written by the writer (spoiled for its owner).
        """
        p = self._pages(pages)
        shape = p.shape
        p = p.reshape(-1)
        w = self._handles(request, shape, "request")
        owner = self._owner_req.index_select(0, p)
        own = owner == w
        if tenant is None:
            fallback: Tensor | int = UNKNOWN_TENANT if isinstance(w, Tensor) else self.tenant_of(w)
        else:
            fallback = self._handles(tenant, shape, "tenant")
        writer_ten = torch.where(own, self._owner_ten.index_select(0, p), fallback)
        gen = self._gen.index_select(0, p)
        full_valid = torch.where(own, owner, NOBODY)
        if isinstance(partial, bool) and not partial:
            if isinstance(w, Tensor):
                self._writer_req.index_copy_(0, p, w)
            else:
                self._writer_req.index_fill_(0, p, w)
            self._writer_ten.index_copy_(0, p, writer_ten)
            self._writer_gen.index_copy_(0, p, gen)
            self._zeroized.index_fill_(0, p, False)
            self._valid_for.index_copy_(0, p, full_valid)
            return
        valid_for = torch.take(self._valid_for, p)
        spoil = (valid_for != NOBODY) & (valid_for != w)
        if isinstance(partial, Tensor):
            part = torch.broadcast_to(partial.to(device=self.device, dtype=torch.bool), shape)
            part = part.reshape(-1)
            change = spoil | ~part
        else:
            change = spoil
        # a spoiled page's writer is not its owner, so full_valid is NOBODY there
        new_valid = torch.where(change, full_valid, valid_for)
        # pages left unchanged go to the sink row; changed ones are fully rewritten (a
        # spoiled page was valid, hence not zeroized; a full write clears zeroized)
        target = torch.where(change, p, self._num_pages)
        if isinstance(w, Tensor):
            self._writer_req_sink.index_copy_(0, target, w)
        else:
            self._writer_req_sink.index_fill_(0, target, w)
        self._writer_ten_sink.index_copy_(0, target, writer_ten)
        self._writer_gen_sink.index_copy_(0, target, gen)
        self._zeroized_sink.index_fill_(0, target, False)
        self._valid_for.index_copy_(0, p, new_valid)

    def free(self, pages: PageIds, zeroized: bool = False) -> None:
        """Pages return to the free list. Their last writer stays (the memory is not
        cleared), unless ``zeroized``: then they are marked zeroized until rewritten."""
        p = self._index(pages)
        self._owner_req.index_fill_(0, p, FREE)
        self._owner_ten.index_fill_(0, p, FREE)
        self._valid_for.index_fill_(0, p, NOBODY)
        if zeroized:
            self._zeroized.index_fill_(0, p, True)

    def stale_mask(self, pages: PageIds, readers: Tensor | int) -> Tensor:
        """Which reads are stale, without a host sync: a bool tensor shaped like ``pages``.

        ``readers`` is one request handle or an integer tensor broadcastable to the shape of
        ``pages`` (e.g. ``[batch, 1]`` against a ``[batch, pages_per_request]`` block table).
        """
        p = self._pages(pages)
        return torch.take(self._valid_for, p) != self._readers(readers, p.shape)

    def read(self, pages: PageIds, readers: Tensor | int) -> list[StaleRead]:
        """Check a decode gather of ``pages`` by ``readers`` (see :meth:`stale_mask`).

        Returns ``[]`` when every read is valid, after one reduction and one host sync;
        otherwise the stale reads grouped by (reader, previous writer, zeroized).
        """
        stale = self.stale_mask(pages, readers)
        if not bool(stale.any()):
            return []
        return self._report(pages, readers, stale, "decode")

    def transfer(
        self, src_pages: PageIds, dst: PageLedger, dst_pages: PageIds, request: int
    ) -> list[StaleRead]:
        """Record a copy of KV from this pool's ``src_pages`` into ``dst``'s ``dst_pages``
        (same length; ``dst`` may be this ledger, on any device).

        The source side is a read by ``request``: source pages not valid for it are returned
        as stale reads (``read_kind="transfer"``). Each destination page takes on what its
        source held: written by ``request`` in ``dst``'s current generation if the source
        page was valid for ``request``; otherwise the source's last writer, tenant and
        zeroized flag, with ``writer_generation = -1``, so any later read of it is stale and
        names the original writer. The destination's owner and generation are unchanged.
        """
        _check_handle(request, "request")
        s = self._index(src_pages)
        d = dst._index(dst_pages)
        if s.numel() != d.numel():
            raise ValueError(
                f"transfer needs as many destination pages as source pages "
                f"({s.numel()} != {d.numel()})"
            )
        ok = torch.take(self._valid_for, s) == request
        stale = ~ok
        reports = self._report(s, request, stale, "transfer") if bool(stale.any()) else []

        src_writer = torch.where(ok, request, self._writer_req.index_select(0, s))
        src_ten = torch.where(
            ok, self._owner_ten.index_select(0, s), self._writer_ten.index_select(0, s)
        )
        src_zero = self._zeroized.index_select(0, s) & stale
        dev = dst.device
        ok_d = ok.to(dev)
        dst_gen = dst._gen.index_select(0, d)
        dst_owner = dst._owner_req.index_select(0, d)
        dst._writer_req.index_copy_(0, d, src_writer.to(dev))
        dst._writer_ten.index_copy_(0, d, src_ten.to(dev))
        dst._writer_gen.index_copy_(0, d, torch.where(ok_d, dst_gen, -1))
        dst._zeroized.index_copy_(0, d, src_zero.to(dev))
        dst._valid_for.index_copy_(
            0, d, torch.where(ok_d & (dst_owner == request), request, NOBODY)
        )
        return reports

    # ------------------------------------------------------------------ internals

    def _remember_tenant(self, request: int, tenant: int) -> None:
        tenants = self._tenants
        tenants[request] = tenant
        tenants.move_to_end(request)
        if len(tenants) > self._tenant_capacity:
            tenants.popitem(last=False)

    def _pages(self, pages: PageIds) -> Tensor:
        """Page ids as an int64 tensor on the ledger's device, shape kept (no copy when the
        caller already passes one: the hot path)."""
        if isinstance(pages, Tensor):
            if pages.dtype == torch.long and pages.device == self.device:
                return pages
            if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
                raise TypeError(f"page ids must be integers, got {pages.dtype}")
            return pages.to(device=self.device, dtype=torch.long)
        return torch.as_tensor(pages, dtype=torch.long, device=self.device)

    def _index(self, pages: PageIds) -> Tensor:
        return self._pages(pages).reshape(-1)

    def _readers(self, readers: Tensor | int, shape: torch.Size) -> Tensor | int:
        """Reader handles for :meth:`stale_mask`: an int, or a tensor broadcastable to
        ``shape`` (returned as is, unflattened: the compare broadcasts)."""
        if not isinstance(readers, Tensor):
            return _check_handle(readers, "reader")
        if readers.dtype == torch.long and readers.device == self.device and readers.shape == shape:
            return readers
        if readers.dtype.is_floating_point or readers.dtype.is_complex:
            raise TypeError(f"reader handles must be integers, got {readers.dtype}")
        # by hand: torch.broadcast_shapes costs about a millisecond per call
        rs = readers.shape
        if len(rs) > len(shape) or any(
            a not in (1, b) for a, b in zip(reversed(rs), reversed(shape), strict=False)
        ):
            raise ValueError(
                f"handles of shape {tuple(readers.shape)} do not broadcast to the pages' "
                f"shape {tuple(shape)}"
            )
        return readers.to(device=self.device, dtype=torch.long)

    def _handles(self, handles: Tensor | int, shape: torch.Size, what: str) -> Tensor | int:
        """An int handle (checked), or a tensor of them broadcast to ``shape``, flattened."""
        if not isinstance(handles, Tensor):
            return _check_handle(handles, what)
        h = self._readers(handles, shape)
        assert isinstance(h, Tensor)
        return (h if h.shape == shape else torch.broadcast_to(h, shape)).reshape(-1)

    def _report(
        self, pages: PageIds, readers: Tensor | int, stale: Tensor, kind: ReadKind
    ) -> list[StaleRead]:
        """Group the stale reads (the rare path: syncs, and loops over groups only)."""
        p = self._pages(pages)
        shape = p.shape
        p = p.reshape(-1)
        idx = stale.reshape(-1).nonzero().squeeze(1)
        stale_pages = p.index_select(0, idx)
        if isinstance(readers, Tensor):
            r = readers.to(device=self.device, dtype=torch.long)
            stale_readers = torch.broadcast_to(r, shape).reshape(-1).index_select(0, idx)
        else:
            stale_readers = torch.full_like(stale_pages, readers)
        keys = torch.stack(
            [
                stale_readers,
                self._writer_req.index_select(0, stale_pages),
                self._writer_ten.index_select(0, stale_pages),
                self._zeroized.index_select(0, stale_pages).long(),
            ],
            dim=1,
        )
        groups, inverse = torch.unique(keys, dim=0, return_inverse=True)
        order = torch.argsort(inverse, stable=True)
        counts = torch.bincount(inverse, minlength=groups.shape[0]).tolist()
        page_list = stale_pages.index_select(0, order).tolist()
        out: list[StaleRead] = []
        start = 0
        for (reader, writer, writer_ten, zeroized), count in zip(
            groups.tolist(), counts, strict=True
        ):
            never = writer == NEVER
            out.append(
                StaleRead(
                    reader_request=reader,
                    reader_tenant=self.tenant_of(reader),
                    page_ids=page_list[start : start + count],
                    previous_request=None if never else writer,
                    previous_tenant=None if never else writer_ten,
                    zeroized=bool(zeroized),
                    read_kind=kind,
                    pool=self.name,
                )
            )
            start += count
        return out
