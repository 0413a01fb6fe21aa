"""Breach assessment: which requests, which tenants, what data, what deadline.

A report covers an incident (the stale reads of the incident's deployment since its previous
incident was closed, up to this one's close or now; the scope records those bounds, an open
side as None, so the evidence hash does not change with the generation time) or a window
(one model's requests in ``[since, until)`` with prompts of at least ``min_prompt_tokens``).
The affected requests are summarised in SQL (:mod:`collector.reports.breach_rows`): exact
counts, per tenant, route, deployment and category figures, and a bounded sample (the first
``SAMPLE_ROWS`` by first event, and every request a stale read names); nothing loads them
all. The CSV lists every one of them, streamed from the database when it is written
(:meth:`BreachService.write_csv`: ``COPY … TO STDOUT`` on PostgreSQL), and it must hold
exactly ``affected_requests.count`` rows.

The evidence set (the sections named in ``EVIDENCE_KEYS``) is serialised canonically (sorted
keys, compact separators, UTF-8) and hashed with SHA-256: ``evidence_sha256``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import secrets
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, BinaryIO, cast

import pandas as pd
import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.limits import Limits
from collector.reports import breach_rows as rows_sql
from collector.reports.breach_rows import CSV_COLUMNS, RowFilter, csv_row
from collector.reports.stored import ReportStore, canonical
from collector.settings import Settings
from collector.timefmt import iso, parse_iso, to_micros
from policies.datamap import DataMap
from policies.errors import PackError

CHUNK_ROWS = 50_000
# 2: "items" is a sample (SAMPLE_ROWS), the CSV is streamed from the database and lists every
# affected request. 1: "items" listed up to 100,000 requests and the CSV was made from them.
SCHEMA_VERSION = 2
# A CSV served over HTTP is spooled (and counted) before its first byte goes out: in memory up
# to this size, then in a temporary file.
_SPOOL_BYTES = 8 << 20
# Requests listed in the JSON (and so the PDF): a sample; the CSV lists them all.
SAMPLE_ROWS = 1_000
BUCKETS = 48
# GDPR Art. 9(1) special categories and Art. 10 criminal-offence data, as request tags.
SPECIAL_CATEGORIES = frozenset(
    {
        "special",
        "health",
        "medical",
        "biometric",
        "genetic",
        "racial_or_ethnic_origin",
        "ethnic_origin",
        "political_opinions",
        "religious_beliefs",
        "philosophical_beliefs",
        "trade_union",
        "sex_life",
        "sexual_orientation",
        "criminal",
    }
)
EVIDENCE_KEYS = (
    "scope",
    "affected_requests",
    "tenants",
    "data_categories",
    "stale_reads",
    "deployments",
    "cause",
)
NEEDS_PERSON = "needs a person"


@dataclass(frozen=True, slots=True)
class BreachScope:
    incident_id: int | None = None
    model_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_prompt_tokens: int | None = None
    deployment_id: str | None = None

    def validate(self) -> None:
        for name in ("since", "until"):
            v = getattr(self, name)
            if v is not None and v.tzinfo is None:
                raise InvalidInput(f"{name} must be a UTC instant (with a timezone)")
        if self.incident_id is None:
            missing = [n for n in ("model_id", "since", "until") if getattr(self, n) is None]
            if missing:
                raise InvalidInput(
                    "a breach report needs incident_id, or model_id, since and until; missing: "
                    + ", ".join(missing),
                    {"missing": missing},
                )
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InvalidInput(
                f"inverted window: since ({iso(self.since)}) must be before until "
                f"({iso(self.until)})",
                {"since": iso(self.since), "until": iso(self.until)},
            )
        if self.min_prompt_tokens is not None and self.min_prompt_tokens < 0:
            raise InvalidInput("min_prompt_tokens must be >= 0")

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["since"] = iso(self.since)
        d["until"] = iso(self.until)
        return d


def evidence_digest(report: dict[str, Any]) -> str:
    """SHA-256 of the report's evidence set (recomputable from a stored report)."""
    return hashlib.sha256(canonical({k: report[k] for k in EVIDENCE_KEYS})).hexdigest()


def _int(v: Any) -> int | None:
    return None if v is None or pd.isna(v) else int(v)


