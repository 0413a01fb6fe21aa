"""Breach-report generation over N synthetic requests, SQLite and PostgreSQL: time and peak
memory (the RSS high-water mark; Python's allocation peak too with ``--tracemalloc``), to show
memory stays bounded as N grows, and on PostgreSQL against a ceiling: a raw ``COPY`` of the
rows the CSV lists.

Per database and N: a fresh database (temp-dir SQLite file, or a throwaway PostgreSQL
database, dropped afterwards), migrated; N requests of one model inserted with raw SQL
(SQLite ``executemany``, PostgreSQL binary ``COPY``) in batches; then ``BreachService.build``
for a window covering all of them runs in a fresh (spawned) process, so the RSS high-water mark
is the build's, not the insert's; then, in the same process, the CSV of every affected request
(``BreachService.write_csv`` into a sink that discards it). The ceiling (PostgreSQL): the
report's own listing statement as a plain ``COPY (SELECT …) TO STDOUT``, read in blocks and
discarded, timed twice (its A/A ratio shows the run's noise). ``ratio`` = ceiling / (build +
CSV): the whole report against copying out its rows. Last line: one JSON object.

    python -m bench.report --quick          # 100,000 requests
    python -m bench.report                  # 1,000,000 and 10,000,000
    python -m bench.report --sizes 1000000 --skip-postgres --tracemalloc
    python -m bench.report --sizes 10000000 --skip-sqlite
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sqlite3
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import BenchError, bench_main
from bench.ingest import PgServer, add_pg_url

MODEL = "glm-5.3"
T0 = datetime(2026, 8, 1, tzinfo=UTC)
SPAN_US = 30 * 86_400 * 10**6
BATCH = 50_000
COLS = (
    "deployment_id, request_id, tenant, route, model_id, prompt_tokens, completion_tokens, "
    "status, data_categories, first_ts, last_ts, part_ts"
)


def _rows(n: int, start: int) -> Iterator[tuple[Any, ...]]:
    t0 = int(T0.timestamp() * 10**6)
    for i in range(start, min(n, start + BATCH)):
        ts = t0 + i * SPAN_US // n
        yield (
            f"dep-{i % 3}",
            f"r{i}",
            f"tenant-{i % 50}",
            f"/v1/route-{i % 4}",
            MODEL,
            1000 + (i * 7919) % 700_000,
            50 + i % 500,
            "completed",
            '["contact"]' if i % 10 == 0 else None,
            ts,
            ts + 2_000_000,
            ts,
        )


def insert_sqlite(path: Path, n: int) -> None:
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        sql = f"INSERT INTO requests ({COLS}) VALUES ({', '.join('?' * 12)})"
        for start in range(0, n, BATCH):
            con.executemany(sql, _rows(n, start))
            con.commit()
    finally:
        con.close()


def insert_postgres(conninfo: str, n: int) -> None:
    import psycopg

    with psycopg.connect(conninfo) as con, con.cursor() as cur:
        for start in range(0, n, BATCH):
            with cur.copy(f"COPY requests ({COLS}) FROM STDIN") as cp:
                for row in _rows(n, start):
                    cp.write_row(row)
            con.commit()
        cur.execute("ANALYZE requests")
        con.commit()


def _build(url: str, n: int, traced: bool, q: Any) -> None:
    """In a fresh process: build the window report; put its figures on ``q``.

    tracemalloc slows allocation-heavy code several-fold, so it is on only when asked; the
    RSS high-water mark is measured either way.
    """
    from collector.db import Database
    from collector.reports.breach import BreachScope, BreachService
    from collector.settings import Settings

    db = Database(url)
    scope = BreachScope(model_id=MODEL, since=T0, until=T0 + timedelta(days=31))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if traced:
        tracemalloc.start()
    service = BreachService(db, Settings(database_url=url))
    t = time.perf_counter()
    report = service.build(scope, now=datetime.now(UTC))
    secs = time.perf_counter() - t
    rss_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = tracemalloc.get_traced_memory()[1] if traced else None
    tracemalloc.stop()
    size = 0

    def sink(block: bytes) -> None:
        nonlocal size
        size += len(block)

    t = time.perf_counter()
    csv_rows = service.write_csv(report, sink)
    csv_secs = time.perf_counter() - t
    db.dispose()
    q.put(
        {
            "seconds": round(secs, 2),
            "rss_build_mb": round(rss_build / 1024, 1),
            "csv_seconds": round(csv_secs, 2),
            "csv_rows": csv_rows,
            "csv_mb": round(size / 2**20, 1),
            "tracemalloc_peak_mb": None if peak is None else round(peak / 2**20, 1),
            "rss_before_mb": round(rss0 / 1024, 1),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "count": report.affected_requests.count,
            "listed": report.affected_requests.listed,
        }
    )


def measure(url: str, n: int, traced: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_build, args=(url, n, traced, q))
    p.start()
    try:
        out: dict[str, Any] = q.get(timeout=7200)
    finally:
        p.join()
    if out["count"] != n or out["csv_rows"] != n:
        raise BenchError(
            f"report counted {out['count']} requests and its CSV listed {out['csv_rows']}; "
            f"{n} were inserted"
        )
    return out


def ceiling(url: str) -> float:
    """Seconds for a plain COPY of the report's own listing statement, output discarded."""
    import psycopg
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.engine import make_url

    from collector.reports.breach_rows import RowFilter, listing_statement

    lo = int(T0.timestamp() * 10**6)
    f = RowFilter.window(MODEL, lo, lo + 31 * 86_400 * 10**6)
    compiled = listing_statement(f).compile(
        dialect=postgresql.psycopg.dialect(), compile_kwargs={"render_postcompile": True}
    )
    u = make_url(url)
    with psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database) as con:
        con.execute("SET DateStyle = 'ISO, MDY'")
        t = time.perf_counter()
        with con.cursor().copy(
            f"COPY ({compiled}) TO STDOUT (FORMAT csv, HEADER)", dict(compiled.params)
        ) as cp:
            for _ in cp:
                pass
        return time.perf_counter() - t


