"""The ingest repository: writes one probe's batch in one transaction.

Idempotency lives in ``probes.max_seq`` plus ``seq_gaps`` (see ``models.Probe``): an event is
new when its seq is above the probe's high-water mark or inside one of its open gaps, so a
retried batch stores nothing twice without a per-event index. The probe's row is locked
(``SELECT ... FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite) so concurrent
collector replicas serialise per probe.

Rows go in through the driver directly (``executemany`` on SQLite, ``COPY`` on PostgreSQL):
the ORM would cost several times the insert itself on this path.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import chain, pairwise
from typing import Any

import msgspec
from sqlalchemy import Connection, delete, func, insert, select, update

from collector import lost_rows as lost
from collector import models as m
from collector.errors import Forbidden
from collector.rollups.buckets import POOL_BUCKET_US, REQUEST_BUCKET_US, request_marks
from collector.settings import REPLACED_QUIET_S
from engine_probe import events as ev

_json = msgspec.json.Encoder()

# Columns, in the order rows are built below.
POOL_COLS = (
    "deployment_id",
    "probe_id",
    "seq",
    "ts",
    "node",
    "role",
    "capacity_tokens",
    "used_tokens",
    "free_tokens",
)
PAGE_COLS = (
    "deployment_id",
    "probe_id",
    "seq",
    "ts",
    "kind",
    "node",
    "request_id",
    "tenant",
    "other_request_id",
    "other_tenant",
    "page_count",
    "cross_tenant",
    "detail",
)
DROP_COLS = ("deployment_id", "probe_id", "seq", "ts", "reason", "count")
REQ_COLS = (
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
    "data_categories",
    "first_ts",
    "last_ts",
    "prompt_shared_with",
    "cached_tokens",
    "cache_write_tokens",
    "probe_id",
    "node",
)
# What is written: a new row's part_ts is its first_ts (never updated by the upsert). The
# batch's rows carry it from the start, folded as first_ts is, so they are written as they are.
REQ_WRITE_COLS = (*REQ_COLS, "part_ts")
_CONFIG_FIELDS = (
    "engine",
    "engine_version",
    "model_id",
    "advertised_context",
    "pool_capacity_tokens",
    "page_size",
    "dtype",
    "quantization",
    "tp_size",
    "cuda_graphs",
    "disaggregated",
    "prefix_caching",
    "prefix_cache_salting",
    "kv_connector",
    "kv_connector_version",
    "kv_tiers",
)


def micros(ts: Any) -> int:
    return round(ts.timestamp() * 1_000_000)


@dataclass(slots=True)
class WriteResult:
    accepted: int
    duplicates: int
    new_gaps: list[tuple[int, int]] = field(default_factory=list)
    filled: int = 0
    deployments: set[str] = field(default_factory=set)
    new_events: list[ev.Event] = field(default_factory=list)
    #: requests the batch's transaction closed as lost, by reason (``collector.lost``)
    lost: dict[str, int] = field(default_factory=dict)

    def add_lost(self, reason: str, n: int) -> None:
        if n:
            self.lost[reason] = self.lost.get(reason, 0) + n


@dataclass(slots=True)
class Rows:
    """A batch's new events, shaped as the rows of each table."""

    pool: list[tuple[Any, ...]] = field(default_factory=list)
    page: list[tuple[Any, ...]] = field(default_factory=list)
    drops: list[tuple[Any, ...]] = field(default_factory=list)
    #: one row per request, in ``REQ_WRITE_COLS`` order (the writers take several rows of
    #: one request too: the database merges them as it merges batches)
    requests: list[tuple[Any, ...]] = field(default_factory=list)
    configs: list[ev.EngineConfig] = field(default_factory=list)
    deployments: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: when the batch's probe said it shut down cleanly (probe.stopped), µs
    stopped_at: int | None = None


# Request status: "admitted" is provisional; any terminal status replaces it.
_PROVISIONAL = "admitted"

# How two observations of one request merge, per column. One table drives both the merge of
# a batch's rows for one request (SQLite's upsert takes them one by one; PostgreSQL groups
# them first, ``_request_group_sql``) and the upsert into the stored row
# (``_request_upsert_sql``). Every rule is
# commutative and associative and ignores NULL, so the stored row does not depend on which
# probe's batch arrives first: the prefill node's rejection (700,000 prompt tokens) and the
# decode node's completion of the one-token placeholder merge to the same row either way.
# "rank": the outcome a user saw wins over a rejection, which wins over admission.
REQUEST_MERGE: dict[str, str] = {
    "tenant": "min",  # one tenant per request; "min" only makes a producer bug deterministic
    "route": "max",
    "model_id": "max",
    "prompt_tokens": "max",
    "completion_tokens": "max",
    "max_tokens": "max",
    "status": "rank",
    "reject_reason": "max",
    "limit_tokens": "max",
    "data_categories": "max",
    "first_ts": "min",
    "last_ts": "max",
    # Only admissions carry it; NULL from the other events leaves it as it is.
    "prompt_shared_with": "max",
    # Only finishes carry it (the prompt tokens a prefix cache served).
    "cached_tokens": "max",
    "cache_write_tokens": "max",
    # Only admissions carry them: the probe that admitted it, and on which node ("max" only
    # makes two admitting probes, a disaggregated prefill and decode, deterministic).
    "probe_id": "max",
    "node": "max",
}
# "lost" (the collector closed it: its probe is gone, ``collector.lost``) ranks just above
# "admitted": a late admission leaves it lost, and any outcome a probe reports, arriving
# later (a replayed journal), replaces it.
STATUS_RANK: dict[str, int] = {
    "admitted": 0,
    "lost": 1,
    "rejected": 2,
    "completed": 3,
    "length": 4,
    "aborted": 5,
    "error": 6,
}
# Where each rule applies in a row. part_ts merges as first_ts does (it is the earliest
# first_ts until the row is stored), though the upsert never changes a stored one.
_MERGE_AT = (
    *((REQ_WRITE_COLS.index(c), rule) for c, rule in REQUEST_MERGE.items()),
    (REQ_WRITE_COLS.index("part_ts"), "min"),
)
_TEXT_COLS = {
    "tenant",
    "route",
    "model_id",
    "reject_reason",
    "data_categories",
    "status",
    "prompt_shared_with",
    "probe_id",
    "node",
}


