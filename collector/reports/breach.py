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

The report is typed (:mod:`collector.reports.breach_model`); its JSON document is
``to_document(report)``. The evidence set (the sections named in ``EVIDENCE_KEYS``) of that
document is serialised canonically (sorted keys, compact separators, UTF-8) and hashed with
SHA-256: ``evidence_sha256``. Configs and verifications come from
:mod:`collector.deployment_facts`, as the rules, the limits card and the review read them.
"""

from __future__ import annotations

import csv
import json
import secrets
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, BinaryIO, cast

import pandas as pd
import sqlalchemy as sa
from msgspec.structs import replace
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import deployment_facts
from collector import models as m
from collector.cases.facts import as_logged
from collector.cases.register import Decision, decisions_for
from collector.cases.status import PartyStatus, late_parties, party_status
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.limits import Limits
from collector.reports import breach_rows as rows_sql
from collector.reports.breach_model import (
    SCHEMA_VERSION,
    AffectedRequests,
    Art34,
    BreachReport,
    CauseStep,
    ChartWindow,
    ChecklistItem,
    ConfigEntry,
    DataCategories,
    Deployment,
    ExposedTenant,
    FilledBy,
    Incident,
    Notice,
    Point,
    ReceivingTenant,
    Scope,
    Series,
    StaleRead,
    StaleReads,
    Tenants,
    Timeline,
    VerificationEntry,
    evidence_digest,
    page_split,
    to_document,
)
from collector.reports.breach_rows import CSV_COLUMNS, AffectedRequest, RowFilter, csv_row
from collector.reports.stored import ReportStore
from collector.settings import Settings
from collector.timefmt import iso, parse_iso, to_micros
from policies import VerificationFact
from policies.datamap import SELECTORS, DataMap
from policies.errors import PackError
from policies.limits import strictest

CHUNK_ROWS = 50_000
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

    def section(self) -> Scope:
        """The report's scope section, as asked (an incident's replaces since and until with
        its own window)."""
        return Scope(**{**asdict(self), "since": iso(self.since), "until": iso(self.until)})


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

    def points(self) -> tuple[Point, ...]:
        width = (self.hi - self.lo) / BUCKETS
        return tuple(
            Point(ts=iso(int(self.lo + i * width)), value=v)
            for i, v in enumerate(self.vals)
            if v is not None
        )


@dataclass(slots=True)
class _Affected:
    """The affected requests as a report states them: exact figures from SQL, a sample."""

    count: int
    listed: list[AffectedRequest]
    tenants: dict[str, int]
    routes: dict[str, int]
    deployments: dict[str, int]
    models: dict[str, int]
    statuses: dict[str, int]
    categories: Counter[str]
    max_prompt: int | None
    first_ts: int | None
    last_ts: int | None

    def section(self) -> AffectedRequests:
        return AffectedRequests(
            count=self.count,
            listed=len(self.listed),
            truncated=self.count > len(self.listed),
            max_prompt_tokens=self.max_prompt,
            by_tenant=dict(sorted(self.tenants.items())),
            by_route=dict(sorted(self.routes.items())),
            by_deployment=dict(sorted(self.deployments.items())),
            by_status=dict(sorted(self.statuses.items())),
            sample=f"the first {SAMPLE_ROWS:,} by first event, and every request a stale read "
            "names",
            items=tuple(self.listed),
        )


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
        statuses=s.by_status,
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


def _roles(reads: Iterable[StaleRead]) -> dict[tuple[str, str], str]:
    """Each request the stale reads name, by (deployment, request id): reader, previous
    writer, or both."""
    roles: dict[tuple[str, str], str] = {}
    for s in reads:
        if s.reader_request_id:
            key = (s.deployment_id, s.reader_request_id)
            roles[key] = "both" if roles.get(key) in ("previous_writer", "both") else "reader"
        if s.previous_request_id:
            key = (s.deployment_id, s.previous_request_id)
            roles[key] = "both" if roles.get(key) in ("reader", "both") else "previous_writer"
    return roles


def _named(reads: Iterable[StaleRead]) -> set[tuple[str, str]]:
    """The requests stale reads name, on either side."""
    return {
        (s.deployment_id, rid)
        for s in reads
        for rid in (s.reader_request_id, s.previous_request_id)
        if rid
    }


def _chunks(conn: Connection, stmt: Any) -> Iterator[pd.DataFrame]:
    # A server-side cursor on PostgreSQL: psycopg would otherwise fetch the whole result
    # before the first chunk (SQLite's cursor already streams).
    streaming = conn.execution_options(stream_results=True, max_row_buffer=CHUNK_ROWS)
    yield from pd.read_sql(stmt, streaming, chunksize=CHUNK_ROWS)


def _new_report_id() -> str:
    return "rpt_" + secrets.token_urlsafe(12).replace("-", "x").replace("_", "y")


@dataclass(frozen=True, slots=True)
class _Stamp:
    """When a report is generated, why late when it is, and the parties whose notice was
    sent after its due time (from the notification register, never from ``now``)."""

    now: datetime
    late_reason: str | None
    sent_late: tuple[PartyStatus, ...] = ()
    deadline_rule: str = "GDPR Art. 33(1): 72 hours from awareness"


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
    ) -> BreachReport:
        """Build the report, store it and record it in the audit log; returns the report."""
        now = now or datetime.now(UTC)
        report = self.build(scope, now=now, late_reason=late_reason)
        from collector.reports.signed import sign_breach  # signing hook: docs/signing.md

        signature = sign_breach(self, report, now)
        ReportStore(self.db).save(
            to_document(report), created_by=created_by, now=now, signature=signature
        )
        return report

    def write_csv(self, report: BreachReport, sink: Callable[[bytes], Any]) -> int:
        """The report's CSV, handed to ``sink`` block by block: its first line names the
        report and its evidence hash, then every affected request, streamed from the database
        (``COPY`` on PostgreSQL). Returns the rows written.

        The rows are read again, so they must still be the ones the report counted: when
        their number differs (rows erased or expired since), raises :class:`Conflict` after
        the last block; a caller that must not hand out such a file writes to a temporary
        one first."""
        sink(_csv_head(report).encode())
        with self.db.read() as conn:
            n = rows_sql.write_listing(conn, _report_filter(report), sink)
        expected = report.affected_requests.count
        if n != expected:
            raise Conflict(
                f"report {report.report_id} counted {expected} affected requests; the "
                f"database now holds {n} of them (erased, expired or changed since): generate "
                "a new report",
                {"counted": expected, "found": n},
            )
        return n

    def csv_file(self, report: BreachReport) -> BinaryIO:
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
    ) -> BreachReport:
        """The report of ``scope`` as of ``now``, every field filled (``account``, ``notices``
        and ``evidence_sha256`` from the report's own sections)."""
        scope.validate()
        stamp = _Stamp(now, late_reason)
        with self.db.read() as conn:
            if self.db.dialect == "postgresql":
                # One snapshot for every statement: the counts, the sample and the figures
                # agree with each other (and with a CSV written from an unchanged database).
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            if scope.incident_id is not None:
                report = self._incident(conn, scope, stamp)
            else:
                report = self._window(conn, scope, stamp)
        report = replace(report, account=plain_account(report), notices=implied_notices(report))
        return replace(report, evidence_sha256=evidence_digest(to_document(report)))

    # ------------------------------------------------------------------ scopes

    def _incident(self, conn: Connection, scope: BreachScope, stamp: _Stamp) -> BreachReport:
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
        # Lateness from the notification register: what was sent when, against when it was
        # due (collector.cases.status), so a report generated later says the same.
        statuses = party_status(conn, inc.id, self.settings)
        logged_facts = as_logged(conn, inc.id, inc.awareness_at, inc.deadline_at)
        stamp = _Stamp(
            stamp.now,
            stamp.late_reason,
            tuple(late_parties(statuses)),
            _deadline_rule(self.settings),
        )
        prev_close = previous_close(conn, inc.deployment_id, inc.id)
        lo = to_micros(scope.since) if scope.since else (prev_close or 0)
        hi = to_micros(scope.until) if scope.until else (inc.closed_at or to_micros(stamp.now) + 1)
        deps = [inc.deployment_id]
        reads = self._stale_reads(conn, deps, lo, hi)
        roles = _roles(reads)
        # The incident's affected requests are exactly those its stale reads name: all listed.
        agg = _affected(conn, RowFilter.named(roles), set(roles))
        model_ids = sorted(k for k in agg.models if k)
        incident = Incident(
            id=inc.id,
            deployment_id=inc.deployment_id,
            title=inc.title,
            state=inc.state,
            cause_rule=inc.cause_rule,
            opened_at=iso(inc.opened_at),
            closed_at=iso(inc.closed_at),
        )
        # Charts at the incident's own scale: from the first event of its requests to the
        # last stale read, with a margin of a tenth of that span (at least 10 s) each side,
        # so minute-long incidents are not one dot on a day's axis.
        series_lo, series_hi = lo, min(hi, to_micros(stamp.now) + 1)
        if reads:
            first = to_micros(parse_iso(reads[0].ts))
            if agg.first_ts is not None:
                first = min(first, agg.first_ts)
            last = to_micros(parse_iso(reads[-1].ts))
            margin = max((last - first) // 10, 10 * 10**6)
            series_lo = max(lo, first - margin)
            series_hi = min(hi, last + margin)
        series = self._series(conn, deps, model_ids, series_lo, max(series_hi, series_lo + 1))
        # The hashed scope names the incident's own window, never the generation time: two
        # generations of the same evidence give the same hash. Open-ended sides stay None
        # (since: no earlier incident closed there; until: the incident is still open).
        section = replace(
            scope.section(),
            since=iso(scope.since) if scope.since else iso(prev_close),
            until=iso(scope.until) if scope.until else iso(inc.closed_at),
        )
        return self._assemble(
            conn,
            scope=section,
            agg=agg,
            reads=reads,
            deps=deps,
            model_ids=model_ids,
            incident=incident,
            # as the audit log records them: a database edit does not move a report's clock
            awareness_us=logged_facts[0],
            deadline_us=logged_facts[1],
            series=series,
            window_us=(lo, hi),
            stamp=stamp,
        )

    def _window(self, conn: Connection, scope: BreachScope, stamp: _Stamp) -> BreachReport:
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
            scope=scope.section(),
            agg=agg,
            reads=reads,
            deps=deps,
            model_ids=[scope.model_id],
            incident=None,
            awareness_us=None,
            deadline_us=None,
            series=series,
            window_us=(lo, hi),
            stamp=stamp,
        )

    # ------------------------------------------------------------------ sections

    def _stale_reads(self, conn: Connection, deps: list[str], lo: int, hi: int) -> list[StaleRead]:
        if not deps:
            return []
        out = []
        for row in _page_events(conn, "page.stale_read", deps, lo, hi):
            detail = json.loads(row.detail or "{}")
            out.append(
                StaleRead(
                    ts=iso(row.ts),
                    deployment_id=row.deployment_id,
                    node=row.node,
                    reader_request_id=row.request_id,
                    reader_tenant=row.tenant,
                    previous_request_id=row.other_request_id,
                    previous_tenant=row.other_tenant,
                    page_count=int(row.page_count),
                    pages=tuple(detail.get("page_ids", ())),
                    read_kind=detail.get("read_kind"),
                    cross_tenant=bool(row.cross_tenant),
                )
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
    ) -> Series:
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
        return Series(
            since=iso(lo),
            until=iso(hi),
            prompt_tokens_max=prompt.points(),
            pool_occupancy_max=pool.points(),
            stale_reads=stale.points(),
            window=ChartWindow(from_=iso(lo), until=iso(hi)),  # the charts' time axis
            bucket_seconds=(max(hi, lo + 1) - lo) / BUCKETS / 1e6,
        )

    def _cause(
        self,
        conn: Connection,
        deps: list[str],
        window_us: tuple[int, int],
        agg: _Affected,
        reads: list[StaleRead],
        deployments: Sequence[Deployment],
    ) -> tuple[CauseStep, ...]:
        """The chain that led to the stale reads, in time order, each step from stored
        evidence: prefill pools smaller than the advertised context, rejected prefills, KV
        transferred for a rejected prefill, and the stale reads themselves."""
        steps: list[CauseStep] = []
        for d in deployments:
            for c in d.configs:
                if c.role != "decode" and c.pool_capacity_tokens < c.advertised_context:
                    steps.append(
                        CauseStep(
                            at=c.ts,
                            step="pool_below_advertised",
                            text=f"{d.deployment_id} node {c.node} ({c.role}): KV pool "
                            f"{c.pool_capacity_tokens:,} tokens, smaller than the advertised "
                            f"context {c.advertised_context:,}",
                        )
                    )
        readers = {s.reader_request_id for s in reads}
        for r in agg.listed:
            if r.reject_reason and r.request_id in readers:
                tokens = r.prompt_tokens
                steps.append(
                    CauseStep(
                        at=r.first_ts,
                        step="prefill_rejected",
                        text=f"request {r.request_id} of tenant {r.tenant} "
                        f"({'?' if tokens is None else f'{tokens:,}'} prompt tokens) rejected "
                        f"by prefill: {r.reject_reason}",
                    )
                )
        for row in _page_events(conn, "kv.transfer", deps, *window_us):
            detail = json.loads(row.detail or "{}")
            if detail.get("prefill_rejected"):
                steps.append(
                    CauseStep(
                        at=iso(row.ts),
                        step="rejected_kv_transfer",
                        text=f"KV of rejected request {row.request_id} (tenant {row.tenant}) "
                        f"transferred from {detail.get('from_node')} to {detail.get('to_node')} "
                        f"anyway: {row.page_count:,} pages prefill never wrote",
                    )
                )
        for s in reads:
            prev = (
                f"last written by request {s.previous_request_id} of tenant {s.previous_tenant}"
                if s.previous_tenant
                else "never written since the pool was made (no one's data)"
            )
            steps.append(
                CauseStep(
                    at=s.ts,
                    step="stale_read" + ("_cross_tenant" if s.cross_tenant else ""),
                    text=f"request {s.reader_request_id} of tenant {s.reader_tenant} "
                    f"read {s.page_count:,} pages on {s.node} {prev}",
                )
            )
        steps.sort(key=lambda x: (x.at or "", x.step))
        return tuple(steps)

    def _deployments(
        self, conn: Connection, deps: list[str], model_ids: list[str], now: datetime
    ) -> tuple[Deployment, ...]:
        decided = self.limits.in_conn(conn, deps, now)
        out = []
        for dep in deps:
            # The limit in force of each of the report's models here (policies.limits, as the
            # rule, the card and the gateway have it); the deployment's is the strictest.
            limits = tuple(
                lim
                for (d, model), lim in sorted(decided.items())
                if d == dep and (model in model_ids or not model_ids)
            )
            held = strictest(limits)
            verifications = deployment_facts.verification_history(conn, dep)
            out.append(
                Deployment(
                    deployment_id=dep,
                    configs=tuple(
                        _config_entry(c) for c in deployment_facts.config_history(conn, dep)
                    ),
                    verifications=tuple(
                        _verification_entry(v.fact, v.created_by) for v in verifications
                    ),
                    safe_context=None if held is None else held.tokens,
                    safe_context_source=None if held is None else held.source,
                    limit=None if held is None else held.text,
                    limits_in_force=limits,
                    advertised_context=None if held is None else held.advertised_context,
                    min_pool_capacity_tokens=None if held is None else held.prefill_pool_tokens,
                )
            )
        return tuple(out)

    def _assemble(
        self,
        conn: Connection,
        *,
        scope: Scope,
        agg: _Affected,
        reads: list[StaleRead],
        deps: list[str],
        model_ids: list[str],
        incident: Incident | None,
        awareness_us: int | None,
        deadline_us: int | None,
        series: Series,
        window_us: tuple[int, int],
        stamp: _Stamp,
    ) -> BreachReport:
        """The report from its sections; ``account``, ``notices`` and ``evidence_sha256`` are
        left empty for :meth:`build` to fill from the report itself."""
        cross = [s for s in reads if s.cross_tenant]
        tenants = _tenants(cross)
        categories = self._categories(agg, cross)
        stale_reads = StaleReads(
            count=len(reads),
            cross_tenant=len(cross),
            pages=sum(s.page_count for s in reads),
            items=tuple(reads),
        )
        affected = agg.section()
        deployments = self._deployments(conn, deps, model_ids, stamp.now)
        involved = crossed_deployments(stale_reads)
        return BreachReport(
            mode="incident" if incident is not None else "window",
            scope=scope,
            incident=incident,
            model_ids=tuple(model_ids),
            affected_requests=affected,
            tenants=tenants,
            data_categories=categories,
            stale_reads=stale_reads,
            deployments=deployments,
            cause=self._cause(conn, deps, window_us, agg, reads, deployments),
            timeline=_timeline(reads, agg, awareness_us, deadline_us, stamp),
            series=series,
            report_id=_new_report_id(),
            kind="breach",
            generated_at=iso(stamp.now),
            schema_version=SCHEMA_VERSION,
            checklist=self._checklist(
                tenants,
                stale_reads,
                affected,
                categories,
                involved,
                decisions_for(conn, incident.id) if incident is not None else [],
            ),
            art34=_art34(categories, stale_reads),
            account="",
            notices=(),
            involved_deployments=involved,
            evidence_sha256="",
        )

    def _categories(self, agg: _Affected, cross: list[StaleRead]) -> DataCategories:
        """What leaked: the categories of the exposed (previous-writer) requests, from their
        tags and from the data map's declarations; never guessed."""
        exposed_keys = {(s.deployment_id, s.previous_request_id) for s in cross}
        dm = self._data_map()
        exposed_cats: Counter[str] = Counter()
        map_special: set[str] = set()
        undeclared = {(d, r) for d, r in exposed_keys if r}
        hit_entries: set[int] = set()
        population_known = bool(undeclared)
        for r in agg.listed:
            key = (r.deployment_id, r.request_id)
            if key not in exposed_keys:
                continue
            labels = {s: getattr(r, s) for s in SELECTORS}
            said = dm.declared(labels)
            exposed_cats.update(set(r.data_categories) | said.categories | said.special)
            map_special |= said.special
            if r.data_categories or said.any:
                undeclared.discard(key)
            entries = [i for i, e in enumerate(dm.entries) if e.matches(labels)]
            if not any(dm.entries[i].declared_population is not None for i in entries):
                population_known = False
            hit_entries.update(entries)
        return DataCategories(
            affected=dict(sorted(agg.categories.items())),
            exposed=dict(sorted(exposed_cats.items())),
            exposed_undeclared=len(undeclared),
            special=tuple(
                sorted(
                    {c for c in set(agg.categories) | set(exposed_cats) if c in SPECIAL_CATEGORIES}
                    | map_special
                )
            ),
            data_map=dm.source,
            # The persons the exposed prompts concern cannot be counted without their text,
            # which is never stored: unknown. The map's population is a different figure.
            data_subjects=None,
            population=(
                sum(dm.entries[i].declared_population or 0 for i in hit_entries)
                if population_known
                else None
            ),
        )

    def _checklist(
        self,
        t: Tenants,
        sr: StaleReads,
        ar: AffectedRequests,
        cats: DataCategories,
        involved: Sequence[str],
        decisions: Sequence[Decision],
    ) -> tuple[ChecklistItem, ...]:
        dpo = self.settings.dpo_contact.strip()
        in_force = [d for d in decisions if not d.superseded]
        nature = nature_statement(sr, ar, involved)
        cat_names = sorted(set(cats.affected) | set(cats.exposed))
        return (
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
                    "Data subjects: the persons the exposed prompts are about (the tenants' "
                    "end users, staff or customers; tenants are controllers, not data "
                    "subjects); data: "
                    + (", ".join(cat_names) if cat_names else "no category tags on the requests")
                ),
                "data" if cat_names else "person",
                None if cat_names else "requests carry no data_categories tags: classify",
            ),
            _item(
                "subjects",
                "33(3)(a)",
                "Approximate number of data subjects concerned",
                subjects_statement(cats, t),
                "person",
                "the exposed tenants must say whom their exposed prompts concern",
            ),
            _item(
                "records",
                "33(3)(a)",
                "Approximate number of personal data records concerned",
                records_statement(t, ar),
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
                "Possible disclosure of the exposed tenants' prompts to the receiving tenants: "
                "the answers they received may contain fragments of them"
                + (
                    f"; special categories involved: {', '.join(cats.special)}"
                    if cats.special
                    else ""
                )
                + ".",
                "partial",
                "a person must assess the harm to the data subjects",
            ),
            _measures_item(in_force),
        )


