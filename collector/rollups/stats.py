"""The dashboard's questions, answered from rollups and indexed queries: no answer grows with
the number of raw rows in the window.

Prompt sizes come from the request rollups' prompt bins (9% wide: 5-minute buckets for
windows under a day, hourly ones beyond; an operator reads the rows summed over tenants, a
tenant token its own rows), so
percentiles are bin upper bounds clipped to the exact maximum, and counts at or above a line
count a whole bin when its largest prompt reaches the line (an upper bound, never an
undercount). Those figures are per request (each request occupies the context, so n
parallel-sampling children are n requests); ``prompts`` and ``prompt_tokens`` are usage and
count a prompt that several requests share (``prompt_shared_with``) once. The open bucket
is recomputed at most once a minute, so the newest minute (plus
``KVWATCH_ROLLUP_INTERVAL_S``) may not be in these figures yet.

Times are ISO 8601 UTC text (:func:`collector.timefmt.iso`) like every other answer of the
API, except the fields whose names end in ``_us`` (``bucket_start_us``, ``first_ts_us``),
which are microseconds since the epoch, as ``/v1/pool-samples``' ``bucket_start_us``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.limits import Limits
from collector.rollups.buckets import (
    ALL_TENANTS,
    HOUR_US,
    REQUEST_BUCKET_US,
    UNKNOWN_BIN,
    bin_high,
    bin_low,
    floor_to,
)
from collector.timefmt import iso
from policies.limits import LimitInForce

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


def thresholds(
    limits: Mapping[tuple[str, str], LimitInForce], pairs: set[tuple[str, str]]
) -> dict[str, dict[str, Any]]:
    """Per model: the smallest limit in force among the deployments serving it (``pairs``
    of (deployment, model)), and whether it is verified, its source and staleness; and
    every deployment serving it in the window (``deployments``)."""
    out: dict[str, dict[str, Any]] = {}
    for dep, model in sorted(pairs):
        lim = limits.get((dep, model))
        if lim is None or lim.tokens is None:
            continue  # nothing known: no line (0, every prompt refused, is a line too)
        safe = lim.tokens
        cur = out.get(model)
        if cur is None or safe < cur["safe_context"]:
            out[model] = {
                "model_id": model,
                "safe_context": safe,
                "verified": lim.verified,
                "source": lim.source,
                "stale": bool(lim.stale),
                "limit": lim.text,
                "deployment_id": dep,
                "warn_line": int(safe * WARN_RATIO),
                "critical_line": int(safe * CRITICAL_RATIO),
            }
    for model, line in out.items():
        line["deployments"] = sorted(d for d, m in pairs if m == model)
    return out


class _Dist:
    """Prompt-size bins of one group: counts, exact max, quantiles and line counts.

    Sizes, quantiles and line counts are per request (each request occupies the context);
    ``prompts`` and ``prompt_tokens`` are usage, counting a prompt that several requests
    share (``prompt_shared_with``) once."""

    __slots__ = ("bins", "max", "rejected", "requests", "shared", "shared_sum", "sum", "unknown")

    def __init__(self) -> None:
        self.bins: dict[int, list[int]] = {}  # bin -> [requests, max prompt]
        self.requests = self.rejected = self.sum = self.unknown = 0
        self.shared = self.shared_sum = 0
        self.max: int | None = None

    def add(
        self,
        b: int,
        n: int,
        rejected: int,
        mx: int | None,
        total: int,
        shared: int = 0,
        shared_total: int = 0,
    ) -> None:
        self.requests += n
        self.rejected += rejected
        self.sum += total
        self.shared += shared
        self.shared_sum += shared_total
        if b == UNKNOWN_BIN or mx is None:
            self.unknown += n
            return
        self.max = mx if self.max is None else max(self.max, mx)
        cur = self.bins.setdefault(b, [0, mx])
        cur[0] += n
        cur[1] = max(cur[1], mx)

    def quantile(self, pct: int) -> int | None:
        """The upper bound of the bin where the cumulative count reaches ``pct`` percent
        (integer arithmetic: the same answer the series' SQL gives), clipped to its max."""
        known = self.requests - self.unknown
        if known <= 0:
            return None
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b][0]
            if seen * 100 >= pct * known:
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
            "prompts": self.requests - self.shared,
            "prompt_tokens": self.sum - self.shared_sum,
            "rejected": self.rejected,
            "unknown_prompt": self.unknown,
            "max": self.max,
            "mean": round(self.sum / known, 1) if known else None,
            "p50": self.quantile(50),
            "p99": self.quantile(99),
            "at_or_above_warn": self.at_or_above(line["warn_line"] if line else None),
            "at_or_above_critical": self.at_or_above(line["critical_line"] if line else None),
        }


