"""The dashboard's questions, answered from rollups and indexed queries: no answer grows with
the number of raw rows in the window.

Prompt sizes come from :class:`~collector.models.RequestRollup` prompt bins (9% wide), so
percentiles are bin upper bounds clipped to the exact maximum, and counts at or above a line
count a whole bin when its largest prompt reaches the line (an upper bound, never an
undercount). The open bucket is recomputed at most once a minute, so the newest minute
(plus ``KVWATCH_ROLLUP_INTERVAL_S``) may not be in these figures yet.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.alerting import facts as F
from collector.rollups.buckets import (
    ALL_TENANTS,
    HOUR_US,
    REQUEST_BUCKET_US,
    UNKNOWN_BIN,
    bin_high,
    bin_low,
    floor_to,
)
from policies.kinds.context import safe_context

WARN_RATIO, CRITICAL_RATIO = 0.8, 1.0


@dataclass(frozen=True, slots=True)
class Window:
    since_us: int
    until_us: int
    max_points: int

    def width(self, unit: int) -> int:
        """A bucket width, a whole number of ``unit``s, giving at most ``max_points``."""
        span = self.until_us - floor_to(self.since_us, unit)
        per = -(-span // self.max_points)
        return max(unit, -(-per // unit) * unit)


@dataclass(frozen=True, slots=True)
class Scope:
    model_id: str | None = None
    route: str | None = None
    deployment_id: str | None = None
    tenant: str | None = None


def thresholds(conn: Connection, pairs: set[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Per model: the smallest safe context among the deployments serving it (``pairs`` of
    (deployment, model)), and whether every one of them is verified."""
    deps = {d for d, _ in pairs}
    if not deps:
        return {}
    configs = F.node_configs(conn, deps)
    facts = F.deployment_facts(configs, F.verifications(conn, deps), {}, deps)
    out: dict[str, dict[str, Any]] = {}
    for dep, model in sorted(pairs):
        safe, verified = safe_context(facts[dep], model)
        if safe is None:
            continue
        cur = out.get(model)
        if cur is None or safe < cur["safe_context"]:
            out[model] = {
                "model_id": model,
                "safe_context": safe,
                "verified": verified,
                "deployment_id": dep,
                "warn_line": int(safe * WARN_RATIO),
                "critical_line": int(safe * CRITICAL_RATIO),
            }
    return out


class _Dist:
    """Prompt-size bins of one group: counts, exact max, quantiles and line counts."""

    __slots__ = ("bins", "max", "rejected", "requests", "sum", "unknown")

    def __init__(self) -> None:
        self.bins: dict[int, list[int]] = {}  # bin -> [requests, max prompt]
        self.requests = self.rejected = self.sum = self.unknown = 0
        self.max: int | None = None

    def add(self, b: int, n: int, rejected: int, mx: int | None, total: int) -> None:
        self.requests += n
        self.rejected += rejected
        self.sum += total
        if b == UNKNOWN_BIN or mx is None:
            self.unknown += n
            return
        self.max = mx if self.max is None else max(self.max, mx)
        cur = self.bins.setdefault(b, [0, mx])
        cur[0] += n
        cur[1] = max(cur[1], mx)

    def quantile(self, q: float) -> int | None:
        known = self.requests - self.unknown
        if known <= 0:
            return None
        rank, seen = q * known, 0
        for b in sorted(self.bins):
            seen += self.bins[b][0]
            if seen >= rank:
                return min(int(bin_high(b)), self.bins[b][1])
        return self.max

    def at_or_above(self, line: int | None) -> int | None:
        if line is None:
            return None
        return sum(n for n, mx in self.bins.values() if mx >= line)

    def summary(self, line: dict[str, Any] | None) -> dict[str, Any]:
        known = self.requests - self.unknown
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "unknown_prompt": self.unknown,
            "max": self.max,
            "mean": round(self.sum / known, 1) if known else None,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
            "at_or_above_warn": self.at_or_above(line["warn_line"] if line else None),
            "at_or_above_critical": self.at_or_above(line["critical_line"] if line else None),
        }


