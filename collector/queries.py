"""Read repository: the SQL behind the read API. Functions take a connection and plain
filters; authorisation and paging policy live in ``collector.reads``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection, func, select, tuple_

from collector import models as m
from collector.rollups.buckets import POOL_BUCKET_US, floor_to
from collector.timefmt import to_micros
from engine_probe import events as ev
from policies.facts import ProbeFact, superseded

# Buckets at least this wide come from the per-minute pool rollups.
ROLLUP_MIN_WIDTH_US = 5 * 60 * 1_000_000


@dataclass(frozen=True, slots=True)
class RequestFilter:
    deployment_id: str | None = None
    model_id: str | None = None
    tenant: str | None = None
    route: str | None = None
    since_us: int | None = None
    until_us: int | None = None
    min_prompt_tokens: int | None = None


def _latest(model: Any) -> Any:
    """The newest row (by event time, then id) of each (deployment, node, role): what a
    config or a pool is now, even when an older event arrived last."""
    rank = (
        func.row_number()
        .over(
            partition_by=(model.deployment_id, model.node, model.role),
            order_by=(model.ts.desc(), model.id.desc()),
        )
        .label("rank")
    )
    ranked = select(model.id, rank).subquery()
    newest = select(ranked.c.id).where(ranked.c.rank == 1)
    return (
        select(model)
        .where(model.id.in_(newest))
        .order_by(model.deployment_id, model.node, model.role)
    )


def latest_configs(conn: Connection) -> list[Any]:
    return list(conn.execute(_latest(m.DeploymentConfig)))


def latest_pool_samples(conn: Connection, deployments: list[str] | None = None) -> list[Any]:
    """The latest sample of each (deployment, node, role), of ``deployments`` (default:
    all). The table is large: each deployment's newest rows come from a backward scan of its
    (deployment_id, ts) index, and a node that has sent nothing among them counts as
    silent."""
    out = []
    if deployments is None:
        deployments = list(conn.execute(select(m.Deployment.id)).scalars())
    for dep in deployments:
        seen: set[tuple[str, str]] = set()
        for p in conn.execute(
            select(m.PoolSample)
            .where(m.PoolSample.deployment_id == dep)
            .order_by(m.PoolSample.ts.desc(), m.PoolSample.id.desc())
            .limit(256)
        ):
            if (p.node, p.role) not in seen:
                seen.add((p.node, p.role))
                out.append(p)
    return out


def list_deployments(conn: Connection) -> list[dict[str, Any]]:
    configs: dict[str, list[dict[str, Any]]] = {}
    for c in latest_configs(conn):
        configs.setdefault(c.deployment_id, []).append(_config(c))
    out = []
    for d in conn.execute(select(m.Deployment).order_by(m.Deployment.id)):
        out.append(
            {
                "deployment_id": d.id,
                "first_seen": d.first_seen,
                "last_seen": d.last_seen,
                "config": configs.get(d.id, []),
            }
        )
    return out


def config_history(conn: Connection, deployment_id: str) -> list[dict[str, Any]]:
    return [
        _config(c)
        for c in conn.execute(
            select(m.DeploymentConfig)
            .where(m.DeploymentConfig.deployment_id == deployment_id)
            .order_by(m.DeploymentConfig.ts, m.DeploymentConfig.id)
        )
    ]


def _config(c: Any) -> dict[str, Any]:
    return {
        "node": c.node,
        "role": c.role,
        "ts": c.ts,
        "engine": c.engine,
        "engine_version": c.engine_version,
        "model_id": c.model_id,
        "advertised_context": c.advertised_context,
        "pool_capacity_tokens": c.pool_capacity_tokens,
        "page_size": c.page_size,
        "dtype": c.dtype,
        "quantization": c.quantization,
        "tp_size": c.tp_size,
        "cuda_graphs": c.cuda_graphs,
        "disaggregated": c.disaggregated,
        "prefix_caching": c.prefix_caching,
        "prefix_cache_salting": c.prefix_cache_salting,
        "kv_connector": c.kv_connector,
        "kv_connector_version": c.kv_connector_version,
        "kv_tiers": [msgspec.structs.asdict(t) for t in ev.decode_tiers(c.kv_tiers)],
        "config_hash": c.config_hash,
    }


REQUEST_FIELDS = (
    "deployment_id",
    "request_id",
    "tenant",
    "route",
    "model_id",
    "prompt_tokens",
    "completion_tokens",
    "max_tokens",
    "status",
    "reject_reason",
    "limit_tokens",
    "prompt_shared_with",
    "cached_tokens",
    "cache_write_tokens",
    "lost_reason",
    "probe_id",
    "node",
    "first_ts",
    "last_ts",
)


def list_requests(
    conn: Connection, f: RequestFilter, *, limit: int, after: tuple[int, int] | None
) -> list[dict[str, Any]]:
    """Newest first, keyset-paged on (first_ts, id): stable under concurrent inserts."""
    q = select(m.Request)
    if f.deployment_id is not None:
        q = q.where(m.Request.deployment_id == f.deployment_id)
    if f.model_id is not None:
        q = q.where(m.Request.model_id == f.model_id)
    if f.tenant is not None:
        q = q.where(m.Request.tenant == f.tenant)
    if f.route is not None:
        q = q.where(m.Request.route == f.route)
    if f.since_us is not None:
        q = q.where(m.requests_since(m.Request, f.since_us))
    if f.until_us is not None:
        q = q.where(m.Request.first_ts < f.until_us)
    if f.min_prompt_tokens is not None:
        q = q.where(m.Request.prompt_tokens >= f.min_prompt_tokens)
    if after is not None:
        q = q.where(tuple_(m.Request.first_ts, m.Request.id) < tuple_(*after))
    q = q.order_by(m.Request.first_ts.desc(), m.Request.id.desc()).limit(limit)
    out = []
    for r in conn.execute(q):
        row: dict[str, Any] = {k: getattr(r, k) for k in REQUEST_FIELDS}
        row["data_categories"] = _json_list(r.data_categories)
        row["_key"] = (to_micros(r.first_ts), r.id)
        out.append(row)
    return out


def _json_list(v: str | None) -> list[str]:
    return [] if v is None else list(msgspec.json.decode(v))


def pool_samples(
    conn: Connection,
    *,
    deployment_id: str | None,
    node: str | None,
    since_us: int,
    until_us: int,
    max_points: int,
) -> tuple[int, list[dict[str, Any]]]:
    """Downsample to at most ``max_points`` buckets per (deployment, node, role).

    Returns (bucket width in microseconds, rows). Each bucket carries the mean and max
    of used tokens, the min of free tokens and the max capacity, so a spike never averages
    away.
    """
    width = max(1, -(-(until_us - since_us) // max_points))
    if width >= ROLLUP_MIN_WIDTH_US:
        # Long windows read the per-minute rollups: buckets become whole minutes, aligned
        # to the minute, and the newest may trail ingest by the refresher's interval.
        width = -(-width // POOL_BUCKET_US) * POOL_BUCKET_US
        since_us = floor_to(since_us, POOL_BUCKET_US)
        pr = m.PoolRollup
        rb = ((pr.bucket_start - since_us) // width).label("bucket")
        q = (
            select(
                pr.deployment_id,
                pr.node,
                pr.role,
                rb,
                func.sum(pr.samples).label("samples"),
                (func.sum(pr.used_sum) * 1.0 / func.sum(pr.samples)).label("used_avg"),
                func.max(pr.used_max).label("used_max"),
                func.min(pr.free_min).label("free_min"),
                func.max(pr.capacity_max).label("capacity"),
            )
            .where(pr.bucket_start >= since_us, pr.bucket_start < until_us)
            .group_by(pr.deployment_id, pr.node, pr.role, rb)
            .order_by(pr.deployment_id, pr.node, pr.role, rb)
        )
        table: Any = pr
    else:
        ts = m.PoolSample.__table__.c.ts
        bucket = ((ts - since_us) // width).label("bucket")
        q = (
            select(
                m.PoolSample.deployment_id,
                m.PoolSample.node,
                m.PoolSample.role,
                bucket,
                func.count().label("samples"),
                func.avg(m.PoolSample.used_tokens).label("used_avg"),
                func.max(m.PoolSample.used_tokens).label("used_max"),
                func.min(m.PoolSample.free_tokens).label("free_min"),
                func.max(m.PoolSample.capacity_tokens).label("capacity"),
            )
            .where(ts >= since_us, ts < until_us)
            .group_by(m.PoolSample.deployment_id, m.PoolSample.node, m.PoolSample.role, bucket)
            .order_by(m.PoolSample.deployment_id, m.PoolSample.node, m.PoolSample.role, bucket)
        )
        table = m.PoolSample
    if deployment_id is not None:
        q = q.where(table.deployment_id == deployment_id)
    if node is not None:
        q = q.where(table.node == node)
    rows = []
    for r in conn.execute(q):
        rows.append(
            {
                "deployment_id": r.deployment_id,
                "node": r.node,
                "role": r.role,
                "bucket_start_us": since_us + int(r.bucket) * width,
                "samples": r.samples,
                "used_avg": float(r.used_avg),
                "used_max": r.used_max,
                "free_min": r.free_min,
                "capacity": r.capacity,
            }
        )
    return width, rows


def list_probes(conn: Connection) -> list[dict[str, Any]]:
    gaps: dict[str, list[tuple[int, int]]] = {}
    for g in conn.execute(
        select(m.SeqGap.probe_id, m.SeqGap.first_seq, m.SeqGap.last_seq).order_by(
            m.SeqGap.probe_id, m.SeqGap.first_seq
        )
    ):
        gaps.setdefault(g.probe_id, []).append((g.first_seq, g.last_seq))
    drops: dict[str, dict[str, int]] = {}
    for d in conn.execute(
        select(m.ProbeDrop.probe_id, m.ProbeDrop.reason, func.sum(m.ProbeDrop.count)).group_by(
            m.ProbeDrop.probe_id, m.ProbeDrop.reason
        )
    ):
        drops.setdefault(d[0], {})[d[1]] = int(d[2])
    probes = list(conn.execute(select(m.Probe).order_by(m.Probe.probe_id)))
    successors = superseded(
        ProbeFact(p.probe_id, p.deployment_id, p.last_seen, p.first_seen, p.stopped_at)
        for p in probes
    )
    out = []
    for p in probes:
        probe_gaps = gaps.get(p.probe_id, [])
        out.append(
            {
                "probe_id": p.probe_id,
                "deployment_id": p.deployment_id,
                "max_seq": p.max_seq,
                "accepted": p.accepted,
                "duplicates": p.duplicates,
                "missing": sum(b - a + 1 for a, b in probe_gaps),
                "gaps": [list(x) for x in probe_gaps],
                "reported_drops": drops.get(p.probe_id, {}),
                "first_seen": p.first_seen,
                "last_seen": p.last_seen,
                "stopped_at": p.stopped_at,
                "superseded_by": successors.get(p.probe_id),
                "gone_at": p.gone_at,
                "gone_reason": p.gone_reason,
                "lost_requests": int(p.lost_requests or 0),
            }
        )
    return out


def list_page_events(
    conn: Connection,
    *,
    deployment_id: str | None,
    kind: str | None,
    tenant: str | None,
    since_us: int | None,
    until_us: int | None,
    limit: int,
    after: tuple[int, int] | None,
) -> list[dict[str, Any]]:
    q = select(m.PageEvent)
    if deployment_id is not None:
        q = q.where(m.PageEvent.deployment_id == deployment_id)
    if kind is not None:
        q = q.where(m.PageEvent.kind == kind)
    if tenant is not None:
        # A tenant sees events where it read, or where its pages were read.
        q = q.where((m.PageEvent.tenant == tenant) | (m.PageEvent.other_tenant == tenant))
    if since_us is not None:
        q = q.where(m.PageEvent.ts >= since_us)
    if until_us is not None:
        q = q.where(m.PageEvent.ts < until_us)
    if after is not None:
        q = q.where(tuple_(m.PageEvent.ts, m.PageEvent.id) < tuple_(*after))
    q = q.order_by(m.PageEvent.ts.desc(), m.PageEvent.id.desc()).limit(limit)
    out = []
    for r in conn.execute(q):
        out.append(
            {
                "deployment_id": r.deployment_id,
                "kind": r.kind,
                "ts": r.ts,
                "node": r.node,
                "request_id": r.request_id,
                "tenant": r.tenant,
                "other_request_id": r.other_request_id,
                "other_tenant": r.other_tenant,
                "page_count": r.page_count,
                "cross_tenant": r.cross_tenant,
                "detail": msgspec.json.decode(r.detail),
                "_key": (to_micros(r.ts), r.id),
            }
        )
    return out
