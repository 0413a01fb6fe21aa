"""Soak: sustained ingest from several probe processes into two collectors on one PostgreSQL
for a set time. Events/s, batch latency (p50/p99), the collectors' memory over the run (it
must stay flat), and at the end an exact count: every accepted event stored once.

Each producer is its own process (a probe's ``seq`` space, request ids and pool samples),
sending batches round-robin to both collectors; every tenth batch is delivered twice, the
second time to the other collector (a retry after a lost answer), which must answer it as
duplicates. 503s and connection errors are retried with backoff, as a probe does.

The ceiling is the raw write ceiling measured in the same run: the collector's own
``IngestStore.write_rows`` (binary COPY) on the same kind of batches, no HTTP, no bookkeeping;
the JSON gives soak events/s over it, and the collectors' RSS at the end over the start
(after a warm-up).

    python -m bench.soak --quick            # 20 s
    python -m bench.soak --seconds 300 --producers 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchError, bench_main, ingest_token, pct
from bench.ingest import (
    Batch,
    Expected,
    PgServer,
    Workload,
    add_pg_url,
    collector,
    raw_postgres,
)
from collector.store import shape_rows
from engine_probe import events as ev

TENANTS = ("acme", "globex", "initech", "umbrella")
DUPLICATE_EVERY = 10


def _batch(p: int, seq0: int, n_requests: int, t: datetime) -> list[ev.Event]:
    """``n_requests`` admitted + finished requests and a pool sample per 4, from probe ``p``
    starting at ``seq0``."""
    out: list[ev.Event] = []
    seq = seq0
    probe = f"soak-{p:02d}"
    dep = f"soak-dep-{p % 2}"
    for i in range(n_requests):
        rid = f"{probe}-{seq0}-{i}"
        tenant = TENANTS[(seq0 + i) % len(TENANTS)]
        ts = t + timedelta(microseconds=i)
        out.append(
            ev.RequestAdmitted(
                schema_version=1,
                probe_id=probe,
                deployment_id=dep,
                seq=seq,
                ts=ts,
                request_id=rid,
                tenant=tenant,
                model_id="glm-5.3",
                route="/v1/chat/completions",
                prompt_tokens=1000 + (seq0 + i) % 60_000,
            )
        )
        out.append(
            ev.RequestFinished(
                schema_version=1,
                probe_id=probe,
                deployment_id=dep,
                seq=seq + 1,
                ts=ts,
                request_id=rid,
                tenant=tenant,
                completion_tokens=100,
                status="completed",
            )
        )
        seq += 2
        if i % 4 == 0:
            out.append(
                ev.PoolSample(
                    schema_version=1,
                    probe_id=probe,
                    deployment_id=dep,
                    seq=seq,
                    ts=ts,
                    node=f"node-{p}",
                    role="both",
                    capacity_tokens=10**6,
                    used_tokens=i,
                    free_tokens=10**6 - i,
                )
            )
            seq += 1
    return out


def _post(client: httpx.Client, body: bytes, deadline: float) -> tuple[dict[str, Any], float]:
    delay = 0.05
    while True:
        t = time.perf_counter()
        try:
            r = client.post("/v1/events", content=body)
            if r.status_code == 200:
                return r.json(), time.perf_counter() - t
            if r.status_code not in (429, 502, 503, 504):
                raise BenchError(f"POST /v1/events -> {r.status_code}: {r.text[:500]}")
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline + 120:
            raise BenchError("a batch could not be delivered for two minutes past the end")
        time.sleep(delay)
        delay = min(2.0, delay * 2)


def producer(p: int, bases: list[str], token: str, seconds: float, per_batch: int, q: Any) -> None:
    """One probe process: sends until ``seconds`` have passed; puts its tally on ``q``."""
    try:
        clients = [
            httpx.Client(
                base_url=b,
                headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
                timeout=httpx.Timeout(120.0),
            )
            for b in bases
        ]
        deadline = time.monotonic() + seconds
        seq, k = 1, 0
        accepted = duplicates = sent_events = 0
        lat: list[float] = []
        t = datetime.now(UTC)
        while time.monotonic() < deadline:
            events = _batch(p, seq, per_batch, t)
            seq = events[-1].seq + 1
            body = ev.encode_batch(events)
            ans, secs = _post(clients[k % 2], body, deadline)
            accepted += ans["accepted"]
            duplicates += ans["duplicates"]
            lat.append(secs)
            sent_events += len(events)
            if k % DUPLICATE_EVERY == 0:  # the retry after a lost answer, to the other replica
                again, _ = _post(clients[(k + 1) % 2], body, deadline)
                if again["accepted"] != 0 or again["duplicates"] != len(events):
                    raise BenchError(f"a re-sent batch was not all duplicates: {again}")
                duplicates += again["duplicates"]
            k += 1
            t += timedelta(milliseconds=5)
        for c in clients:
            c.close()
        q.put(
            {
                "p": p,
                "events": sent_events,
                "accepted": accepted,
                "duplicates": duplicates,
                "batches": k,
                "latencies": lat,
            }
        )
    except BaseException as exc:  # the parent reports it
        q.put({"p": p, "error": repr(exc)})


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise BenchError(f"no RSS for pid {pid}")


def _children_rss_mb(pid: int) -> float:
    """A collector's RSS: the serve process (uvicorn runs the app in it with one worker)."""
    return _rss_mb(pid)


