"""The dashboard's collector endpoints over N requests on PostgreSQL: how long each takes,
against the raw aggregate it replaces (the ceiling, measured in the same run).

Per N: a throwaway database, migrated; N requests over 7 days (3 deployments, 6 tenants, 3
routes, log-normal prompt sizes) by binary COPY; every bucket marked and the rollups built by
the collector's own refresher (timed: the backfill); then, best of three each, the services
behind ``/v1/stats/prompt-tokens`` (admin and tenant-scoped) and ``/v1/stats/top-prompts``
for the last 24 hours and 7 days, and the raw ``GROUP BY`` over requests that the rollups
exist to beat. Ratio = endpoint / raw (below 1: the rollups pay). Last line: one JSON object.

    python -m bench.dashboard --quick        # 200,000 requests
    python -m bench.dashboard                # 1,000,000 and 10,000,000
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.common import BenchError, bench_main
from bench.ingest import PgServer, add_pg_url

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli", "stark")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
DAYS = 7


def _best(fn: Callable[[], object], n: int = 3) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def _fill(conninfo: str, n: int, now: datetime) -> None:
    import psycopg

    t0 = int((now - timedelta(days=DAYS)).timestamp() * 10**6)
    span = DAYS * 86_400 * 10**6
    rng = random.Random(1)
    cols = (
        "deployment_id, request_id, tenant, route, model_id, prompt_tokens, status, first_ts, "
        "last_ts, part_ts"
    )
    with psycopg.connect(conninfo) as con, con.cursor() as cur:
        with cur.copy(f"COPY requests ({cols}) FROM STDIN") as cp:
            for i in range(n):
                ts = t0 + i * span // n
                prompt = min(600_000, 1 + int(rng.lognormvariate(7.0, 1.2)))
                cp.write_row((f"dep-{i % 3}", f"r{i}", TENANTS[i % 6], ROUTES[i % 3], "glm-5.3",
                              prompt, "completed", ts, ts, ts))  # fmt: skip
        cur.execute(
            "INSERT INTO rollup_dirty SELECT DISTINCT 'requests', deployment_id, "
            "(first_ts / 300000000) * 300000000, 0 FROM requests"
        )
        con.commit()
        cur.execute("ANALYZE")
        con.commit()


def measure(conninfo: str, url: str, n: int) -> dict[str, Any]:
    from collector import migrate
    from collector.db import Database
    from collector.limits import Limits
    from collector.rollups.refresh import RollupRefresher
    from collector.rollups.stats import Scope, StatsService, Window
    from collector.timefmt import to_micros

    migrate.upgrade(url)
    now = datetime.now(UTC)
    t = time.perf_counter()
    _fill(conninfo, n, now)
    out: dict[str, Any] = {"insert_s": round(time.perf_counter() - t, 1)}
    db = Database(url)
    try:
        t = time.perf_counter()
        built = RollupRefresher(db).refresh(everything=True)
        out["rollup_backfill_s"] = round(time.perf_counter() - t, 1)
        with db.read() as conn:
            out["rollup_rows"] = conn.exec_driver_sql(
                "SELECT count(*) FROM request_rollups"
            ).scalar()
        out["buckets"] = built.request_buckets
        stats = StatsService(db, Limits(db))
        for label, days in (("24h", 1), ("7d", DAYS)):
            w = Window(to_micros(now - timedelta(days=days)), to_micros(now), 200)
            lo = w.since_us
            width = (w.until_us - lo) // 200

            def raw(lo: int = lo, width: int = width) -> None:
                with db.read() as conn:
                    conn.exec_driver_sql(
                        f"SELECT model_id, route, (first_ts - {lo}) / {width} AS b, count(*), "
                        f"max(prompt_tokens) FROM requests WHERE first_ts >= {lo} "
                        "GROUP BY 1, 2, 3"
                    ).all()

            ceiling = _best(raw)
            admin = _best(functools.partial(stats.prompt_tokens, Scope(), w))
            tenant = _best(functools.partial(stats.prompt_tokens, Scope(tenant="acme"), w))
            top = _best(functools.partial(stats.top_prompts, Scope(model_id="glm-5.3"), w, 20))
            out[label] = {
                "raw_group_by_ms": round(ceiling * 1000, 1),
                "prompt_tokens_ms": round(admin * 1000, 1),
                "prompt_tokens_tenant_ms": round(tenant * 1000, 1),
                "top_prompts_ms": round(top * 1000, 1),
                "ratio_prompt_tokens_to_raw": round(admin / ceiling, 3),
            }
            print(
                f"N={n:>10,} {label:>3}: prompt-tokens {admin * 1000:7.0f} ms (tenant "
                f"{tenant * 1000:.0f} ms), top-prompts {top * 1000:.0f} ms; raw GROUP BY "
                f"{ceiling * 1000:.0f} ms -> ratio {admin / ceiling:.2f}",
                flush=True,
            )
    finally:
        db.dispose()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [200_000] if args.quick else args.sizes
    pg = PgServer(args.pg_url)
    if (why := pg.reachable()) is not None:
        raise BenchError(f"PostgreSQL is needed: {why}")
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    results: dict[str, Any] = {}
    try:
        for n in sizes:
            conninfo, url = pg.create(f"dash{n}")
            try:
                results[str(n)] = measure(conninfo, url, n)
            finally:
                pg.drop_all()
    finally:
        pg.drop_all()
    return {"bench": "dashboard", "sizes": sizes, "days": DAYS, "results": results}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="200,000 requests only")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    add_pg_url(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("dashboard", parse_args(argv), run)


if __name__ == "__main__":
    raise SystemExit(main())