def _measures_item(decisions: Sequence[Decision]) -> ChecklistItem:
    """Art. 33(3)(d) from the decision register (the same entries the notices list): what is
    done and what is still open; with nothing recorded, the usual proposals, for a person."""
    title = "Measures taken or proposed to address the breach and mitigate its effects"
    if not decisions:
        return _item(
            "measures",
            "33(3)(d)",
            title,
            "Proposed: cap the served context at the verified safe context (kvwatch verify); "
            "switch to clean rejection (no KV transfer for rejected prefills); zero or "
            "salt reused pages; inform the exposed and receiving tenants.",
            "partial",
            "no decision is recorded: record the measures taken (kvwatch incidents decide)",
        )
    done = [f"{d.what} ({d.at[:10]}, {d.by})" for d in decisions if d.status == "done"]
    still = [f"{d.what} ({d.at[:10]}, {d.by})" for d in decisions if d.status != "done"]
    parts = []
    if done:
        parts.append("Done: " + "; ".join(done) + ".")
    if still:
        parts.append("Still open: " + "; ".join(still) + ".")
    return _item(
        "measures",
        "33(3)(d)",
        title,
        " ".join(parts),
        "data",
        "from the incident's decision register (Art. 33(5))",
    )


@dataclass(slots=True)
class _Side:
    """One tenant's side of the cross-tenant stale reads: how many, its requests in them, and
    the tenants on the other side."""

    stale_reads: int = 0
    requests: set[str | None] = field(default_factory=set)
    others: set[str | None] = field(default_factory=set)

    def request_ids(self) -> set[str]:
        return {r for r in self.requests if r}

    def other_tenants(self) -> tuple[str, ...]:
        return tuple(sorted(o for o in self.others if o))