def shape_rows(events: Iterable[ev.Event]) -> Rows:
    """Turn decoded events into table rows. Pure; events must be in seq order.

    A request's events in the batch fold into one row by ``REQUEST_MERGE`` (``_merge``):
    SQLite would merge them too, row by row, but its upsert's update costs twice the
    insert (measured); folding here is a dictionary look-up per event.
    """
    rows = Rows()
    pool = rows.pool.append
    reqs = rows.requests
    at: dict[tuple[str, str], int] = {}  # request key -> its row's index in reqs
    deps = rows.deployments
    admitted, finished, sample = ev.RequestAdmitted, ev.RequestFinished, ev.PoolSample
    # A batch nearly always holds one deployment: track its time span in locals.
    cur_dep, lo, hi = "", 0, 0
    e: Any  # each branch below knows its event's type
    row: tuple[Any, ...] | None
    for e in events:
        ts = round(e.ts.timestamp() * 1_000_000)  # micros(), inlined: once per event
        dep = e.deployment_id
        if dep != cur_dep:
            if cur_dep:
                _widen(deps, cur_dep, lo, hi)
            cur_dep, lo, hi = dep, ts, ts
        elif ts < lo:
            lo = ts
        elif ts > hi:
            hi = ts
        # The common kinds by identity (cheaper than a match's isinstance chain); the
        # rest in _shape_other. Request rows are in REQ_WRITE_COLS order.
        t = type(e)
        if t is finished:
            row = (dep, e.request_id, e.tenant, e.route, e.model_id, e.prompt_tokens,
                   e.completion_tokens, None, e.status, None, e.limit_tokens, None, ts, ts,
                   None, e.cached_tokens, e.cache_write_tokens, None, None, ts)  # fmt: skip
        elif t is admitted:
            cats = e.data_categories
            row = (dep, e.request_id, e.tenant, e.route, e.model_id, e.prompt_tokens, None,
                   e.max_tokens, _PROVISIONAL, None, None, _categories(cats) if cats else None,
                   ts, ts, e.prompt_shared_with, None, None, e.probe_id, e.node, ts)  # fmt: skip
        elif t is sample:
            pool((dep, e.probe_id, e.seq, ts, e.node, e.role, e.capacity_tokens,
                  e.used_tokens, e.free_tokens))  # fmt: skip
            continue
        else:
            row = _shape_other(rows, e, dep, ts)
            if row is None:
                continue
        key = (dep, row[1])
        i = at.get(key)
        if i is None:
            at[key] = len(reqs)
            reqs.append(row)
        else:
            reqs[i] = _merge(reqs[i], row)
    if cur_dep:
        _widen(deps, cur_dep, lo, hi)
    return rows


