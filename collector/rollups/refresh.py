"""The rollup refresher: recomputes marked buckets from the raw rows.

Request rollups trail ingest by up to a minute (the open 5-minute bucket is recomputed at
most once a minute) plus the refresher's interval; pool rollups by the interval. The
dashboard's short windows read raw rows, and alerts never wait for rollups.

Each pass takes up to ``batch`` marks per transaction; on PostgreSQL with ``FOR UPDATE SKIP
LOCKED``, so replicas refreshing at once share the work instead of queueing on it. Within the
transaction a bucket's mark is deleted *before* its raw rows are read: a batch ingested after
that read marks the bucket again (its insert waits for our delete to commit), so no write is
ever missed, at worst recomputed twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.db import Database
from collector.rollups.buckets import (
    ALL_TENANTS,
    BINS_PER_OCTAVE,
    HOUR_US,
    POOL_BUCKET_US,
    REQUEST_BUCKET_US,
    UNKNOWN_BIN,
    floor_to,
)
from collector.timefmt import to_micros

log = logging.getLogger("kvwatch.rollups")
SETTLE_US = 10_000_000  # late events of a just-closed bucket usually land within this
OPEN_BUCKET_EVERY_US = 60_000_000


@dataclass(slots=True)
class RefreshResult:
    request_buckets: int = 0
    pool_buckets: int = 0

    @property
    def buckets(self) -> int:
        return self.request_buckets + self.pool_buckets


def _due(now_us: int) -> Any:
    """Marks to act on now. A closed bucket is recomputed once it has settled. The open
    request bucket is recomputed at most once per ``OPEN_BUCKET_EVERY_US`` (its mark's
    age): every pass re-reads all its rows, which under steady ingest would grow quadratic in
    the bucket and keep ingest waiting on the mark's lock. Pool buckets are a minute of a
    few samples per node: always due."""
    d = m.RollupDirty
    return sa.or_(
        d.kind != "requests",
        d.bucket_start + REQUEST_BUCKET_US + SETTLE_US <= now_us,
        d.marked_at <= now_us - OPEN_BUCKET_EVERY_US,
    )


class RollupRefresher:
    def __init__(self, db: Database, *, batch: int = 64):
        self.db = db
        self.batch = batch

    def pending(self, now: datetime | None = None) -> int:
        """Marks due for recomputation at ``now`` (default: the clock)."""
        now_us = to_micros(now or datetime.now(UTC))
        with self.db.read() as conn:
            q = select(sa.func.count()).select_from(m.RollupDirty).where(_due(now_us))
            return int(conn.execute(q).scalar_one())

    def refresh(
        self, *, now: datetime | None = None, max_passes: int = 1_000, everything: bool = False
    ) -> RefreshResult:
        """Recompute due buckets until none is left (or ``max_passes`` transactions);
        ``everything``: every marked bucket, due or not (a collector's first pass, so what
        was ingested before it started shows at once)."""
        out = RefreshResult()
        now_us = 2**62 if everything else to_micros(now or datetime.now(UTC))
        for _ in range(max_passes):
            # A read first: an idle refresher must not take SQLite's write lock every pass.
            with self.db.read() as conn:
                q0 = select(m.RollupDirty.kind).where(_due(now_us)).limit(1)
                if conn.execute(q0).first() is None:
                    return out
            with self.db.write() as conn:
                d = m.RollupDirty
                q = (
                    select(d.kind, d.deployment_id, d.bucket_start)
                    .where(_due(now_us))
                    .order_by(d.bucket_start, d.kind, d.deployment_id)
                )
                q = q.limit(self.batch)
                if not self.db.is_sqlite:
                    q = q.with_for_update(skip_locked=True)
                marks = conn.execute(q).all()
                if not marks:
                    return out
                hours: set[tuple[str, int]] = set()
                for kind, dep, bucket in marks:
                    conn.execute(
                        sa.delete(d).where(
                            d.kind == kind, d.deployment_id == dep, d.bucket_start == bucket
                        )
                    )
                    if kind == "requests":
                        _requests(conn, dep, int(bucket))
                        hours.add((dep, floor_to(int(bucket), HOUR_US)))
                        out.request_buckets += 1
                    elif kind == "pool":
                        _pool(conn, dep, int(bucket))
                        out.pool_buckets += 1
                    else:  # a mark from a newer version: leave it to that version
                        log.warning("unknown rollup kind %r ignored", kind)
                # once per hour touched, however many of its buckets the batch held
                for dep, hour in sorted(hours):
                    _hour(conn, dep, hour)
        return out


def mark(conn: Connection, marks: Iterable[tuple[str, str, int]]) -> None:
    """Mark (kind, deployment, bucket)s for recomputation (outside ingest: erasure and
    retention); a bucket already marked keeps its mark."""
    d = m.RollupDirty
    for kind, dep, bucket in sorted(set(marks)):
        exists = conn.execute(
            select(d.kind).where(d.kind == kind, d.deployment_id == dep, d.bucket_start == bucket)
        ).first()
        if exists is None:
            conn.execute(
                sa.insert(d).values(kind=kind, deployment_id=dep, bucket_start=bucket, marked_at=0)
            )


def _prompt_bin(conn: Connection, col: Any) -> Any:
    """``floor(8 * log2(max(prompt, 1)))`` in SQL, -1 for NULL: the same bins as
    :func:`collector.rollups.buckets.bin_of` (SQLite calls it as a registered function)."""
    if conn.dialect.name == "sqlite":
        return sa.func.kvw_prompt_bin(col)
    log2 = sa.func.ln(sa.cast(sa.func.greatest(col, 1), sa.Float)) / math.log(2)
    binned = sa.cast(sa.func.floor(BINS_PER_OCTAVE * log2 + 1e-9), sa.Integer)
    return sa.case((col.is_(None), UNKNOWN_BIN), else_=binned)


_ROLLUP_COLS = [
    "deployment_id",
    "bucket_start",
    "model_id",
    "route",
    "tenant",
    "prompt_bin",
    "requests",
    "rejected",
    "prompt_tokens_max",
    "prompt_tokens_sum",
    "shared_prompts",
    "shared_prompt_tokens",
]


def _requests(conn: Connection, dep: str, bucket: int) -> None:
    # INSERT ... SELECT ... GROUP BY: the database aggregates, so a bucket of millions of
    # requests costs no memory here. Per tenant from the raw rows, then over tenants from
    # those (a few hundred rows, not the raw ones again).
    r, rr = m.Request, m.RequestRollup
    conn.execute(sa.delete(rr).where(rr.deployment_id == dep, rr.bucket_start == bucket))
    first = type_coerce(r.first_ts, BigInteger)
    pbin = _prompt_bin(conn, r.prompt_tokens).label("prompt_bin")
    shared = r.prompt_shared_with.is_not(None)
    source = (
        select(
            sa.literal(dep, sa.String),
            sa.literal(bucket, BigInteger),
            r.model_id,
            r.route,
            r.tenant,
            pbin,
            sa.func.count(),
            sa.func.sum(sa.case((r.status == "rejected", 1), else_=0)),
            sa.func.max(r.prompt_tokens),
            sa.func.coalesce(sa.func.sum(r.prompt_tokens), 0),
            sa.func.sum(sa.case((shared, 1), else_=0)),
            sa.func.coalesce(sa.func.sum(sa.case((shared, r.prompt_tokens), else_=None)), 0),
        )
        .where(r.deployment_id == dep, first >= bucket, first < bucket + REQUEST_BUCKET_US)
        .group_by(r.model_id, r.route, r.tenant, pbin)
    )
    conn.execute(sa.insert(rr).from_select(_ROLLUP_COLS, source))
    _sum_rollups(conn, rr, rr, dep, bucket, REQUEST_BUCKET_US, over_tenants=True)


def _hour(conn: Connection, dep: str, hour: int) -> None:
    """The hourly tier's rows of one hour, from its 5-minute rows (``'*'`` ones included)."""
    h = m.RequestRollupHourly
    conn.execute(sa.delete(h).where(h.deployment_id == dep, h.bucket_start == hour))
    _sum_rollups(conn, m.RequestRollup, h, dep, hour, HOUR_US, over_tenants=False)