def _ceiling(pg: PgServer, per_batch: int, producers: int) -> float:
    """Raw COPY events/s on batches of the soak's shape (same run, same database server)."""
    conninfo, url = pg.create("soakraw")
    from collector import migrate

    migrate.upgrade(url)
    t = datetime.now(UTC)
    batches = []
    for p in range(producers):
        mine, seq = [], 1
        for _ in range(20):
            events = _batch(p, seq, per_batch, t)
            seq = events[-1].seq + 1
            mine.append(Batch(p, len(events), b"", shape_rows(events)))
        batches.append(mine)
    wl = Workload([f"soak-{p:02d}" for p in range(producers)], batches, Expected())
    n = sum(b.events for bs in batches for b in bs)
    return n / raw_postgres(conninfo, url, wl, producers)


def run(args: argparse.Namespace) -> dict[str, Any]:
    seconds = 20.0 if args.quick else args.seconds
    pg = PgServer(args.pg_url)
    if (why := pg.reachable()) is not None:
        raise BenchError(f"PostgreSQL is needed: {why}")
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    try:
        ceiling = _ceiling(pg, args.batch_requests, args.producers)
        print(f"raw ceiling: {ceiling:,.0f} events/s", flush=True)
        _, url = pg.create("soak")
        token = ingest_token(url)
        dummy = Workload([], [[Batch(0, 0, b"x" * (1 << 20), shape_rows([]))]], Expected())
        with tempfile.TemporaryDirectory(prefix="kvw-soak-") as tmp, ExitStack() as stack:
            cols = [stack.enter_context(collector(url, Path(tmp), dummy, 10_000)) for _ in range(2)]
            bases, pids = [c[0] for c in cols], [c[1] for c in cols]
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            procs = [
                ctx.Process(
                    target=producer,
                    args=(p, bases, token, seconds, args.batch_requests, q),
                )
                for p in range(args.producers)
            ]
            t0 = time.perf_counter()
            for pr in procs:
                pr.start()
            samples: list[tuple[float, list[float]]] = []
            warm = min(5.0, seconds / 4)
            while any(pr.is_alive() for pr in procs) and time.perf_counter() - t0 < seconds + 180:
                time.sleep(1.0)
                samples.append((time.perf_counter() - t0, [_children_rss_mb(x) for x in pids]))
            results = [q.get(timeout=60) for _ in procs]
            wall = time.perf_counter() - t0
            for pr in procs:
                pr.join(10)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                raise BenchError(f"producer failed: {errors[0]}")
            accepted = sum(r["accepted"] for r in results)
            sent = sum(r["events"] for r in results)
            lat = [x for r in results for x in r["latencies"]]
            stored = _count(url)
    finally:
        pg.drop_all()
    if accepted != sent or stored != accepted:
        raise BenchError(f"sent {sent}, accepted {accepted}, stored {stored}: not exactly once")
    after_warm = [s for s in samples if s[0] >= warm] or samples
    start, end = after_warm[0][1], after_warm[-1][1]
    peak = [max(s[1][i] for s in after_warm) for i in range(2)]
    eps = accepted / wall
    print(
        f"soak {wall:.0f} s, {args.producers} producers, 2 collectors: {eps:,.0f} events/s "
        f"({accepted:,} stored exactly once); batch p50 {1000 * pct(lat, 0.5):.0f} ms, p99 "
        f"{1000 * pct(lat, 0.99):.0f} ms; collector RSS start {start[0]:.0f}/{start[1]:.0f} MB, "
        f"end {end[0]:.0f}/{end[1]:.0f} MB, peak {peak[0]:.0f}/{peak[1]:.0f} MB"
    )
    return {
        "bench": "soak",
        "quick": args.quick,
        "seconds": round(wall, 1),
        "producers": args.producers,
        "collectors": 2,
        "events": accepted,
        "events_per_s": round(eps),
        "ceiling_events_per_s": round(ceiling),
        "ratio": round(eps / ceiling, 4),
        "batch_latency_p50_ms": round(1000 * pct(lat, 0.5), 1),
        "batch_latency_p99_ms": round(1000 * pct(lat, 0.99), 1),
        "rss_start_mb": [round(x, 1) for x in start],
        "rss_end_mb": [round(x, 1) for x in end],
        "rss_peak_mb": [round(x, 1) for x in peak],
        "rss_end_over_start": [round(e / s, 3) for s, e in zip(start, end, strict=True)],
    }


def _count(url: str) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            reqs = conn.execute(text("SELECT count(*) FROM requests")).scalar_one()
            pool = conn.execute(text("SELECT count(*) FROM pool_samples")).scalar_one()
    finally:
        engine.dispose()
    # two events per request (admitted, finished) and one per pool sample
    return int(reqs) * 2 + int(pool)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 seconds")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch-requests", type=int, default=400, help="requests per batch")
    add_pg_url(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("soak", parse_args(argv), run)


if __name__ == "__main__":
    raise SystemExit(main())