def _merge(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """Two rows of one request merged by ``REQUEST_MERGE``, as the upsert merges them."""
    out = list(a)
    for i, rule in _MERGE_AT:
        x, y = out[i], b[i]
        if y is None or x == y:
            continue
        if x is None:
            out[i] = y
        elif rule == "max":
            if y > x:
                out[i] = y
        elif rule == "min":
            if y < x:
                out[i] = y
        elif STATUS_RANK[y] > STATUS_RANK[x]:  # rule == "rank"
            out[i] = y
    return tuple(out)


def _categories(cats: Sequence[str]) -> str:
    return _json.encode(sorted(set(cats))).decode()


def _shape_other(rows: Rows, e: ev.Event, dep: str, ts: int) -> tuple[Any, ...] | None:
    """Shape an event of the less frequent kinds (see ``shape_rows``): a request's row is
    returned (for the caller to fold), any other is added to ``rows``."""
    detail: dict[str, Any]
    match e:
        case ev.RequestRejected():
            cats = e.data_categories
            return (dep, e.request_id, e.tenant, e.route, e.model_id, e.prompt_tokens, None,
                    None, "rejected", e.reason, e.limit_tokens,
                    _categories(cats) if cats else None, ts, ts, None, None, None, None,
                    None, ts)  # fmt: skip
        case ev.PageStaleRead():
            detail = {
                "page_ids": e.page_ids,
                "read_kind": e.read_kind,
                "role": e.role,
                "zeroized": e.zeroized,
            }
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "page.stale_read", e.node, e.reader_request_id,
                 e.reader_tenant, e.previous_request_id, e.previous_tenant, len(e.page_ids),
                 e.cross_tenant, _json.encode(detail).decode())
            )  # fmt: skip
        case ev.KvTransfer():
            detail = {
                "from_node": e.from_node,
                "to_node": e.to_node,
                "tokens": e.tokens,
                "prefill_rejected": e.prefill_rejected,
            }
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "kv.transfer", e.from_node, e.request_id,
                 e.tenant, None, None, e.pages, False, _json.encode(detail).decode())
            )  # fmt: skip
        case ev.PageReuse():
            detail = {
                "step": e.step,
                "role": e.role,
                "cross_tenant_pages": e.cross_tenant_pages,
                "zeroized_pages": e.zeroized_pages,
            }
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "page.reuse", e.node, None, None, None, None,
                 e.reused_pages, e.cross_tenant_pages > 0, _json.encode(detail).decode())
            )  # fmt: skip
        case ev.PrefixCacheHit():
            detail = {"role": e.role, "tokens": e.tokens, "salted": e.salted}
            # added later, and only where they say something: older rows have neither key
            if e.tier is not None:
                detail["tier"] = e.tier
            if e.salt_mismatch:
                detail["salt_mismatch"] = True
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "prefix_cache.hit", e.node, e.reader_request_id,
                 e.reader_tenant, e.owner_request_id, e.owner_tenant, e.pages, e.cross_tenant,
                 _json.encode(detail).decode())
            )  # fmt: skip
        case ev.KvTurnover():
            detail = {
                "role": e.role,
                "interval_s": e.interval_s,
                "removed_blocks": e.removed_blocks,
                "cleared": e.cleared,
                "unsalted_blocks": e.unsalted_blocks,
                "salted_blocks": e.salted_blocks,
                "restored_blocks": e.restored_blocks,
                "cross_session_blocks": e.cross_session_blocks,
                "lost_batches": e.lost_batches,
            }
            # page_count: the blocks stored; the engine's events name no tenant, so no
            # row of this kind is ever cross-tenant
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "kv.turnover", e.node, None, None, None, None,
                 e.stored_blocks, False, _json.encode(detail).decode())
            )  # fmt: skip
        case ev.SourceGap():
            detail = {
                "source": e.source,
                "interval_s": e.interval_s,
                "silent_s": e.silent_s,
                "cause": e.cause,
                "requests": e.requests,
                "reason": e.reason,
            }
            # an interval the source could not be observed in: stored as the gap it is
            # (page_count 0), beside the kv.turnover rows it stands in for, never as one
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "source.gap", e.node, None, None, None, None,
                 0, False, _json.encode(detail).decode())
            )  # fmt: skip
        case ev.CanaryHit():
            detail = {"detector": e.detector, "page_ids": e.page_ids}
            rows.page.append(
                (dep, e.probe_id, e.seq, ts, "canary.hit", e.node, e.reader_request_id,
                 e.reader_tenant, None, e.canary_tenant, len(e.page_ids), e.cross_tenant,
                 _json.encode(detail).decode())
            )  # fmt: skip
        case ev.EngineConfig():
            rows.configs.append(e)
        case ev.ProbeDrops():
            for reason, count in sorted(e.counts.items()):
                rows.drops.append((dep, e.probe_id, e.seq, ts, reason, count))
        case ev.ProbeStopped():
            rows.stopped_at = ts if rows.stopped_at is None else max(rows.stopped_at, ts)
        case _:  # pragma: no cover - the decoder only yields the kinds above
            raise TypeError(f"unhandled event kind {ev.kind_of(e)}")
    return None


def _widen(spans: dict[str, tuple[int, int]], dep: str, lo: int, hi: int) -> None:
    old = spans.get(dep)
    spans[dep] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))


def _request_upsert_sql(dialect: str, source: str) -> str:
    """The upsert of request rows (``REQ_WRITE_COLS``) from ``source``. PostgreSQL's
    conflict target holds ``part_ts``: its unique index must hold the partition key, and the
    staged rows carry the stored row's part_ts (from ``request_keys``)."""
    r, x = "requests", "excluded"
    # Compare strings by code point on both databases (SQLite's default; PostgreSQL's
    # database collation could order them otherwise).
    collate = ' COLLATE "C"' if dialect == "postgresql" else ""
    sets = []
    for col, rule in REQUEST_MERGE.items():
        rc, xc = f"{r}.{col}", f"{x}.{col}"
        if rule == "rank":
            better = f"{_rank_sql(xc)} > {_rank_sql(rc)}"
        else:
            c = collate if col in _TEXT_COLS else ""
            better = f"{xc}{c} {'>' if rule == 'max' else '<'} {rc}{c}"
        sets.append(
            f"{col} = CASE WHEN {xc} IS NULL THEN {rc} "
            f"WHEN {rc} IS NULL OR {better} THEN {xc} ELSE {rc} END"
        )
    # Ingest never writes "lost" (only ``collector.lost`` does), so a stored row's reason
    # goes when an incoming status outranks the stored one: the outcome replaced "lost".
    sets.append(
        f"lost_reason = CASE WHEN {_rank_sql(f'{x}.status')} > {_rank_sql(f'{r}.status')} "
        f"THEN NULL ELSE {r}.lost_reason END"
    )
    target = "deployment_id, request_id" + (", part_ts" if dialect == "postgresql" else "")
    return (
        f"INSERT INTO requests ({', '.join(REQ_WRITE_COLS)}) {source} "
        f"ON CONFLICT ({target}) DO UPDATE SET " + ", ".join(sets)
    )