def _tenants(cross: Sequence[StaleRead]) -> Tenants:
    """Exposed tenants (whose KV was read) and receiving tenants (whose requests read it)."""
    exposed: dict[str, _Side] = {}
    receiving: dict[str, _Side] = {}
    for s in cross:
        if s.previous_tenant:
            e = exposed.setdefault(s.previous_tenant, _Side())
            e.stale_reads += 1
            e.requests.add(s.previous_request_id)
            e.others.add(s.reader_tenant)
        if s.reader_tenant:
            v = receiving.setdefault(s.reader_tenant, _Side())
            v.stale_reads += 1
            v.requests.add(s.reader_request_id)
            v.others.add(s.previous_tenant)
    return Tenants(
        exposed=tuple(
            ExposedTenant(
                tenant=t,
                stale_reads=x.stale_reads,
                requests=len(x.request_ids()),
                receiving_tenants=x.other_tenants(),
            )
            for t, x in sorted(exposed.items())
        ),
        receiving=tuple(
            ReceivingTenant(
                tenant=t,
                stale_reads=x.stale_reads,
                requests=len(x.request_ids()),
                exposed_tenants=x.other_tenants(),
            )
            for t, x in sorted(receiving.items())
        ),
        exposed_count=len(exposed),
        exposed_requests=len({r for x in exposed.values() for r in x.request_ids()}),
        receiving_count=len(receiving),
        receiving_requests=len({r for x in receiving.values() for r in x.request_ids()}),
        involved_count=len(set(exposed) | set(receiving)),
    )