class StatsService:
    def __init__(self, db: Any):
        self.db = db

    def prompt_tokens(self, scope: Scope, window: Window) -> dict[str, Any]:
        # The hourly tier once 5-minute points would be half an hour or wider (windows over
        # about four days at the default 200 points): at most half the points, 12x fewer rows.
        unit = REQUEST_BUCKET_US
        rr: Any = m.RequestRollup
        if window.width(REQUEST_BUCKET_US) >= HOUR_US // 2:
            unit, rr = HOUR_US, m.RequestRollupHourly
        width = window.width(unit)
        lo = floor_to(window.since_us, unit)
        bucket = ((rr.bucket_start - lo) // width).label("b")
        q = (
            select(
                rr.deployment_id,
                rr.model_id,
                rr.route,
                bucket,
                rr.prompt_bin,
                sa.func.sum(rr.requests),
                sa.func.sum(rr.rejected),
                sa.func.max(rr.prompt_tokens_max),
                sa.func.sum(rr.prompt_tokens_sum),
            )
            .where(rr.bucket_start >= lo, rr.bucket_start < window.until_us)
            .group_by(rr.deployment_id, rr.model_id, rr.route, bucket, rr.prompt_bin)
        )
        q = _filter(q, rr, scope).where(rr.tenant == (scope.tenant or ALL_TENANTS))
        with self.db.read() as conn:
            rows = conn.execute(q).all()
            lines = thresholds(conn, {(r[0], r[1]) for r in rows if r[1] is not None})
        series: dict[tuple[Any, Any, int], _Dist] = defaultdict(_Dist)
        totals: dict[tuple[Any, Any], _Dist] = defaultdict(_Dist)
        hist: dict[tuple[Any, int], int] = defaultdict(int)
        for _dep, model, route, bk, pbin, n, rej, mx, total in rows:
            args = (int(pbin), int(n), int(rej), None if mx is None else int(mx), int(total or 0))
            series[(model, route, int(bk))].add(*args)
            totals[(model, route)].add(*args)
            if int(pbin) != UNKNOWN_BIN:
                hist[(model, int(pbin))] += int(n)
        return {
            "since": window.since_us,
            "until": window.until_us,
            "bucket_seconds": width / 1_000_000,
            "thresholds": [lines[k] for k in sorted(lines)],
            "series": [
                {
                    "model_id": model,
                    "route": route,
                    "bucket_start_us": lo + bk * width,
                    **d.summary(lines.get(model)),
                }
                for (model, route, bk), d in sorted(series.items(), key=_key)
            ],
            "routes": [
                {"model_id": model, "route": route, **d.summary(lines.get(model))}
                for (model, route), d in sorted(totals.items(), key=_key)
            ],
            "histogram": [
                {
                    "model_id": model,
                    "bin_low": int(bin_low(pb)),
                    "bin_high": int(bin_high(pb)),
                    "requests": n,
                }
                for (model, pb), n in sorted(hist.items(), key=_key)
            ],
        }

    def top_prompts(self, scope: Scope, window: Window, limit: int) -> dict[str, Any]:
        """The largest prompts in the window (the requests nearest the threshold)."""
        r = m.Request
        first = type_coerce(r.first_ts, BigInteger)
        q = (
            select(
                r.deployment_id,
                r.request_id,
                r.tenant,
                r.route,
                r.model_id,
                r.prompt_tokens,
                r.status,
                r.reject_reason,
                first.label("first_ts"),
            )
            .where(first >= window.since_us, first < window.until_us, r.prompt_tokens.is_not(None))
            .order_by(r.prompt_tokens.desc(), r.id.desc())
            .limit(limit)
        )
        q = _filter(q, r, scope)
        with self.db.read() as conn:
            rows = conn.execute(q).all()
            lines = thresholds(conn, {(x.deployment_id, x.model_id) for x in rows if x.model_id})
        items = []
        for x in rows:
            line = lines.get(x.model_id) if x.model_id else None
            safe = line["safe_context"] if line else None
            items.append(
                {
                    "deployment_id": x.deployment_id,
                    "request_id": x.request_id,
                    "tenant": x.tenant,
                    "route": x.route,
                    "model_id": x.model_id,
                    "prompt_tokens": int(x.prompt_tokens),
                    "status": x.status,
                    "reject_reason": x.reject_reason,
                    "first_ts_us": int(x.first_ts),
                    "safe_context": safe,
                    "ratio": round(int(x.prompt_tokens) / safe, 4) if safe else None,
                }
            )
        return {"items": items}

    def page_events(self, scope: Scope, window: Window) -> dict[str, Any]:
        """Page events per bucket, deployment and kind: events, pages, cross-tenant events."""
        p = m.PageEvent
        width = max(1, -(-(window.until_us - window.since_us) // window.max_points))
        ts = type_coerce(p.ts, BigInteger)
        bucket = ((ts - window.since_us) // width).label("b")
        cross = sa.func.sum(sa.case((p.cross_tenant.is_(True), 1), else_=0))
        q = (
            select(
                p.deployment_id,
                p.kind,
                bucket,
                sa.func.count(),
                sa.func.sum(p.page_count),
                cross,
            )
            .where(ts >= window.since_us, ts < window.until_us)
            .group_by(p.deployment_id, p.kind, bucket)
            .order_by(p.deployment_id, p.kind, bucket)
        )
        if scope.deployment_id is not None:
            q = q.where(p.deployment_id == scope.deployment_id)
        if scope.tenant is not None:
            q = q.where(sa.or_(p.tenant == scope.tenant, p.other_tenant == scope.tenant))
        with self.db.read() as conn:
            rows = conn.execute(q).all()
        return {
            "since": window.since_us,
            "until": window.until_us,
            "bucket_seconds": width / 1_000_000,
            "items": [
                {
                    "deployment_id": dep,
                    "kind": kind,
                    "bucket_start_us": window.since_us + int(bk) * width,
                    "events": int(n),
                    "pages": int(pages or 0),
                    "cross_tenant": int(x or 0),
                }
                for dep, kind, bk, n, pages, x in rows
            ],
        }


def _key(item: tuple[tuple[Any, ...], Any]) -> tuple[Any, ...]:
    # NULL labels sort first, as "".
    return tuple("" if v is None else v for v in item[0])


def _filter(q: Any, t: Any, scope: Scope) -> Any:
    if scope.model_id is not None:
        q = q.where(t.model_id == scope.model_id)
    if scope.route is not None:
        q = q.where(t.route == scope.route)
    if scope.deployment_id is not None:
        q = q.where(t.deployment_id == scope.deployment_id)
    if scope.tenant is not None and t is m.Request:  # rollups: the caller picks the rows
        q = q.where(t.tenant == scope.tenant)
    return q
