"""The rollup refresher: recomputes marked buckets from the raw rows, once they have closed.

Rollups therefore trail ingest by up to a bucket (5 minutes for requests, 1 minute for pool
samples) plus ``SETTLE_US`` plus the refresher's interval; the dashboard's short windows read
raw rows, and alerts never wait for rollups.

Each pass takes up to ``batch`` marks per transaction; on PostgreSQL with ``FOR UPDATE SKIP
LOCKED``, so replicas refreshing at once share the work instead of queueing on it. Within the
transaction a bucket's mark is deleted *before* its raw rows are read: a batch ingested after
that read marks the bucket again (its insert waits for our delete to commit), so no write is
ever missed, at worst recomputed twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pandas as pd
import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.db import Database
from collector.rollups.buckets import POOL_BUCKET_US, REQUEST_BUCKET_US, prompt_bins

log = logging.getLogger("kvwatch.rollups")
SETTLE_US = 10_000_000  # late events of a just-closed bucket usually land within this


@dataclass(slots=True)
class RefreshResult:
    request_buckets: int = 0
    pool_buckets: int = 0

    @property
    def buckets(self) -> int:
        return self.request_buckets + self.pool_buckets


def _due(now_us: int) -> Any:
    """Marks of buckets that closed at least ``SETTLE_US`` ago. The open bucket is left
    alone: recomputing it on every pass would read all of its rows again and again (quadratic
    in its size under steady ingest), and hold its mark while ingest waits to re-mark it."""
    d = m.RollupDirty
    return sa.or_(
        sa.and_(d.kind == "requests", d.bucket_start + REQUEST_BUCKET_US + SETTLE_US <= now_us),
        sa.and_(d.kind != "requests", d.bucket_start + POOL_BUCKET_US + SETTLE_US <= now_us),
    )


class RollupRefresher:
    def __init__(self, db: Database, *, batch: int = 64):
        self.db = db
        self.batch = batch

    def pending(self, now: datetime | None = None) -> int:
        """Marks due for recomputation at ``now`` (default: the clock)."""
        now_us = m.to_micros(now or datetime.now(UTC))
        with self.db.read() as conn:
            q = select(sa.func.count()).select_from(m.RollupDirty).where(_due(now_us))
            return int(conn.execute(q).scalar_one())

    def refresh(self, *, now: datetime | None = None, max_passes: int = 1_000) -> RefreshResult:
        """Recompute due buckets until none is left (or ``max_passes`` transactions)."""
        out = RefreshResult()
        now_us = m.to_micros(now or datetime.now(UTC))
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
                for kind, dep, bucket in marks:
                    conn.execute(
                        sa.delete(d).where(
                            d.kind == kind, d.deployment_id == dep, d.bucket_start == bucket
                        )
                    )
                    if kind == "requests":
                        _requests(conn, dep, int(bucket))
                        out.request_buckets += 1
                    elif kind == "pool":
                        _pool(conn, dep, int(bucket))
                        out.pool_buckets += 1
                    else:  # a mark from a newer version: leave it to that version
                        log.warning("unknown rollup kind %r ignored", kind)
        return out


def _requests(conn: Connection, dep: str, bucket: int) -> None:
    r, rr = m.Request, m.RequestRollup
    conn.execute(sa.delete(rr).where(rr.deployment_id == dep, rr.bucket_start == bucket))
    first = type_coerce(r.first_ts, BigInteger)
    rows = conn.execute(
        select(r.model_id, r.route, r.tenant, r.status, r.prompt_tokens).where(
            r.deployment_id == dep, first >= bucket, first < bucket + REQUEST_BUCKET_US
        )
    ).all()
    if not rows:
        return
    df = pd.DataFrame(rows, columns=["model_id", "route", "tenant", "status", "prompt_tokens"])
    prompt = pd.to_numeric(df["prompt_tokens"], errors="coerce").astype("float64")
    df["prompt_bin"] = prompt_bins(prompt.to_numpy())
    df["rejected"] = (df["status"] == "rejected").astype("int64")
    df["prompt"] = prompt
    # NULL labels are grouped as themselves, not dropped.
    keys = ["model_id", "route", "tenant", "prompt_bin"]
    g = df.groupby(keys, dropna=False, sort=True)
    agg = g.agg(
        requests=("rejected", "size"),
        rejected=("rejected", "sum"),
        prompt_tokens_max=("prompt", "max"),
        prompt_tokens_sum=("prompt", "sum"),
    ).reset_index()
    conn.execute(
        sa.insert(rr),
        [
            {
                "deployment_id": dep,
                "bucket_start": bucket,
                "model_id": None if pd.isna(a.model_id) else a.model_id,
                "route": None if pd.isna(a.route) else a.route,
                "tenant": a.tenant,
                "prompt_bin": int(a.prompt_bin),
                "requests": int(a.requests),
                "rejected": int(a.rejected),
                "prompt_tokens_max": None
                if pd.isna(a.prompt_tokens_max)
                else int(a.prompt_tokens_max),
                "prompt_tokens_sum": int(a.prompt_tokens_sum),
            }
            for a in agg.itertuples(index=False)
        ],
    )


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
