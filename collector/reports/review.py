"""The quarterly review: per deployment, route and model, over a window (default the last 90
days), the request count (and how many of them were lost: their probe went away first), the
largest and the p99 prompt, and the weekly trend (max and p99 per week, and the
least-squares slope of each in tokens per week), against the safe threshold of the
deployment and model: the limit in force (:mod:`policies.limits`, served by
:mod:`collector.limits`), with its source and whether it is stale, as of the review. A route
whose max or p99 reaches ``HIGHLIGHT_RATIO`` of its threshold is highlighted.

Bounded memory whatever the window holds: counts and maxima are SQL ``GROUP BY``s, and each
p99 is exact (nearest rank: the ``ceil(0.99 n)``-th smallest prompt) by one
``ORDER BY prompt_tokens LIMIT 1 OFFSET k`` query per group and per group-week, so no request
row is ever loaded here.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, Connection, Table, case, func, or_, select, type_coerce

from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput
from collector.limits import Limits
from collector.reports.stored import ReportStore, canonical
from collector.signing import KeyRing
from collector.timefmt import iso, to_micros

R: Table = m.Request.__table__  # type: ignore[assignment]
INC: Table = m.Incident.__table__  # type: ignore[assignment]
# A refused prompt never occupied the context: counted as a request, never in the max, the
# p99 or the highlight (a deployment that refused over-long prompts did its job)
SERVED = R.c.status != "rejected"
DEFAULT_DAYS = 90
HIGHLIGHT_RATIO = 0.8
QUANTILE = 0.99
WEEK_US = 7 * 86_400 * 10**6
CSV_COLUMNS = (
    "deployment_id",
    "route",
    "model_id",
    "requests",
    "max_prompt_tokens",
    "p99_prompt_tokens",
    "safe_context",
    "verified",
    "limit_source",
    "limit_stale",
    "max_ratio",
    "p99_ratio",
    "highlighted",
    "max_slope_per_week",
    "p99_slope_per_week",
    "refused_requests",
    "lost_requests",
)


@dataclass(frozen=True, slots=True)
class ReviewScope:
    since: datetime | None = None
    until: datetime | None = None
    deployment_id: str | None = None

    def resolve(self, now: datetime) -> tuple[datetime, datetime]:
        """The window ``[since, until)``: until defaults to now, since to 90 days before."""
        for name in ("since", "until"):
            v = getattr(self, name)
            if v is not None and v.tzinfo is None:
                raise InvalidInput(f"{name} must carry a time zone", {"field": name})
        until = self.until or now
        since = self.since or until - timedelta(days=DEFAULT_DAYS)
        if since >= until:
            raise InvalidInput(
                f"inverted window: since ({iso(since)}) must be before until ({iso(until)})",
                {"field": "since", "since": iso(since), "until": iso(until)},
            )
        return since, until


def nearest_rank(n: int, q: float = QUANTILE) -> int:
    """The 1-based rank of the q-quantile of n values (nearest-rank method)."""
    return max(1, math.ceil(q * n))


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (week index, value); None with fewer than two weeks."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return round(sum((x - mx) * (y - my) for x, y in points) / den, 2) if den else None


class ReviewService:
    def __init__(self, db: Database, limits: Limits, key_ring: KeyRing | None = None):
        self.db = db
        self.limits = limits
        self.key_ring = key_ring  # signs what create() stores (None: unsigned, as before)

    def build(self, scope: ReviewScope, *, now: datetime | None = None) -> dict[str, Any]:
        now = now or datetime.now(UTC)
        since, until = scope.resolve(now)
        lo, hi = to_micros(since), to_micros(until)
        weeks = max(1, math.ceil((hi - lo) / WEEK_US))
        with self.db.read() as conn:
            groups = self._groups(conn, lo, hi, scope.deployment_id)
            weekly = self._weekly(conn, lo, hi, scope.deployment_id)
            incidents = self._incidents(conn, since, until, scope.deployment_id)
            deps = sorted({g[0] for g in groups})
            limits = self.limits.in_conn(conn, deps, now)
            rows = []
            # the deployments with an incident in the window lead: that is the quarter's news
            leading = {i["deployment_id"] for i in incidents}
            for (dep, route, model), (count, n_tokens, mx, lost, refused) in sorted(
                groups.items(),
                key=lambda kv: (kv[0][0] not in leading, *(x or "" for x in kv[0])),
            ):
                p99 = self._quantile(conn, lo, hi, dep, route, model, n_tokens)
                series: list[dict[str, Any]] = []
                for week, (w_n, w_max) in sorted(weekly.get((dep, route, model), {}).items()):
                    w_lo = lo + week * WEEK_US
                    w_hi = min(hi, w_lo + WEEK_US)
                    series.append(
                        {
                            "week": week,
                            "start": iso(w_lo),
                            "requests": w_n,
                            "max": w_max,
                            "p99": self._quantile(conn, w_lo, w_hi, dep, route, model, w_n),
                        }
                    )
                lim = limits.get((dep, model)) if model else None
                safe = lim.tokens if lim is not None and lim.tokens else None
                max_ratio = round(mx / safe, 4) if safe and mx is not None else None
                p99_ratio = round(p99 / safe, 4) if safe and p99 is not None else None
                rows.append(
                    {
                        "deployment_id": dep,
                        "route": route,
                        "model_id": model,
                        "requests": count,
                        # closed by the collector: their probe went away before they ended
                        "lost_requests": lost,
                        "refused_requests": refused,
                        "max_prompt_tokens": mx,
                        "p99_prompt_tokens": p99,
                        "safe_context": safe,
                        "verified": lim is not None and lim.verified,
                        "limit_source": None if lim is None else lim.source,
                        "limit_stale": lim is not None and bool(lim.stale),
                        "limit": None if lim is None else lim.text,
                        "max_ratio": max_ratio,
                        "p99_ratio": p99_ratio,
                        "highlighted": any(
                            r is not None and r >= HIGHLIGHT_RATIO for r in (max_ratio, p99_ratio)
                        ),
                        "trend": {
                            "weeks": series,
                            "max_slope_per_week": slope(
                                [(w["week"], w["max"]) for w in series if w["max"] is not None]
                            ),
                            "p99_slope_per_week": slope(
                                [(w["week"], w["p99"]) for w in series if w["p99"] is not None]
                            ),
                        },
                    }
                )
        rid = "rev_" + secrets.token_urlsafe(12).replace("-", "x").replace("_", "y")
        doc: dict[str, Any] = {
            "report_id": rid,
            "kind": "review",
            "generated_at": iso(now),
            "scope": {
                "since": iso(since),
                "until": iso(until),
                "deployment_id": scope.deployment_id,
                "weeks": weeks,
            },
            "incidents": incidents,
            "highlight_ratio": HIGHLIGHT_RATIO,
            "quantile": QUANTILE,
            "totals": {
                "requests": sum(r["requests"] for r in rows),
                "lost_requests": sum(r["lost_requests"] for r in rows),
                "routes": len(rows),
                "highlighted": sum(1 for r in rows if r["highlighted"]),
            },
            "rows": rows,
        }
        doc["evidence_sha256"] = review_digest(doc)
        return doc

    def create(
        self, scope: ReviewScope, *, created_by: str, now: datetime | None = None
    ) -> dict[str, Any]:
        """Build the review, store it and record it in the audit log; returns it."""
        now = now or datetime.now(UTC)
        doc = self.build(scope, now=now)
        from collector.reports.signed import sign_review

        signature = sign_review(self.key_ring, doc, now) if self.key_ring is not None else None
        ReportStore(self.db).save(doc, created_by=created_by, now=now, signature=signature)
        return doc

    # ------------------------------------------------------------------ queries

    @staticmethod
    def _where(lo: int, hi: int, deployment_id: str | None) -> list[Any]:
        ts = type_coerce(R.c.first_ts, BigInteger)
        conds = [m.requests_since(R.c, lo), ts < hi]
        if deployment_id is not None:
            conds.append(R.c.deployment_id == deployment_id)
        return conds

    def _groups(
        self, conn: Connection, lo: int, hi: int, deployment_id: str | None
    ) -> dict[tuple[str, str | None, str | None], tuple[int, int, int | None, int, int]]:
        served = case((SERVED, R.c.prompt_tokens))
        stmt = (
            select(
                R.c.deployment_id,
                R.c.route,
                R.c.model_id,
                func.count(),
                func.count(served),
                func.max(served),
                func.count(case((R.c.status == "lost", 1))),
                func.count(case((R.c.status == "rejected", 1))),
            )
            .where(*self._where(lo, hi, deployment_id))
            .group_by(R.c.deployment_id, R.c.route, R.c.model_id)
        )
        return {
            (d, r, mod): (
                int(n),
                int(nt),
                None if mx is None else int(mx),
                int(lost),
                int(refused),
            )
            for d, r, mod, n, nt, mx, lost, refused in conn.execute(stmt)
        }

    def _weekly(
        self, conn: Connection, lo: int, hi: int, deployment_id: str | None
    ) -> dict[tuple[str, str | None, str | None], dict[int, tuple[int, int | None]]]:
        week = ((type_coerce(R.c.first_ts, BigInteger) - lo) // WEEK_US).label("week")
        stmt = (
            select(
                R.c.deployment_id,
                R.c.route,
                R.c.model_id,
                week,
                func.count(R.c.prompt_tokens),
                func.max(R.c.prompt_tokens),
            )
            .where(*self._where(lo, hi, deployment_id), R.c.prompt_tokens.is_not(None), SERVED)
            .group_by(R.c.deployment_id, R.c.route, R.c.model_id, week)
        )
        out: dict[tuple[str, str | None, str | None], dict[int, tuple[int, int | None]]] = {}
        for d, r, mod, w, n, mx in conn.execute(stmt):
            out.setdefault((d, r, mod), {})[int(w)] = (int(n), None if mx is None else int(mx))
        return out

    @staticmethod
    def _incidents(
        conn: Connection, since: datetime, until: datetime, deployment_id: str | None
    ) -> list[dict[str, Any]]:
        """Incidents open at any moment of ``[since, until)``, oldest first: opened before its
        end and not closed before its start."""
        stmt = (
            select(INC)
            .where(
                INC.c.opened_at < until,
                or_(INC.c.closed_at.is_(None), INC.c.closed_at >= since),
            )
            .order_by(INC.c.opened_at, INC.c.id)
        )
        if deployment_id is not None:
            stmt = stmt.where(INC.c.deployment_id == deployment_id)
        return [
            {
                "id": r.id,
                "deployment_id": r.deployment_id,
                "title": r.title,
                "state": r.state,
                "opened_at": iso(r.opened_at),
                "deadline_at": iso(r.deadline_at),
                "closed_at": None if r.closed_at is None else iso(r.closed_at),
            }
            for r in conn.execute(stmt)
        ]

    def _quantile(
        self,
        conn: Connection,
        lo: int,
        hi: int,
        dep: str,
        route: str | None,
        model: str | None,
        n: int,
    ) -> int | None:
        """The exact nearest-rank p99 of the group's prompts in ``[lo, hi)`` (n of them)."""
        if n <= 0:
            return None
        stmt = (
            select(R.c.prompt_tokens)
            .where(
                *self._where(lo, hi, dep),
                R.c.route.is_not_distinct_from(route),
                R.c.model_id.is_not_distinct_from(model),
                R.c.prompt_tokens.is_not(None),
                SERVED,
            )
            .order_by(R.c.prompt_tokens)
            .limit(1)
            .offset(nearest_rank(n) - 1)
        )
        v = conn.execute(stmt).scalar()
        return None if v is None else int(v)


def review_digest(doc: dict[str, Any]) -> str:
    """SHA-256 of a review's evidence: its scope and rows (recomputable from a stored one)."""
    return hashlib.sha256(canonical({"scope": doc["scope"], "rows": doc["rows"]})).hexdigest()


def to_csv(review: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in review["rows"]:
        vals = {**r, **{k: r["trend"][k] for k in ("max_slope_per_week", "p99_slope_per_week")}}
        # .get: a review stored before lost_requests was added has none
        w.writerow(["" if vals.get(c) is None else vals[c] for c in CSV_COLUMNS])
    return buf.getvalue()