class StatsService:
    def __init__(self, db: Any, limits: Limits):
        self.db = db
        self.limits = limits

    def _limits(
        self, conn: Connection, pairs: set[tuple[str, str]]
    ) -> dict[tuple[str, str], LimitInForce]:
        if not pairs:
            return {}
        return self.limits.in_conn(conn, {d for d, _ in pairs}, datetime.now(UTC))

    def prompt_tokens(self, scope: Scope, window: Window) -> dict[str, Any]:
        """Per model and route: the window's totals, histogram, and per-bucket series.

        Two passes over the window's rollup rows, both aggregated in the database, so the
        rows that reach Python do not grow with the number of buckets times bins: the totals
        (deployment x model x route x bin: a few hundred rows), then the series, whose
        quantiles a window function finds (per series only the bins where the cumulative
        count crosses 50% and 99%, plus one row of its totals).
        """
        # The hourly tier for windows of a day or more, or once 5-minute points would be half
        # an hour wide anyway: 12x fewer rows. At 10M requests a day of 5-minute rows took
        # ~1.1 s (as long as the raw GROUP BY); a day reads as 24 hourly points, each with
        # its exact max, so a spike still shows.
        unit = REQUEST_BUCKET_US
        rr: Any = m.RequestRollup
        span = window.until_us - window.since_us
        if span >= 24 * HOUR_US or window.width(REQUEST_BUCKET_US) >= HOUR_US // 2:
            unit, rr = HOUR_US, m.RequestRollupHourly
        width = window.width(unit)
        lo = floor_to(window.since_us, unit)
        tenant = scope.tenant or ALL_TENANTS
        in_window = (rr.bucket_start >= lo, rr.bucket_start < window.until_us, rr.tenant == tenant)
        figures = (
            sa.func.sum(rr.requests),
            sa.func.sum(rr.rejected),
            sa.func.max(rr.prompt_tokens_max),
            sa.func.sum(rr.prompt_tokens_sum),
            sa.func.sum(rr.shared_prompts),
            sa.func.sum(rr.shared_prompt_tokens),
        )
        by_bin = (rr.deployment_id, rr.model_id, rr.route, rr.prompt_bin)
        q = _filter(select(*by_bin, *figures).where(*in_window).group_by(*by_bin), rr, scope)
        totals: dict[tuple[Any, Any], _Dist] = defaultdict(_Dist)
        hist: dict[tuple[Any, int], int] = defaultdict(int)
        pairs: set[tuple[str, str]] = set()
        with self.db.read() as conn:
            for dep, model, route, pbin, n, rej, mx, total, sh, sh_total in conn.execute(q):
                mx = None if mx is None else int(mx)
                totals[(model, route)].add(
                    int(pbin), int(n), int(rej), mx, int(total or 0), int(sh), int(sh_total)
                )
                if int(pbin) != UNKNOWN_BIN:
                    hist[(model, int(pbin))] += int(n)
                if model is not None:
                    pairs.add((dep, model))
            lines = thresholds(self._limits(conn, pairs), pairs)
            series = self._series(conn, rr, scope, in_window, lo, width, lines)
        return {
            "since": iso(window.since_us),
            "until": iso(window.until_us),
            "bucket_seconds": width / 1_000_000,
            "thresholds": [lines[k] for k in sorted(lines)],
            "series": series,
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

    @staticmethod
    def _series(
        conn: Connection,
        rr: Any,
        scope: Scope,
        in_window: tuple[Any, ...],
        lo: int,
        width: int,
        lines: dict[str, dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The per-bucket series, with the same figures as :meth:`_Dist.summary`."""
        bucket = ((rr.bucket_start - lo) // width).label("b")
        g = _filter(
            select(
                rr.model_id,
                rr.route,
                bucket,
                rr.prompt_bin,
                sa.func.sum(rr.requests).label("n"),
                sa.func.sum(rr.rejected).label("rej"),
                sa.func.max(rr.prompt_tokens_max).label("mx"),
                sa.func.sum(rr.prompt_tokens_sum).label("total"),
                sa.func.sum(rr.shared_prompts).label("shared"),
                sa.func.sum(rr.shared_prompt_tokens).label("shared_total"),
            )
            .where(*in_window)
            .group_by(rr.model_id, rr.route, bucket, rr.prompt_bin),
            rr,
            scope,
        ).subquery()
        part = (g.c.model_id, g.c.route, g.c.b)
        known_n = sa.case((g.c.prompt_bin != UNKNOWN_BIN, g.c.n), else_=0)
        known_mx = sa.case((g.c.prompt_bin != UNKNOWN_BIN, g.c.mx), else_=None)

        def line_of(kind: str) -> Any:
            return sa.case(*[(g.c.model_id == mdl, ln[kind]) for mdl, ln in lines.items()])

        def over(fn: Any, ordered: bool = False) -> Any:
            return fn.over(partition_by=part, order_by=g.c.prompt_bin if ordered else None)

        def reaching(kind: str) -> Any:
            if not lines:  # no model has a line: the figure is None (see below)
                return sa.literal(0, BigInteger)
            return over(sa.func.sum(sa.case((known_mx >= line_of(kind), g.c.n), else_=0)))

        c = select(
            *part,
            g.c.prompt_bin,
            g.c.n,
            g.c.mx,
            over(sa.func.sum(known_n), ordered=True).label("cum"),
            over(sa.func.sum(known_n)).label("known"),
            over(sa.func.sum(g.c.n)).label("requests"),
            over(sa.func.sum(g.c.rej)).label("rejected"),
            over(sa.func.max(known_mx)).label("max"),
            over(sa.func.sum(g.c.total)).label("total"),
            over(sa.func.sum(g.c.shared)).label("shared"),
            over(sa.func.sum(g.c.shared_total)).label("shared_total"),
            reaching("warn_line").label("warn"),
            reaching("critical_line").label("critical"),
            over(sa.func.row_number(), ordered=True).label("rn"),
        ).subquery()

        def crossing(pct: int) -> Any:  # integers: the same rank test as _Dist.quantile
            return sa.and_(
                c.c.prompt_bin != UNKNOWN_BIN,
                c.c.cum * 100 >= pct * c.c.known,
                (c.c.cum - c.c.n) * 100 < pct * c.c.known,
            )

        q = select(c).where(sa.or_(c.c.rn == 1, crossing(50), crossing(99)))
        out: dict[tuple[Any, Any, int], dict[str, Any]] = {}
        for row in conn.execute(q):
            key = (row.model_id, row.route, int(row.b))
            item = out.get(key)
            if item is None:
                known, has_line = int(row.known), row.model_id in lines
                item = out[key] = {
                    "model_id": row.model_id,
                    "route": row.route,
                    "bucket_start_us": lo + int(row.b) * width,
                    "requests": int(row.requests),
                    "prompts": int(row.requests) - int(row.shared),
                    "prompt_tokens": int(row.total or 0) - int(row.shared_total or 0),
                    "rejected": int(row.rejected),
                    "unknown_prompt": int(row.requests) - known,
                    "max": None if row.max is None else int(row.max),
                    "mean": round(int(row.total or 0) / known, 1) if known else None,
                    "p50": None,
                    "p99": None,
                    "at_or_above_warn": int(row.warn) if has_line else None,
                    "at_or_above_critical": int(row.critical) if has_line else None,
                }
            if row.prompt_bin == UNKNOWN_BIN or row.known == 0:
                continue
            value = min(int(bin_high(int(row.prompt_bin))), int(row.mx))
            for pct, name in ((50, "p50"), (99, "p99")):
                if row.cum * 100 >= pct * row.known and (row.cum - row.n) * 100 < pct * row.known:
                    item[name] = value
        return [out[k] for k in sorted(out, key=lambda k: _key((k, None)))]

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
                r.lost_reason,
                first.label("first_ts"),
            )
            .where(
                m.requests_since(r, window.since_us),
                first < window.until_us,
                r.prompt_tokens.is_not(None),
            )
            .order_by(r.prompt_tokens.desc(), r.id.desc())
            .limit(limit)
        )
        q = _filter(q, r, scope)
        with self.db.read() as conn:
            rows = conn.execute(q).all()
            limits = self._limits(conn, {(x.deployment_id, x.model_id) for x in rows if x.model_id})
        items = []
        for x in rows:
            # each request against its own deployment's limit
            lim = limits.get((x.deployment_id, x.model_id)) if x.model_id else None
            safe = lim.tokens if lim is not None and lim.tokens else None
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
                    "lost_reason": x.lost_reason,
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
            "since": iso(window.since_us),
            "until": iso(window.until_us),
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