def _timeline(
    reads: list[StaleRead],
    agg: _Affected,
    awareness_us: int | None,
    deadline_us: int | None,
    stamp: _Stamp,
) -> Timeline:
    times = [to_micros(parse_iso(s.ts)) for s in reads]
    if agg.first_ts is not None:
        times += [agg.first_ts]
    if agg.last_ts is not None:
        times += [agg.last_ts]
    late = deadline_us is not None and bool(stamp.sent_late)
    return Timeline(
        first_event_at=iso(min(times)) if times else None,
        last_event_at=iso(max(times)) if times else None,
        first_stale_read_at=reads[0].ts if reads else None,
        last_stale_read_at=reads[-1].ts if reads else None,
        awareness_at=iso(awareness_us),
        deadline_at=iso(deadline_us),
        deadline_rule=stamp.deadline_rule,
        late=late,
        late_reason=(
            stamp.late_reason
            or f"{NEEDS_PERSON}: "
            + "; ".join(
                f"the notice to {s.party} was sent at {s.sent_at}, due {s.due_at}"
                for s in stamp.sent_late
            )
            + "; Art. 33 requires the reasons for the delay"
        )
        if late
        else None,
    )


def _deadline_rule(settings: Settings) -> str:
    """What the timeline's deadline is, and what "late" is judged by, for the operator's role."""
    if settings.operator_role == "controller":
        return (
            "GDPR Art. 33(1): 72 hours from awareness, to the supervisory authority; late when "
            "its notification was sent after the deadline"
        )
    return (
        "GDPR Art. 33(2): each controller without undue delay (kvwatch target "
        f"{settings.controller_notice_target_h:g} h from awareness); late when a controller's "
        "notice was sent after it. The deadline is the incident's Art. 33(1) 72 hours, the "
        "controllers' own clock."
    )