def _request_group_sql(stage: str) -> str:
    """The staged request rows merged into one per request by ``REQUEST_MERGE``, for
    PostgreSQL, whose upsert may not meet one row twice in a statement. Its aggregates skip
    NULL as the upsert's rules do; part_ts, the same on every row of a stored request (see
    ``IngestStore``), is the earliest first_ts of a new one. Ordered by key: two batches
    touching the same requests lock them in one order and cannot deadlock."""
    cols = []
    for col in REQ_WRITE_COLS:
        rule = REQUEST_MERGE.get(col, "min" if col == "part_ts" else "key")
        if rule == "key":
            cols.append(col)
        elif rule == "rank":
            ranked = " ".join(f"WHEN {v} THEN '{k}'" for k, v in STATUS_RANK.items())
            cols.append(f"(CASE max({_rank_sql(col)}) {ranked} END)")
        else:
            c = ' COLLATE "C"' if col in _TEXT_COLS else ""
            cols.append(f"{rule}({col}{c})")
    return (
        f"SELECT {', '.join(cols)} FROM {stage} GROUP BY deployment_id, request_id "
        "ORDER BY deployment_id, request_id"
    )


def _rank_sql(col: str) -> str:
    cases = " ".join(f"WHEN '{k}' THEN {v}" for k, v in STATUS_RANK.items())
    return f"(CASE {col} {cases} ELSE -1 END)"


# Fields added since 0026: hashed only when set, so a config that sets none of them keeps
# the hash it had before (an upgraded collector stores no spurious "new" config).
_LATER_CONFIG_FIELDS = ("kv_connector", "kv_connector_version", "kv_tiers")


def config_hash(c: ev.EngineConfig) -> str:
    values = [getattr(c, f) for f in _CONFIG_FIELDS if f not in _LATER_CONFIG_FIELDS]
    later = [getattr(c, f) for f in _LATER_CONFIG_FIELDS]
    payload = _json.encode(values + later if any(later) else values)
    return hashlib.sha256(payload).hexdigest()


