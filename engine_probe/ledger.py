"""The page ledger: who owns, and who last wrote, every page (and how much of it) of a KV pool.

One :class:`PageLedger` per KV pool, kept as int64 tensors on the pool's own device. The
engine adapter calls it when the engine allocates, writes, frees, transfers and reads pages.
The ledger tracks pages and, within a page, the length of the prefix its owner has written
(``filled``): writes carry their slot range, reads how many slots of each page they read
(``upto``). A read is valid only if the reader's own request wrote the page in the page's
current allocation generation, from its first slot up to at least ``upto``; anything else is
a *stale read* (:class:`StaleRead`), reported with the previous writer, i.e. the request and
tenant whose KV the reader may have seen.

Every operation is vectorised over tensors of page ids; nothing loops over pages in Python.
The common case of a read check (:meth:`PageLedger.any_stale`, given the engine's slot mask)
is three gathers (the pages' ``valid_for`` and ``filled``, and the words marking the slots past
``filled``), an and, an xor, an or and one reduction, with no host sync; the caller's one sync
decides whether anything must be reported (:meth:`PageLedger.read` syncs once itself). A
decode step's writes (:meth:`PageLedger.append`) are a dozen ops, also without a sync.

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
    "Extent",
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
Extent = Tensor | int | None
"""What a read covers of each page: ``None`` (whole pages), an int or an integer tensor
broadcastable to the pages' shape (slots ``[0, upto)``), or a bool tensor of shape
``pages.shape + (page_size,)`` marking the slots read (the read covers up to its last set
slot, e.g. an engine's attention mask)."""

# columns of the row tensors
_REQ, _TEN, _GEN, _ZERO = 0, 1, 2, 3


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
    """Pages one reader read without having written them in their current generation, or
    read past the prefix it wrote (``upto > filled``: the read ran into slots that still hold
    what the page held before).

    Grouped by (reader, previous writer request and tenant, zeroized). The previous writer is
    the page's last writer, or, for a read past the reader's own prefix, the writer of the
    slots past it (see :class:`PageLedger`). ``previous_request`` and ``previous_tenant`` are
    ``None`` when that content was never written since the pool was created;
    ``previous_tenant`` is ``UNKNOWN_TENANT`` (-1) when the writer's tenant is not known to
    the ledger, and ``reader_tenant`` likewise. ``zeroized``: the slots read were zeroized on
    free and not rewritten since, so they hold zeros, not the previous writer's KV.
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


def _check_slot(value: int, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an int in [{low}, {high}], got {value!r}")
    return value


class PageLedger:
    """Per-page ownership and provenance of one KV pool, as tensors on the pool's device.

    State, per page (int64; the zeroized flags as 0/1)::

        owner_request, owner_tenant   current owner; FREE (-1) when the page is free
        generation                    allocation generation, +1 on every alloc of the page
        writer_request, writer_tenant last writer; NEVER (-1) if never written since creation
        writer_generation             generation of *this pool* in which that write happened;
                                      -1 if never written, or if the content was carried in
                                      by a transfer of a page that was not valid at the source
        zeroized                      zeroized on free and not written since
        filled                        0..page_size: how many leading slots the owner has
                                      validly written in the current generation
        previous_request, _tenant,    who the slots past ``filled`` are attributed to: the
        previous_zeroized             writer of what the owner's prefix was written over (the
                                      page's last writer before the owner's generation, in
                                      the normal case)
        valid_for                     the only request for which a read is valid, else NOBODY

    Writes carry their slot range ``[start, end)`` within each page; reads carry how much of
    each page they read (``upto``, see :data:`Extent`). An owner's write that starts at or
    before ``filled`` extends ``filled`` to its end; one that starts past ``filled`` leaves a
    hole and extends nothing (engines append to a page in order; the ledger keeps a prefix
    length per page, not a bit per slot, so a hole stays one even if filled in later).

    Invariants (checked by :meth:`check_invariants`):

    1. ``owner_request == FREE`` iff ``owner_tenant == FREE``.
    2. ``generation >= 0`` and ``writer_generation <= generation``.
    3. ``writer_request == NEVER`` implies ``writer_tenant == -1`` and
       ``writer_generation == -1``; ``previous_request == NEVER`` implies
       ``previous_tenant == -1``.
    4. ``valid_for == owner_request`` where the page is owned, was written by its owner in
       its current generation and is not zeroized; ``valid_for == NOBODY`` everywhere else.
    5. ``0 <= filled <= page_size``, and ``filled > 0`` iff ``valid_for != NOBODY``. So a read
       of slots ``[0, upto)`` of page ``p`` by request ``r`` is valid iff
       ``valid_for[p] == r and upto <= filled[p]``: the reader owns the page and wrote its
       first ``upto`` slots in the page's current generation. Every other read is a stale
       read. Every operation maintains ``valid_for`` and ``filled``, so that a read check
       needs no more than three gathers.
    6. Where ``valid_for == NOBODY``, the previous writer fields equal the writer fields
       (``previous_zeroized == zeroized``): the whole page is attributed to its last writer.
       Where the page is valid, they name who the slots past ``filled`` are attributed to:
       whoever the page was attributed to when its owner's prefix started (its first write
       from slot 0 in this generation; for a page transferred in, the source page's previous
       writer), or a later writer that wrote starting exactly at ``filled``.
    7. Free keeps the last writer (freed memory is not cleared); ``free(zeroized=True)`` sets
       ``zeroized``, which only a write covering the first slot of what is not valid clears.
       Alloc never changes the writer fields.

    Grants (:meth:`grant`, :meth:`revoke`): an engine may hand a request pages another
    request wrote, for it to read and never write (a prefix-cache hit). A grant is a
    (reader, page) pair with the request whose write it grants, the page's *granter*: a read
    of a granted page by its reader is checked as the granter's read (valid iff the page is
    valid for the granter, and the slots read lie within its ``filled`` prefix), so it stays
    valid exactly as long as the page still holds the granter's write of that generation,
    and turns stale the moment the page is handed out again or written by anyone else. A
    stale granted read is reported as the reader's (``reader_request``), naming the page's
    writer as any stale read does. Grants live until revoked (the reader finished) and are
    kept as a sorted table of ``reader * num_pages + page`` keys on the device, so a read
    check with grants costs one ``searchsorted`` and two gathers more, and none without.
    The caller keeps every grant's reader live (it revokes a finished reader's grants); a
    read of a page its reader was not granted is checked as its own. :meth:`transfer` does
    not consult grants: a source page the request was only granted is checked as its own
    read.

    Stale reads name the previous writer: for a page not valid for the reader, the page's
    last writer (``writer_*``, ``zeroized``); for a page valid for the reader but read past
    ``filled`` (a hole: the incident's one-token placeholder page read as 16 positions), who
    the slots past ``filled`` are attributed to (``previous_*``, ``previous_zeroized``): the
    tenant whose bytes sit in the hole.

    Request and tenant handles are non-negative ints chosen by the adapter. The ledger
    remembers each request's tenant from its allocs (the last ``tenant_capacity`` requests,
    least recently allocating first out) to name the tenant of a reader or of a writer that
    wrote into a page it did not own. Page ids must be in ``[0, num_pages)`` and slot ranges
    within ``[0, page_size]`` with ``start < end`` (not checked for tensors: checking would
    cost a host sync on CUDA; out-of-range ids fail in torch's indexing). Within one call, ids
    should be distinct (duplicates are harmless except in the destination of
    :meth:`transfer` or in a write with several writers, where which one wins is
    unspecified).

    Layout: the owner fields are the columns of one ``[num_pages, 4]`` tensor (owner
    request, tenant, generation, 0), the writer and previous-writer fields the columns of two
    ``[num_pages + 1, 4]`` tensors (the previous writer's third column is unused), so that a
    write gathers one row per page and scatters it, patched, as the writer's row;
    ``valid_for`` and ``filled`` are contiguous; a ``[page_size + 1, page_size / 8]`` table
    marks, 8 slots per int64 word, the slots at or past each value of ``filled``, for the read
    path. The writer and previous-writer rows and ``filled`` have a sink row past the last
    page, where :meth:`write` and :meth:`append` scatter what they must leave unchanged.
    """

    def __init__(
        self,
        num_pages: int,
        device: torch.device | str = "cpu",
        name: str = "pool",
        *,
        page_size: int = 16,
        tenant_capacity: int = 1 << 16,
    ) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if tenant_capacity < 1:
            raise ValueError("tenant_capacity must be >= 1")
        self.name = name
        self._num_pages = num_pages
        self._page_size = page_size
        self._tenant_capacity = tenant_capacity
        self._tenants: OrderedDict[int, int] = OrderedDict()
        dev = torch.device(device)
        n = num_pages

        def rows(*values: int, sink: bool = False) -> Tensor:
            row = torch.tensor(values, dtype=torch.long, device=dev)
            return row.repeat(n + sink, 1)

        self._own = rows(FREE, FREE, 0, 0)  # the 4th column stays 0: see write()
        # The writer and previous-writer rows have one extra row, a sink at index num_pages:
        # a write scatters the pages whose rows it leaves unchanged there instead of
        # gathering and re-writing their old values. Everything else uses the first n rows.
        self._writer_rows = rows(NEVER, -1, -1, 0, sink=True)
        self._prev_rows = rows(NEVER, -1, -1, 0, sink=True)
        self._owner_req, self._owner_ten, self._gen, _ = self._own.unbind(1)
        w = self._writer_rows[:n]
        self._writer_req, self._writer_ten, self._writer_gen, self._zeroized = w.unbind(1)
        self._prev_req, self._prev_ten, _, self._prev_zero = self._prev_rows[:n].unbind(1)
        # filled also has a sink row (see append()); its first n rows are a view,
        # contiguous, used everywhere else.
        self._filled_sink = torch.zeros((n + 1,), dtype=torch.long, device=dev)
        self._filled = self._filled_sink[:n]
        self._valid_for = torch.full((n,), NOBODY, dtype=torch.long, device=dev)
        # For page sizes a multiple of 8, the slots a read of each page must not use (those
        # at or past `filled`) as int64 words of 8 slots (bytes): the layout of a bool slot
        # mask viewed as int64, so that `mask & unread` is what a read used past the prefix,
        # without a reduction over slots. Row f of `_unread_of` is the words for filled == f.
        self._words = page_size // 8 if page_size % 8 == 0 else 0
        past = torch.arange(page_size)[None, :] >= torch.arange(page_size + 1)[:, None]
        unread_of = past.view(torch.int64) if self._words else torch.zeros((page_size + 1, 0))
        self._unread_of = unread_of.to(device=dev, dtype=torch.long)
        # The last append()'s writes, settled by the next operation: (pages, writers, slots,
        # which ones were not plain appends and still need the general write rules). Those
        # pages' valid_for is NOBODY until then (see append()).
        self._unsettled: tuple[Tensor, Tensor | int, Tensor | int, Tensor] | None = None
        # torch.device("cuda") has no index; the tensors' device does.
        self.device: torch.device = self._valid_for.device
        # 1..page_size: a slot's rank, to find the last slot a slot mask marks
        self._slot_rank = torch.arange(1, page_size + 1, dtype=torch.int32, device=self.device)
        # Grants, per reader: (keys reader * num_pages + page, granters), and the merged,
        # sorted table the read path searches (None: rebuild it on the next read)
        self._grants: dict[int, tuple[Tensor, Tensor]] = {}
        self._grant_table: tuple[Tensor, Tensor] | None = None

    # ------------------------------------------------------------------ accessors

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    def owner_of(self, pages: PageIds) -> Tensor:
        """Owner request of each page (FREE = -1), an int64 tensor on the ledger's device."""
        self._settle()
        return self._owner_req.index_select(0, self._index(pages))

    def owner_tenant_of(self, pages: PageIds) -> Tensor:
        """Owner tenant of each page (FREE = -1), an int64 tensor on the ledger's device."""
        self._settle()
        return self._owner_ten.index_select(0, self._index(pages))

    def writer_of(self, pages: PageIds) -> tuple[Tensor, Tensor]:
        """Last writer request and its tenant of each page (NEVER = -1 and -1 if never
        written since creation), int64 tensors on the ledger's device."""
        self._settle()
        index = self._index(pages)
        return self._writer_req.index_select(0, index), self._writer_ten.index_select(0, index)

    def filled_of(self, pages: PageIds) -> Tensor:
        """Leading slots of each page valid for its owner (0..page_size), an int64 tensor."""
        self._settle()
        return self._filled.index_select(0, self._index(pages))

    def tenant_of(self, request: int) -> int:
        """The tenant this ledger last saw ``request`` allocate for, or UNKNOWN_TENANT."""
        return self._tenants.get(request, UNKNOWN_TENANT)

    def num_owned(self) -> int:
        """Pages currently allocated (one host sync)."""
        self._settle()
        return int((self._owner_req >= 0).sum().item())

    def snapshot(self) -> dict[str, list[int]]:
        """The whole state as Python lists (for tests and debugging; copies to the host)."""
        self._settle()
        return {
            "owner_request": self._owner_req.tolist(),
            "owner_tenant": self._owner_ten.tolist(),
            "generation": self._gen.tolist(),
            "writer_request": self._writer_req.tolist(),
            "writer_tenant": self._writer_ten.tolist(),
            "writer_generation": self._writer_gen.tolist(),
            "zeroized": self._zeroized.tolist(),
            "filled": self._filled.tolist(),
            "previous_request": self._prev_req.tolist(),
            "previous_tenant": self._prev_ten.tolist(),
            "previous_zeroized": self._prev_zero.tolist(),
            "valid_for": self._valid_for.clamp(min=-1).tolist(),  # NOBODY shown as -1
        }

    def check_invariants(self) -> list[str]:
        """Names of the class invariants that do not hold (empty when all hold)."""
        self._settle()
        owned = self._owner_req >= 0
        never = self._writer_req == NEVER
        zeroized = self._zeroized != 0
        expected_valid = torch.where(
            owned
            & (self._writer_req == self._owner_req)
            & (self._writer_gen == self._gen)
            & ~zeroized,
            self._owner_req,
            NOBODY,
        )
        invalid = self._valid_for == NOBODY
        flags01 = torch.cat([self._zeroized, self._prev_zero])
        checks = {
            "1 owner request/tenant free together": (
                (self._owner_req == FREE) != (self._owner_ten == FREE)
            ).any(),
            "2 generations": ((self._gen < 0) | (self._writer_gen > self._gen)).any(),
            "3 never-written pages have no writer tenant/generation": (
                (never & ((self._writer_ten != -1) | (self._writer_gen != -1)))
                | ((self._prev_req == NEVER) & (self._prev_ten != -1))
            ).any(),
            "4 valid_for": (self._valid_for != expected_valid).any(),
            "5 filled": (
                (self._filled < 0)
                | (self._filled > self._page_size)
                | ((self._filled > 0) == invalid)
            ).any(),
            "6 previous writer of a page not valid is its writer": (
                invalid
                & (
                    (self._prev_req != self._writer_req)
                    | (self._prev_ten != self._writer_ten)
                    | (self._prev_zero != self._zeroized)
                )
            ).any(),
            "zeroized flags are 0 or 1": ((flags01 != 0) & (flags01 != 1)).any(),
        }
        flags = torch.stack(list(checks.values())).tolist()
        return [name for name, bad in zip(checks, flags, strict=True) if bad]

    # ------------------------------------------------------------------ operations

    def alloc_counts(self, pages: PageIds, request: Tensor | int, tenant: Tensor | int) -> Tensor:
        """:meth:`alloc` without the host sync: returns the counts as an int64 tensor of
        shape (3,) on the ledger's device: ``[reused, cross_tenant, zeroized]``. Lets the
        adapter sum a whole step's allocations before syncing once.

        ``request`` and ``tenant`` are one handle each, or integer tensors like ``pages``
        (one owner per page: several requests' allocations in one call, as a host-side
        engine's batched operations make; pages must then be distinct). The tensor form
        copies the handles to the host once, to remember each request's tenant."""
        self._settle()
        p = self._index(pages)
        rt: Tensor | int
        tt: Tensor | int
        if isinstance(request, Tensor) or isinstance(tenant, Tensor):
            shape = p.shape
            r = self._handles(request, shape, "request")
            t = self._handles(tenant, shape, "tenant")
            rt = r if isinstance(r, Tensor) else torch.full_like(p, r)
            tt = t if isinstance(t, Tensor) else torch.full_like(p, t)
            if bool(((rt < 0) | (tt < 0)).any()):
                raise ValueError("request and tenant handles must be non-negative")
        else:
            rt = _check_handle(request, "request")
            tt = _check_handle(tenant, "tenant")
        writer = self._writer_rows.index_select(0, p)
        zeroized = writer[:, _ZERO] != 0
        holds = (writer[:, _REQ] != NEVER) & ~zeroized
        cross = holds & (writer[:, _TEN] != tt)
        counts = torch.stack([holds.sum(), cross.sum(), zeroized.sum()])
        if isinstance(rt, Tensor):
            assert isinstance(tt, Tensor)
            self._owner_req.index_copy_(0, p, rt)
            self._owner_ten.index_copy_(0, p, tt)
        else:
            assert isinstance(tt, int)
            self._owner_req.index_fill_(0, p, rt)
            self._owner_ten.index_fill_(0, p, tt)
        self._gen.index_add_(0, p, torch.ones_like(p))
        self._set_read_state(p, NOBODY, 0)
        # invariant 6 (a no-op unless the page was still valid: a double allocation)
        self._prev_rows.index_copy_(0, p, writer)
        if isinstance(rt, Tensor):
            assert isinstance(tt, Tensor)
            last = None
            for pair in zip(rt.tolist(), tt.tolist(), strict=True):
                if pair != last:
                    self._remember_tenant(*pair)
                    last = pair
        else:
            assert isinstance(tt, int)
            self._remember_tenant(rt, tt)
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
        start: Tensor | int = 0,
        end: Tensor | int | None = None,
        tenant: Tensor | int | None = None,
    ) -> None:
        """``request`` wrote KV into slots ``[start, end)`` of these pages in their current
        generation.

        ``request`` is one handle, or an integer tensor of writer handles broadcastable to the
        shape of ``pages`` (a decode step: one page per request, each written by its own
        request, in one call). ``start`` and ``end`` likewise: ints (``end`` defaults to
        ``page_size``: the write runs to the end of the page) or integer tensors. The default
        ``[0, page_size)`` is a whole-page write.

        Page ``p`` with ``filled[p] == f`` (0 when it is not valid for its owner):

        * the owner writing from ``start <= f``: ``filled = max(f, end)``, the page is valid
          for it (a page written from slot 0 becomes valid; an append extends the prefix);
        * anyone writing from ``start > f``: nothing changes (a hole: the slots between still
          hold what they held, so the write validates nothing and the page keeps naming its
          previous writer);
        * another request writing from ``start < f``, or from slot 0 of a page not valid
          (``f == 0``): the page is now that writer's (spoiled for its owner; ``filled = 0``);
        * another request writing from exactly ``start == f > 0``: the owner's prefix stays
          valid, and the slots past it are now attributed to that writer.

        The writer's tenant is the page owner's when the writer owns the page; otherwise (an
        engine writing into pages it does not own) ``tenant`` (an int or a tensor like
        ``request``) if given, else, for a single handle, the tenant the ledger remembers for
        it, else UNKNOWN_TENANT.
        """
        self._settle()
        ps = self._page_size
        p = self._pages(pages)
        shape = p.shape
        if p.dim() != 1:
            p = p.reshape(-1)
        w = self._handles(request, shape, "request")
        s = self._slots(start, shape, "start", 0, ps - 1)
        e = self._slots(ps if end is None else end, shape, "end", 1, ps)
        if isinstance(s, int) and isinstance(e, int) and s >= e:
            raise ValueError(f"a write needs start < end, got [{s}, {e})")
        # The owner's row (request, tenant, generation, 0) is the writer's row (request,
        # tenant, generation, not zeroized) once patched for writers that are not the owner.
        written = self._own.index_select(0, p)
        owner = written[:, _REQ]
        foreign = owner != w  # the writer does not own the page
        if tenant is None:
            fallback: Tensor | int = UNKNOWN_TENANT if isinstance(w, Tensor) else self.tenant_of(w)
        else:
            fallback = self._handles(tenant, shape, "tenant")
        if isinstance(fallback, Tensor):
            written[:, _TEN] = torch.where(foreign, fallback, written[:, _TEN])
        else:
            written[:, _TEN].masked_fill_(foreign, fallback)
        sink = self._num_pages
        if isinstance(s, int) and s == 0:
            # Every write covers its page's first slot: the owner's pages are valid, with
            # filled = max(filled, end); every other page is spoiled, the writer's now.
            if isinstance(e, int) and e == ps:
                new_filled = torch.where(foreign, 0, ps)
            else:
                grown = torch.maximum(self._filled.index_select(0, p), self._tensor(e))
                new_filled = grown.masked_fill_(foreign, 0)
            writer_target: Tensor = p
            prev_target = torch.where(foreign, p, sink)
            new_valid = torch.where(foreign, NOBODY, owner)
        else:
            f = self._filled.index_select(0, p)
            reach = f >= s  # the write starts within the prefix or at its end
            ext = reach > foreign  # the owner extends its prefix (or starts it, at slot 0)
            cover = reach & foreign  # another writer reaches into the prefix or its end
            # ... into the prefix itself, or at slot 0 of a page not valid: spoiled (a start
            # below max(f, 1) is within reach)
            spoil = (f.clamp(min=1) > s) & foreign
            grown = f.clamp(min=e) if isinstance(e, int) else torch.maximum(f, e)
            new_filled = torch.where(ext, grown, f).masked_fill_(spoil, 0)
            # the writer rows of a page already valid are rewritten with the same values
            writer_target = torch.where(ext | spoil, p, sink)
            prev_target = torch.where(cover, p, sink)
            new_valid = torch.where(new_filled > 0, owner, NOBODY)
        written[:, _REQ] = w  # (owner, a view of this column, is not used past here)
        self._writer_rows.index_copy_(0, writer_target, written)
        self._prev_rows.index_copy_(0, prev_target, written)
        self._set_read_state(p, new_valid, new_filled)

    def append(self, pages: PageIds, request: Tensor | int, slot: Tensor | int) -> None:
        """``write(pages, request, start=slot, end=slot + 1)``: each writer wrote the one slot
        ``slot`` of its page (a decode step), for the price of a dozen tensor ops and no host
        sync.

        The common case, the page's owner appending exactly at the end of its prefix (at
        slot 0 of a page not written yet), is applied here: the prefix grows by one and the
        page is valid for its owner, which is all :meth:`write` would do. Any other write (an
        engine writing into a page it does not own, into its prefix or past it) is applied
        by the general rules of :meth:`write` when the ledger is next used: the first later
        operation syncs once on whether there is any, except :meth:`any_stale`, which
        instead answers True for a read of any of those pages while they wait
        (conservatively: they are valid for nobody until then; :meth:`read` settles them and
        is exact). Reads of every other page are checked exactly. Pages within one call must
        be distinct.
        """
        self._settle()
        ps = self._page_size
        p = self._index(pages)
        shape = p.shape
        w = self._handles(request, shape, "request")
        s = self._slots(slot, shape, "slot", 0, ps - 1)
        own = self._own.index_select(0, p)
        owner = own[:, _REQ]
        rest = (owner != w).logical_or_(self._filled.index_select(0, p) != s)
        target = p.masked_fill(rest, self._num_pages)  # all but plain appends: the sink row
        # The owner's row (request, tenant, generation, 0) is its writer row (invariant 4);
        # a page already valid for it gets the same values again.
        self._writer_rows.index_copy_(0, target, own)
        # Valid for the owner after a plain append; valid for nobody while another write
        # waits to be settled, so that any_stale needs no separate "anything unsettled?"
        # test (the general rules recompute valid_for from filled and the owner, which
        # that write leaves as they were).
        self._valid_for.index_copy_(0, p, owner.masked_fill(rest, NOBODY))
        if isinstance(s, int):
            self._filled_sink.index_fill_(0, target, s + 1)
        else:
            self._filled_sink.index_copy_(0, target, s + 1)
        self._unsettled = (p, w, s, rest)

    def _settle(self) -> None:
        """Apply the writes of the last append() that were not plain appends (see there)."""
        unsettled = self._unsettled
        if unsettled is None:
            return
        self._unsettled = None
        p, w, s, rest = unsettled
        # One op and the sync on the common path (none to settle), where rest.any() and a
        # bool() of it would be two.
        found = rest.nonzero()
        if not found.shape[0]:
            return
        idx = found.squeeze(1)
        w = w.index_select(0, idx) if isinstance(w, Tensor) else w
        s = s.index_select(0, idx) if isinstance(s, Tensor) else s
        self.write(p.index_select(0, idx), w, start=s, end=s + 1)

    def free(self, pages: PageIds, zeroized: bool = False) -> None:
        """Pages return to the free list. Their last writer stays (the memory is not
        cleared), unless ``zeroized``: then they are marked zeroized until rewritten."""
        self._settle()
        p = self._index(pages)
        self._owner_req.index_fill_(0, p, FREE)
        self._owner_ten.index_fill_(0, p, FREE)
        self._set_read_state(p, NOBODY, 0)
        if zeroized:
            self._zeroized.index_fill_(0, p, 1)
        # invariant 6: the whole page is now attributed to its last writer
        self._prev_rows.index_copy_(0, p, self._writer_rows.index_select(0, p))

    def grant(
        self, pages: PageIds, reader: int, granters: Tensor | int, tenant: int | None = None
    ) -> None:
        """``reader`` may read ``pages`` as ``granters`` (one handle, or a tensor like
        ``pages``: the request whose write of each page is granted) would: see the class
        docstring. ``tenant``: the reader's tenant, remembered as an alloc would. Granting a
        page the reader was granted already replaces that grant."""
        _check_handle(reader, "reader")
        if tenant is not None:
            self._remember_tenant(reader, _check_handle(tenant, "tenant"))
        p = self._index(pages)
        g = self._handles(granters, p.shape, "granter")
        g = g if isinstance(g, Tensor) else torch.full_like(p, g)
        keys = p + reader * self._num_pages
        old = self._grants.get(reader)
        if old is not None:
            keep = ~torch.isin(old[0], keys)
            keys, g = torch.cat([old[0][keep], keys]), torch.cat([old[1][keep], g])
        self._grants[reader] = (keys, g)
        self._grant_table = None

    def revoke(self, reader: int) -> None:
        """Forget every grant to ``reader`` (it finished)."""
        if self._grants.pop(reader, None) is not None:
            self._grant_table = None

    def granted(self, reader: int) -> int:
        """How many pages ``reader`` holds grants on (no sync)."""
        found = self._grants.get(reader)
        return 0 if found is None else found[0].numel()

    def stale_mask(self, pages: PageIds, readers: Tensor | int, upto: Extent = None) -> Tensor:
        """Which reads are stale, without a host sync: a bool tensor shaped like ``pages``.

        ``readers`` is one request handle or an integer tensor broadcastable to the shape of
        ``pages`` (e.g. ``[batch, 1]`` against a ``[batch, pages_per_request]`` block table).
        ``upto``: how much of each page is read (see :data:`Extent`; ``None``: whole pages).
        A read is stale unless the page is valid for its reader and every slot read lies
        within the page's ``filled`` prefix.
        """
        self._settle()
        return self._stale(pages, readers, upto, everywhere=False)

    def any_stale(self, pages: PageIds, readers: Tensor | int, upto: Extent = None) -> Tensor:
        """``stale_mask(pages, readers, upto).any()`` (a 0-d bool tensor, no host sync),
        cheaper for slot masks: the hot path of an engine's read check.

        Right after an :meth:`append` that was not all plain appends it is conservative for
        the pages of those writes (True for any read of one, since they are not applied
        yet), exact for every other page; :meth:`read` is exact."""
        return self._stale(pages, readers, upto, everywhere=True)

    def read(self, pages: PageIds, readers: Tensor | int, upto: Extent = None) -> list[StaleRead]:
        """Check a decode gather of ``pages`` by ``readers``, of ``upto`` of each page (see
        :meth:`stale_mask`).

        Returns ``[]`` when every read is valid, after one reduction and one host sync;
        otherwise the stale reads grouped by (reader, previous writer, zeroized).
        """
        stale = self.stale_mask(pages, readers, upto)
        if not bool(stale.any()):
            return []
        return self._report(pages, readers, stale, "decode")

    def transfer(
        self, src_pages: PageIds, dst: PageLedger, dst_pages: PageIds, request: int
    ) -> list[StaleRead]:
        """Record a copy of KV from this pool's ``src_pages`` into ``dst``'s ``dst_pages``
        (same length; ``dst`` may be this ledger, on any device).

        The source side is a read by ``request``: source pages not valid for it are returned
        as stale reads (``read_kind="transfer"``). A valid source page is copied whole, its
        prefix and what lies past it: the copy is no read of the slots past ``filled``, which
        a later read of the destination still finds there. Each destination page takes on
        what its source held: written by ``request`` in ``dst``'s current generation, with
        the source's ``filled`` and previous writer, if the source page was valid for
        ``request`` (valid for it at the destination when it owns that page; otherwise
        ``filled`` is 0); else the source's last writer, tenant and zeroized flag, with
        ``writer_generation = -1`` and ``filled = 0``, so any later read of it is stale and
        names the original writer. The destination's owner and generation are unchanged.
        """
        _check_handle(request, "request")
        self._settle()
        dst._settle()
        s = self._index(src_pages)
        d = dst._index(dst_pages)
        if s.numel() != d.numel():
            raise ValueError(
                f"transfer needs as many destination pages as source pages "
                f"({s.numel()} != {d.numel()})"
            )
        ok = self._valid_for.index_select(0, s) == request
        stale = ~ok
        reports = self._report(s, request, stale, "transfer") if bool(stale.any()) else []

        dev = dst.device
        src = self._writer_rows.index_select(0, s)
        src_prev = self._prev_rows.index_select(0, s).to(dev)
        src_filled = self._filled.index_select(0, s).to(dev)
        src_owner_ten = self._owner_ten.index_select(0, s).to(dev)
        src = src.to(dev)
        ok = ok.to(dev)
        own_rows = dst._own.index_select(0, d)
        valid = ok & (own_rows[:, _REQ] == request)
        # A valid source: written by `request` in dst's generation, not zeroized. Else what
        # the source holds, carried in from elsewhere (writer generation -1).
        carried = torch.stack(
            [
                src[:, _REQ].masked_fill(ok, request),
                torch.where(ok, src_owner_ten, src[:, _TEN]),
                torch.where(ok, own_rows[:, _GEN], -1),
                src[:, _ZERO].masked_fill(ok, 0),
            ],
            dim=1,
        )
        dst._writer_rows.index_copy_(0, d, carried)
        dst._set_read_state(
            d, torch.where(valid, request, NOBODY), src_filled.masked_fill_(~valid, 0)
        )
        # invariant 6: a page valid at the destination carries what lies past its source's
        # prefix; any other destination page is attributed whole to its (new) writer
        dst._prev_rows.index_copy_(0, d, torch.where(valid[:, None], src_prev, carried))
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
        p = self._pages(pages)
        return p if p.dim() == 1 else p.reshape(-1)

    def _tensor(self, value: Tensor | int) -> Tensor:
        if isinstance(value, Tensor):
            return value
        return torch.tensor(value, dtype=torch.long, device=self.device)

    def _set_read_state(self, p: Tensor, valid_for: Tensor | int, filled: Tensor | int) -> None:
        """``valid_for`` and ``filled`` of pages ``p`` (tensors like ``p``, or ints)."""
        if isinstance(valid_for, int):
            self._valid_for.index_fill_(0, p, valid_for)
        else:
            self._valid_for.index_copy_(0, p, valid_for)
        if isinstance(filled, int):
            self._filled.index_fill_(0, p, filled)
        else:
            self._filled.index_copy_(0, p, filled)

    def _stale(
        self, pages: PageIds, readers: Tensor | int, upto: Extent, *, everywhere: bool
    ) -> Tensor:
        """Which reads of ``pages`` are stale (shaped like ``pages``), or, ``everywhere``,
        whether any is (0-d). See :meth:`stale_mask`."""
        p = self._pages(pages)
        shape = p.shape
        flat = p if p.dim() == 1 else p.reshape(-1)
        r = self._as_granters(flat, self._readers(readers, shape), shape)
        mask = words = None
        if isinstance(upto, Tensor) and upto.dtype == torch.bool:
            mask = self._slot_mask(upto, shape)
            words = self._slot_words(mask)
        if words is not None:  # the hot path: 3 gathers, an and, an xor, an or, 1 reduction
            if isinstance(r, Tensor) and r.shape != flat.shape:
                r = torch.broadcast_to(r, shape).reshape(-1)
            if words.dim() != 2:
                words = words.view(-1, self._words)
            unread = self._unread_of.index_select(0, self._filled.index_select(0, flat))
            hit = unread.bitwise_and_(words)  # nonzero: a slot read past the prefix
            if everywhere:
                # valid_for ^ reader is nonzero iff the page is not valid for its reader
                # (NOBODY matches no handle); or-ed into the first word, one reduction
                # answers for both tests
                foreign = self._valid_for.index_select(0, flat).bitwise_xor_(r)
                hit[:, 0].bitwise_or_(foreign)
                return hit.any()
            foreign = self._valid_for.index_select(0, flat) != r
            return (foreign | hit.any(-1)).reshape(shape)
        if isinstance(r, Tensor) and r.shape == flat.shape and flat.shape != shape:
            r = r.reshape(shape)  # granters, flat
        foreign = self._valid_for.index_select(0, flat).reshape(shape) != r
        filled = self._filled.index_select(0, flat).reshape(shape)
        if mask is not None:  # a mask not viewable as words: the last slot marked, + 1
            past = filled < (mask * self._slot_rank).amax(-1)
        elif upto is None:
            past = filled < self._page_size
        else:
            past = filled < self._extent(upto, shape)
        stale = foreign | past
        return stale.any() if everywhere else stale

    def _as_granters(self, flat: Tensor, r: Tensor | int, shape: torch.Size) -> Tensor | int:
        """The handle each read of ``flat`` pages is checked as: its granter where the
        reader was granted the page, else the reader (flat, or ``r`` unchanged without
        grants: the common path costs nothing)."""
        if not self._grants:
            return r
        table = self._grant_table
        if table is None:
            keys = torch.cat([k for k, _ in self._grants.values()])
            granters = torch.cat([g for _, g in self._grants.values()])
            keys, order = torch.sort(keys)
            table = self._grant_table = (keys, granters.index_select(0, order))
        keys, granters = table
        if isinstance(r, Tensor):
            rr = r if r.shape == flat.shape else torch.broadcast_to(r, shape).reshape(-1)
        else:
            rr = torch.full_like(flat, r)
        q = rr * self._num_pages + flat
        at = torch.searchsorted(keys, q).clamp_(max=keys.numel() - 1)
        return torch.where(keys.index_select(0, at) == q, granters.index_select(0, at), rr)

    def _slot_mask(self, mask: Tensor, shape: torch.Size) -> Tensor:
        ms = mask.shape
        if not ms or ms[:-1] != shape or ms[-1] != self._page_size:
            want = (*shape, self._page_size)
            raise ValueError(f"a slot mask of shape {tuple(ms)}, not {want}")
        return mask if mask.device == self.device else mask.to(self.device)

    def _slot_words(self, mask: Tensor) -> Tensor | None:
        """The mask as int64 words of 8 slots (a view, no copy), or None where it cannot be
        viewed so (page size not a multiple of 8, a strided or misaligned mask)."""
        if not self._words or not mask.is_contiguous():
            return None
        try:
            return mask.view(torch.int64)
        except RuntimeError:
            return None

    def _broadcastable(self, values: Tensor, shape: torch.Size, what: str) -> Tensor:
        """``values`` on the ledger's device, checked to be integers that broadcast to
        ``shape`` (returned unflattened: a compare broadcasts)."""
        dtype = values.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{what} must be integers, got {dtype}")
        rs = values.shape
        # by hand: torch.broadcast_shapes costs about a millisecond per call
        if rs != shape and (
            len(rs) > len(shape)
            or any(a not in (1, b) for a, b in zip(reversed(rs), reversed(shape), strict=False))
        ):
            raise ValueError(
                f"{what} of shape {tuple(rs)} do not broadcast to the pages' shape {tuple(shape)}"
            )
        return values if values.device == self.device else values.to(self.device)

    def _readers(self, readers: Tensor | int, shape: torch.Size) -> Tensor | int:
        """Reader handles: an int, or a tensor broadcastable to ``shape``."""
        if not isinstance(readers, Tensor):
            return _check_handle(readers, "reader")
        if readers.dtype == torch.long and readers.device == self.device and readers.shape == shape:
            return readers  # the hot path: the adapter's readers, one per page read
        return self._broadcastable(readers, shape, "handles").long()

    def _extent(self, upto: Tensor | int, shape: torch.Size) -> Tensor | int:
        """Read extents: an int (checked), or a tensor broadcastable to ``shape``."""
        if not isinstance(upto, Tensor):
            return _check_slot(upto, "upto", 0, self._page_size)
        return self._broadcastable(upto, shape, "read extents")

    def _flat(self, values: Tensor, shape: torch.Size, what: str) -> Tensor:
        """A tensor broadcast to ``shape``, flattened."""
        if values.shape == shape and values.dim() == 1 and values.device == self.device:
            if values.dtype.is_floating_point or values.dtype == torch.bool:
                raise TypeError(f"{what} must be integers, got {values.dtype}")
            return values  # the hot path: one value per page, already flat
        v = self._broadcastable(values, shape, what)
        return (v if v.shape == shape else torch.broadcast_to(v, shape)).reshape(-1)

    def _handles(self, handles: Tensor | int, shape: torch.Size, what: str) -> Tensor | int:
        """An int handle (checked), or a tensor of them broadcast to ``shape``, flattened."""
        if not isinstance(handles, Tensor):
            return _check_handle(handles, what)
        flat = self._flat(handles, shape, "handles")
        return flat if flat.dtype == torch.long else flat.long()

    def _slots(
        self, slots: Tensor | int, shape: torch.Size, what: str, low: int, high: int
    ) -> Tensor | int:
        """A slot bound: an int (checked against ``[low, high]``), or a tensor of them
        broadcast to ``shape``, flattened (not checked)."""
        if not isinstance(slots, Tensor):
            return _check_slot(slots, what, low, high)
        return self._flat(slots, shape, f"{what} slots")

    def _report(
        self, pages: PageIds, readers: Tensor | int, stale: Tensor, kind: ReadKind
    ) -> list[StaleRead]:
        """Group the stale reads (the rare path: syncs, and loops over groups only).

        A stale page valid for its reader (for a decode read, the granter it is checked as)
        was read past its prefix: it names who the slots past the prefix are attributed to;
        any other stale page names its last writer."""
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
        # Name each page as it was checked. Only decode reads consult grants; a transfer
        # checks its source pages as the request's own (see transfer()), so they must not be
        # mapped through its grants here either: a granted page still valid for its granter
        # would then look like a read past the granter's prefix and name whoever the slots
        # past it are attributed to (often nobody: None), not the granter, the tenant whose
        # KV the transfer copied.
        if kind == "decode":
            checked_as = self._as_granters(stale_pages, stale_readers, stale_pages.shape)
        else:
            checked_as = stale_readers
        hole = self._valid_for.index_select(0, stale_pages) == checked_as
        named = torch.where(
            hole[:, None],
            self._prev_rows.index_select(0, stale_pages),
            self._writer_rows.index_select(0, stale_pages),
        )
        keys = torch.stack([stale_readers, named[:, _REQ], named[:, _TEN], named[:, _ZERO]], dim=1)
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