def _config_entry(c: deployment_facts.ConfigRecord) -> ConfigEntry:
    n = c.config
    return ConfigEntry(
        ts=iso(n.ts),
        node=n.node,
        role=n.role,
        engine=n.engine,
        engine_version=n.engine_version,
        model_id=n.model_id,
        advertised_context=int(n.advertised_context),
        pool_capacity_tokens=int(n.pool_capacity_tokens),
        page_size=c.page_size,
        dtype=c.dtype,
        quantization=n.quantization,
        tp_size=int(n.tp_size),
        cuda_graphs=n.cuda_graphs,
        disaggregated=n.disaggregated,
        config_hash=c.config_hash,
    )


def _verification_entry(v: VerificationFact, created_by: str) -> VerificationEntry:
    return VerificationEntry(
        model_id=v.model_id,
        passed=v.passed,
        verified_safe_context=v.verified_safe_context,
        engine_version=v.engine_version,
        pool_capacity_tokens=v.pool_capacity_tokens,
        verified_at=iso(v.verified_at),
        created_by=created_by,
    )


def _item(
    key: str,
    article: str,
    title: str,
    value: str,
    source: FilledBy,
    note: str | None = None,
) -> ChecklistItem:
    return ChecklistItem(
        key=key,
        article=f"Art. {article}",
        title=title,
        value=value,
        filled_by=source,
        needs_person=source != "data",
        note=note,
    )