def _sum_rollups(
    conn: Connection,
    src: Any,
    dst: Any,
    dep: str,
    start: int,
    width: int,
    *,
    over_tenants: bool,
) -> None:
    """Insert into ``dst``, at ``start``, the sums of ``src``'s rows in [start, start +
    width): per tenant (``'*'`` rows included), or ``over_tenants`` as ``'*'`` rows."""
    tenant = sa.literal(ALL_TENANTS, sa.String) if over_tenants else src.tenant
    keys = [src.model_id, src.route, src.prompt_bin] + ([] if over_tenants else [src.tenant])
    source = (
        select(
            sa.literal(dep, sa.String),
            sa.literal(start, BigInteger),
            src.model_id,
            src.route,
            tenant,
            src.prompt_bin,
            sa.func.sum(src.requests),
            sa.func.sum(src.rejected),
            sa.func.max(src.prompt_tokens_max),
            sa.func.sum(src.prompt_tokens_sum),
            sa.func.sum(src.shared_prompts),
            sa.func.sum(src.shared_prompt_tokens),
        )
        .where(
            src.deployment_id == dep,
            src.bucket_start >= start,
            src.bucket_start < start + width,
            *([src.tenant != ALL_TENANTS] if over_tenants else []),
        )
        .group_by(*keys)
    )
    conn.execute(sa.insert(dst).from_select(_ROLLUP_COLS, source))


def _pool(conn: Connection, dep: str, bucket: int) -> None:
    p, pr = m.PoolSample, m.PoolRollup
    conn.execute(sa.delete(pr).where(pr.deployment_id == dep, pr.bucket_start == bucket))
    ts = type_coerce(p.ts, BigInteger)
    source = (
        select(
            p.deployment_id,
            sa.literal(bucket, BigInteger),
            p.node,
            p.role,
            sa.func.count(),
            sa.func.sum(p.used_tokens),
            sa.func.max(p.used_tokens),
            sa.func.min(p.free_tokens),
            sa.func.max(p.capacity_tokens),
        )
        .where(p.deployment_id == dep, ts >= bucket, ts < bucket + POOL_BUCKET_US)
        .group_by(p.deployment_id, p.node, p.role)
    )
    conn.execute(
        sa.insert(pr).from_select(
            [
                "deployment_id",
                "bucket_start",
                "node",
                "role",
                "samples",
                "used_sum",
                "used_max",
                "free_min",
                "capacity_max",
            ],
            source,
        )
    )
