"""Ingest benchmark: events/s through ``POST /v1/events`` beside the raw ceiling.

For each backend (SQLite, then PostgreSQL when reachable) it measures, in the same run:

* **http**: a real collector (``kvwatch serve`` as a subprocess, fresh database) taking
  pre-encoded batches from a few concurrent client connections (one probe per connection at a
  time, so each probe's batches arrive in seq order). Wall time runs from the first send to the
  last response; the stored rows are then counted and checked (nothing missing, nothing
  doubled, every request finished), or the benchmark fails.
* **raw**: the very same rows (``collector.store.shape_rows`` on the same batches) written
  into a fresh migrated database with no HTTP, no decoding and no idempotency bookkeeping,
  one transaction per batch. SQLite: ``sqlite3`` ``executemany`` with the collector's SQL and
  pragmas, one connection. PostgreSQL: binary ``COPY`` into pool_samples and page_events, and
  requests through the collector's staging table + ``INSERT .. SELECT .. ON CONFLICT`` upsert
  (a request's admitted and finished events may fall in different batches, so its row is
  upserted, as the collector does), with as many connections as there are clients.

The ratio is http / raw. Decode-only throughput (``decode_json_batch`` on one core) is
reported as context. The last line printed is one JSON object with the headline figures.

    python -m bench.ingest --quick
    python -m bench.ingest [--events N] [--batch N] [--clients N] [--probes N] [--skip-postgres]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BenchError,
    bench_main,
    cpu_seconds,
    finished,
    ingest_token,
    load_at_start,
    pct,
    run_parallel,
)
from collector import migrate
from collector.db import Database
from collector.store import IngestStore, Rows, shape_rows
from engine_probe import events as ev

GOAL_SQLITE_HTTP_EVENTS_PER_S = 150_000
GOAL_MIN_RATIO = 0.6
GOAL_MAX_SHAPE_COST = 0.25  # shaping may cost at most this share of decoding's time
AA_TOLERANCE = 0.02  # the ceiling's two runs within this of each other: a quiet enough run
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"

# The workload: fixed, so every run (and every machine) sends the same bytes.
T0 = datetime(2026, 1, 1, tzinfo=UTC)
TENANTS = ("acme", "globex", "initech", "umbrella", "hooli", "stark")
TENANT_WEIGHTS = (30, 20, 15, 15, 10, 10)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ROUTE_WEIGHTS = (70, 20, 10)
STATUSES = ("completed", "length", "error", "aborted")
STATUS_WEIGHTS = (88, 8, 2, 2)
CATEGORIES: tuple[list[str], ...] = (["pii"], ["health"], ["finance", "pii"])
# (deployment_id, model_id, pool capacity in tokens)
DEPLOYMENTS = (
    ("glm-prod", "glm-5.3", 681_280),
    ("llama-prod", "llama-4-70b", 1_048_576),
    ("qwen-batch", "qwen3-32b", 262_144),
)
POOL_EVERY = 4  # one pool.sample per 4 requests
REUSE_EVERY = 50  # one page.reuse per 50 requests
EVENTS_PER_REQUEST = 2 + 1 / POOL_EVERY + 1 / REUSE_EVERY


# -- workload ----------------------------------------------------------------------------


@dataclass(slots=True)
class Batch:
    probe: int
    events: int
    body: bytes
    rows: Rows


@dataclass(slots=True)
class Expected:
    """What the database must hold after every batch is stored once."""

    events: int = 0
    requests: int = 0
    pool_samples: int = 0
    page_events: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    deployments: set[str] = field(default_factory=set)
    per_probe: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Workload:
    probes: list[str]
    batches: list[list[Batch]]  # per probe, in seq order
    expected: Expected

    def interleaved(self, probes: Sequence[int] | None = None) -> list[Batch]:
        """Batches round-robin over ``probes`` (all by default), each probe in seq order."""
        lists = [self.batches[p] for p in (range(len(self.batches)) if probes is None else probes)]
        out: list[Batch] = []
        for k in range(max((len(b) for b in lists), default=0)):
            out.extend(b[k] for b in lists if k < len(b))
        return out

    def bodies(self) -> list[bytes]:
        return [b.body for b in self.interleaved()]


@dataclass(frozen=True, slots=True)
class PolicyMix:
    """What a workload adds for the policy engine to chew on (``bench/policy_eval.py``); the
    ingest benchmark's workload has none of it.

    ``advertised``: each deployment's advertised context (in ``DEPLOYMENTS`` order); the
    first probe of each deployment opens with an ``engine.config`` reporting it and the
    deployment's pool. ``near_every``: one request in this many (per probe) gets a prompt of
    ``near_range`` times min(advertised context, pool), the bound ``context_pressure``
    measures against while nothing is verified, so that rule fires, at warning and at
    critical, instead of only evaluating."""

    advertised: tuple[int, ...]
    near_every: int = 0
    near_range: tuple[float, float] = (0.7, 1.1)
    engine: str = "sglang"
    engine_version: str = "0.5.24"


def _engine_config(
    mix: PolicyMix, index: int, probe_id: str, node: str, ts: datetime
) -> ev.EngineConfig:
    dep, model, cap = DEPLOYMENTS[index % len(DEPLOYMENTS)]
    return ev.EngineConfig(
        schema_version=1,
        probe_id=probe_id,
        seq=1,
        ts=ts,
        deployment_id=dep,
        engine=mix.engine,
        engine_version=mix.engine_version,
        model_id=model,
        node=node,
        advertised_context=mix.advertised[index % len(DEPLOYMENTS)],
        pool_capacity_tokens=cap,
        page_size=16,
        dtype="bfloat16",
        tp_size=8,
        cuda_graphs=True,
        prefix_caching=True,
        prefix_cache_salting=True,
    )


def _probe_events(
    index: int, n_requests: int, seed: int, exp: Expected, mix: PolicyMix | None = None
) -> list[ev.Event]:
    """One probe's events in seq order: requests admitted then finished a little later
    (interleaved with others), pool samples and page reuse summaries in between; with
    ``mix``, an engine.config first (one per deployment) and some near-threshold prompts.
    Without ``mix`` the events are exactly the ingest benchmark's."""
    rng = random.Random(seed * 1_000_003 + index)
    dep, model, cap = DEPLOYMENTS[index % len(DEPLOYMENTS)]
    probe_id = f"bench-probe-{index:02d}"
    node = f"node-{index // len(DEPLOYMENTS)}"
    tenants = rng.choices(TENANTS, TENANT_WEIGHTS, k=n_requests)
    routes = rng.choices(ROUTES, ROUTE_WEIGHTS, k=n_requests)
    statuses = rng.choices(STATUSES, STATUS_WEIGHTS, k=n_requests)
    prompts = [min(cap // 2, 1 + int(rng.lognormvariate(7.0, 1.2))) for _ in range(n_requests)]
    max_tokens = [rng.choice((256, 512, 1024, 4096)) for _ in range(n_requests)]
    out: list[ev.Event] = []
    if mix is not None:
        if index < len(DEPLOYMENTS):
            out.append(_engine_config(mix, index, probe_id, node, T0))
        if mix.near_every > 0:
            # Its own generator: the rest of the workload stays what it is without ``mix``.
            near = random.Random(seed * 2_000_003 + index)
            bound = min(mix.advertised[index % len(DEPLOYMENTS)], cap)
            lo, hi = mix.near_range
            for i in range(mix.near_every // 2, n_requests, mix.near_every):
                prompts[i] = int(bound * near.uniform(lo, hi))

    # (ts in µs from T0, order within one instant, request index, kind)
    timeline: list[tuple[int, int, int, str]] = []
    t = 0
    for i in range(n_requests):
        # ~100 requests/s per node, 0.2-6 s each: ~300 in flight, so a request's finished
        # event lands ~700 events after its admission (sometimes in the next batch).
        t += 1 + int(rng.expovariate(100.0) * 1e6)
        timeline.append((t, 0, i, "a"))
        timeline.append((t + int(rng.uniform(0.2, 6.0) * 1e6), 1, i, "f"))
        if i % POOL_EVERY == 0:
            timeline.append((t, 2, i, "p"))
        if i % REUSE_EVERY == REUSE_EVERY - 1:
            timeline.append((t, 3, i, "r"))
    timeline.sort()

    used = cap // 4
    step = 0
    for seq, (us, _, i, kind) in enumerate(timeline, start=len(out) + 1):
        base: dict[str, Any] = {
            "schema_version": 1,
            "probe_id": probe_id,
            "seq": seq,
            "ts": T0 + timedelta(microseconds=us),
            "deployment_id": dep,
        }
        rid = f"{probe_id}-r{i:07d}"
        if kind == "a":
            cats = CATEGORIES[i % 3] if i % 10 == 0 else []
            out.append(
                ev.RequestAdmitted(
                    **base,
                    request_id=rid,
                    tenant=tenants[i],
                    route=routes[i],
                    model_id=model,
                    prompt_tokens=prompts[i],
                    max_tokens=max_tokens[i],
                    node=node,
                    data_categories=cats,
                )
            )
        elif kind == "f":
            status = statuses[i]
            completion = (
                max_tokens[i]
                if status == "length"
                else 0
                if status == "error"
                else rng.randint(1, max_tokens[i])
            )
            exp.prompt_tokens += prompts[i]
            exp.completion_tokens += completion
            out.append(
                ev.RequestFinished(
                    **base,
                    request_id=rid,
                    tenant=tenants[i],
                    prompt_tokens=prompts[i],
                    completion_tokens=completion,
                    status=status,  # type: ignore[arg-type]
                    node=node,
                )
            )
        elif kind == "p":
            used = max(0, min(cap, used + rng.randint(-cap // 20, cap // 20)))
            out.append(
                ev.PoolSample(
                    **base, node=node, capacity_tokens=cap, used_tokens=used, free_tokens=cap - used
                )
            )
            exp.pool_samples += 1
        else:
            step += rng.randint(1, 40)
            reused = rng.randint(1, 64)
            out.append(
                ev.PageReuse(
                    **base,
                    node=node,
                    step=step,
                    reused_pages=reused,
                    cross_tenant_pages=rng.randint(0, reused // 4),
                    zeroized_pages=reused,
                )
            )
            exp.page_events += 1
    exp.requests += n_requests
    exp.events += len(out)
    exp.deployments.add(dep)
    exp.per_probe[probe_id] = len(out)
    return out


def build_workload(
    events: int, probes: int, batch: int, seed: int, mix: PolicyMix | None = None
) -> Workload:
    exp = Expected()
    per_probe_requests = max(1, round(events / (probes * EVENTS_PER_REQUEST)))
    names: list[str] = []
    batches: list[list[Batch]] = []
    for p in range(probes):
        evs = _probe_events(p, per_probe_requests, seed, exp, mix)
        names.append(evs[0].probe_id)
        mine: list[Batch] = []
        for k in range(0, len(evs), batch):
            chunk = evs[k : k + batch]
            mine.append(Batch(p, len(chunk), ev.encode_batch(chunk), shape_rows(chunk)))
        batches.append(mine)
    return Workload(names, batches, exp)


# -- decode (context) ----------------------------------------------------------------------


def bench_decode(wl: Workload, passes: int = 3) -> tuple[float, float]:
    """Events/s of ``decode_json_batch`` alone, and of decode + ``shape_rows``, on one core:
    the best of ``passes`` passes over the workload each, alternating (one pass swings with
    whatever else the machine does)."""
    bodies = wl.bodies()
    decode, both = [], []
    for _ in range(passes):
        t0 = time.perf_counter()
        for body in bodies:
            ev.decode_json_batch(body)
        t1 = time.perf_counter()
        for body in bodies:
            shape_rows(ev.decode_json_batch(body))
        t2 = time.perf_counter()
        decode.append(t1 - t0)
        both.append(t2 - t1)
    n = wl.expected.events
    return n / min(decode), n / min(both)


# -- raw ceilings --------------------------------------------------------------------------


def raw_sqlite(path: Path, wl: Workload, *, executemany: bool = True) -> float:
    """Seconds to write every batch's rows with the collector's own SQL (``IngestStore
    .write_rows``), one transaction per batch: one statement per row (sqlite3 executemany,
    the ceiling), or with ``executemany=False`` the collector's own multi-row statements."""
    migrate.upgrade(f"sqlite:///{path}")
    store = IngestStore("sqlite", sqlite_executemany=executemany)
    con = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            con.execute(f"PRAGMA {pragma}")
        order = wl.interleaved()
        t0 = time.perf_counter()
        for b in order:
            con.execute("BEGIN IMMEDIATE")
            store.write_rows(con, b.rows)
            con.execute("COMMIT")
        return time.perf_counter() - t0
    finally:
        con.close()


def raw_postgres(dsn: str, url: str, wl: Workload, clients: int) -> float:
    """Seconds to write every batch's rows with the collector's own writer
    (``IngestStore.write_rows``: binary COPY, requests via its staging table and upsert), one
    transaction per batch, from ``clients`` connections (each writes the batches of the
    probes it owns, in order)."""
    import psycopg

    migrate.upgrade(url)
    store = IngestStore("postgresql")

    def write(conn: Any, batches: list[Batch]) -> None:
        for b in batches:
            store.write_rows(conn, b.rows)
            conn.commit()

    conns = [psycopg.connect(dsn) for _ in range(clients)]
    try:
        plan = [wl.interleaved(range(i, len(wl.probes), clients)) for i in range(clients)]
        return run_parallel(
            [functools.partial(write, c, p) for c, p in zip(conns, plan, strict=True)]
        )
    finally:
        for c in conns:
            c.close()


# -- HTTP through a real collector -------------------------------------------------------


@dataclass(slots=True)
class HttpResult:
    seconds: float
    accepted: int
    duplicates: int
    gaps: int
    latencies: list[float]
    server_cpu_s: float | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _kvwatch_cmd() -> list[str]:
    script = Path(sys.executable).with_name("kvwatch")
    if script.exists():
        return [str(script)]
    found = shutil.which("kvwatch")
    return [found] if found else [sys.executable, "-m", "kvwatch.cli"]


@contextlib.contextmanager
def collector(
    url: str,
    workdir: Path,
    wl: Workload,
    batch: int,
    workers: int = 1,
    settings: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, int]]:
    """A ``kvwatch serve`` subprocess on a free port; yields (base URL, pid). Always stopped.
    ``settings``: more ``KVWATCH_*`` environment (collector settings) for it."""
    largest = max(len(b.body) for bs in wl.batches for b in bs)
    env = os.environ | {
        "KVWATCH_DATABASE_URL": url,
        "KVWATCH_MAX_BATCH_EVENTS": str(max(10_000, batch)),
        "KVWATCH_MAX_BODY_BYTES": str(max(16 << 20, 2 * largest)),
        "KVWATCH_WORKERS": str(workers),
        **(settings or {}),
    }
    port = _free_port()
    log_path = workdir / f"collector-{port}.log"
    cmd = [*_kvwatch_cmd(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--database-url", url]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise BenchError(f"collector exited ({proc.returncode}):\n{_tail(log_path)}")
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"collector not ready after 60 s:\n{_tail(log_path)}")
            time.sleep(0.1)
        yield base, proc.pid
    except BaseException:
        print(f"collector log (tail):\n{_tail(log_path)}", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """With ``out``, sample the collector with py-spy (collapsed stacks) while the body runs."""
    if out is None:
        yield
        return
    exe = Path(sys.executable).with_name("py-spy")
    found = str(exe) if exe.exists() else shutil.which("py-spy")
    if found is None:
        raise BenchError("--profile needs py-spy (pip install py-spy)")
    cmd = [found, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "-o", str(out)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # let it attach
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        if not out.exists():
            print(f"warning: py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
        else:
            print(f"  collector profile (py-spy, collapsed stacks): {out}")


def ingest_client(base: str, token: str, headers: Mapping[str, str] | None = None) -> httpx.Client:
    """An HTTP client for ``POST /v1/events`` with an ingest token; ``headers`` replace or
    add to its own (another content type, a content encoding)."""
    return httpx.Client(
        base_url=base,
        headers={
            "authorization": f"Bearer {token}",
            "content-type": "application/json",
            **(headers or {}),
        },
        timeout=httpx.Timeout(300.0),
    )


@dataclass(slots=True)
class Sender:
    """Posts batches to a collector (to ``path``) from client threads and tallies its
    answers. Any failure raises ``BenchError`` and stops the other threads sharing this
    sender."""

    accepted: int = 0
    duplicates: int = 0
    gaps: int = 0
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abort: threading.Event = field(default_factory=threading.Event)
    path: str = "/v1/events"

    def answer(self, r: httpx.Response, b: Batch) -> tuple[int, int, int]:
        """(accepted, duplicates, gaps) from a 200 answer to batch ``b``."""
        body = r.json()
        return body["accepted"], body["duplicates"], len(body["gaps"])

    def send(self, client: httpx.Client, batches: Sequence[Batch]) -> None:
        acc = dup = gaps = 0
        lat: list[float] = []
        for b in batches:
            if self.abort.is_set():
                return
            t = time.perf_counter()
            try:
                r = client.post(self.path, content=b.body)
            except httpx.HTTPError as exc:
                self.abort.set()
                raise BenchError(f"POST {self.path} failed: {exc!r}") from exc
            lat.append(time.perf_counter() - t)
            if r.status_code != 200:
                self.abort.set()
                raise BenchError(f"POST {self.path} -> {r.status_code}: {r.text[:2000]}")
            a, d, g = self.answer(r, b)
            acc += a
            dup += d
            gaps += g
        with self.lock:
            self.accepted += acc
            self.duplicates += dup
            self.gaps += gaps
            self.latencies.extend(lat)


def http_ingest(
    url: str,
    workdir: Path,
    wl: Workload,
    batch: int,
    clients: int,
    profile: Path | None = None,
    workers: int = 1,
) -> HttpResult:
    token = ingest_token(url)
    with collector(url, workdir, wl, batch, workers) as (base, pid):
        print(f"  collector pid {pid} at {base}", flush=True)
        plan = [wl.interleaved(range(i, len(wl.probes), clients)) for i in range(clients)]
        sender = Sender()
        http_clients = [ingest_client(base, token) for _ in range(clients)]
        try:
            for c in http_clients:  # open every connection before the clock starts
                c.get("/readyz").raise_for_status()
            with _py_spy(pid, profile):
                cpu0 = cpu_seconds(pid)
                seconds = run_parallel(
                    [
                        functools.partial(sender.send, c, p)
                        for c, p in zip(http_clients, plan, strict=True)
                    ]
                )
                cpu1 = cpu_seconds(pid)
        finally:
            for c in http_clients:
                c.close()
    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return HttpResult(
        seconds, sender.accepted, sender.duplicates, sender.gaps, sender.latencies, cpu
    )


# -- verification --------------------------------------------------------------------------


def verify(url: str, wl: Workload, *, bookkeeping: bool, label: str) -> None:
    """Fail loudly unless the database holds exactly the workload, once."""
    exp = wl.expected
    db = Database(url)
    try:
        with db.read() as conn:

            def one(sql: str) -> Any:
                return conn.exec_driver_sql(sql).scalar()

            got: dict[str, Any] = {
                "requests": one("SELECT COUNT(*) FROM requests"),
                "requests still admitted": one(
                    "SELECT COUNT(*) FROM requests WHERE status = 'admitted'"
                ),
                "requests without route": one(
                    "SELECT COUNT(*) FROM requests WHERE route IS NULL OR model_id IS NULL"
                ),
                "sum(prompt_tokens)": one("SELECT COALESCE(SUM(prompt_tokens), 0) FROM requests"),
                "sum(completion_tokens)": one(
                    "SELECT COALESCE(SUM(completion_tokens), 0) FROM requests"
                ),
                "pool_samples": one("SELECT COUNT(*) FROM pool_samples"),
                "distinct pool (probe_id, seq)": one(
                    "SELECT COUNT(*) FROM (SELECT DISTINCT probe_id, seq FROM pool_samples) x"
                ),
                "page_events": one("SELECT COUNT(*) FROM page_events"),
                "distinct page (probe_id, seq)": one(
                    "SELECT COUNT(*) FROM (SELECT DISTINCT probe_id, seq FROM page_events) x"
                ),
                "deployments": one("SELECT COUNT(*) FROM deployments"),
            }
            want: dict[str, Any] = {
                "requests": exp.requests,
                "requests still admitted": 0,
                "requests without route": 0,
                "sum(prompt_tokens)": exp.prompt_tokens,
                "sum(completion_tokens)": exp.completion_tokens,
                "pool_samples": exp.pool_samples,
                "distinct pool (probe_id, seq)": exp.pool_samples,
                "page_events": exp.page_events,
                "distinct page (probe_id, seq)": exp.page_events,
                "deployments": len(exp.deployments),
            }
            if bookkeeping:
                probes = {
                    r[0]: tuple(r[1:])
                    for r in conn.exec_driver_sql(
                        "SELECT probe_id, max_seq, accepted, duplicates FROM probes"
                    )
                }
                got["probes"] = probes
                want["probes"] = {p: (n, n, 0) for p, n in exp.per_probe.items()}
                got["seq_gaps"] = one("SELECT COUNT(*) FROM seq_gaps")
                want["seq_gaps"] = 0
    finally:
        db.dispose()
    bad = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if bad:
        lines = "\n".join(f"    {k}: stored {g!r}, expected {w!r}" for k, (g, w) in bad.items())
        raise BenchError(f"{label}: the database does not hold the workload exactly once:\n{lines}")


# -- PostgreSQL databases ------------------------------------------------------------------


@dataclass(slots=True)
class PgServer:
    admin_url: str
    created: list[str] = field(default_factory=list)

    def _admin(self) -> Any:
        import psycopg

        return psycopg.connect(self._conninfo(), autocommit=True, connect_timeout=5)

    def _conninfo(self, dbname: str | None = None) -> str:
        from psycopg.conninfo import make_conninfo

        raw = self.admin_url.replace("postgresql+psycopg://", "postgresql://", 1)
        return make_conninfo(raw, dbname=dbname) if dbname else make_conninfo(raw)

    def reachable(self) -> str | None:
        """None when usable, else why not."""
        try:
            with self._admin() as c:
                c.execute("SELECT 1")
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        return None

    def create(self, tag: str, template: str | None = None) -> tuple[str, str]:
        """A fresh database (a copy of the database at SQLAlchemy URL ``template``, which
        nothing may be connected to); returns (psycopg conninfo, SQLAlchemy URL)."""
        from sqlalchemy.engine import make_url

        name = f"kvwatch_bench_{tag}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        copy = "" if template is None else f' TEMPLATE "{make_url(template).database}"'
        with self._admin() as c:
            c.execute(f'CREATE DATABASE "{name}"{copy}')
        self.created.append(name)
        sa_url = make_url(self.admin_url).set(drivername="postgresql+psycopg", database=name)
        return self._conninfo(name), sa_url.render_as_string(hide_password=False)

    def drop_all(self) -> None:
        while self.created:
            name = self.created.pop()
            try:
                with self._admin() as c:
                    c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            except Exception as exc:  # report, keep cleaning
                print(f"warning: could not drop database {name}: {exc}", file=sys.stderr)


def add_pg_url(p: argparse.ArgumentParser) -> None:
    """``--pg-url``: the PostgreSQL server the benchmarks create throwaway databases on."""
    p.add_argument(
        "--pg-url",
        default=os.environ.get("KVWATCH_BENCH_PG_URL", DEFAULT_PG_URL),
        help="an existing PostgreSQL database to connect to for creating and dropping "
        f"throwaway ones (default {DEFAULT_PG_URL}, env KVWATCH_BENCH_PG_URL)",
    )


# -- driver ----------------------------------------------------------------------------------


def _backend_result(
    name: str, n: int, http: HttpResult, raw_runs: Sequence[float], raw_note: str
) -> dict[str, Any]:
    """``raw_runs``: the ceiling's two runs, one before the http run and one after: their
    mean is the ceiling, their ratio the run's A/A (how far the same work drifted)."""
    raw_s = sum(raw_runs) / len(raw_runs)
    aa = raw_runs[0] / raw_runs[1]
    http_rate = n / http.seconds
    raw_rate = n / raw_s
    ratio = http_rate / raw_rate
    cpu = "" if http.server_cpu_s is None else f", collector CPU {http.server_cpu_s:.2f} s"
    print(
        f"  {name} http: {http_rate:>10,.0f} events/s ({http.seconds:.2f} s; batch latency "
        f"p50 {pct(http.latencies, 0.5) * 1e3:.0f} ms, p99 {pct(http.latencies, 0.99) * 1e3:.0f}"
        f" ms{cpu})"
    )
    print(
        f"  {name} raw:  {raw_rate:>10,.0f} events/s ({raw_s:.2f} s, the mean of "
        f"{' and '.join(f'{r:.2f}' for r in raw_runs)}: A/A {aa:.3f}; {raw_note})"
    )
    print(f"  {name} ratio http/raw: {ratio:.3f}", flush=True)
    out: dict[str, Any] = {
        "http_events_per_s": round(http_rate),
        "raw_events_per_s": round(raw_rate),
        "ratio": round(ratio, 4),
        "http_s": round(http.seconds, 3),
        "raw_s": round(raw_s, 3),
        "batch_latency_p50_ms": round(pct(http.latencies, 0.5) * 1e3, 1),
        "batch_latency_p99_ms": round(pct(http.latencies, 0.99) * 1e3, 1),
        "raw_method": raw_note,
        "raw_aa_ratio": round(aa, 4),
        "raw_aa_within_2pct": abs(aa - 1) <= AA_TOLERANCE,
    }
    if http.server_cpu_s is not None:
        out["collector_cpu_s"] = round(http.server_cpu_s, 2)
    return out


def _check_http(http: HttpResult, wl: Workload, label: str) -> None:
    if (http.accepted, http.duplicates, http.gaps) != (wl.expected.events, 0, 0):
        raise BenchError(
            f"{label}: collector answered accepted={http.accepted} duplicates={http.duplicates} "
            f"gaps={http.gaps}; expected accepted={wl.expected.events}, no duplicates, no gaps"
        )


def _prof(args: argparse.Namespace, backend: str) -> Path | None:
    if args.profile is None:
        return None
    args.profile.mkdir(parents=True, exist_ok=True)
    return Path(args.profile).resolve() / f"collector-{backend}.txt"


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    load0 = load_at_start()
    wl = build_workload(args.events, args.probes, args.batch, args.seed)
    # The workload is a large, long-lived heap: keep the collector of cycles off it, so it
    # does not tax the decode timing and the client threads.
    gc.collect()
    gc.freeze()
    exp = wl.expected
    n_batches = sum(len(b) for b in wl.batches)
    mib = sum(len(b.body) for bs in wl.batches for b in bs) / (1 << 20)
    print(
        f"workload: {exp.events:,} events ({exp.requests:,} requests admitted+finished, "
        f"{exp.pool_samples:,} pool.sample, {exp.page_events:,} page.reuse) from "
        f"{len(wl.probes)} probes; {n_batches} batches of <= {args.batch}, {mib:.1f} MiB JSON; "
        f"built in {time.perf_counter() - t_start:.1f} s",
        flush=True,
    )
    decode_rate, decode_shape_rate = bench_decode(wl)
    shape_cost = decode_rate / decode_shape_rate - 1  # shaping's time over decoding's
    print(
        f"decode only (1 core): {decode_rate:,.0f} events/s; decode + shape_rows: "
        f"{decode_shape_rate:,.0f} events/s (shaping costs {shape_cost:.0%} of decoding)",
        flush=True,
    )
    result: dict[str, Any] = {
        "bench": "ingest",
        "quick": args.quick,
        "events": exp.events,
        "requests": exp.requests,
        "batch": args.batch,
        "clients": args.clients,
        "workers": args.workers,
        "probes": args.probes,
        "decode_events_per_s": round(decode_rate),
        "decode_shape_events_per_s": round(decode_shape_rate),
        "shape_cost_of_decode": round(shape_cost, 3),
    }

    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-ingest-"))
    pg = PgServer(args.pg_url)
    try:
        print("sqlite:", flush=True)
        raw_s = raw_sqlite(workdir / "raw.db", wl)
        verify(f"sqlite:///{workdir / 'raw.db'}", wl, bookkeeping=False, label="sqlite raw")
        url = f"sqlite:///{workdir / 'http.db'}"
        http = http_ingest(
            url, workdir, wl, args.batch, args.clients, _prof(args, "sqlite"), args.workers
        )
        _check_http(http, wl, "sqlite http")
        verify(url, wl, bookkeeping=True, label="sqlite http")
        raw2_s = raw_sqlite(workdir / "raw2.db", wl)
        result["sqlite"] = _backend_result(
            "sqlite",
            exp.events,
            http,
            (raw_s, raw2_s),
            "executemany, WAL, synchronous=NORMAL, 1 conn",
        )
        # Context: the collector's own writer (multi-row statements) with nothing around it.
        multi_s = raw_sqlite(workdir / "raw3.db", wl, executemany=False)
        result["sqlite"]["raw_multirow_events_per_s"] = round(exp.events / multi_s)
        print(
            f"  sqlite raw, the collector's multi-row statements: "
            f"{exp.events / multi_s:,.0f} events/s ({multi_s:.2f} s)",
            flush=True,
        )

        why = "skipped (--skip-postgres)" if args.skip_postgres else None
        if why is None and (err := pg.reachable()) is not None:
            why = f"skipped: PostgreSQL unreachable at {args.pg_url} ({err})"
        if why is not None:
            print(f"postgresql: {why}", flush=True)
            result["postgresql"] = {"skipped": why}
        else:
            print("postgresql:", flush=True)
            dsn, raw_url = pg.create("raw")
            raw_s = raw_postgres(dsn, raw_url, wl, args.clients)
            verify(raw_url, wl, bookkeeping=False, label="postgresql raw")
            _, http_url = pg.create("http")
            http = http_ingest(
                http_url,
                workdir,
                wl,
                args.batch,
                args.clients,
                _prof(args, "postgresql"),
                args.workers,
            )
            _check_http(http, wl, "postgresql http")
            verify(http_url, wl, bookkeeping=True, label="postgresql http")
            dsn2, raw2_url = pg.create("raw2")
            raw2_s = raw_postgres(dsn2, raw2_url, wl, args.clients)
            result["postgresql"] = _backend_result(
                "postgresql",
                exp.events,
                http,
                (raw_s, raw2_s),
                f"binary COPY; requests via staging table + upsert; {args.clients} conns",
            )
    finally:
        pg.drop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    sq = result["sqlite"]
    pgr = result["postgresql"]
    result["goal"] = {
        "sqlite_http_events_per_s": GOAL_SQLITE_HTTP_EVENTS_PER_S,
        "min_ratio": GOAL_MIN_RATIO,
        "max_shape_cost_of_decode": GOAL_MAX_SHAPE_COST,
    }
    result["met"] = {
        "sqlite_http_events_per_s": sq["http_events_per_s"] >= GOAL_SQLITE_HTTP_EVENTS_PER_S,
        "sqlite_ratio": sq["ratio"] >= GOAL_MIN_RATIO,
        "postgresql_ratio": None if "skipped" in pgr else pgr["ratio"] >= GOAL_MIN_RATIO,
        "shape_cost_of_decode": shape_cost <= GOAL_MAX_SHAPE_COST,
    }
    return finished(result, load0, t_start)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small workload (under a minute)")
    p.add_argument("--events", type=int, help="events in the workload (default 1,000,000)")
    p.add_argument("--batch", type=int, default=5000, help="events per POST (default 5000)")
    p.add_argument("--clients", type=int, default=4, help="concurrent connections (default 4)")
    p.add_argument("--probes", type=int, default=8, help="probes (default 8)")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--skip-postgres", action="store_true", help="SQLite only")
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample the collector with py-spy while it ingests; collapsed stacks to DIR "
        "(the sampling costs the collector some CPU: figures are then indicative only)",
    )
    add_pg_url(p)
    p.add_argument("--workers", type=int, default=1, help="collector processes (default 1)")
    args = p.parse_args(argv)
    if args.events is None:
        args.events = 150_000 if args.quick else 1_000_000
    for name in ("events", "batch", "clients", "probes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    args.clients = min(args.clients, args.probes)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("ingest", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