class MultiRowInsert:
    """One SQLite INSERT (or upsert) of many rows: ``head`` + ``VALUES (...), (...)`` +
    ``tail``, run as a few statements of many rows each instead of one per row.

    Why: ``executemany`` steps once per row and the driver releases the GIL around every
    step; with another thread decoding the next batch, each row then waits for the GIL
    (a batch's write took 4x as long beside a decoding thread, measured). A statement of a
    thousand rows releases it once.

    Invariant: every statement text is one of ``len(sizes)`` fixed shapes (a row count from
    ``sizes``), built here once, so the driver's statement cache holds them all and no batch
    parses SQL; a statement never binds more than ``max_vars`` parameters.
    """

    def __init__(self, head: str, ncols: int, tail: str = "", *, max_vars: int):
        largest = max(1, min(1024, max_vars // ncols))
        sizes = [largest]
        while sizes[-1] > 1:
            sizes.append(max(1, sizes[-1] // 4))
        self.sizes = tuple(sizes)
        group = "(" + ", ".join("?" * ncols) + ")"
        self._sql = {n: f"{head} VALUES {', '.join([group] * n)}{tail}" for n in self.sizes}

    def run(self, cur: Any, rows: Sequence[Sequence[Any]]) -> None:
        i, n = 0, len(rows)
        for size in self.sizes:
            sql = self._sql[size]
            while n - i >= size:
                cur.execute(sql, list(chain.from_iterable(rows[i : i + size])))
                i += size


def _sqlite_max_vars() -> int:
    """How many parameters one SQLite statement may bind: 32,766 from SQLite 3.32, 999
    before (the library's compile-time default)."""
    return 32_766 if sqlite3.sqlite_version_info >= (3, 32) else 999


class IngestStore:
    """Writes batches for one database dialect ("sqlite" or "postgresql").

    ``sqlite_executemany``: write SQLite rows one statement per row (only the benchmark's
    ceiling asks for it; see :class:`MultiRowInsert` for why the collector does not).
    ``replaced_quiet_s``: ``KVWATCH_PROBE_REPLACED_QUIET_S`` (see :mod:`collector.lost`).
    """

    def __init__(
        self,
        dialect: str,
        *,
        sqlite_executemany: bool = False,
        replaced_quiet_s: float = REPLACED_QUIET_S,
    ):
        self.dialect = dialect
        self._replaced_quiet_us = round(replaced_quiet_s * 1_000_000)
        self._sqlite = dialect == "sqlite"
        self._executemany = sqlite_executemany
        self._dep_sql = deployment_upsert_sql(dialect)
        if self._sqlite:
            self._req_sql = _request_upsert_sql(
                dialect, "VALUES (" + ", ".join("?" * len(REQ_WRITE_COLS)) + ")"
            )
            self._pool_sql = _insert_sql("pool_samples", POOL_COLS)
            self._page_sql = _insert_sql("page_events", PAGE_COLS)
            self._drop_sql = _insert_sql("probe_drops", DROP_COLS)
            self._mark_sql = _MARK_SQL.format("?, ?, ?, ?")
            max_vars = _sqlite_max_vars()
            upsert_head, upsert_tail = _request_upsert_sql(dialect, "<rows>").split("<rows>")
            self._multi = {
                "pool": MultiRowInsert(_insert_head("pool_samples", POOL_COLS),
                                       len(POOL_COLS), max_vars=max_vars),
                "page": MultiRowInsert(_insert_head("page_events", PAGE_COLS),
                                       len(PAGE_COLS), max_vars=max_vars),
                "requests": MultiRowInsert(upsert_head.rstrip(), len(REQ_WRITE_COLS),
                                           upsert_tail, max_vars=max_vars),
            }  # fmt: skip
        else:
            self._mark_sql = _MARK_SQL.format("%s, %s, %s, %s")
            # The staging table makes a whole batch one COPY plus one INSERT ... SELECT.
            self._req_sql = _request_upsert_sql(dialect, _request_group_sql("_kvw_stage_requests"))
            self._stage_sql = (
                "CREATE TEMP TABLE IF NOT EXISTS _kvw_stage_requests ON COMMIT DELETE ROWS AS "
                f"SELECT {', '.join(REQ_WRITE_COLS)} FROM requests WITH NO DATA"
            )
            # A request's month is fixed by whichever batch stores it first: new keys are
            # claimed (in key order, like the upsert: no deadlock), then every staged row
            # takes its key's part_ts, so the upsert meets the stored row in its partition.
            self._keys_sql = (
                "INSERT INTO request_keys (deployment_id, request_id, part_ts) "
                "SELECT deployment_id, request_id, min(part_ts) FROM _kvw_stage_requests "
                "GROUP BY deployment_id, request_id ORDER BY deployment_id, request_id "
                "ON CONFLICT DO NOTHING"
            )
            self._part_sql = (
                "UPDATE _kvw_stage_requests s SET part_ts = k.part_ts FROM request_keys k "
                "WHERE k.deployment_id = s.deployment_id AND k.request_id = s.request_id "
                "AND k.part_ts <> s.part_ts"
            )

    # -- the probe's row: ownership, high-water mark, gaps -------------------------------

    def write_batch(
        self,
        conn: Connection,
        *,
        probe_id: str,
        token_id: int,
        events: Sequence[ev.Event],
        now_us: int,
        rows: Rows | None = None,
        lineage_id: int | None = None,
    ) -> WriteResult:
        """Store a batch (all from ``probe_id``) inside the caller's transaction.

        ``rows`` may be ``shape_rows(events)`` computed before the transaction (it is pure),
        which keeps that work out of the write lock; it is used only when every event turns
        out to be new.
        """
        probe = self._owned_probe(
            conn, probe_id, token_id, events[0].deployment_id, now_us, lineage_id
        )
        max_seq = int(probe.max_seq)
        low = min(e.seq for e in events)
        # Gaps matter only to a batch reaching back below the high-water mark (a retry or a
        # late replay); load just those that overlap it.
        gaps = (
            []
            if low > max_seq
            else [
                (g.id, g.first_seq, g.last_seq)
                for g in conn.execute(
                    select(m.SeqGap.id, m.SeqGap.first_seq, m.SeqGap.last_seq)
                    .where(
                        m.SeqGap.probe_id == probe_id,
                        m.SeqGap.last_seq >= low,
                        m.SeqGap.first_seq <= max_seq,
                    )
                    .order_by(m.SeqGap.first_seq)
                )
            ]
        )
        # Rows shaped by the caller come from a batch in seq order (``shape_rows`` needs it).
        new, duplicates, filled = _classify(events, max_seq, gaps, ordered=rows is not None)
        if rows is None or len(new) != len(events):
            rows = shape_rows(new) if new else None
        new_max = max(max_seq, new[-1].seq) if new else max_seq
        new_gaps = _gaps_above(new, max_seq)
        if filled:
            self._rewrite_gaps(conn, probe_id, gaps, filled, now_us)
        if new_gaps:
            conn.execute(
                insert(m.SeqGap),
                [
                    {"probe_id": probe_id, "first_seq": a, "last_seq": b, "detected_at": now_us}
                    for a, b in new_gaps
                ],
            )
        result = WriteResult(len(new), duplicates, new_gaps, len(filled), new_events=new)
        gone: dict[str, Any] = {}
        if rows is not None:
            self._write_rows(conn, rows, now_us)
            result.deployments = set(rows.deployments)
            gone = self._close_lost(conn, probe_id, probe, rows, now_us, result)
        elif probe.gone_reason == lost.SILENT:  # heard from again, if only duplicates
            gone = {"gone_at": None, "gone_reason": None}
        conn.execute(
            update(m.Probe)
            .where(m.Probe.probe_id == probe_id)
            .values(
                max_seq=new_max,
                accepted=m.Probe.accepted + len(new),
                duplicates=m.Probe.duplicates + duplicates,
                last_seen=now_us,
                **(
                    {}
                    if rows is None or rows.stopped_at is None
                    else {"stopped_at": rows.stopped_at}
                ),
                **gone,
            )
        )
        return result

    def _close_lost(
        self,
        conn: Connection,
        probe_id: str,
        probe: Any,
        rows: Rows,
        now_us: int,
        result: WriteResult,
    ) -> dict[str, Any]:
        """After a batch's rows: the requests lost with a gone probe (``collector.lost``),
        and the probe's new gone state (the columns to set on its row)."""
        if rows.configs:  # a probe announcing its node replaces the old probes on it
            seen: set[tuple[str, str]] = set()
            for c in rows.configs:
                if (c.deployment_id, c.node) not in seen:
                    seen.add((c.deployment_id, c.node))
                    n = lost.replace_on_node(
                        conn,
                        c.deployment_id,
                        c.node,
                        probe_id,
                        micros(probe.first_seen),
                        now_us,
                        self._replaced_quiet_us,
                    )
                    result.add_lost(lost.REPLACED, n)
        if rows.stopped_at is not None:
            n = lost.close(conn, probe_id, lost.STOPPED)
            result.add_lost(lost.STOPPED, n)
            return {
                "gone_at": now_us,
                "gone_reason": lost.STOPPED,
                "lost_requests": m.Probe.lost_requests + n,
            }
        if probe.gone_reason == lost.SILENT:  # heard from again: running
            return {"gone_at": None, "gone_reason": None}
        if probe.gone_reason is not None and rows.requests:
            # Stopped or replaced, yet sending: a journal replayed under its id. What it
            # leaves open will never finish.
            n = lost.close(conn, probe_id, probe.gone_reason)
            result.add_lost(probe.gone_reason, n)
            if n:
                return {"lost_requests": m.Probe.lost_requests + n}
        return {}

    def high_water(
        self,
        conn: Connection,
        probe_id: str,
        token_id: int,
        deployment_id: str,
        now_us: int,
        *,
        lineage_id: int | None = None,
    ) -> int:
        """Lock ``probe_id``'s row (made on first use) until the transaction ends and return
        its high-water mark. A producer that numbers its events only once it holds the lock
        (the OTLP ingest) takes the seqs above it. Refuses a probe id that another token
        lineage owns."""
        probe = self._owned_probe(conn, probe_id, token_id, deployment_id, now_us, lineage_id)
        return int(probe.max_seq)

    def _owned_probe(
        self,
        conn: Connection,
        probe_id: str,
        token_id: int,
        deployment_id: str,
        now_us: int,
        lineage_id: int | None,
    ) -> Any:
        probe = self._lock_probe(conn, probe_id, token_id, deployment_id, now_us)
        # A probe id belongs to the token lineage that first wrote it: a rotated token (and
        # the old one in its grace period) writes on for the same probes.
        if probe.lineage != (token_id if lineage_id is None else lineage_id):
            raise Forbidden(
                f"probe_id {probe_id!r} is registered to another ingest token",
                {"field": "probe_id"},
            )
        return probe

    def stored_requests(
        self, conn: Connection, deployment_id: str, request_ids: Sequence[str]
    ) -> set[str]:
        """Which of ``request_ids`` the deployment already has a row for (PostgreSQL asks
        ``request_keys``, which is not partitioned)."""
        if self._sqlite:
            r = m.Request
            return _stored(conn, r, r.request_id, deployment_id, request_ids)
        return _pg_stored(conn, "request_keys", "request_id", deployment_id, request_ids)

    def request_tenants(
        self, conn: Connection, deployment_id: str, request_ids: Sequence[str]
    ) -> dict[str, str | None]:
        """The tenant of each of these stored requests of the deployment."""
        r = m.Request
        return {
            rid: tenant
            for rid, tenant in conn.execute(
                select(r.request_id, r.tenant).where(
                    r.deployment_id == deployment_id, r.request_id.in_(list(request_ids))
                )
            )
        }

    def stored_spans(self, conn: Connection, deployment_id: str, keys: Sequence[str]) -> set[str]:
        """Which of these OTLP span keys (trace id + span id) the deployment stored already."""
        if self._sqlite:
            t = m.OtlpSpan
            return _stored(conn, t, t.span_key, deployment_id, keys)
        return _pg_stored(conn, "otlp_spans", "span_key", deployment_id, keys)

    def remember_spans(
        self, conn: Connection, deployment_id: str, spans: Sequence[tuple[str, str]], now_us: int
    ) -> None:
        """Record (span key, request id) pairs as stored, in the transaction storing them
        (through the driver, as the batch's rows go: the ORM's per-row dicts cost more)."""
        ph = "?" if self._sqlite else "%s"
        conn.exec_driver_sql(
            "INSERT INTO otlp_spans (deployment_id, span_key, request_id, seen_at) "
            f"VALUES ({ph}, {ph}, {ph}, {ph})",
            [(deployment_id, k, r, now_us) for k, r in spans],
        )

    def _lock_probe(
        self, conn: Connection, probe_id: str, token_id: int, deployment_id: str, now_us: int
    ) -> Any:
        conn.exec_driver_sql(
            "INSERT INTO probes (probe_id, token_id, deployment_id, max_seq, accepted, "
            "duplicates, first_seen, last_seen) VALUES "
            + ("(?, ?, ?, 0, 0, 0, ?, ?)" if self._sqlite else "(%s, %s, %s, 0, 0, 0, %s, %s)")
            + " ON CONFLICT (probe_id) DO NOTHING",
            (probe_id, token_id, deployment_id, now_us, now_us),
        )
        t = m.ApiToken
        return conn.execute(
            select(
                m.Probe.token_id,
                m.Probe.max_seq,
                m.Probe.first_seen,
                m.Probe.gone_reason,
                func.coalesce(t.lineage_id, t.id).label("lineage"),
            )
            .join(t, t.id == m.Probe.token_id)
            .where(m.Probe.probe_id == probe_id)
            .with_for_update(of=m.Probe)
        ).one()

    def _rewrite_gaps(
        self,
        conn: Connection,
        probe_id: str,
        gaps: list[tuple[int, int, int]],
        filled: set[int],
        now_us: int,
    ) -> None:
        for gap_id, lo, hi in gaps:
            inside = sorted(s for s in filled if lo <= s <= hi)
            if not inside:
                continue
            conn.execute(delete(m.SeqGap).where(m.SeqGap.id == gap_id))
            remaining, start = [], lo
            for s in inside:
                if s > start:
                    remaining.append((start, s - 1))
                start = s + 1
            if start <= hi:
                remaining.append((start, hi))
            if remaining:
                conn.execute(
                    insert(m.SeqGap),
                    [
                        {"probe_id": probe_id, "first_seq": a, "last_seq": b, "detected_at": now_us}
                        for a, b in remaining
                    ],
                )

    # -- rows ------------------------------------------------------------------------------

    def _write_rows(self, conn: Connection, rows: Rows, now_us: int) -> None:
        raw = conn.connection.driver_connection
        assert raw is not None
        self.write_rows(raw, rows, now_us)
        if rows.configs:  # after the deployment rows they reference
            self._write_configs(conn, rows.configs)

    def write_rows(self, raw: Any, rows: Rows, now_us: int | None = None) -> None:
        """Write a batch's rows through the DBAPI connection ``raw``, inside its open
        transaction: ``executemany`` on SQLite, binary ``COPY`` on PostgreSQL. This is the
        whole data write of a batch (``bench/ingest.py`` times it alone as the ceiling).
        ``now_us`` stamps the rollup marks (default: the clock)."""
        if now_us is None:
            now_us = time.time_ns() // 1000
        if self._sqlite:
            cur = raw.cursor()
            try:
                if self._executemany:
                    if rows.pool:
                        cur.executemany(self._pool_sql, rows.pool)
                    if rows.page:
                        cur.executemany(self._page_sql, rows.page)
                    if rows.requests:
                        cur.executemany(self._req_sql, rows.requests)
                else:
                    if rows.pool:
                        self._multi["pool"].run(cur, rows.pool)
                    if rows.page:
                        self._multi["page"].run(cur, rows.page)
                    if rows.requests:
                        self._multi["requests"].run(cur, rows.requests)
                if rows.drops:  # a handful per batch at most
                    cur.executemany(self._drop_sql, rows.drops)
                if marks := rollup_marks(rows, now_us):
                    cur.executemany(self._mark_sql, marks)
                cur.executemany(self._dep_sql, _spans(rows.deployments))
            finally:
                cur.close()
            return
        with raw.cursor() as cur:
            if rows.pool:
                _copy(cur, "pool_samples", POOL_COLS, rows.pool)
            if rows.page:
                _copy(cur, "page_events", PAGE_COLS, rows.page)
            if rows.drops:
                _copy(cur, "probe_drops", DROP_COLS, rows.drops)
            if rows.requests:
                cur.execute(self._stage_sql)
                _copy(cur, "_kvw_stage_requests", REQ_WRITE_COLS, rows.requests, "requests")
                cur.execute(self._keys_sql)
                cur.execute(self._part_sql)
                cur.execute(self._req_sql)
            # Sorted, after the requests and before the deployment: one lock order for all.
            if marks := rollup_marks(rows, now_us):
                cur.executemany(self._mark_sql, marks)
            # Last: the deployment's row lock is then held only until the commit, so
            # batches of one deployment from different probes barely queue on it.
            cur.executemany(self._dep_sql, _spans(rows.deployments))

    def _write_configs(self, conn: Connection, configs: list[ev.EngineConfig]) -> None:
        latest: dict[tuple[str, str, str], str] = {}
        for c in configs:
            key = (c.deployment_id, c.node, c.role)
            if key not in latest:
                prev = conn.execute(
                    select(m.DeploymentConfig.config_hash)
                    .where(
                        m.DeploymentConfig.deployment_id == c.deployment_id,
                        m.DeploymentConfig.node == c.node,
                        m.DeploymentConfig.role == c.role,
                    )
                    .order_by(m.DeploymentConfig.ts.desc(), m.DeploymentConfig.id.desc())
                    .limit(1)
                ).scalar()
                latest[key] = prev or ""
            h = config_hash(c)
            if h == latest[key]:
                continue
            latest[key] = h
            values: dict[str, Any] = {f: getattr(c, f) for f in _CONFIG_FIELDS}
            values["kv_tiers"] = _json.encode(c.kv_tiers).decode() if c.kv_tiers else None
            values.update(
                deployment_id=c.deployment_id,
                probe_id=c.probe_id,
                seq=c.seq,
                ts=micros(c.ts),
                node=c.node,
                role=c.role,
                config_hash=h,
            )
            conn.execute(insert(m.DeploymentConfig).values(**values))


def _stored(
    conn: Connection, table: Any, col: Any, deployment_id: str, values: Sequence[str]
) -> set[str]:
    found: set[str] = set()
    name, column = table.__tablename__, col.key
    for i in range(0, len(values), 500):
        chunk = list(values[i : i + 500])
        sql = (
            f"SELECT {column} FROM {name} WHERE deployment_id = ? "
            f"AND {column} IN ({', '.join('?' * len(chunk))})"
        )
        found.update(row[0] for row in conn.exec_driver_sql(sql, (deployment_id, *chunk)))
    return found


def _pg_stored(
    conn: Connection, table: str, col: str, deployment_id: str, values: Sequence[str]
) -> set[str]:
    # A join to the array, not IN (...) nor = ANY: psycopg prepares a statement after five
    # runs, and PostgreSQL's generic plan for those, on a table without fresh statistics,
    # compared every row of the deployment with every value (83 ms at 8,000 rows,
    # measured); the hash join stays near 1 ms.
    sql = (
        f"SELECT t.{col} FROM {table} t JOIN unnest(%s::text[]) AS v(value) "
        f"ON t.{col} = v.value WHERE t.deployment_id = %s"
    )
    return {row[0] for row in conn.exec_driver_sql(sql, (list(values), deployment_id))}


_MARK_SQL = (
    "INSERT INTO rollup_dirty (kind, deployment_id, bucket_start, marked_at) VALUES ({}) "
    "ON CONFLICT (kind, deployment_id, bucket_start) DO NOTHING"
)
_FIRST_TS = REQ_COLS.index("first_ts")
_POOL_TS = POOL_COLS.index("ts")


def rollup_marks(rows: Rows, now_us: int) -> list[tuple[str, str, int, int]]:
    """The rollup buckets a batch's rows touch, sorted, stamped ``now_us`` (see
    ``collector.rollups``)."""
    # Distinct (deployment, bucket) pairs first: a batch's thousands of rows touch a few.
    req_w, pool_w = REQUEST_BUCKET_US, POOL_BUCKET_US
    req = {(r[0], r[_FIRST_TS] // req_w) for r in rows.requests}
    pool = {(p[0], p[_POOL_TS] // pool_w) for p in rows.pool}
    marks = {("requests", d, b) for d, k in req for b in request_marks((k * req_w,))}
    marks.update(("pool", d, k * pool_w) for d, k in pool)
    return [(*mk, now_us) for mk in sorted(marks)]


def _insert_head(table: str, cols: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(cols)})"


def _insert_sql(table: str, cols: Sequence[str]) -> str:
    return f"{_insert_head(table, cols)} VALUES ({', '.join('?' * len(cols))})"


def _spans(spans: dict[str, tuple[int, int]]) -> list[tuple[str, int, int]]:
    # Sorted, so concurrent batches take row locks in one order (no deadlock).
    return [(d, a, b) for d, (a, b) in sorted(spans.items())]


def deployment_upsert_sql(dialect: str) -> str:
    lo, hi = ("MIN", "MAX") if dialect == "sqlite" else ("LEAST", "GREATEST")
    ph = "?" if dialect == "sqlite" else "%s"
    return (
        f"INSERT INTO deployments (id, first_seen, last_seen) VALUES ({ph}, {ph}, {ph}) "
        f"ON CONFLICT (id) DO UPDATE SET first_seen = {lo}(deployments.first_seen, "
        f"excluded.first_seen), last_seen = {hi}(deployments.last_seen, excluded.last_seen)"
    )


_PG_TYPE_NAMES = {"VARCHAR": "varchar", "TEXT": "text", "BIGINT": "int8", "INTEGER": "int4"}
_PG_TYPE_NAMES["BOOLEAN"] = "bool"


@cache
def _pg_types(table: str, cols: tuple[str, ...]) -> list[str]:
    """PostgreSQL type names of ``table``'s columns, from the models (binary COPY needs them)."""
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()
    t = m.Base.metadata.tables[table]
    return [_PG_TYPE_NAMES[t.c[c].type.compile(dialect).split("(")[0]] for c in cols]


def _copy(
    cur: Any,
    table: str,
    cols: tuple[str, ...],
    rows: Iterable[Sequence[Any]],
    types_of: str | None = None,
) -> None:
    # Binary COPY: no text formatting or parsing of every number on either side.
    with cur.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(_pg_types(types_of or table, cols))
        for row in rows:
            copy.write_row(row)


def _classify(
    events: Sequence[ev.Event],
    max_seq: int,
    gaps: list[tuple[int, int, int]],
    *,
    ordered: bool = False,
) -> tuple[list[ev.Event], int, set[int]]:
    """Split a batch into new events (in seq order), a duplicate count, and the seqs that
    fill existing gaps. ``ordered``: the caller knows the seqs strictly increase."""
    # The common case: a fresh, ordered batch above the high-water mark.
    if events[0].seq > max_seq and (ordered or all(a.seq < b.seq for a, b in pairwise(events))):
        return list(events), 0, set()
    seen: set[int] = set()
    new: list[ev.Event] = []
    filled: set[int] = set()
    duplicates = 0
    starts = [lo for _, lo, _ in gaps]  # gaps are disjoint and sorted by first_seq
    for e in sorted(events, key=lambda x: x.seq):
        s = e.seq
        if s in seen:
            duplicates += 1
            continue
        if s > max_seq:
            seen.add(s)
            new.append(e)
            continue
        k = bisect_right(starts, s) - 1
        if k >= 0 and s <= gaps[k][2]:
            seen.add(s)
            filled.add(s)
            new.append(e)
        else:
            duplicates += 1
    return new, duplicates, filled


def _gaps_above(new: Sequence[ev.Event], max_seq: int) -> list[tuple[int, int]]:
    """The seqs above ``max_seq`` that ``new`` (in seq order) skips."""
    if not new:
        return []
    first, last = new[0].seq, new[-1].seq
    if first > max_seq and last - first == len(new) - 1:
        # Strictly increasing and as many as the span holds: no gap inside the batch.
        return [(max_seq + 1, first - 1)] if first > max_seq + 1 else []
    gaps: list[tuple[int, int]] = []
    prev = max_seq
    for e in new:
        if e.seq <= max_seq:
            continue
        if e.seq > prev + 1:
            gaps.append((prev + 1, e.seq - 1))
        prev = e.seq
    return gaps
