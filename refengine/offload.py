"""The offload tier: prefix-cache pages the pool evicts, kept in host memory and loaded back
into a later request's pages, as vLLM's native CPU offloading and LMCache's CPU tier do.

Keys
----
An entry is stored under the evicted page's *tier key*: its prefix-cache key (the salted
chain of :mod:`refengine.prefix_cache`), so a tier keeps the cache's isolation. The engine's
``offload_drops_salt`` fault keys it instead by the unsalted chain (the tokens alone), as
LMCache's SGLang path did (LMCache #4825): a request with another salt, or of another tenant
under server-side salting, is then served a prefix someone else computed.

State and invariants
--------------------
1. At most ``capacity_pages`` entries; storing past it drops the least recently used first
   (``dropped`` counts them). A key is stored once: storing it again refreshes its place.
2. An entry holds a copy of one page's K/V as its writer's prefill wrote it (host memory,
   never the pool's own storage), with the handle of that request and its tenant's handle:
   what the engine's observers are told a load carries.
3. Loading never removes an entry (other requests may load the same prefix), and never
   changes its content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TierEntry:
    k: torch.Tensor  # [page_size, heads, head_dim], host memory
    v: torch.Tensor
    writer: int  # the handle of the request whose prefill wrote the page
    writer_tenant: int


class OffloadTier:
    """Pages kept past the pool (see the module docstring for the invariants)."""

    def __init__(self, capacity_pages: int) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be >= 1, not {capacity_pages}")
        self.capacity_pages = capacity_pages
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self.stored = 0
        self.loaded = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, key: bytes, entry: TierEntry) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        self.stored += 1
        while len(entries) > self.capacity_pages:
            entries.popitem(last=False)
            self.dropped += 1

    def lookup(self, keys: Sequence[bytes]) -> list[TierEntry]:
        """The entries of the longest run of leading ``keys`` the tier holds (no change)."""
        out: list[TierEntry] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            out.append(entry)
        return out

    def touch(self, keys: Sequence[bytes]) -> None:
        """``keys`` were just loaded: most recently used now."""
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)
        self.loaded += len(keys)