class _Buckets:
    """Max (or sum) of a value per time bucket over ``[lo, hi)``: bounded memory."""

    def __init__(self, lo: int, hi: int, how: str):
        self.lo, self.hi, self.how = lo, max(hi, lo + 1), how
        self.vals: list[float | None] = [None] * BUCKETS

    def add(self, ts: pd.Series, values: pd.Series) -> None:
        if ts.empty:
            return
        idx = ((ts - self.lo) * BUCKETS // (self.hi - self.lo)).clip(0, BUCKETS - 1)
        grouped = values.groupby(idx.to_numpy())
        agg = grouped.max() if self.how == "max" else grouped.sum()
        for i, v in agg.items():
            cur = self.vals[int(i)]
            fv = float(v)
            if cur is None:
                self.vals[int(i)] = fv
            else:
                self.vals[int(i)] = max(cur, fv) if self.how == "max" else cur + fv

    def put(self, values: dict[int, int]) -> None:
        """Per-bucket values computed elsewhere (in SQL), folded in like :meth:`add`'s."""
        for i, v in values.items():
            cur, fv = self.vals[i], float(v)
            self.vals[i] = fv if cur is None else max(cur, fv) if self.how == "max" else cur + fv

    def points(self) -> list[dict[str, Any]]:
        width = (self.hi - self.lo) / BUCKETS
        return [
            {"ts": iso(int(self.lo + i * width)), "value": v}
            for i, v in enumerate(self.vals)
            if v is not None
        ]


@dataclass(slots=True)
class _Affected:
    """The affected requests as a report states them: exact figures from SQL, a sample."""

    count: int
    listed: list[dict[str, Any]]
    tenants: dict[str, int]
    routes: dict[str, int]
    deployments: dict[str, int]
    models: dict[str, int]
    categories: Counter[str]
    max_prompt: int | None
    first_ts: int | None
    last_ts: int | None


def _affected(
    conn: Connection,
    f: RowFilter,
    named: set[tuple[str, str]],
    s: rows_sql.Summary | None = None,
) -> _Affected:
    """``f``'s requests: ``s`` (its summary, computed here unless given) and the sample, which
    holds every request in ``named`` that ``f`` covers."""
    s = s or rows_sql.summary(conn, f)
    cats: Counter[str] = Counter()
    for raw, n in s.by_categories.items():
        for c in rows_sql.categories(raw):
            cats[c] += n
    return _Affected(
        count=s.count,
        listed=rows_sql.sample(conn, f, SAMPLE_ROWS, named),
        tenants=s.by_tenant,
        routes=s.by_route,
        deployments=s.by_deployment,
        models=s.by_model,
        categories=cats,
        max_prompt=s.max_prompt,
        first_ts=s.first_ts,
        last_ts=s.last_ts,
    )


def _window_filter(scope: BreachScope) -> RowFilter:
    assert scope.since is not None and scope.until is not None and scope.model_id
    return RowFilter.window(
        scope.model_id,
        to_micros(scope.since),
        to_micros(scope.until),
        min_prompt_tokens=scope.min_prompt_tokens,
        deployment_id=scope.deployment_id,
    )


def _roles(reads: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Each request the stale reads name, by (deployment, request id): reader, previous
    writer, or both."""
    roles: dict[tuple[str, str], str] = {}
    for s in reads:
        if s["reader_request_id"]:
            key = (s["deployment_id"], s["reader_request_id"])
            roles[key] = "both" if roles.get(key) in ("previous_writer", "both") else "reader"
        if s["previous_request_id"]:
            key = (s["deployment_id"], s["previous_request_id"])
            roles[key] = "both" if roles.get(key) in ("reader", "both") else "previous_writer"
    return roles


def _named(reads: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """The requests stale reads name, on either side."""
    return {
        (s["deployment_id"], rid)
        for s in reads
        for rid in (s["reader_request_id"], s["previous_request_id"])
        if rid
    }


def _chunks(conn: Connection, stmt: Any) -> Iterator[pd.DataFrame]:
    # A server-side cursor on PostgreSQL: psycopg would otherwise fetch the whole result
    # before the first chunk (SQLite's cursor already streams).
    streaming = conn.execution_options(stream_results=True, max_row_buffer=CHUNK_ROWS)
    yield from pd.read_sql(stmt, streaming, chunksize=CHUNK_ROWS)


class BreachService:
    def __init__(self, db: Database, settings: Settings, limits: Limits | None = None):
        self.db = db
        self.settings = settings
        self.limits = limits or Limits.for_settings(db, settings)

    def _data_map(self) -> DataMap:
        """``KVWATCH_DATA_MAP``, read at each report (a fix to it takes effect at once)."""
        path = self.settings.data_map
        if path is None:
            return DataMap()
        try:
            return DataMap.load(path)
        except PackError as exc:
            raise InvalidInput(f"KVWATCH_DATA_MAP: {exc}", {"data_map": str(path)}) from None

    # ------------------------------------------------------------------ public

    def create(
        self,
        scope: BreachScope,
        *,
        created_by: str,
        now: datetime | None = None,
        late_reason: str | None = None,
    ) -> dict[str, Any]:
        """Build the report, store it and record it in the audit log; returns the report."""
        now = now or datetime.now(UTC)
        report = self.build(scope, now=now, late_reason=late_reason)
        ReportStore(self.db).save(report, created_by=created_by, now=now)
        return report

    def write_csv(self, report: dict[str, Any], sink: Callable[[bytes], Any]) -> int:
        """The report's CSV, handed to ``sink`` block by block: its first line names the
        report and its evidence hash, then every affected request, streamed from the database
        (``COPY`` on PostgreSQL). Returns the rows written.

        The rows are read again, so they must still be the ones the report counted: when
        their number differs (rows erased or expired since), raises :class:`Conflict` after
        the last block; a caller that must not hand out such a file writes to a temporary
        one first. A report stored before the CSV was streamed (schema 1) gives the requests
        it listed, as it always did."""
        sink(_csv_head(report).encode())
        if report.get("schema_version", 1) < 2:
            body = to_csv(report).split("\n", 1)[1]
            sink(body.encode())
            return len(report["affected_requests"]["items"])
        with self.db.read() as conn:
            n = rows_sql.write_listing(conn, _report_filter(report), sink)
        expected = report["affected_requests"]["count"]
        if n != expected:
            raise Conflict(
                f"report {report['report_id']} counted {expected} affected requests; the "
                f"database now holds {n} of them (erased, expired or changed since): generate "
                "a new report",
                {"counted": expected, "found": n},
            )
        return n

    def csv_file(self, report: dict[str, Any]) -> BinaryIO:
        """The report's CSV (:meth:`write_csv`) in a temporary file, at its start: checked
        whole before anyone reads a byte, in memory while small and on disk beyond."""
        out = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)  # noqa: SIM115 - returned
        try:
            self.write_csv(report, out.write)
        except BaseException:
            out.close()
            raise
        out.seek(0)
        return cast(BinaryIO, out)

    def build(
        self, scope: BreachScope, *, now: datetime, late_reason: str | None = None
    ) -> dict[str, Any]:
        scope.validate()
        with self.db.read() as conn:
            if self.db.dialect == "postgresql":
                # One snapshot for every statement: the counts, the sample and the figures
                # agree with each other (and with a CSV written from an unchanged database).
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            if scope.incident_id is not None:
                body = self._incident(conn, scope, now)
            else:
                body = self._window(conn, scope, now)
        body["report_id"] = "rpt_" + secrets.token_urlsafe(12).replace("-", "x").replace("_", "y")
        body["kind"] = "breach"
        body["generated_at"] = iso(now)
        body["schema_version"] = SCHEMA_VERSION
        tl = body["timeline"]
        if tl["deadline_at"] is not None and to_micros(now) > tl["deadline_us"]:
            tl["late"] = True
            tl["late_reason"] = late_reason or (
                f"{NEEDS_PERSON}: generated after the 72-hour deadline; Art. 33(1) requires "
                "the reasons for the delay"
            )
        else:
            tl["late"] = False
            tl["late_reason"] = None
        del tl["deadline_us"]
        body["checklist"] = self._checklist(body)
        body["art34"] = _art34(body)
        body["account"] = plain_account(body)
        body["notices"] = implied_notices(body)
        body["involved_deployments"] = crossed_deployments(body)
        body["evidence_sha256"] = evidence_digest(body)
        return body

    # ------------------------------------------------------------------ scopes

    def _incident(self, conn: Connection, scope: BreachScope, now: datetime) -> dict[str, Any]:
        inc = conn.execute(
            select(
                m.Incident.id,
                m.Incident.deployment_id,
                m.Incident.title,
                m.Incident.state,
                m.Incident.cause_rule,
                type_coerce(m.Incident.opened_at, BigInteger).label("opened_at"),
                type_coerce(m.Incident.awareness_at, BigInteger).label("awareness_at"),
                type_coerce(m.Incident.deadline_at, BigInteger).label("deadline_at"),
                type_coerce(m.Incident.closed_at, BigInteger).label("closed_at"),
            ).where(m.Incident.id == scope.incident_id)
        ).one_or_none()
        if inc is None:
            raise NotFound(f"no incident {scope.incident_id}")
        prev_close = previous_close(conn, inc.deployment_id, inc.id)
        lo = to_micros(scope.since) if scope.since else (prev_close or 0)
        hi = to_micros(scope.until) if scope.until else (inc.closed_at or to_micros(now) + 1)
        deps = [inc.deployment_id]
        reads = self._stale_reads(conn, deps, lo, hi)
        roles = _roles(reads)
        # The incident's affected requests are exactly those its stale reads name: all listed.
        agg = _affected(conn, RowFilter.named(roles), set(roles))
        model_ids = sorted(k for k in agg.models if k)
        incident = {
            "id": inc.id,
            "deployment_id": inc.deployment_id,
            "title": inc.title,
            "state": inc.state,
            "cause_rule": inc.cause_rule,
            "opened_at": iso(inc.opened_at),
            "closed_at": iso(inc.closed_at),
        }
        # Charts at the incident's own scale: from the first event of its requests to the
        # last stale read, with a margin of a tenth of that span (at least 10 s) each side,
        # so minute-long incidents are not one dot on a day's axis.
        series_lo, series_hi = lo, min(hi, to_micros(now) + 1)
        if reads:
            first = to_micros(parse_iso(reads[0]["ts"]))
            if agg.first_ts is not None:
                first = min(first, agg.first_ts)
            last = to_micros(parse_iso(reads[-1]["ts"]))
            margin = max((last - first) // 10, 10 * 10**6)
            series_lo = max(lo, first - margin)
            series_hi = min(hi, last + margin)
        series = self._series(conn, deps, model_ids, series_lo, max(series_hi, series_lo + 1))
        # The hashed scope names the incident's own window, never the generation time: two
        # generations of the same evidence give the same hash. Open-ended sides stay None
        # (since: no earlier incident closed there; until: the incident is still open).
        window = {
            "since": iso(scope.since) if scope.since else iso(prev_close),
            "until": iso(scope.until) if scope.until else iso(inc.closed_at),
        }
        return self._assemble(
            conn,
            scope_json={**scope.as_json(), **window},
            agg=agg,
            reads=reads,
            deps=deps,
            model_ids=model_ids,
            incident=incident,
            awareness_us=inc.awareness_at,
            deadline_us=inc.deadline_at,
            series=series,
            mode="incident",
            window_us=(lo, hi),
            now=now,
        )

    def _window(self, conn: Connection, scope: BreachScope, now: datetime) -> dict[str, Any]:
        assert scope.since is not None and scope.until is not None and scope.model_id
        lo, hi = to_micros(scope.since), to_micros(scope.until)
        f = _window_filter(scope)
        s = rows_sql.summary(conn, f)
        deps = sorted(
            set(s.by_deployment) | ({scope.deployment_id} if scope.deployment_id else set())
        )
        reads = self._stale_reads(conn, deps, lo, hi)
        agg = _affected(conn, f, _named(reads), s)
        prompt = _Buckets(lo, hi, "max")
        prompt.put(rows_sql.prompt_buckets(conn, f, lo, hi, BUCKETS))
        series = self._series(conn, deps, [scope.model_id], lo, hi, prompt=prompt)
        return self._assemble(
            conn,
            scope_json=scope.as_json(),
            agg=agg,
            reads=reads,
            deps=deps,
            model_ids=[scope.model_id],
            incident=None,
            awareness_us=None,
            deadline_us=None,
            series=series,
            mode="window",
            window_us=(lo, hi),
            now=now,
        )

    # ------------------------------------------------------------------ sections

    def _stale_reads(
        self, conn: Connection, deps: list[str], lo: int, hi: int
    ) -> list[dict[str, Any]]:
        if not deps:
            return []
        rows = _page_events(conn, "page.stale_read", deps, lo, hi)
        out = []
        for row in rows:
            detail = json.loads(row.detail or "{}")
            out.append(
                {
                    "ts": iso(row.ts),
                    "deployment_id": row.deployment_id,
                    "node": row.node,
                    "reader_request_id": row.request_id,
                    "reader_tenant": row.tenant,
                    "previous_request_id": row.other_request_id,
                    "previous_tenant": row.other_tenant,
                    "page_count": int(row.page_count),
                    "pages": detail.get("page_ids", []),
                    "read_kind": detail.get("read_kind"),
                    "cross_tenant": bool(row.cross_tenant),
                }
            )
        return out

    def _series(
        self,
        conn: Connection,
        deps: list[str],
        model_ids: list[str],
        lo: int,
        hi: int,
        prompt: _Buckets | None = None,
    ) -> dict[str, Any]:
        if prompt is None:
            prompt = _Buckets(lo, hi, "max")
            if deps and model_ids:
                r = m.Request
                around = RowFilter([r.deployment_id.in_(deps), r.model_id.in_(model_ids)])
                prompt.put(rows_sql.prompt_buckets(conn, around, lo, hi, BUCKETS))
        pool = _Buckets(lo, hi, "max")
        stale = _Buckets(lo, hi, "sum")
        if deps:
            ps = m.PoolSample
            ts = type_coerce(ps.ts, BigInteger)
            pool_stmt: Any = select(
                ts.label("ts"),
                (ps.used_tokens * 1.0 / sa.func.nullif(ps.capacity_tokens, 0)).label("occ"),
            ).where(ps.deployment_id.in_(deps), ts >= lo, ts < hi)
            for df in _chunks(conn, pool_stmt):
                df = df.dropna()
                pool.add(df["ts"].astype("int64"), df["occ"].astype("float64"))
            pe = m.PageEvent
            ts = type_coerce(pe.ts, BigInteger)
            stale_stmt: Any = select(ts.label("ts")).where(
                pe.kind == "page.stale_read", pe.deployment_id.in_(deps), ts >= lo, ts < hi
            )
            for df in _chunks(conn, stale_stmt):
                stale.add(df["ts"].astype("int64"), pd.Series(1, index=df.index))
        return {
            "since": iso(lo),
            "until": iso(hi),
            "prompt_tokens_max": prompt.points(),
            "pool_occupancy_max": pool.points(),
            "stale_reads": stale.points(),
            "window": {"from": iso(lo), "until": iso(hi)},  # the charts' time axis
            "bucket_seconds": (max(hi, lo + 1) - lo) / BUCKETS / 1e6,
        }

    def _cause(
        self,
        conn: Connection,
        deps: list[str],
        window_us: tuple[int, int],
        agg: _Affected,
        reads: list[dict[str, Any]],
        deployments: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The chain that led to the stale reads, in time order, each step from stored
        evidence: prefill pools smaller than the advertised context, rejected prefills, KV
        transferred for a rejected prefill, and the stale reads themselves."""
        steps: list[dict[str, Any]] = []
        for d in deployments:
            for c in d["configs"]:
                if c["role"] != "decode" and c["pool_capacity_tokens"] < c["advertised_context"]:
                    steps.append(
                        {
                            "at": c["ts"],
                            "step": "pool_below_advertised",
                            "text": f"{d['deployment_id']} node {c['node']} ({c['role']}): KV "
                            f"pool {c['pool_capacity_tokens']:,} tokens, smaller than the "
                            f"advertised context {c['advertised_context']:,}",
                        }
                    )
        readers = {s["reader_request_id"] for s in reads}
        for r in agg.listed:
            if r["reject_reason"] and r["request_id"] in readers:
                tokens = r["prompt_tokens"]
                steps.append(
                    {
                        "at": r["first_ts"],
                        "step": "prefill_rejected",
                        "text": f"request {r['request_id']} of tenant {r['tenant']} "
                        f"({'?' if tokens is None else f'{tokens:,}'} prompt tokens) rejected "
                        f"by prefill: {r['reject_reason']}",
                    }
                )
        for row in _page_events(conn, "kv.transfer", deps, *window_us):
            detail = json.loads(row.detail or "{}")
            if detail.get("prefill_rejected"):
                steps.append(
                    {
                        "at": iso(row.ts),
                        "step": "rejected_kv_transfer",
                        "text": f"KV of rejected request {row.request_id} (tenant {row.tenant}) "
                        f"transferred from {detail.get('from_node')} to {detail.get('to_node')} "
                        f"anyway: {row.page_count:,} pages prefill never wrote",
                    }
                )
        for s in reads:
            prev = (
                f"last written by request {s['previous_request_id']} of tenant "
                f"{s['previous_tenant']}"
                if s["previous_tenant"]
                else "never written since the pool was made (no one's data)"
            )
            steps.append(
                {
                    "at": s["ts"],
                    "step": "stale_read" + ("_cross_tenant" if s["cross_tenant"] else ""),
                    "text": f"request {s['reader_request_id']} of tenant {s['reader_tenant']} "
                    f"read {s['page_count']:,} pages on {s['node']} {prev}",
                }
            )
        steps.sort(key=lambda x: (x["at"] or "", x["step"]))
        return steps

    def _deployments(
        self, conn: Connection, deps: list[str], model_ids: list[str], now: datetime
    ) -> list[dict[str, Any]]:
        decided = self.limits.in_conn(conn, deps, now)
        out = []
        for dep in deps:
            c = m.DeploymentConfig
            configs = [
                {
                    "ts": iso(row.ts),
                    "node": row.node,
                    "role": row.role,
                    "engine": row.engine,
                    "engine_version": row.engine_version,
                    "model_id": row.model_id,
                    "advertised_context": int(row.advertised_context),
                    "pool_capacity_tokens": int(row.pool_capacity_tokens),
                    "page_size": int(row.page_size),
                    "dtype": row.dtype,
                    "quantization": row.quantization,
                    "tp_size": int(row.tp_size),
                    "cuda_graphs": bool(row.cuda_graphs),
                    "disaggregated": bool(row.disaggregated),
                    "config_hash": row.config_hash,
                }
                for row in conn.execute(
                    select(
                        type_coerce(c.ts, BigInteger).label("ts"),
                        c.node,
                        c.role,
                        c.engine,
                        c.engine_version,
                        c.model_id,
                        c.advertised_context,
                        c.pool_capacity_tokens,
                        c.page_size,
                        c.dtype,
                        c.quantization,
                        c.tp_size,
                        c.cuda_graphs,
                        c.disaggregated,
                        c.config_hash,
                    )
                    .where(c.deployment_id == dep)
                    .order_by(c.ts, c.id)
                )
            ]
            v = m.Verification
            verifications = [
                {
                    "model_id": row.model_id,
                    "passed": bool(row.passed),
                    "verified_safe_context": _int(row.verified_safe_context),
                    "engine_version": row.engine_version,
                    "pool_capacity_tokens": _int(row.pool_capacity_tokens),
                    "verified_at": iso(row.verified_at),
                    "created_by": row.created_by,
                }
                for row in conn.execute(
                    select(
                        v.model_id,
                        v.passed,
                        v.verified_safe_context,
                        v.engine_version,
                        v.pool_capacity_tokens,
                        type_coerce(v.verified_at, BigInteger).label("verified_at"),
                        v.created_by,
                    )
                    .where(v.deployment_id == dep)
                    .order_by(v.verified_at, v.id)
                )
            ]
            # The limit in force of each of the report's models here (policies.limits, as the
            # rule, the card and the gateway have it); the deployment's is the strictest.
            limits = [
                lim
                for (d, model), lim in sorted(decided.items())
                if d == dep and (model in model_ids or not model_ids)
            ]
            known = [lim for lim in limits if lim.tokens is not None]
            strictest = min(known, key=lambda lim: lim.tokens or 0) if known else None
            out.append(
                {
                    "deployment_id": dep,
                    "configs": configs,
                    "verifications": verifications,
                    "safe_context": None if strictest is None else strictest.tokens,
                    "safe_context_source": None if strictest is None else strictest.source,
                    "limit": None if strictest is None else strictest.text,
                    "limits_in_force": [lim.as_json() for lim in limits],
                    "advertised_context": None
                    if strictest is None
                    else strictest.advertised_context,
                    "min_pool_capacity_tokens": None
                    if strictest is None
                    else strictest.prefill_pool_tokens,
                }
            )
        return out

    def _assemble(
        self,
        conn: Connection,
        *,
        scope_json: dict[str, Any],
        agg: _Affected,
        reads: list[dict[str, Any]],
        deps: list[str],
        model_ids: list[str],
        incident: dict[str, Any] | None,
        awareness_us: int | None,
        deadline_us: int | None,
        series: dict[str, Any],
        mode: str,
        window_us: tuple[int, int],
        now: datetime,
    ) -> dict[str, Any]:
        cross = [s for s in reads if s["cross_tenant"]]
        exposed: dict[str, dict[str, Any]] = {}
        victims: dict[str, dict[str, Any]] = {}
        for s in cross:
            if s["previous_tenant"]:
                e = exposed.setdefault(
                    s["previous_tenant"], {"stale_reads": 0, "requests": set(), "readers": set()}
                )
                e["stale_reads"] += 1
                e["requests"].add(s["previous_request_id"])
                e["readers"].add(s["reader_tenant"])
            if s["reader_tenant"]:
                v = victims.setdefault(
                    s["reader_tenant"], {"stale_reads": 0, "requests": set(), "sources": set()}
                )
                v["stale_reads"] += 1
                v["requests"].add(s["reader_request_id"])
                v["sources"].add(s["previous_tenant"])

        def rows(d: dict[str, dict[str, Any]], other: str) -> list[dict[str, Any]]:
            return [
                {
                    "tenant": t,
                    "stale_reads": x["stale_reads"],
                    "requests": len({r for r in x["requests"] if r}),
                    other: sorted(o for o in x[other] if o),
                }
                for t, x in sorted(d.items())
            ]

        # What leaked: the categories of the exposed (previous-writer) requests.
        exposed_keys = {(s["deployment_id"], s["previous_request_id"]) for s in cross}
        # What leaked: the categories of the exposed (previous-writer) requests, from their
        # tags and from the data map's declarations; never guessed.
        dm = self._data_map()
        exposed_cats: Counter[str] = Counter()
        map_special: set[str] = set()
        undeclared = {(d, r) for d, r in exposed_keys if r}
        hit_entries: set[int] = set()
        subjects_known = bool(undeclared)
        for r in agg.listed:
            key = (r["deployment_id"], r["request_id"])
            if key not in exposed_keys:
                continue
            said = dm.declared(r)
            exposed_cats.update(set(r["data_categories"]) | said.categories | said.special)
            map_special |= said.special
            if r["data_categories"] or said.any:
                undeclared.discard(key)
            entries = [i for i, e in enumerate(dm.entries) if e.matches(r)]
            if not any(dm.entries[i].data_subjects is not None for i in entries):
                subjects_known = False
            hit_entries.update(entries)
        declared_subjects = (
            sum(dm.entries[i].data_subjects or 0 for i in hit_entries) if subjects_known else None
        )
        times = [to_micros(parse_iso(s["ts"])) for s in reads]
        if agg.first_ts is not None:
            times += [agg.first_ts]
        if agg.last_ts is not None:
            times += [agg.last_ts]
        timeline = {
            "first_event_at": iso(min(times)) if times else None,
            "last_event_at": iso(max(times)) if times else None,
            "first_stale_read_at": reads[0]["ts"] if reads else None,
            "last_stale_read_at": reads[-1]["ts"] if reads else None,
            "awareness_at": iso(awareness_us),
            "deadline_at": iso(deadline_us),
            "deadline_us": deadline_us,
            "deadline_rule": "GDPR Art. 33(1): 72 hours from awareness",
        }
        return {
            "mode": mode,
            "scope": scope_json,
            "incident": incident,
            "model_ids": model_ids,
            "affected_requests": {
                "count": agg.count,
                "listed": len(agg.listed),
                "truncated": agg.count > len(agg.listed),
                "max_prompt_tokens": agg.max_prompt,
                "by_tenant": dict(sorted(agg.tenants.items())),
                "by_route": dict(sorted(agg.routes.items())),
                "by_deployment": dict(sorted(agg.deployments.items())),
                # What "items" holds; the CSV lists all "count" of them.
                "sample": f"the first {SAMPLE_ROWS:,} by first event, and every request a "
                "stale read names",
                "items": agg.listed,
            },
            # Tenants are customers (controllers), not data subjects. Exposed: whose KV was
            # read; receiving: who read it ("victims", "victim_count": the same, older names).
            "tenants": {
                "exposed": rows(exposed, "readers"),
                "victims": rows(victims, "sources"),
                "exposed_count": len(exposed),
                "exposed_requests": len({r for x in exposed.values() for r in x["requests"] if r}),
                "receiving_count": len(victims),
                "receiving_requests": len(
                    {r for x in victims.values() for r in x["requests"] if r}
                ),
                "victim_count": len(victims),
                "involved_count": len(set(exposed) | set(victims)),
            },
            "data_categories": {
                "affected": dict(sorted(agg.categories.items())),
                "exposed": dict(sorted(exposed_cats.items())),
                # exposed requests that declare no category: their data is unknown
                "exposed_undeclared": len(undeclared),
                "special": sorted(
                    {c for c in set(agg.categories) | set(exposed_cats) if c in SPECIAL_CATEGORIES}
                    | map_special
                ),
                "data_map": dm.source,
                # persons the exposed data concerns, only where the data map declares it
                "data_subjects": declared_subjects,
            },
            "stale_reads": {
                "count": len(reads),
                "cross_tenant": len(cross),
                "pages": sum(s["page_count"] for s in reads),
                "items": reads,
            },
            "deployments": (deployments := self._deployments(conn, deps, model_ids, now)),
            "cause": self._cause(conn, deps, window_us, agg, reads, deployments),
            "timeline": timeline,
            "series": series,
        }

    def _checklist(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        t = body["tenants"]
        sr = body["stale_reads"]
        ar = body["affected_requests"]
        cats = body["data_categories"]
        dpo = self.settings.dpo_contact.strip()
        nature = (
            f"Confidentiality breach: {sr['cross_tenant']} cross-tenant stale KV-cache page "
            f"reads ({sr['count']} stale reads, {sr['pages']} pages) on "
            f"{', '.join(crossed_deployments(body)) or 'no deployment'}: "
            "responses carried fragments of other tenants' prompts."
            if sr["cross_tenant"]
            else f"No cross-tenant stale read recorded; {ar['count']} requests in scope are at "
            "risk (prompts in the scope's range)."
        )
        cat_names = sorted(set(cats["affected"]) | set(cats["exposed"]))
        items = [
            _item(
                "nature",
                "33(3)(a)",
                "Nature of the personal data breach",
                nature,
                "data",
            ),
            _item(
                "categories",
                "33(3)(a)",
                "Categories of data subjects and of personal data records",
                (
                    "Data subjects: tenants (and their end users); data: "
                    + (", ".join(cat_names) if cat_names else "no category tags on the requests")
                ),
                "data" if cat_names else "person",
                None if cat_names else "requests carry no data_categories tags: classify",
            ),
            _item(
                "subjects",
                "33(3)(a)",
                "Approximate number of data subjects concerned",
                (
                    f"{cats['data_subjects']:,} (declared in the data map {cats['data_map']}). "
                    if cats.get("data_subjects") is not None
                    else "unknown: kvwatch cannot know how many persons a prompt concerns. "
                )
                + "Customers "
                f"(controllers) involved: {t['exposed_count']} exposed tenant(s) "
                f"({t['exposed_requests']} request(s) whose KV was read), "
                f"{t['receiving_count']} receiving tenant(s) "
                f"({t['receiving_requests']} request(s) that read it)",
                "person",
                "the exposed tenants must say whom their exposed prompts concern",
            ),
            _item(
                "records",
                "33(3)(a)",
                "Approximate number of personal data records concerned",
                f"{ar['count']} requests",
                "data",
            ),
            _item(
                "contact",
                "33(3)(b)",
                "Name and contact details of the DPO or other contact point",
                dpo or NEEDS_PERSON,
                "data" if dpo else "person",
                None if dpo else "set KVWATCH_DPO_CONTACT",
            ),
            _item(
                "consequences",
                "33(3)(c)",
                "Likely consequences of the breach",
                "Disclosure of prompt contents of the exposed tenants to the receiving tenants"
                + (
                    f"; special categories involved: {', '.join(cats['special'])}"
                    if cats["special"]
                    else ""
                )
                + ".",
                "partial",
                "a person must assess the harm to the data subjects",
            ),
            _item(
                "measures",
                "33(3)(d)",
                "Measures taken or proposed to address the breach and mitigate its effects",
                "Proposed: cap the served context at the verified safe context (kvwatch verify); "
                "switch to clean rejection (no KV transfer for rejected prefills); zero or "
                "salt reused pages; inform the exposed and receiving tenants.",
                "partial",
                "a person must record the measures actually taken",
            ),
        ]
        return items


def _item(
    key: str, article: str, title: str, value: str, source: str, note: str | None = None
) -> dict[str, Any]:
    return {
        "key": key,
        "article": f"Art. {article}",
        "title": title,
        "value": value,
        "filled_by": source,  # data | partial | person
        "needs_person": source != "data",
        "note": note,
    }


def _art34(body: dict[str, Any]) -> dict[str, Any]:
    """Decision support for Art. 34: ``high_risk`` True, False or None (undetermined).

    Absence of category tags is not absence of risk: when exposed requests declare no data
    categories, high risk is undetermined, never "no"."""
    cats = body["data_categories"]
    special = cats["special"]
    undeclared = cats.get("exposed_undeclared", 0)
    cross = body["stale_reads"]["cross_tenant"] > 0
    high: bool | None
    if cross and special:
        high = True
        reasons = [
            f"cross-tenant exposure of special-category data ({', '.join(special)}): Art. 9/10"
        ]
    elif cross and undeclared:
        high = None
        reasons = [
            f"{undeclared} exposed request(s) declare no data categories: what they held is "
            "unknown, so the risk is undetermined; a person must assess the exposed prompts"
        ]
    elif cross:
        high = False
        reasons = [
            "the exposed requests declare only non-special categories "
            f"({', '.join(sorted(cats['exposed'])) or 'none'}): not high risk by this rule; "
            "cross-tenant exposure did occur"
        ]
    else:
        high = False
        reasons = ["no cross-tenant exposure recorded in scope"]
    return {
        "high_risk": high,
        "verdict": {True: "yes", False: "no", None: "undetermined"}[high],
        "communicate_to_subjects": high,
        "reasons": reasons,
        "rule": "high risk if special-category data was exposed across tenants; undetermined "
        "when exposed requests declare no categories",
        "needs_person": True,
        "note": "decision support only: a person decides under Art. 34(1) and (3)",
    }


def previous_close(conn: Connection, deployment_id: str, incident_id: int) -> int | None:
    """When the deployment's previous incident closed (µs), or None. An incident's window runs
    from there (or from the beginning) to its own close (or now): the stale reads it covers."""
    return conn.execute(
        select(sa.func.max(type_coerce(m.Incident.closed_at, BigInteger))).where(
            m.Incident.deployment_id == deployment_id,
            m.Incident.id < incident_id,
        )
    ).scalar()


def _page_events(conn: Connection, kind: str, deps: list[str], lo: int, hi: int) -> Any:
    """The deployments' page events of one kind in ``[lo, hi)`` µs, in time order."""
    p = m.PageEvent
    ts = type_coerce(p.ts, BigInteger)
    return conn.execute(
        select(
            p.deployment_id,
            ts.label("ts"),
            p.node,
            p.request_id,
            p.tenant,
            p.other_request_id,
            p.other_tenant,
            p.page_count,
            p.cross_tenant,
            p.detail,
        )
        .where(p.kind == kind, p.deployment_id.in_(deps), ts >= lo, ts < hi)
        .order_by(p.ts, p.id)
    )


def crossed_deployments(body: dict[str, Any]) -> list[str]:
    """The deployments where data crossed tenants: the ones a breach involves. A deployment
    in scope whose requests were refused cleanly is listed in ``deployments``, not here."""
    return sorted({s["deployment_id"] for s in body["stale_reads"]["items"] if s["cross_tenant"]})


def implied_notices(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tenant notices an incident implies (Art. 33(2): each affected controller), one per
    exposed or receiving tenant, with the command that writes it."""
    if body["mode"] != "incident" or body["incident"] is None:
        return []
    t = body["tenants"]
    exposed = {x["tenant"] for x in t["exposed"]}
    received = {x["tenant"] for x in t["victims"]}
    out = []
    for tenant in sorted(exposed | received):
        kind = (
            "both"
            if tenant in exposed and tenant in received
            else "exposed"
            if tenant in exposed
            else "received"
        )
        out.append(
            {
                "tenant": tenant,
                "kind": kind,
                "command": f"kvwatch report notice --incident {body['incident']['id']} "
                f"--tenant {tenant} --out notice-{tenant}.pdf",
            }
        )
    return out


def plain_account(body: dict[str, Any]) -> str:
    """One paragraph in plain language, generated from the report's own figures (a template,
    no model): what happened, why, and what is not known."""
    sr, t, cats = body["stale_reads"], body["tenants"], body["data_categories"]
    deps = ", ".join(crossed_deployments(body) or [d["deployment_id"] for d in body["deployments"]])
    deps = deps or "no deployment"
    steps = {x["step"] for x in body.get("cause", [])}
    parts: list[str] = []
    if sr["cross_tenant"]:
        receivers = ", ".join(x["tenant"] for x in t["victims"]) or "unknown tenants"
        exposed = ", ".join(x["tenant"] for x in t["exposed"]) or "unknown tenants"
        tl = body["timeline"]
        parts.append(
            f"Between {tl['first_stale_read_at']} and {tl['last_stale_read_at']}, on {deps}, "
            f"{t.get('receiving_requests', '?')} request(s) of {receivers} read KV-cache pages "
            f"last written by {t.get('exposed_requests', '?')} request(s) of {exposed} "
            f"({sr['cross_tenant']} cross-tenant stale read(s)): the answers they received may "
            "contain fragments of the other tenant's prompts."
        )
        why = []
        if "pool_below_advertised" in steps:
            why.append("the prefill KV pool is smaller than the advertised context")
        if "prefill_rejected" in steps:
            why.append("prefill rejected the reading request for lack of room")
        if "rejected_kv_transfer" in steps:
            why.append("its KV pages were still handed to decode, which read pages prefill "
                       "never wrote")  # fmt: skip
        if why:
            parts.append("Cause, from the evidence: " + "; ".join(why) + ".")
    else:
        parts.append(
            f"No cross-tenant stale read is recorded in scope on {deps}; "
            f"{body['affected_requests']['count']} request(s) are in scope."
        )
    known = ", ".join(sorted(cats["exposed"])) or "none declared"
    parts.append(
        "kvwatch stores no prompt text: what the pages held, and how many persons it concerns, "
        f"is not known to it. Declared data categories of the exposed requests: {known}. "
        f"Art. 34 high risk: {body['art34']['verdict']}."
    )
    return " ".join(parts)


def _csv_head(report: dict[str, Any]) -> str:
    return (
        f"# kvwatch breach report {report['report_id']} evidence_sha256="
        f"{report['evidence_sha256']}\n"
    )


def _report_filter(report: dict[str, Any]) -> RowFilter:
    """The rows a stored report covers, from the report alone: a window's scope, or the
    requests an incident's stale reads name."""
    if report["mode"] == "incident":
        roles = _roles(report["stale_reads"]["items"])
        return RowFilter.named(roles)
    sc = report["scope"]
    return _window_filter(
        BreachScope(
            model_id=sc["model_id"],
            since=parse_iso(sc["since"]),
            until=parse_iso(sc["until"]),
            min_prompt_tokens=sc["min_prompt_tokens"],
            deployment_id=sc["deployment_id"],
        )
    )


def check_csv(report: dict[str, Any], lines: Iterable[str]) -> list[str]:
    """What is wrong with ``lines`` (a CSV's text, line by line) as this report's CSV; empty
    when nothing. The first line must name the report and its hash; then, for a schema-2
    report, the rows are recounted: their number, per tenant, route and deployment, the
    largest prompt, and every request the JSON lists must be among them, as listed. A
    schema-1 report's CSV must be exactly :func:`to_csv`'s."""
    it = iter(lines)
    head = next(it, "")
    if report.get("schema_version", 1) < 2:
        return [] if head + "".join(it) == to_csv(report) else ["its rows differ"]
    problems = []
    if head != _csv_head(report):
        problems.append("its first line does not name this report and its evidence hash")
    reader = csv.reader(it)
    if next(reader, None) != list(CSV_COLUMNS):
        return [*problems, "its header row is not the breach CSV's"]
    ar = report["affected_requests"]
    listed = {tuple(str(x) for x in csv_row(r)) for r in ar["items"]}
    count = 0
    tenants: Counter[str] = Counter()
    routes: Counter[str] = Counter()
    deployments: Counter[str] = Counter()
    max_prompt: int | None = None
    for row in reader:
        count += 1
        rec = dict(zip(CSV_COLUMNS, row, strict=False))
        tenants[rec.get("tenant", "")] += 1
        routes[rec.get("route", "")] += 1
        deployments[rec.get("deployment_id", "")] += 1
        if pt := rec.get("prompt_tokens"):
            max_prompt = max(max_prompt or 0, int(pt)) if pt.isdigit() else max_prompt
        listed.discard(tuple(row))
    expected = {
        "rows": (count, ar["count"]),
        "rows per tenant": (dict(tenants), ar["by_tenant"]),
        "rows per route": (dict(routes), ar.get("by_route", dict(routes))),
        "rows per deployment": (dict(deployments), ar.get("by_deployment", dict(deployments))),
        "largest prompt": (max_prompt, ar["max_prompt_tokens"]),
    }
    problems += [f"{what} differ" for what, (got, want) in expected.items() if got != want]
    if listed:
        problems.append(f"{len(listed)} request(s) the report lists are missing or changed")
    return problems


def to_csv(report: dict[str, Any]) -> str:
    """The requests the report lists in its JSON ("items"), as CSV with the first comment line
    that names the report and its evidence hash. The whole CSV of a schema-2 report comes from
    :meth:`BreachService.write_csv`; this is the CSV of a schema-1 report."""
    buf = io.StringIO()
    buf.write(_csv_head(report))
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in report["affected_requests"]["items"]:
        w.writerow(csv_row(r))
    return buf.getvalue()
