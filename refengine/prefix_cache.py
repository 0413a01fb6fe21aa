"""The prefix cache: full prompt pages kept after their request, found again by their tokens.

Keys
----
A prompt's *full* pages (``page_size`` tokens each; a partial last page is never cached) are
keyed in a chain: page ``i``'s key is ``sha256(key(i - 1) || tokens of page i)``, so a page
matches only together with its whole prefix. The chain starts from a root that holds the
salt: nothing in ``shared`` mode (a request's ``cache_salt`` is ignored: the insecure
setting), the request's ``cache_salt`` in ``salted`` mode, and the tenant as well when
salting by tenant. Root fields are length-prefixed, so no salt can spell a tenant.

State and invariants
--------------------
Page ids here are host ints (the cache's bookkeeping is host-side, as vLLM's block pool is);
the engine copies a block table to the host once per prefill and once per free, only while
the cache is on. Per cached page ``p``: ``key_of[p]`` (the key it is cached under),
``computed_by[p]`` (the handle of the request whose prefill wrote it) and ``refs[p]``.

1. ``by_key`` and ``key_of`` are inverse maps: each key names one page, each cached page
   one key.
2. ``refs[p]`` is the number of live requests whose block table holds ``p``; a cached page
   is in ``idle`` (an LRU, least recently released first) iff ``refs[p] == 0``.
3. A cached page is never in the pool's free list. So every page of the pool is exactly
   one of: free (in the pool's free list, held by nobody), cached and idle (in ``idle``,
   held by nobody), or held by live requests: by exactly one if it is not cached, by
   ``refs[p] >= 1`` if it is. ``Engine.check_invariants`` checks this (``KVPool.check``).
4. A cached page holds exactly what its computing request's prefill wrote into it, the
   tokens its key chains: nobody writes into a cached page (decode writes past the prompt,
   and only full prompt pages are cached), and it leaves the cache only by eviction, which
   returns it to the free list (zeroized when the pool zeroizes freed pages) before
   anyone can be handed it.
5. Eviction takes only idle pages, least recently released first: a page a live request
   holds is never evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.pool import KVPool

ROOT_TAG = b"refengine-prefix-cache-v1"


def _field(tag: bytes, value: str) -> bytes:
    data = value.encode("utf-8")
    return tag + len(data).to_bytes(8, "big") + data


def root_key(*, salt: str | None = None, tenant: str | None = None) -> bytes:
    """The key the chain starts from: the salt and the tenant, where they take part."""
    h = hashlib.sha256(ROOT_TAG)
    if salt is not None:
        h.update(_field(b"S", salt))
    if tenant is not None:
        h.update(_field(b"T", tenant))
    return h.digest()


def page_keys(tokens: bytes, page_size: int, root: bytes) -> list[bytes]:
    """The chained keys of the full pages of ``tokens`` (the prompt, one token per byte)."""
    keys: list[bytes] = []
    parent = root
    for i in range(len(tokens) // page_size):
        parent = hashlib.sha256(parent + tokens[i * page_size : (i + 1) * page_size]).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """The cached pages of one pool (see the module docstring for the invariants). Given the
    pool, it keeps ``pool.cached_idle_pages`` equal to ``idle_pages``."""

    def __init__(self, num_pages: int, pool: KVPool | None = None) -> None:
        self.num_pages = num_pages
        self.pool = pool
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.computed_by: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()
        #: counters, vLLM's prefix-cache queries and hits, in tokens
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    @property
    def cached_pages(self) -> int:
        return len(self.key_of)

    @property
    def idle_pages(self) -> int:
        return len(self.idle)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of leading ``keys`` that are cached (no change)."""
        pages: list[int] = []
        by_key = self.by_key
        for key in keys:
            page = by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Iterable[int]) -> None:
        """A live request now holds these cached pages (they leave ``idle``)."""
        refs, idle = self.refs, self.idle
        for p in pages:
            refs[p] += 1
            idle.pop(p, None)
        self._sync()

    def insert(self, key: bytes, page: int, computed_by: int) -> bool:
        """Cache ``page`` (held by its computing request, ``refs`` 1) under ``key``; False,
        with nothing changed, when the key is cached already (another request prefilled the
        same prefix meanwhile: this page stays its request's own)."""
        if key in self.by_key:
            return False
        self.by_key[key] = page
        self.key_of[page] = key
        self.computed_by[page] = computed_by
        self.refs[page] = 1
        return True

    def release(self, pages: Iterable[int]) -> None:
        """A request holding these cached pages let them go; unheld ones become idle, most
        recently used last."""
        refs, idle = self.refs, self.idle
        for p in pages:
            n = refs[p] - 1
            refs[p] = n
            if n == 0:
                idle[p] = None
            elif n < 0:
                raise AssertionError(f"cached page {p} released more often than acquired")
        self._sync()

    def evict(self, n: int) -> list[tuple[int, int]]:
        """Take the ``n`` least recently used idle pages out of the cache (for the free
        list): ``(page, the handle of the request that computed it)`` each."""
        if n > len(self.idle):
            raise AssertionError(f"asked to evict {n} pages, {len(self.idle)} idle")
        out: list[tuple[int, int]] = []
        for _ in range(n):
            p, _ = self.idle.popitem(last=False)
            del self.by_key[self.key_of.pop(p)]
            out.append((p, self.computed_by.pop(p)))
            del self.refs[p]
        self.evictions += n
        self._sync()
        return out

    def _sync(self) -> None:
        if self.pool is not None:
            self.pool.cached_idle_pages = len(self.idle)

    def check(self, free: Iterable[int], held: dict[int, int]) -> None:
        """Assert invariants 1-3 against the pool's free pages and ``held`` (page -> how many
        live requests' block tables hold it). Tests only."""
        assert len(self.by_key) == len(self.key_of), "by_key and key_of differ in size"
        for key, p in self.by_key.items():
            assert self.key_of.get(p) == key, f"page {p} is not cached under its key"
        assert set(self.refs) == set(self.key_of) == set(self.computed_by), "cache maps differ"
        free_set = set(free)
        for p, n in self.refs.items():
            assert p not in free_set, f"cached page {p} is in the free list"
            assert n == held.get(p, 0), f"cached page {p}: refs {n}, held by {held.get(p, 0)}"
            assert (n == 0) == (p in self.idle), f"cached page {p}: refs {n} vs idle"
        assert set(self.idle) <= set(self.refs), "an idle page is not cached"
        if self.pool is not None:
            assert self.pool.cached_idle_pages == len(self.idle), "the pool's idle count is off"
