"""Retention: a deployment's requests, pool samples and page events older than its policy
are deleted, except what an open incident references. On PostgreSQL, months of the
partitioned tables that every deployment has let go are dropped whole first.

What an open incident references: the stale reads (and canary hits) of its deployment since
the previous incident there was closed, the requests they name (readers and exposed writers,
however old), and everything from an hour before its first stale read, which its breach
report charts. Rollups of deleted buckets are deleted; the bucket the cutoff falls in, and
those of kept older requests, are marked for the refresher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import audit, partitions
from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput, NotFound
from collector.rollups import refresh as rollups
from collector.rollups.buckets import HOUR_US, POOL_BUCKET_US, REQUEST_BUCKET_US, floor_to
from collector.timefmt import iso, to_micros

EVIDENCE_KINDS = ("page.stale_read", "canary.hit")
CHART_LEAD_US = 3600 * 10**6
MAX_KEEP_DAYS = 36_500


@dataclass(slots=True)
class DeploymentResult:
    deployment_id: str
    keep_days: int | None
    cutoff: str | None = None
    requests: int = 0
    pool_samples: int = 0
    page_events: int = 0
    kept_for_incidents: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "keep_days": self.keep_days,
            "cutoff": self.cutoff,
            "deleted": {
                "requests": self.requests,
                "pool_samples": self.pool_samples,
                "page_events": self.page_events,
            },
            "kept_for_incidents": self.kept_for_incidents,
        }


def _us(col: Any) -> Any:
    return type_coerce(col, BigInteger)


class RetentionService:
    def __init__(self, db: Database, default_days: int | None):
        self.db = db
        self.default_days = default_days

    def set_policy(self, deployment_id: str, keep_days: int, *, by: str, now: datetime) -> None:
        if not 1 <= keep_days <= MAX_KEEP_DAYS:
            raise InvalidInput(
                f"keep_days must be between 1 and {MAX_KEEP_DAYS}, not {keep_days}",
                {"field": "keep_days"},
            )
        now_us = to_micros(now)
        with self.db.write() as conn:
            if (
                conn.execute(
                    select(m.Deployment.id).where(m.Deployment.id == deployment_id)
                ).first()
                is None
            ):
                raise NotFound(f"no deployment {deployment_id!r}", {"deployment_id": deployment_id})
            t = m.RetentionPolicy
            conn.execute(sa.delete(t).where(t.deployment_id == deployment_id))
            conn.execute(
                sa.insert(t).values(
                    deployment_id=deployment_id,
                    keep_days=keep_days,
                    updated_at=now_us,
                    updated_by=by,
                )
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="retention.set",
                subject=f"deployment:{deployment_id}",
                detail={"keep_days": keep_days},
            )

    def policies(self) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            explicit = {
                r.deployment_id: r.keep_days
                for r in conn.execute(
                    select(m.RetentionPolicy.deployment_id, m.RetentionPolicy.keep_days)
                )
            }
            deps = list(conn.execute(select(m.Deployment.id).order_by(m.Deployment.id)).scalars())
        return [
            {
                "deployment_id": d,
                "keep_days": explicit.get(d, self.default_days),
                "source": "policy" if d in explicit else ("default" if self.default_days else None),
            }
            for d in deps
        ]

    def apply(self, *, now: datetime, by: str, dry_run: bool = False) -> dict[str, Any]:
        """Delete what each deployment's policy no longer keeps (or count it: ``dry_run``)."""
        results = []
        now_us = to_micros(now)
        pols = self.policies()
        dropped, months = self._drop_months(pols, now, dry_run)
        for pol in pols:
            res = DeploymentResult(pol["deployment_id"], pol["keep_days"])
            res.requests = dropped.get(("requests", res.deployment_id), 0)
            res.pool_samples = dropped.get(("pool_samples", res.deployment_id), 0)
            res.page_events = dropped.get(("page_events", res.deployment_id), 0)
            if res.keep_days is not None:
                # One deployment per transaction: a huge deletion never holds every lock.
                with self.db.write() as conn:
                    self._apply(conn, res, now, dry_run, months)
                    if not dry_run:
                        audit.append(
                            conn,
                            now_us=now_us,
                            actor=by,
                            action="retention.apply",
                            subject=f"deployment:{res.deployment_id}",
                            detail=res.as_dict(),
                        )
            results.append(res.as_dict())
        return {"generated_at": iso(now_us), "dry_run": dry_run, "deployments": results}

    def _drop_months(
        self, pols: list[dict[str, Any]], now: datetime, dry: bool
    ) -> tuple[dict[tuple[str, str], int], dict[str, list[partitions.Partition]]]:
        """PostgreSQL: drop whole months of the partitioned tables that every deployment's
        retention (and every open incident) has let go. Returns rows per (table,
        deployment) and, per table, the months dropped. A month of requests stays while it
        holds a request an open incident names, or one still running at the bound (its
        month is that of its first event; retention goes by its last)."""
        if self.db.is_sqlite or not pols or any(p["keep_days"] is None for p in pols):
            return {}, {}
        with self.db.write() as conn:
            holds = [
                self._incident_holds(
                    conn,
                    p["deployment_id"],
                    to_micros(now - timedelta(days=p["keep_days"])),
                    DeploymentResult(p["deployment_id"], p["keep_days"]),
                )
                for p in pols
            ]
            bound = min(keep_from for keep_from, _ in holds)
            named = sorted({rid for _, q in holds for (rid,) in conn.execute(q)})

            def keep(c: Connection, p: partitions.Partition) -> bool:
                held = c.execute(
                    sa.text(
                        f'SELECT 1 FROM "{p.name}" WHERE last_ts >= :b OR '
                        "request_id = ANY(:named) LIMIT 1"
                    ),
                    {"b": bound, "named": named},
                ).first()
                return held is not None

            out: dict[tuple[str, str], int] = {}
            dropped: dict[str, list[partitions.Partition]] = {}
            for table in partitions.PARTITIONED:
                gone, months = partitions.drop_before(
                    conn, table, bound, dry_run=dry, keep=keep if table == "requests" else None
                )
                dropped[table] = months
                for dep, n in gone.items():
                    out[(table, dep)] = n
        return out, dropped

    def _apply(
        self,
        conn: Connection,
        res: DeploymentResult,
        now: datetime,
        dry: bool,
        months: dict[str, list[partitions.Partition]] | None = None,
    ) -> None:
        dep = res.deployment_id
        assert res.keep_days is not None
        cutoff = to_micros(now - timedelta(days=res.keep_days))
        keep_from, protected = self._incident_holds(conn, dep, cutoff, res)
        res.cutoff = iso(keep_from)
        r, ps, pe = m.Request, m.PoolSample, m.PageEvent
        named = protected.subquery()
        req_cond = [
            r.deployment_id == dep,
            _us(r.last_ts) < keep_from,
            r.request_id.not_in(select(named.c.rid)),
        ]
        pool_cond = [ps.deployment_id == dep, _us(ps.ts) < keep_from]
        page_cond = [pe.deployment_id == dep, _us(pe.ts) < keep_from]
        if dry and months:  # those months are counted as dropped already
            for cond, key, table in (
                (req_cond, r.part_ts, "requests"),
                (pool_cond, _us(ps.ts), "pool_samples"),
                (page_cond, _us(pe.ts), "page_events"),
            ):
                for mo in months.get(table, []):
                    cond.append(
                        sa.not_(sa.and_(key >= (-(2**63) if mo.lo is None else mo.lo), key < mo.hi))
                    )
        if dry:

            def count(table: Any, cond: list[Any]) -> int:
                q = select(sa.func.count()).select_from(table).where(*cond)
                return int(conn.execute(q).scalar_one())

            res.requests += count(r, req_cond)
            res.pool_samples += count(ps, pool_cond)
            res.page_events += count(pe, page_cond)
            return
        k = m.RequestKey  # PostgreSQL's partition keys of the requests going (SQLite: none)
        doomed = select(r.request_id).where(*req_cond)
        conn.execute(sa.delete(k).where(k.deployment_id == dep, k.request_id.in_(doomed)))
        res.requests += conn.execute(sa.delete(r).where(*req_cond)).rowcount
        res.pool_samples += conn.execute(sa.delete(ps).where(*pool_cond)).rowcount
        res.page_events += conn.execute(sa.delete(pe).where(*page_cond)).rowcount
        # The OTLP spans stored before the cutoff: a retry that late is no retry any more.
        sp = m.OtlpSpan
        conn.execute(sa.delete(sp).where(sp.deployment_id == dep, sp.seen_at < keep_from))
        rr, rh, pr = m.RequestRollup, m.RequestRollupHourly, m.PoolRollup
        conn.execute(
            sa.delete(rr).where(
                rr.deployment_id == dep, rr.bucket_start + REQUEST_BUCKET_US <= keep_from
            )
        )
        # The hour keep_from falls in is recomputed with its marked bucket below.
        conn.execute(
            sa.delete(rh).where(rh.deployment_id == dep, rh.bucket_start + HOUR_US <= keep_from)
        )
        conn.execute(
            sa.delete(pr).where(
                pr.deployment_id == dep, pr.bucket_start + POOL_BUCKET_US <= keep_from
            )
        )
        marks = {
            ("requests", floor_to(keep_from, REQUEST_BUCKET_US)),
            ("pool", floor_to(keep_from, POOL_BUCKET_US)),
        }
        for (first,) in conn.execute(
            select(_us(r.first_ts)).where(r.deployment_id == dep, _us(r.first_ts) < keep_from)
        ):
            marks.add(("requests", floor_to(int(first), REQUEST_BUCKET_US)))
        rollups.mark(conn, ((kind, dep, bucket) for kind, bucket in marks))

    def _incident_holds(
        self, conn: Connection, dep: str, cutoff: int, res: DeploymentResult
    ) -> tuple[int, Any]:
        """(the time before which data may go, a query of the request ids it must keep)."""
        i, pe = m.Incident, m.PageEvent
        keep_from = cutoff
        windows = []
        for inc_id, opened in conn.execute(
            select(i.id, _us(i.opened_at))
            .where(i.deployment_id == dep, i.state == "open")
            .order_by(i.id)
        ):
            prev_close = conn.execute(
                select(sa.func.max(_us(i.closed_at))).where(i.deployment_id == dep, i.id < inc_id)
            ).scalar()
            lo = int(prev_close or 0)
            windows.append(lo)
            first = conn.execute(
                select(sa.func.min(_us(pe.ts))).where(
                    pe.deployment_id == dep, pe.kind.in_(EVIDENCE_KINDS), _us(pe.ts) >= lo
                )
            ).scalar()
            start = int(first) if first is not None else int(opened)
            keep_from = min(keep_from, start - CHART_LEAD_US)
            res.kept_for_incidents.append(int(inc_id))
        evidence = [pe.deployment_id == dep, pe.kind.in_(EVIDENCE_KINDS)]
        if windows:
            evidence.append(_us(pe.ts) >= min(windows))
        else:
            evidence.append(sa.false())
        protected = sa.union(
            select(pe.request_id.label("rid")).where(*evidence, pe.request_id.is_not(None)),
            select(pe.other_request_id.label("rid")).where(
                *evidence, pe.other_request_id.is_not(None)
            ),
        )
        return keep_from, protected