def _art34(cats: DataCategories, sr: StaleReads) -> Art34:
    """Decision support for Art. 34: ``high_risk`` True, False or None (undetermined).

    Categories can make it "yes" (a special category exposed across tenants) or leave it
    undetermined; they never make it "no" by themselves: kvwatch never stores the text, so
    special or sensitive content in an exposed prompt cannot be ruled out from categories,
    declared or tagged, and absence of tags is not absence of risk. "No" only when no data
    crossed tenants; a person's own Art. 34 decision belongs in the decision register."""
    special = cats.special
    undeclared = cats.exposed_undeclared
    cross = sr.cross_tenant > 0
    high: bool | None
    if cross and special:
        high = True
        reasons = [
            f"cross-tenant exposure of special-category data ({', '.join(special)}): Art. 9/10"
        ]
    elif cross:
        high = None
        reasons = []
        if undeclared:
            reasons.append(
                f"{undeclared} exposed request(s) declare no data categories: what they held "
                "is unknown, so the risk is undetermined; a person must assess the exposed "
                "prompts"
            )
        if cats.exposed:
            reasons.append(
                "the exposed requests declare only non-special categories "
                f"({', '.join(sorted(cats.exposed))}): categories alone cannot rule out "
                "special or sensitive content in a prompt, and kvwatch never stores the "
                "text, so the risk is undetermined, not low; a person must assess the "
                "exposed prompts with the exposed tenant"
            )
        if not reasons:  # cross-tenant reads whose previous writers are not in the evidence
            reasons.append(
                "what the exposed requests held is not recorded: the risk is undetermined; a "
                "person must assess the exposed prompts"
            )
    else:
        high = False
        reasons = ["no cross-tenant exposure recorded in scope: no data crossed tenants"]
    return Art34(
        high_risk=high,
        verdict="undetermined" if high is None else "yes" if high else "no",
        communicate_to_subjects=high,
        reasons=tuple(reasons),
        rule="high risk if special-category data was exposed across tenants; otherwise "
        "undetermined whenever data crossed tenants (categories, declared or not, cannot rule "
        "out special or sensitive content: the text is never stored); no only when no data "
        "crossed tenants",
        needs_person=True,
        note="decision support only: a person decides under Art. 34(1) and (3)",
    )


