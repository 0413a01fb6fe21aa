"""The probe's own record of what went into an engine's offload tier, and the verdict on
each load back: whose write a loaded page carries, against the request that reads it.

The engine says whose write it loads (its own bookkeeping); the probe does not take that on
trust. At a store it records, under the tier's key, the writer the probe itself saw write
the page (request, tenant, and a digest of its cache salt); at a load it looks the key up
and compares that writer with the reader. A load of another tenant's write is a
cross-tenant prefix hit; a load across salts (any tenants) means the tier's key dropped the
salt. A key the probe never saw stored (stored before it attached, or dropped from this
record) has an unknown writer and is counted, never guessed.

Invariants: one record per key (a later store under the same key replaces it: the tier
holds that one too); at most ``capacity`` records, least recently stored or loaded dropped
first (``dropped`` counts them). Salts are kept as digests, never as the salt itself.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def salt_digest(salt: str | None) -> bytes | None:
    return None if salt is None else hashlib.sha256(salt.encode("utf-8")).digest()[:16]


@dataclass(frozen=True, slots=True)
class TierWriter:
    request_id: str
    tenant: str
    salt: bytes | None  # salt_digest of the writer's cache_salt


@dataclass(frozen=True, slots=True)
class TierLoad:
    """One loaded page's verdict: its writer (None: unknown) against the reader."""

    writer: TierWriter | None
    cross_tenant: bool
    salt_mismatch: bool


class TierLedger:
    """Writers of the pages in one offload tier, by the tier's key (see the module
    docstring for the invariants)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[bytes, TierWriter] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._records)

    def store(self, key: bytes, writer: TierWriter) -> None:
        records = self._records
        records[key] = writer
        records.move_to_end(key)
        if len(records) > self.capacity:
            records.popitem(last=False)
            self.dropped += 1

    def forget(self, key: bytes) -> None:
        """The tier now holds a write under ``key`` whose writer is not known."""
        self._records.pop(key, None)

    def load(self, key: bytes, tenant: str, salt: bytes | None) -> TierLoad:
        writer = self._records.get(key)
        if writer is None:
            return TierLoad(None, False, False)
        self._records.move_to_end(key)
        return TierLoad(writer, writer.tenant != tenant, writer.salt != salt)
