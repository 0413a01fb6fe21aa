"""A paged KV pool and its free-list page allocator.

Pages are the unit of allocation, transfer and observation; slots (``page_size`` per page)
are the unit of writes. Page ids are int64 tensors on the pool's device everywhere, so the
hot path never turns them into Python lists (which would synchronise a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from refengine.errors import PoolExhausted

Role = Literal["prefill", "decode", "both"]


class KVPool:
    """K and V tensors ``[num_pages, page_size, heads, head_dim]`` plus a LIFO free list.

    Invariants:

    * ``_stack[:free_pages]`` holds each free page id exactly once; every other page is owned
      by exactly one live request, or, with the prefix cache on, is a cached page: idle (held
      by nobody) or held by each live request whose block table has it, as many as its
      reference count (the engine and :class:`~refengine.prefix_cache.PrefixCache` keep that
      side, see ``Engine.check_invariants``). The pool itself knows nothing of the cache: a
      cached page is simply not free.
    * ``free(pages)`` followed by ``alloc(len(pages))`` returns the same pages in the same
      order: the most recently freed pages go out first, and in block-table order. Engines
      favour recently freed pages (they are warm in cache); it also means a stale read comes
      out as a coherent fragment of the previous owner's text, as in the incident.
    * Freeing does not touch page contents unless ``zeroize_on_free``: a freed page keeps the
      previous owner's K/V until someone overwrites it. That is the realistic behaviour
      behind the incident, not an oversight.
    * The allocator trusts its caller: it does not detect double frees (that would need a
      device-to-host sync per call); ``check`` does, for tests.
    """

    def __init__(
        self,
        *,
        name: str,
        role: Role,
        num_pages: int,
        page_size: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroize_on_free: bool = False,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("a pool needs at least one page of at least one slot")
        self.name = name
        self.role: Role = role
        self.num_pages = num_pages
        self.page_size = page_size
        self.heads = heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.zeroize_on_free = zeroize_on_free
        shape = (num_pages, page_size, heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Flipped so that a fresh pool hands out pages 0, 1, 2, ... in order.
        self._stack = torch.arange(num_pages, dtype=torch.int64, device=device).flip(0)
        self._free = num_pages
        #: pages the prefix cache keeps that no request holds (evictable; kept up to date by
        #: :class:`~refengine.prefix_cache.PrefixCache`): not free, yet not in use either
        self.cached_idle_pages = 0

    # -- capacity ------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return self._free

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._free

    @property
    def free_tokens(self) -> int:
        return self._free * self.page_size

    @property
    def used_tokens(self) -> int:
        """Tokens of capacity held by allocated pages (whole pages, written or not)."""
        return self.used_pages * self.page_size

    @property
    def held_tokens(self) -> int:
        """Tokens of capacity held by live requests: ``used_tokens`` less the idle cached
        pages (what vLLM's KV-cache usage counts: its evictable cached blocks are free)."""
        return (self.num_pages - self._free - self.cached_idle_pages) * self.page_size

    @property
    def available_tokens(self) -> int:
        """Tokens of capacity an allocation can have: free, or cached and idle (evictable)."""
        return (self._free + self.cached_idle_pages) * self.page_size

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- allocator -----------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` page ids (int64, on the pool's device); contents are whatever they were."""
        if n > self._free:
            raise PoolExhausted(f"pool {self.name!r}: asked for {n} pages, {self._free} free")
        top = self._free
        self._free -= n
        # flip() copies, so later pushes onto the stack cannot change the pages handed out.
        return self._stack[top - n : top].flip(0)

    def free(self, pages: torch.Tensor) -> bool:
        """Return ``pages`` to the free list; returns whether they were zeroized."""
        n = pages.shape[0]
        if self._free + n > self.num_pages:
            raise PoolExhausted(f"pool {self.name!r}: freeing {n} pages overflows the free list")
        if self.zeroize_on_free and n:
            self.k.index_fill_(0, pages, 0)
            self.v.index_fill_(0, pages, 0)
        self._stack[self._free : self._free + n] = pages.flip(0)
        self._free += n
        return self.zeroize_on_free

    def free_page_ids(self) -> torch.Tensor:
        """The free pages (a copy), next to be allocated first."""
        return self._stack[: self._free].flip(0).clone()

    def check(
        self,
        owned: list[torch.Tensor],
        *,
        idle: Sequence[int] = (),
        shared: Mapping[int, int] | None = None,
    ) -> None:
        """Assert the allocator invariant against the pages the engine says are owned (the
        live requests' block tables), the prefix cache's ``idle`` pages and its reference
        counts (``shared``: cached page -> live requests holding it): every page is listed
        exactly once (free, idle, or in one block table), except a cached page held by
        ``n >= 1`` requests, listed ``n`` times.

        Synchronises the device: for tests and debugging only.
        """
        every = torch.cat(
            [
                self._stack[: self._free],
                torch.tensor(list(idle), dtype=torch.int64, device=self.device),
                *[p.to(self.device) for p in owned],
            ]
        )
        counts = torch.bincount(every, minlength=self.num_pages)
        expected = torch.ones(self.num_pages, dtype=torch.int64, device=self.device)
        for page, n in (shared or {}).items():
            if n > 0:
                expected[page] = n
        if counts.numel() != self.num_pages or bool((counts != expected).any()):
            raise AssertionError(
                f"pool {self.name!r}: free, cached and owned pages do not account for every "
                f"page once (or a shared page once per holder) "
                f"({every.numel()} ids for {self.num_pages} pages)"
            )

    # -- slot access ---------------------------------------------------------------------

    def slots(self, pages: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Flat slot ids (``page * page_size + offset``) of positions ``start..start+count-1``
        of a block table ``pages``."""
        pos = torch.arange(start, start + count, device=self.device)
        return pages.index_select(0, pos // self.page_size) * self.page_size + pos % self.page_size

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ``[N, heads, head_dim]`` at flat ``slots`` ``[N]``."""
        flat = (self.num_pages * self.page_size, self.heads, self.head_dim)
        self.k.view(flat).index_copy_(0, slots, k)
        self.v.view(flat).index_copy_(0, slots, v)

    def gather(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of whole pages: ``[len(pages), page_size, heads, head_dim]`` each."""
        return self.k.index_select(0, pages), self.v.index_select(0, pages)

    def copy_from(self, src: KVPool, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Copy whole pages (every slot, written or not, as RDMA of a page would)."""
        self.k.index_copy_(0, dst_pages, src.k.index_select(0, src_pages).to(self.device))
        self.v.index_copy_(0, dst_pages, src.v.index_select(0, src_pages).to(self.device))

    def __repr__(self) -> str:
        return (
            f"KVPool(name={self.name!r}, role={self.role!r}, pages={self.num_pages}, "
            f"page_size={self.page_size}, used={self.used_pages}, device={self.device})"
        )
