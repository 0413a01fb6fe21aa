"""Bucket widths and prompt-size bins, shared by ingest's marks, the refresher and readers."""

from __future__ import annotations

import math
from collections.abc import Iterable

REQUEST_BUCKET_US = 300_000_000  # 5 minutes, by a request's first_ts
POOL_BUCKET_US = 60_000_000  # 1 minute
HOUR_US = 3_600_000_000  # the second request tier (a whole number of REQUEST_BUCKET_US)
ALL_TENANTS = "*"  # the rollup rows summed over tenants (never a valid tenant id)
BINS_PER_OCTAVE = 8  # bins 2**(1/8) - 1 = 9% wide
UNKNOWN_BIN = -1


def floor_to(ts_us: int, width: int) -> int:
    return ts_us // width * width


def request_marks(first_ts: Iterable[int]) -> set[int]:
    """The request buckets a batch touches. A request's stored ``first_ts`` can move earlier
    when an earlier event of it arrives later (a spooled prefill probe): the bucket after
    also gets a mark, so the one it left is recomputed (requests shorter than a bucket)."""
    out: set[int] = set()
    for ts in first_ts:
        b = floor_to(ts, REQUEST_BUCKET_US)
        out.add(b)
        out.add(b + REQUEST_BUCKET_US)
    return out


def bin_low(b: int) -> float:
    """The smallest prompt size in bin ``b``."""
    return 0.0 if b <= 0 else 2.0 ** (b / BINS_PER_OCTAVE)


def bin_high(b: int) -> float:
    """The bound above bin ``b`` (exclusive)."""
    return 2.0 ** ((b + 1) / BINS_PER_OCTAVE)


def bin_of(tokens: int) -> int:
    return math.floor(BINS_PER_OCTAVE * math.log2(max(tokens, 1)) + 1e-9)
