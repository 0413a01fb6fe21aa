"""The affected requests of a breach report, in SQL: their aggregates, a bounded sample, and
the full listing as CSV.

A report can cover millions of requests, so nothing here loads them all: counts and per
tenant, route, deployment and category figures are ``GROUP BY``s (one scan with ``GROUPING
SETS`` on PostgreSQL), the sample is a ``LIMIT``, and the listing streams. On PostgreSQL the
listing is ``COPY (SELECT …) TO STDOUT (FORMAT csv)``, formatted by the server exactly as
:func:`csv_row` formats a row (ISO times, categories joined by ``;``, empty for null), so the
bytes go from the server to the sink in blocks without a Python object per row; SQLite streams
a cursor through :func:`csv_row`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.timefmt import iso

IN_WINDOW = "in_window"
# Bytes handed to the sink at a time on SQLite (PostgreSQL's COPY blocks are its own).
_SQLITE_FLUSH = 1 << 20


@dataclass(frozen=True, slots=True)
class RowFilter:
    """Which requests a report covers: SQL conditions on ``requests``, and for an incident the
    role of each request a stale read names (``(deployment_id, request_id)`` → role)."""

    where: Sequence[Any]
    roles: dict[tuple[str, str], str] = field(default_factory=dict)

    @classmethod
    def window(
        cls,
        model_id: str,
        lo: int,
        hi: int,
        *,
        min_prompt_tokens: int | None = None,
        deployment_id: str | None = None,
    ) -> RowFilter:
        r = m.Request
        conds = [r.model_id == model_id, m.requests_since(r, lo), _ts(r.first_ts) < hi]
        if min_prompt_tokens is not None:
            conds.append(r.prompt_tokens >= min_prompt_tokens)
        if deployment_id is not None:
            conds.append(r.deployment_id == deployment_id)
        return cls(conds)

    @classmethod
    def named(cls, roles: dict[tuple[str, str], str]) -> RowFilter:
        """Exactly the requests ``roles`` names (an incident's readers and previous writers)."""
        return cls([_keys(roles)], roles)


def _ts(col: Any) -> Any:
    return type_coerce(col, BigInteger)


def _keys(keys: Any) -> Any:
    """``(deployment_id, request_id) IN keys``, grouped by deployment (no row-value IN, which
    SQLite's older versions and SQLAlchemy's expanding parameters handle unevenly)."""
    r = m.Request
    by_dep: dict[str, list[str]] = {}
    for dep, rid in sorted(keys):
        by_dep.setdefault(dep, []).append(rid)
    if not by_dep:
        return sa.false()
    return sa.or_(
        *(sa.and_(r.deployment_id == dep, r.request_id.in_(rids)) for dep, rids in by_dep.items())
    )


def _role(f: RowFilter) -> Any:
    """The role column: a CASE over the named requests (bounded by the stale reads), else the
    window's constant."""
    r = m.Request
    if not f.roles:
        return sa.literal(IN_WINDOW, sa.Text)
    whens = [
        (sa.and_(r.deployment_id == dep, r.request_id == rid), role)
        for (dep, rid), role in sorted(f.roles.items())
    ]
    return sa.case(*whens, else_=sa.literal(IN_WINDOW, sa.Text))


def _raw_cols() -> list[Any]:
    r = m.Request
    return [
        r.deployment_id,
        r.request_id,
        r.tenant,
        r.route,
        r.model_id,
        r.prompt_tokens,
        r.completion_tokens,
        r.status,
        r.reject_reason,
        r.data_categories,
        _ts(r.first_ts).label("first_ts"),
        _ts(r.last_ts).label("last_ts"),
    ]


def _order() -> list[Any]:
    return [m.Request.first_ts, m.Request.id]


# ---------------------------------------------------------------------------- aggregates


@dataclass(slots=True)
class Summary:
    """Exact figures over every request a filter covers."""

    count: int = 0
    max_prompt: int | None = None
    first_ts: int | None = None
    last_ts: int | None = None
    by_tenant: dict[str, int] = field(default_factory=dict)
    by_route: dict[str, int] = field(default_factory=dict)
    by_deployment: dict[str, int] = field(default_factory=dict)
    by_model: dict[str, int] = field(default_factory=dict)
    #: requests per status (``lost``: their probe went away before they finished)
    by_status: dict[str, int] = field(default_factory=dict)
    # the categories' JSON text as stored → requests carrying it (parsed by the caller)
    by_categories: dict[str, int] = field(default_factory=dict)


def summary(conn: Connection, f: RowFilter) -> Summary:
    """Counts, extremes and per tenant, route, deployment, model, status and category-set
    counts, from one ``GROUP BY`` over all six labels, streamed and folded here: one scan
    (PostgreSQL's ``GROUPING SETS`` over five of them took three times as long), and the
    groups are bounded by the labels' combinations, never by the requests."""
    r = m.Request
    keys = [r.tenant, r.route, r.deployment_id, r.model_id, r.data_categories, r.status]
    stmt = (
        select(
            *keys,
            sa.func.count().label("n"),
            sa.func.max(r.prompt_tokens).label("max_prompt"),
            sa.func.min(_ts(r.first_ts)).label("first_ts"),
            sa.func.max(_ts(r.last_ts)).label("last_ts"),
        )
        .where(*f.where)
        .group_by(*keys)
    )
    out = Summary()
    # Not a server-side cursor: PostgreSQL plans a cursor for its first rows (a sorted
    # GroupAggregate over an index, 9x slower here than the hash aggregate it picks for a
    # plain query); the groups are few enough to fetch at once.
    for row in conn.execute(stmt):
        tenant, route, dep, model, cats, status = row[:6]
        n, mx, lo, hi = int(row.n), row.max_prompt, row.first_ts, row.last_ts
        out.count += n
        for d, k in (
            (out.by_tenant, tenant),
            (out.by_route, route),
            (out.by_deployment, dep),
            (out.by_model, model),
            (out.by_status, status),
        ):
            key = "" if k is None else str(k)
            d[key] = d.get(key, 0) + n
        if cats is not None:
            out.by_categories[cats] = out.by_categories.get(cats, 0) + n
        if mx is not None:
            out.max_prompt = int(mx) if out.max_prompt is None else max(out.max_prompt, int(mx))
        out.first_ts = int(lo) if out.first_ts is None else min(out.first_ts, int(lo))
        out.last_ts = int(hi) if out.last_ts is None else max(out.last_ts, int(hi))
    return out


def prompt_buckets(
    conn: Connection, f: RowFilter, lo: int, hi: int, buckets: int
) -> dict[int, int]:
    """The largest prompt per time bucket of ``[lo, hi)`` (by first event): bucket index → max.
    Buckets are ``ceil((hi - lo) / buckets)`` µs wide, integer arithmetic in SQL (no overflow
    over any window of years 1-9999)."""
    r = m.Request
    width = max(1, -(-(hi - lo) // buckets))
    # "//": integer division on both databases ("/" is SQLAlchemy's true division: NUMERIC
    # on PostgreSQL, a group per request).
    idx = ((_ts(r.first_ts) - lo) // width).label("b")
    stmt = (
        select(idx, sa.func.max(r.prompt_tokens))
        .where(*f.where, _ts(r.first_ts) >= lo, _ts(r.first_ts) < hi, r.prompt_tokens.is_not(None))
        .group_by(idx)
    )
    return {min(max(int(b), 0), buckets - 1): int(v) for b, v in conn.execute(stmt)}


# ---------------------------------------------------------------------------- sample rows


def categories(raw: Any) -> list[str]:
    """A stored categories cell (JSON array text, or NULL) as a list; anything else is none."""
    if raw is None:
        return []
    try:
        v = json.loads(raw)
    except (TypeError, ValueError):
        return []
    return [str(c) for c in v] if isinstance(v, list) else []


class AffectedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One affected request as a breach report lists it (its JSON ``items``, a CSV row): the
    fields are the CSV's columns, in their order; times are ISO 8601 UTC text."""

    deployment_id: str
    request_id: str
    tenant: str
    route: str | None
    model_id: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    status: str
    reject_reason: str | None
    data_categories: tuple[str, ...]
    first_ts: str
    last_ts: str
    #: reader, previous_writer, both (the sides of a stale read it is on), or in_window
    role: str


# The CSV's columns are the listed request's fields, in their order.
CSV_COLUMNS: tuple[str, ...] = AffectedRequest.__struct_fields__


def _as_item(row: Any, roles: dict[tuple[str, str], str]) -> AffectedRequest:
    return AffectedRequest(
        deployment_id=row.deployment_id,
        request_id=row.request_id,
        tenant=row.tenant,
        route=row.route,
        model_id=row.model_id,
        prompt_tokens=None if row.prompt_tokens is None else int(row.prompt_tokens),
        completion_tokens=None if row.completion_tokens is None else int(row.completion_tokens),
        status=row.status,
        reject_reason=row.reject_reason,
        data_categories=tuple(categories(row.data_categories)),
        first_ts=iso(int(row.first_ts)),
        last_ts=iso(int(row.last_ts)),
        role=roles.get((row.deployment_id, row.request_id), IN_WINDOW),
    )


def sample(
    conn: Connection, f: RowFilter, limit: int, also: set[tuple[str, str]]
) -> list[AffectedRequest]:
    """The first ``limit`` requests by first event, and every request in ``also`` that the
    filter covers (the ones stale reads name: the evidence needs them whatever their place),
    in first-event order."""
    rows = {
        (x.deployment_id, x.request_id): x
        for x in conn.execute(select(*_raw_cols()).where(*f.where).order_by(*_order()).limit(limit))
    }
    missing = sorted(also - set(rows))
    for i in range(0, len(missing), 500):
        stmt = select(*_raw_cols(), m.Request.id).where(*f.where, _keys(missing[i : i + 500]))
        rows.update({(x.deployment_id, x.request_id): x for x in conn.execute(stmt)})
    items = sorted(rows.values(), key=lambda x: (x.first_ts, x.deployment_id, x.request_id))
    return [_as_item(x, f.roles) for x in items]


# ---------------------------------------------------------------------------- the CSV


def csv_row(item: AffectedRequest) -> list[Any]:
    """One listed request as the CSV writes it: categories joined by ``;``, null as empty."""
    values = [getattr(item, c) for c in CSV_COLUMNS]
    return [
        ";".join(v) if c == "data_categories" else ("" if v is None else v)
        for c, v in zip(CSV_COLUMNS, values, strict=True)
    ]


def _iso_sql(col: str) -> str:
    # The text of collector.timefmt.iso: "YYYY-MM-DDTHH:MM:SS", then ".ffffff" only when there
    # are microseconds, then "Z". A timestamp's own text output (DateStyle ISO, set by
    # write_listing) costs a fifth of to_char's; it trims fractions' trailing zeros, so the
    # fraction is added separately. mod twice: floor semantics for instants before 1970.
    frac = f"mod(mod({col}, 1000000) + 1000000, 1000000)"
    secs = f"(timestamp 'epoch' + ({col} - {frac}) * interval '1 microsecond')::text"
    return (
        f"replace({secs}, ' ', 'T') || "
        f"CASE WHEN {frac} = 0 THEN 'Z' ELSE '.' || lpad({frac}::text, 6, '0') || 'Z' END"
    )


def listing_statement(f: RowFilter) -> Any:
    """PostgreSQL's listing SELECT: the CSV's columns, formatted by the server."""
    r = m.Request
    tbl = m.Request.__tablename__
    cats = (
        f"(SELECT string_agg(e, ';') FROM jsonb_array_elements_text("
        f"CASE WHEN jsonb_typeof({tbl}.data_categories::jsonb) = 'array' "
        f"THEN {tbl}.data_categories::jsonb ELSE '[]'::jsonb END) AS e)"
    )
    cols = [
        r.deployment_id.label("deployment_id"),
        r.request_id.label("request_id"),
        r.tenant.label("tenant"),
        sa.func.nullif(r.route, "").label("route"),
        sa.func.nullif(r.model_id, "").label("model_id"),
        r.prompt_tokens.label("prompt_tokens"),
        r.completion_tokens.label("completion_tokens"),
        r.status.label("status"),
        sa.func.nullif(r.reject_reason, "").label("reject_reason"),
        sa.literal_column(cats).label("data_categories"),
        sa.literal_column(_iso_sql(f"{tbl}.first_ts")).label("first_ts"),
        sa.literal_column(_iso_sql(f"{tbl}.last_ts")).label("last_ts"),
        _role(f).label("role"),
    ]
    return select(*cols).where(*f.where).order_by(*_order())


def copy_sql(conn: Connection, f: RowFilter) -> tuple[str, dict[str, Any]]:
    """``COPY (listing) TO STDOUT`` as CSV with its header, and its parameters (psycopg binds
    them client-side: COPY takes no server-side parameters)."""
    compiled = listing_statement(f).compile(
        dialect=conn.dialect, compile_kwargs={"render_postcompile": True}
    )
    return f"COPY ({compiled}) TO STDOUT (FORMAT csv, HEADER)", dict(compiled.params)


def write_listing(conn: Connection, f: RowFilter, sink: Callable[[bytes], Any]) -> int:
    """Every request the filter covers, as CSV (header row first), in first-event order,
    handed to ``sink`` block by block; returns the number of requests written.

    Ingest refuses control characters in every text field, so no CSV field spans lines and a
    block's rows are its newlines."""
    if conn.dialect.name == "postgresql":
        sql, params = copy_sql(conn, f)
        conn.exec_driver_sql("SET LOCAL DateStyle = 'ISO, MDY'")
        lines = 0
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        with cursor.copy(sql, params) as cp:
            for block in cp:
                data = bytes(block)
                lines += data.count(b"\n")
                sink(data)
        return lines - 1
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    n = 0
    stream = conn.execution_options(stream_results=True, yield_per=10_000)
    for row in stream.execute(select(*_raw_cols()).where(*f.where).order_by(*_order())):
        w.writerow(csv_row(_as_item(row, f.roles)))
        n += 1
        if buf.tell() >= _SQLITE_FLUSH:
            sink(buf.getvalue().encode())
            buf.seek(0)
            buf.truncate()
    sink(buf.getvalue().encode())
    return n