def run(args: argparse.Namespace) -> dict[str, Any]:
    from collector import migrate

    sizes = [100_000] if args.quick else args.sizes
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    backends = ([] if args.skip_sqlite else ["sqlite"]) + (
        [] if args.skip_postgres else ["postgresql"]
    )
    pg = PgServer(args.pg_url)
    try:
        for backend in backends:
            if backend == "postgresql" and (why := pg.reachable()) is not None:
                print(f"postgresql skipped: {why}")
                continue
            for n in sizes:
                with tempfile.TemporaryDirectory(prefix="kvw-bench-report-") as tmp:
                    if backend == "sqlite":
                        path = Path(tmp) / "kvwatch.db"
                        url = f"sqlite:///{path}"
                        migrate.upgrade(url)
                        t = time.perf_counter()
                        insert_sqlite(path, n)
                    else:
                        conninfo, url = pg.create(f"report{n}")
                        migrate.upgrade(url)
                        t = time.perf_counter()
                        insert_postgres(conninfo, n)
                    insert_s = time.perf_counter() - t
                    r = measure(url, n, args.tracemalloc) | {"insert_seconds": round(insert_s, 1)}
                    if backend == "postgresql":
                        # Printed now: the ceilings take as long again, and a run cut short
                        # (the server restarted under it) should still say what it measured.
                        print(f"measured: {r}", file=sys.stderr, flush=True)
                        c1, c2 = ceiling(url), ceiling(url)
                        report_s = r["seconds"] + r["csv_seconds"]
                        r |= {
                            "ceiling_seconds": round(c1, 2),
                            "ceiling_b_seconds": round(c2, 2),
                            "aa_ratio": round(c2 / c1, 3),
                            "ratio": round(c1 / report_s, 3),
                            "ratio_csv": round(c1 / r["csv_seconds"], 3),
                        }
                        pg.drop_all()
                results.setdefault(backend, {})[str(n)] = r
                print(
                    f"{backend:10} N={n:>10,}: build {r['seconds']:7.2f} s "
                    f"({n / max(r['seconds'], 1e-9):,.0f} req/s, RSS {r['rss_build_mb']} MB), "
                    f"CSV {r['csv_seconds']:.2f} s ({r['csv_mb']} MB), RSS peak "
                    f"{r['rss_peak_mb']} MB, tracemalloc peak {r['tracemalloc_peak_mb']} MB "
                    f"(insert {r['insert_seconds']} s)"
                    + (
                        f"; ceiling COPY {r['ceiling_seconds']:.2f} / {r['ceiling_b_seconds']:.2f}"
                        f" s (A/A {r['aa_ratio']}), ratio {r['ratio']} (CSV alone "
                        f"{r['ratio_csv']})"
                        if "ratio" in r
                        else ""
                    )
                )
    finally:
        pg.drop_all()
    ratios = {}
    for backend, by_n in results.items():
        ns = sorted(by_n, key=int)
        if len(ns) > 1:
            lo, hi = by_n[ns[0]], by_n[ns[-1]]
            ratios[backend] = {
                "n_ratio": int(ns[-1]) / int(ns[0]),
                "tracemalloc_peak_ratio": (
                    round(hi["tracemalloc_peak_mb"] / lo["tracemalloc_peak_mb"], 2)
                    if args.tracemalloc
                    else None
                ),
                "rss_peak_ratio": round(hi["rss_peak_mb"] / lo["rss_peak_mb"], 2),
                "time_ratio": round(hi["seconds"] / max(lo["seconds"], 1e-9), 2),
            }
    pg_ratios = [r["ratio"] for r in results.get("postgresql", {}).values() if "ratio" in r]
    return {
        "bench": "report",
        "sizes": sizes,
        "results": results,
        "ratios": ratios,
        # the largest N's: the whole report against a raw COPY of its rows (goal >= 0.7)
        "ratio": pg_ratios[-1] if pg_ratios else None,
        "aa_ratio": (results["postgresql"][str(sizes[-1])]["aa_ratio"] if pg_ratios else None),
        "goal": {"ratio": 0.7, "seconds_at_10m": 10, "rss_mb_at_10m": 300},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="100,000 requests only")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--skip-postgres", action="store_true")
    p.add_argument("--skip-sqlite", action="store_true", help="PostgreSQL only")
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="also record Python's allocation peak (slows the build several-fold)",
    )
    add_pg_url(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("report", parse_args(argv), run)


if __name__ == "__main__":
    raise SystemExit(main())
