"""A mirror of the engine's prefix cache, as its events describe it, and what each interval
of them proves.

Per cached block hash, the mirror keeps whether the block's chain starts with a salted
first block (vLLM puts the cache salt into the extra keys of a prompt's first block only; a
later block inherits its parent's), a digest of that salt (never the salt: salts are the
clients' secrets, and only their equality matters), and the session that first stored it.
A block whose parent the mirror never saw (stored before the consumer joined, or in a batch
that was lost) is of unknown salting. The mirror is bounded: past ``max_blocks`` the oldest
entries are forgotten, and what chains from them becomes unknown.

What an interval proves (:class:`Interval`): how many blocks were stored and removed, how
many of the stored were unsalted (a request whose prompt shares the cache's unsalted
namespace: any other unsalted request with the same prefix hits it), salted, or stored
again while cached (in vLLM's ``kv_cache_report_mode: full`` a hit is reported as a store;
otherwise a hit is no event at all), and of those how many by another session.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kvwatch.kv_events.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
)

Salting = Literal["unsalted", "salted", "unknown"]
MAX_BLOCKS: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class _Block:
    salting: Salting
    salt: bytes | None  # a digest of the salt, for salted blocks
    session: str | None


@dataclass
class Interval:
    """The counts of one interval (the fields of ``events.KvTurnover``, less its stamps)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    unsalted_blocks: int = 0
    salted_blocks: int = 0
    restored_blocks: int = 0
    cross_session_blocks: int = 0
    unknown_kinds: int = 0
    batches: int = 0

    def turnover_fields(self) -> dict[str, Any]:
        return {
            "stored_blocks": self.stored_blocks,
            "removed_blocks": self.removed_blocks,
            "cleared": self.cleared,
            "unsalted_blocks": self.unsalted_blocks,
            "salted_blocks": self.salted_blocks,
            "restored_blocks": self.restored_blocks,
            "cross_session_blocks": self.cross_session_blocks,
        }


@dataclass
class Totals:
    """Since the start: the interval counts summed, and what has been seen at all."""

    counts: Interval = field(default_factory=Interval)
    salts: set[bytes] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    block_sizes: set[int] = field(default_factory=set)
    media: set[str] = field(default_factory=set)

    def summary(self) -> dict[str, object]:
        c = self.counts
        return {
            **c.turnover_fields(),
            "batches": c.batches,
            "unknown_kinds": c.unknown_kinds,
            "distinct_salts": len(self.salts),
            "distinct_sessions": len(self.sessions),
            "block_sizes": sorted(self.block_sizes),
            "media": sorted(self.media),
        }


def salt_digest(salt: str) -> bytes:
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()[:16]


class Mirror:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        self.interval = Interval()
        self.totals = Totals()

    def __len__(self) -> int:
        return len(self._blocks)

    def salting_of(self, block_hash: BlockHash) -> Salting | None:
        """The mirror's knowledge of a cached block (None: not cached as far as it knows)."""
        b = self._blocks.get(block_hash)
        return None if b is None else b.salting

    def take(self) -> Interval:
        """The interval's counts; a new interval starts."""
        done, self.interval = self.interval, Interval()
        return done

    def reset(self) -> None:
        """The publisher restarted: its cache is new, nothing the mirror held is cached (a
        whole-cache reset, counted as ``cleared`` like vLLM's ``AllBlocksCleared``)."""
        self._blocks.clear()
        self._add("cleared", 1)

    def apply(self, events: list[KvEvent], unknown: int = 0) -> None:
        self.interval.batches += 1
        self.totals.counts.batches += 1
        self._add("unknown_kinds", unknown)
        for e in events:
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self._blocks.pop(h, None)
                self._add("removed_blocks", len(e.block_hashes))
                if e.medium:
                    self.totals.media.add(e.medium[:32])
            elif isinstance(e, AllBlocksCleared):
                self._blocks.clear()
                self._add("cleared", 1)

    def _add(self, name: str, n: int) -> None:
        if n:
            setattr(self.interval, name, getattr(self.interval, name) + n)
            setattr(self.totals.counts, name, getattr(self.totals.counts, name) + n)

    def _stored(self, e: BlockStored) -> None:
        t = self.totals
        if e.block_size:
            t.block_sizes.add(e.block_size)
        if e.medium:
            t.media.add(e.medium[:32])
        session = e.session_id or None
        if session is not None and len(t.sessions) < 65_536:
            t.sessions.add(session)
        if e.parent_block_hash is None:
            salt = e.salt_of_first_block()
            if salt:
                digest = salt_digest(salt)
                if len(t.salts) < 65_536:
                    t.salts.add(digest)
                head = _Block("salted", digest, session)
            else:
                head = _Block("unsalted", None, session)
        else:
            parent = self._blocks.get(e.parent_block_hash)
            head = (
                _Block(parent.salting, parent.salt, session)
                if parent
                else _Block("unknown", None, session)
            )
        for h in e.block_hashes:
            old = self._blocks.get(h)
            if old is not None:
                self._add("restored_blocks", 1)
                if old.session is not None and session is not None and old.session != session:
                    self._add("cross_session_blocks", 1)
                self._blocks.move_to_end(h)
                # a hit's report: the block keeps what its first store said of it, and the
                # blocks after it in this store chain from it
                head = _Block(old.salting, old.salt, session)
                self._count_salting(old)
                continue
            else:
                self._blocks[h] = head
                if len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
            self._count_salting(head)
        self._add("stored_blocks", len(e.block_hashes))

    def _count_salting(self, block: _Block) -> None:
        if block.salting == "unsalted":
            self._add("unsalted_blocks", 1)
        elif block.salting == "salted":
            self._add("salted_blocks", 1)
