"""Breach-report generation over N synthetic requests, SQLite and PostgreSQL: time and peak
memory (the RSS high-water mark; Python's allocation peak too with ``--tracemalloc``), to show
memory stays bounded as N grows.

Per database and N: a fresh database (temp-dir SQLite file, or a throwaway PostgreSQL
database, dropped afterwards), migrated; N requests of one model inserted with raw SQL
(SQLite ``executemany``, PostgreSQL binary ``COPY``) in batches; then ``BreachService.build``
for a window covering all of them runs in a fresh (spawned) process, so the RSS high-water mark
is the build's, not the insert's. Last line: one JSON object.

    python -m bench.report --quick          # 100,000 requests
    python -m bench.report                  # 1,000,000 and 10,000,000
    python -m bench.report --sizes 1000000 --skip-postgres --tracemalloc
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
    t = time.perf_counter()
    report = BreachService(db, Settings(database_url=url)).build(scope, now=datetime.now(UTC))
    secs = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] if traced else None
    tracemalloc.stop()
    db.dispose()
    q.put(
        {
            "seconds": round(secs, 2),
            "tracemalloc_peak_mb": None if peak is None else round(peak / 2**20, 1),
            "rss_before_mb": round(rss0 / 1024, 1),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "count": report["affected_requests"]["count"],
            "listed": report["affected_requests"]["listed"],
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
    if out["count"] != n:
        raise BenchError(f"report counted {out['count']} requests, {n} were inserted")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from collector import migrate

    sizes = [100_000] if args.quick else args.sizes
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    backends = ["sqlite"] + ([] if args.skip_postgres else ["postgresql"])
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
                        pg.drop_all()
                results.setdefault(backend, {})[str(n)] = r
                print(
                    f"{backend:10} N={n:>10,}: build {r['seconds']:7.2f} s "
                    f"({n / max(r['seconds'], 1e-9):,.0f} req/s), RSS peak {r['rss_peak_mb']} MB, "
                    f"tracemalloc peak {r['tracemalloc_peak_mb']} MB "
                    f"(insert {r['insert_seconds']} s)"
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
    return {"bench": "report", "sizes": sizes, "results": results, "ratios": ratios}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="100,000 requests only")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--skip-postgres", action="store_true")
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