def _count(n: int, one: str, many: str | None = None) -> str:
    """``1 page``, ``742 pages``: a figure with its noun agreeing."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def nature_statement(sr: StaleReads, ar: AffectedRequests, involved: Sequence[str]) -> str:
    """Art. 33(3)(a), the nature of the breach: the pages that held another tenant's data
    apart from those that held the reader's own tenant's or no one's (a page never written
    since the pool was made), so that the pages read are never all cited as disclosed."""
    split = page_split(sr)
    where = ", ".join(involved) or "no deployment"
    if not sr.cross_tenant:
        text = (
            f"No cross-tenant stale read recorded; {_count(ar.count, 'request')} in scope "
            "(prompts in the scope's range) are at risk."
        )
        if sr.count:
            text += (
                f" {_count(sr.count, 'stale read')} covered {_count(sr.pages, 'page')}, none "
                "of which held another tenant's data."
            )
        return text
    other = sr.count - sr.cross_tenant
    text = (
        f"Confidentiality breach on {where}: {_count(sr.cross_tenant, 'cross-tenant stale')} "
        f"KV-cache {'read' if sr.cross_tenant == 1 else 'reads'} covered "
        f"{_count(split.other_tenant, 'page')} that held another tenant's data; the answers "
        "to the reading requests may contain fragments of that tenant's prompts."
    )
    held = []
    if split.same_tenant:
        held.append(f"{_count(split.same_tenant, 'page')} of the reading tenant's own data")
    if split.no_one:
        held.append(
            f"{_count(split.no_one, 'page')} that held no one's data (never written since the "
            "KV pool was made)"
        )
    if other and held:
        text += (
            f" {_count(other, 'other stale read')} covered " + " and ".join(held) + ": no data "
            "crossed tenants there."
        )
    return text


def records_statement(t: Tenants, ar: AffectedRequests) -> str:
    """Art. 33(3)(a), the records concerned: the exposed requests (whose prompts' KV another
    tenant's request read), never the requests that read them, which are their own figure."""
    if not t.exposed_requests:
        return (
            f"none exposed: no cross-tenant stale read in scope ({_count(ar.count, 'request')} "
            "in scope)"
        )
    one = t.exposed_requests == 1
    return (
        f"{_count(t.exposed_requests, 'exposed request')} ("
        + (
            "a prompt whose KV-cache pages another tenant's request read; what it held is "
            if one
            else "prompts whose KV-cache pages another tenant's request read; what each held is "
        )
        + "not stored). Counted apart: "
        f"{_count(t.receiving_requests, 'receiving request')} that read "
        + ("it" if one else "them")
        + ", whose answers may contain fragments of "
        + ("that prompt." if one else "those prompts.")
    )


def subjects_statement(cats: DataCategories, t: Tenants) -> str:
    """Art. 33(3)(a), the data subjects concerned: unknown (never the data map's population,
    which is stated apart, as what it is); then the customers involved."""
    text = (
        "unknown: kvwatch stores no prompt text and cannot count the persons the exposed "
        "prompts concern; the exposed tenants (the controllers) can."
    )
    if cats.population is not None:
        text += (
            f" Declared population behind the exposed requests: {cats.population:,} persons "
            f"(data map {cats.data_map}): whose data that traffic carries, not the number "
            "concerned."
        )
    return (
        text + " Customers (controllers) involved: "
        f"{t.exposed_count} exposed tenant(s) ({t.exposed_requests} request(s) whose KV was "
        f"read), {t.receiving_count} receiving tenant(s) ({t.receiving_requests} request(s) "
        "that read it)"
    )


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


def crossed_deployments(stale_reads: StaleReads) -> tuple[str, ...]:
    """The deployments where data crossed tenants: the ones a breach involves. A deployment
    in scope whose requests were refused cleanly is listed in ``deployments``, not here."""
    return tuple(sorted({s.deployment_id for s in stale_reads.items if s.cross_tenant}))


def implied_notices(report: BreachReport) -> tuple[Notice, ...]:
    """The tenant notices an incident implies (Art. 33(2): each affected controller), one per
    exposed or receiving tenant, with the command that writes it."""
    if report.incident is None:
        return ()
    exposed = {x.tenant for x in report.tenants.exposed}
    receiving = {x.tenant for x in report.tenants.receiving}
    return tuple(
        Notice(
            tenant=tenant,
            kind="both"
            if tenant in exposed and tenant in receiving
            else "exposed"
            if tenant in exposed
            else "received",
            # the register's steps: prepared (signed, stored), then approved and sent
            command=f"kvwatch incidents notify prepare {report.incident.id} "
            f"--party {tenant} --by NAME --out notices",
        )
        for tenant in sorted(exposed | receiving)
    )


def plain_account(report: BreachReport) -> str:
    """One paragraph in plain language, generated from the report's own figures (a template,
    no model): what happened, why, and what is not known."""
    sr, t, cats = report.stale_reads, report.tenants, report.data_categories
    deps = ", ".join(report.involved_deployments or [d.deployment_id for d in report.deployments])
    deps = deps or "no deployment"
    steps = {x.step for x in report.cause}
    parts: list[str] = []
    if sr.cross_tenant:
        receiving = ", ".join(x.tenant for x in t.receiving) or "unknown tenants"
        exposed = ", ".join(x.tenant for x in t.exposed) or "unknown tenants"
        tl = report.timeline
        parts.append(
            f"Between {tl.first_stale_read_at} and {tl.last_stale_read_at}, on {deps}, "
            f"{t.receiving_requests} request(s) of {receiving} read KV-cache pages "
            f"last written by {t.exposed_requests} request(s) of {exposed} "
            f"({sr.cross_tenant} cross-tenant stale read(s)): the answers they received may "
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
            f"{report.affected_requests.count} request(s) are in scope."
        )
    split = page_split(sr)
    if sr.cross_tenant and split.no_one:
        parts.append(
            f"Of the {sr.pages:,} pages read, {split.other_tenant:,} held another tenant's "
            f"data; {split.no_one:,} had never been written (no one's data)."
        )
    known = ", ".join(sorted(cats.exposed)) or "none declared"
    parts.append(
        "kvwatch stores no prompt text: what the pages held, and how many persons it concerns, "
        f"is not known to it. Declared data categories of the exposed requests: {known}. "
        f"Art. 34 high risk: {report.art34.verdict}."
    )
    return " ".join(parts)


def _csv_head(report: BreachReport) -> str:
    return f"# kvwatch breach report {report.report_id} evidence_sha256={report.evidence_sha256}\n"


def _report_filter(report: BreachReport) -> RowFilter:
    """The rows a stored report covers, from the report alone: a window's scope, or the
    requests an incident's stale reads name."""
    if report.mode == "incident":
        return RowFilter.named(_roles(report.stale_reads.items))
    sc = report.scope
    assert sc.since is not None and sc.until is not None and sc.model_id is not None
    return _window_filter(
        BreachScope(
            model_id=sc.model_id,
            since=parse_iso(sc.since),
            until=parse_iso(sc.until),
            min_prompt_tokens=sc.min_prompt_tokens,
            deployment_id=sc.deployment_id,
        )
    )


def check_csv(report: BreachReport, lines: Iterable[str]) -> list[str]:
    """What is wrong with ``lines`` (a CSV's text, line by line) as this report's CSV; empty
    when nothing. The first line must name the report and its hash; then the rows are
    recounted: their number, per tenant, route and deployment, the largest prompt, and every
    request the JSON lists must be among them, as listed."""
    it = iter(lines)
    head = next(it, "")
    problems = []
    if head != _csv_head(report):
        problems.append("its first line does not name this report and its evidence hash")
    reader = csv.reader(it)
    if next(reader, None) != list(CSV_COLUMNS):
        return [*problems, "its header row is not the breach CSV's"]
    ar = report.affected_requests
    listed = {tuple(str(x) for x in csv_row(r)) for r in ar.items}
    count = 0
    tenants: Counter[str] = Counter()
    routes: Counter[str] = Counter()
    deployments: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    max_prompt: int | None = None
    for row in reader:
        count += 1
        rec = dict(zip(CSV_COLUMNS, row, strict=False))
        tenants[rec.get("tenant", "")] += 1
        routes[rec.get("route", "")] += 1
        deployments[rec.get("deployment_id", "")] += 1
        statuses[rec.get("status", "")] += 1
        if pt := rec.get("prompt_tokens"):
            max_prompt = max(max_prompt or 0, int(pt)) if pt.isdigit() else max_prompt
        listed.discard(tuple(row))
    expected = {
        "rows": (count, ar.count),
        "rows per tenant": (dict(tenants), ar.by_tenant),
        "rows per route": (dict(routes), ar.by_route),
        "rows per deployment": (dict(deployments), ar.by_deployment),
        # a report stored before by_status was added has none to check
        "rows per status": (dict(statuses), ar.by_status or dict(statuses)),
        "largest prompt": (max_prompt, ar.max_prompt_tokens),
    }
    problems += [
        f"{what} differ (file {got}, report {want})"
        for what, (got, want) in expected.items()
        if got != want
    ]
    if listed:
        rid = CSV_COLUMNS.index("request_id")
        named = ", ".join(sorted(row[rid] for row in listed)[:20])
        problems.append(
            f"{len(listed)} request(s) the report lists are missing or changed: {named}"
        )
    return problems
