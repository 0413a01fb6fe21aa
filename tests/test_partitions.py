"""PostgreSQL's monthly partitions of pool_samples and page_events: made by the migration and
kept ahead by the collector, rows that arrived early moved out of the default partition,
whole months dropped by retention, and the API's own queries pruned to the months they
touch and served by an index (checked with EXPLAIN on the statements the collector ran)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from collector import migrate, partitions
from collector.db import Database
from collector.lifecycle.retention import RetentionService
from collector.timefmt import to_micros
from kvwatch.cli import app
from tests import factories as f
from tests.conftest import Collector

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_url(pg_url: str) -> str:
    return pg_url  # PostgreSQL only: the `collector` fixture uses this


def _names(url: str, table: str) -> list[str]:
    db = Database(url)
    try:
        with db.read() as conn:
            return [p.name for p in partitions.partitions(conn, table)]
    finally:
        db.dispose()


def _month(dt: datetime) -> str:
    return f"p{dt.year:04d}_{dt.month:02d}"


def _fill(url: str, n_per_month: int = 4000) -> None:
    """Pool samples and page events over the current month and the three after it, for three
    deployments, straight into the tables (the API takes no future timestamps)."""
    db = Database(url)
    start = partitions.month_start(datetime.now(UTC))
    try:
        with db.write() as conn:
            for k in range(4):
                lo = to_micros(start) + k * 31 * 86_400 * 10**6
                conn.execute(
                    text(
                        "INSERT INTO pool_samples (deployment_id, probe_id, seq, ts, node, role, "
                        "capacity_tokens, used_tokens, free_tokens) "
                        "SELECT 'dep-' || (g % 3), 'p', g, :lo + g * 600000000::bigint, 'n', "
                        "'both', 1000, g % 1000, 1000 - g % 1000 FROM generate_series(0, :n) g"
                    ),
                    {"lo": lo, "n": n_per_month},
                )
                conn.execute(
                    text(
                        "INSERT INTO page_events (deployment_id, probe_id, seq, ts, kind, node, "
                        "request_id, tenant, other_request_id, other_tenant, page_count, "
                        "cross_tenant, detail) SELECT 'dep-' || (g % 3), 'p', g, "
                        ":lo + g * 600000000::bigint, CASE WHEN g % 50 = 0 THEN "
                        "'page.stale_read' ELSE 'page.reuse' END, 'n', NULL, NULL, NULL, NULL, "
                        "1, false, '{}' FROM generate_series(0, :n) g"
                    ),
                    {"lo": lo, "n": n_per_month},
                )
                conn.execute(
                    text(
                        "INSERT INTO requests (deployment_id, request_id, tenant, route, "
                        "model_id, prompt_tokens, status, first_ts, last_ts, part_ts) "
                        "SELECT 'dep-' || (g % 3), 'r-' || :k || '-' || g, 't', '/x', 'm', g, "
                        "'completed', :lo + g * 600000000::bigint, :lo + g * 600000000::bigint, "
                        ":lo + g * 600000000::bigint FROM generate_series(0, :n) g"
                    ),
                    {"lo": lo, "n": n_per_month, "k": k},
                )
            for table in partitions.PARTITIONED:
                conn.execute(text(f"ANALYZE {table}"))
    finally:
        db.dispose()


@pytest.mark.empty_db
def test_the_migration_partitions_by_month_and_ensure_keeps_months_ahead(pg_url: str) -> None:
    now = datetime.now(UTC)  # the clock the migration reads (not the session's start)
    migrate.upgrade(pg_url)
    for table in partitions.PARTITIONED:
        names = _names(pg_url, table)
        month = partitions.month_start(now)
        want = [f"{table}_p_before"]
        for _ in range(partitions.MONTHS_AHEAD + 1):
            want.append(f"{table}_{_month(month)}")
            month = partitions.next_month(month)
        assert names == [*want, f"{table}_default"]
    # A row five months ahead has no month yet: it waits in the default partition, and moves
    # into its month when that month is made.
    far = partitions.next_month(partitions.next_month(now + timedelta(days=31 * 3)))
    db = Database(pg_url)
    try:
        with db.write() as conn:
            conn.execute(
                text(
                    "INSERT INTO pool_samples (deployment_id, probe_id, seq, ts, node, role, "
                    "capacity_tokens, used_tokens, free_tokens) "
                    "VALUES ('d', 'p', 1, :ts, 'n', 'both', 1, 1, 0)"
                ),
                {"ts": to_micros(far) + 5},
            )
        with db.write() as conn:
            created = partitions.ensure(conn, far - timedelta(days=62))
        assert f"pool_samples_{_month(far)}" in created
        with db.read() as conn:
            assert conn.execute(text("SELECT count(*) FROM pool_samples_default")).scalar() == 0
            assert (
                conn.execute(text(f"SELECT count(*) FROM pool_samples_{_month(far)}")).scalar() == 1
            )
        with db.write() as conn:  # idempotent
            assert partitions.ensure(conn, far - timedelta(days=62)) == []
    finally:
        db.dispose()


@pytest.fixture
def captured() -> Iterator[list[tuple[str, Any]]]:
    """Every statement any engine in this process runs (the collector runs in a thread)."""
    seen: list[tuple[str, Any]] = []

    def grab(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        seen.append((statement, params))

    event.listen(Engine, "before_cursor_execute", grab)
    yield seen
    event.remove(Engine, "before_cursor_execute", grab)


def _plan(url: str, statement: str, params: Any) -> str:
    dsn = url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("EXPLAIN " + statement, params).fetchall()  # type: ignore[call-overload]
    return "\n".join(r[0] for r in rows)


def test_api_queries_are_pruned_to_their_months_and_use_an_index(
    collector: Collector, captured: list[tuple[str, Any]]
) -> None:
    _fill(collector.db_url)
    # inside the next month
    month = partitions.month_start(datetime.now(UTC)) + timedelta(days=31 + 3)
    window = {"since": month.isoformat(), "until": (month + timedelta(hours=2)).isoformat()}
    captured.clear()
    with collector.client(collector.admin) as h:
        r = h.get("/v1/pool-samples", params={**window, "deployment_id": "dep-1"})
        assert r.status_code == 200, r.text
        r = h.get(
            "/v1/page-events",
            params={**window, "deployment_id": "dep-1", "kind": "page.stale_read"},
        )
        assert r.status_code == 200, r.text
        r = h.get("/v1/requests", params={**window, "deployment_id": "dep-1"})
        assert r.status_code == 200, r.text
        assert r.json()["items"], "the window holds requests"
    checked = 0
    for table in partitions.PARTITIONED:
        stmts = [(s, p) for s, p in captured if s.startswith("SELECT") and f"FROM {table}" in s]
        assert stmts, f"no query on {table} captured"
        names = _names(collector.db_url, table)
        for statement, params in stmts:
            plan = _plan(collector.db_url, statement, params)
            touched = {n for n in names if n in plan}
            if table == "requests":
                # A request's month is that of its first sight, never before its first_ts:
                # the months before the window are pruned; later ones cannot be.
                earlier = {
                    n
                    for n in names
                    if n.endswith("_p_before")
                    or (not n.endswith("_default") and n < f"{table}_{_month(month)}")
                }
                assert f"{table}_{_month(month)}" in touched and not touched & earlier, plan
                # (the empty default partition, also not prunable, is scanned whole)
                plan = "\n".join(x for x in plan.splitlines() if "requests_default" not in x)
            else:
                assert touched == {f"{table}_{_month(month)}"}, plan
            assert "Index" in plan and "Seq Scan" not in plan, plan
            checked += 1
    assert checked >= 3


def test_retention_drops_whole_months_every_deployment_has_let_go(collector: Collector) -> None:
    # Last month's data sits in the _p_before partition (it predates the migration).
    now = datetime.now(UTC)
    db = Database(collector.db_url)
    old = to_micros(partitions.month_start(now)) - 5 * 86_400 * 10**6
    try:
        with db.write() as conn:
            for dep in ("dep-a", "dep-b"):
                conn.execute(
                    text("INSERT INTO deployments (id, first_seen, last_seen) VALUES (:d, :t, :t)"),
                    {"d": dep, "t": old},
                )
                conn.execute(
                    text(
                        "INSERT INTO pool_samples (deployment_id, probe_id, seq, ts, node, "
                        "role, capacity_tokens, used_tokens, free_tokens) SELECT :d, 'p', g, "
                        ":t + g, 'n', 'both', 1, 1, 0 FROM generate_series(1, 10) g"
                    ),
                    {"d": dep, "t": old},
                )
                conn.execute(
                    text(
                        "INSERT INTO requests (deployment_id, request_id, tenant, route, "
                        "model_id, prompt_tokens, status, first_ts, last_ts, part_ts) "
                        "SELECT :d, 'r' || g, 't', '/x', 'm', g, 'completed', :t + g, :t + g, "
                        ":t + g FROM generate_series(1, 10) g"
                    ),
                    {"d": dep, "t": old},
                )
                conn.execute(
                    text(
                        "INSERT INTO request_keys SELECT deployment_id, request_id, part_ts "
                        "FROM requests WHERE deployment_id = :d"
                    ),
                    {"d": dep},
                )
    finally:
        db.dispose()
    runner = CliRunner()
    args = ["--database-url", collector.db_url]
    for dep in ("dep-a", "dep-b"):
        res = runner.invoke(app, ["retention", "set", "--deployment", dep, "--days", "1", *args])
        assert res.exit_code == 0, res.output
    # Retention keeps at least a day, and _p_before ends where this month starts: on a
    # month's first day nothing of it may go yet. Apply as of two days into the month then
    # (the service takes its `now`, the CLI the clock's).
    when = max(now, partitions.month_start(now) + timedelta(days=2))
    service = RetentionService(Database(collector.db_url), None)
    try:
        dry = service.apply(now=when, by="test", dry_run=True)
        assert "pool_samples_p_before" in _names(collector.db_url, "pool_samples")
        out = service.apply(now=when, by="test")
    finally:
        service.db.dispose()
    assert [d["deleted"] for d in dry["deployments"]] == [d["deleted"] for d in out["deployments"]]
    assert [d["deleted"]["pool_samples"] for d in out["deployments"]] == [10, 10]
    assert [d["deleted"]["requests"] for d in out["deployments"]] == [10, 10]
    assert "pool_samples_p_before" not in _names(collector.db_url, "pool_samples")
    assert "requests_p_before" not in _names(collector.db_url, "requests")
    db = Database(collector.db_url)
    try:
        with db.read() as conn:  # their keys went with them
            assert conn.execute(text("SELECT count(*) FROM request_keys")).scalar() == 0
    finally:
        db.dispose()


def test_a_request_keeps_its_first_month_as_its_events_arrive(collector: Collector) -> None:
    """Admitted last month, finished now, then an earlier event arriving late: one row, in
    the month it was first stored, its first_ts moved earlier; one key; the upsert never
    makes a second row in another month."""
    now = datetime.now(UTC)
    this_month = partitions.month_start(now)
    before = this_month - timedelta(days=3)
    admitted = f.admitted(1, "r-long", ts=before)
    finished = f.finished(2, "r-long", ts=now - timedelta(minutes=1))
    early = f.rejected(3, "r-long", ts=before - timedelta(days=30))
    with collector.client(collector.ingest) as h:
        for e in (admitted, finished, early):
            r = h.post("/v1/events", json=[f.as_json(e)])
            assert r.status_code == 200, r.text
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            rows = conn.execute(
                text("SELECT tableoid::regclass::text, first_ts, part_ts, status FROM requests")
            ).all()
            keys = conn.execute(text("SELECT request_id, part_ts FROM request_keys")).all()
    finally:
        db.dispose()
    ((where, first, part, status),) = rows
    assert where == "requests_p_before" and part == to_micros(before)
    assert first == to_micros(before - timedelta(days=30)) and status == "completed"
    assert [tuple(k) for k in keys] == [("r-long", to_micros(before))]
