"""Ingest bus benchmark: the same events stored through direct ingest and through the ingest
bus (NATS JetStream, ``kvwatch serve --bus`` + ``kvwatch writer``), end to end, and the time
from an alerting batch's send to its webhook.

For each backend (SQLite, then PostgreSQL when reachable), in one run, on one local 3-node
NATS cluster (``kvwatch.bus_cluster.LocalCluster``), each case on a fresh database:

* **direct**: ``kvwatch serve`` without a bus (the ceiling), run first and again last
  (``direct_b``: their ratio is the run's A/A);
* **bus_1_writer** and **bus_2_writers**: ``kvwatch serve`` with ``KVWATCH_BUS_URL`` set, a
  fresh stream per case (``KVWATCH_BUS_PARTITIONS`` partitions: the workload's deployments
  fall on more than one), and 1 or 2 ``kvwatch writer`` processes.

The workload is ``bench.ingest``'s, sent as it sends it (clients owning whole probes). Beside
it, one client sends an *alert batch* every ``--alert-every`` seconds: a new deployment's
``engine.config`` and one request whose prompt exceeds its advertised context, which the
default pack's ``context_pressure`` rule fires on at ingest; a webhook endpoint registered in
the database points at a receiver in this process. Throughput runs from the first send until
the database's ``probes.accepted`` reach every event sent; latency from an alert batch's send
until the webhook for its deployment arrives. The stored rows are then checked
(``bench.ingest.verify``): anything missing or doubled fails the run.

    python -m bench.bus --quick
    python -m bench.bus [--events N] [--batch N] [--clients N] [--probes N] [--skip-postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from bench.common import (
    BenchError,
    bench_main,
    cpu_seconds,
    entered_together,
    finished,
    ingest_token,
    load_at_start,
    pct,
    run_parallel,
)
from bench.ingest import (
    Batch,
    HttpResult,
    PgServer,
    Sender,
    Workload,
    _check_http,
    _kvwatch_cmd,
    _tail,
    add_pg_url,
    build_workload,
    collector,
    ingest_client,
    verify,
)
from collector.db import Database
from collector.store import shape_rows
from engine_probe import events as ev

GOAL_MIN_BUS_RATIO = 0.8  # bus events/s (stored) against direct ingest's
GOAL_WEBHOOK_P99_S = 2.0  # an alerting batch's send to its webhook
PARTITIONS = 2  # the workload's 3 deployments fall on both (bench.ingest.DEPLOYMENTS)
POLL_S = 0.05  # how often the stored count is read
STORE_TIMEOUT_S = 120.0  # every event stored within this after the last answer, or fail
WEBHOOK_TIMEOUT_S = 60.0  # every alert's webhook within this after the last store, or fail

# Alert batches: a new deployment each (a notification group is (alertname, deployment_id):
# a second prompt on a firing deployment notifies nothing), a prompt above its context.
ALERT_MODEL = "bench-alert-model"
ALERT_CONTEXT = 8192
ALERT_PROMPT = 9000  # > 1.0 x the context: context_pressure at critical
ALERT_COMPLETION = 16
ALERT_RULE = "context_pressure"
ALERT_EVENTS = 3  # per alert batch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    writers: int  # 0: direct ingest, no bus


CASES = (
    Case("direct", 0),
    Case("bus_1_writer", 1),
    Case("bus_2_writers", 2),
    Case("direct_b", 0),
)


# -- alert batches -------------------------------------------------------------------------


def alert_batches(first_probe: int, n: int, now: datetime) -> list[Batch]:
    """``n`` one-batch probes, each a new deployment: its engine.config, then one request
    whose prompt is over the advertised context (``context_pressure`` fires, critical)."""
    out = []
    for k in range(n):
        name = f"bench-alert-{k:04d}"
        base: dict[str, Any] = {
            "schema_version": 1,
            "probe_id": name,
            "deployment_id": name,
        }
        base["ts"] = now + timedelta(milliseconds=k)
        request: dict[str, Any] = {
            **base,
            "request_id": f"{name}-r0",
            "tenant": "acme",
            "prompt_tokens": ALERT_PROMPT,
            "node": "bench-alert-node",
        }
        evs: list[ev.Event] = [
            ev.EngineConfig(
                **base,
                seq=1,
                engine="sglang",
                engine_version="0.5.24",
                model_id=ALERT_MODEL,
                node="bench-alert-node",
                advertised_context=ALERT_CONTEXT,
                pool_capacity_tokens=16 * ALERT_CONTEXT,
                page_size=16,
                dtype="bfloat16",
            ),
            ev.RequestAdmitted(
                **request,
                seq=2,
                route="/v1/chat/completions",
                model_id=ALERT_MODEL,
                max_tokens=256,
            ),
            ev.RequestFinished(
                **request, seq=3, completion_tokens=ALERT_COMPLETION, status="completed"
            ),
        ]
        out.append(Batch(first_probe + k, len(evs), ev.encode_batch(evs), shape_rows(evs)))
    return out


def with_alerts(wl: Workload, alerts: Sequence[Batch]) -> Workload:
    """``wl`` and the alert batches sent: what the database must then hold."""
    exp = replace(
        wl.expected,
        deployments=set(wl.expected.deployments),
        per_probe=dict(wl.expected.per_probe),
    )
    names = []
    for b in alerts:
        name = f"bench-alert-{b.probe - len(wl.probes):04d}"
        names.append(name)
        exp.events += b.events
        exp.requests += 1
        exp.prompt_tokens += ALERT_PROMPT
        exp.completion_tokens += ALERT_COMPLETION
        exp.deployments.add(name)
        exp.per_probe[name] = b.events
    return Workload([*wl.probes, *names], [*wl.batches, *([b] for b in alerts)], exp)


# -- the webhook receiver ------------------------------------------------------------------


class Receiver:
    """A webhook receiver on 127.0.0.1 in this process: the ``time.perf_counter`` at which
    the first ``alert.firing`` of ``ALERT_RULE`` arrived, per deployment."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.deliveries = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                at = time.perf_counter()
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(204)
                self.end_headers()
                receiver.received(at, body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def received(self, at: float, body: bytes) -> None:
        try:
            doc = json.loads(body)
        except ValueError:
            return
        with self.lock:
            self.deliveries += 1
            if doc.get("type") != "alert.firing":
                return
            for a in doc.get("alerts", []):
                dep = (a.get("labels") or {}).get("deployment_id")
                if a.get("rule") == ALERT_RULE and dep and dep not in self.first:
                    self.first[dep] = at

    def reset(self) -> None:
        with self.lock:
            self.first.clear()
            self.deliveries = 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def add_webhook(url: str, receiver: Receiver) -> None:
    from collector.notify.outbox import add_endpoint

    db = Database(url)
    try:
        with db.write() as conn:
            add_endpoint(conn, "bench-receiver", receiver.url, now_us=int(time.time() * 1e6))
    finally:
        db.dispose()


# -- writers and the stream ----------------------------------------------------------------


@contextlib.contextmanager
def writers(n: int, url: str, workdir: Path, settings: Mapping[str, str]) -> Iterator[list[int]]:
    """``n`` ``kvwatch writer`` subprocesses, each serving every partition; yields their
    pids once each has bound its consumers. Always stopped (SIGTERM, then SIGKILL)."""
    env = os.environ | {"KVWATCH_DATABASE_URL": url, **settings}
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for _ in range(n):
            log_path = workdir / f"writer-{uuid.uuid4().hex[:8]}.log"
            with open(log_path, "wb") as log:
                cmd = [*_kvwatch_cmd(), "writer", "--database-url", url]
                procs.append(
                    (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log_path)
                )
        deadline = time.monotonic() + 60
        for proc, log_path in procs:
            while "writer: stream" not in log_path.read_text(errors="replace"):
                if proc.poll() is not None:
                    raise BenchError(f"writer exited ({proc.returncode}):\n{_tail(log_path)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"writer not ready after 60 s:\n{_tail(log_path)}")
                time.sleep(0.1)
        yield [p.pid for p, _ in procs]
    except BaseException:
        for _, log_path in procs:
            print(f"writer log (tail):\n{_tail(log_path)}", file=sys.stderr)
        raise
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _on_bus(bus_url: str, what: Callable[[Any], Awaitable[T]]) -> T:
    """``what(nats connection)`` on a connection of its own."""
    import nats

    async def go() -> T:
        nc = await nats.connect(servers=bus_url.split(","), connect_timeout=5)
        try:
            return await what(nc)
        finally:
            await nc.close()

    return asyncio.run(go())


def max_payload(bus_url: str) -> int:
    """The largest message the servers take (nats-server's ``max_payload``, 1 MiB unless
    configured): a larger batch is refused by the bus."""

    async def read(nc: Any) -> int:
        return int(nc.max_payload)

    return _on_bus(bus_url, read)


def delete_stream(bus_url: str, stream: str) -> None:
    """Drop a case's stream (its file store reservation with it); best effort."""

    async def delete(nc: Any) -> None:
        await nc.jetstream(timeout=10).delete_stream(stream)

    try:
        _on_bus(bus_url, delete)
    except Exception as exc:
        print(f"warning: could not delete stream {stream}: {exc!r}", file=sys.stderr)


# -- one case ------------------------------------------------------------------------------


@dataclass(slots=True)
class CaseResult:
    events: int  # the workload's
    stored_s: float  # first send to every event of the workload stored
    answered_s: float  # first send to the workload's last answer
    setup_s: float  # the case's database, collector and writers up
    alerts_sent: int
    alerts_under_load: int  # sent before the workload was all stored
    alert_latencies: list[float]
    batch_latencies: list[float]
    answers: HttpResult  # the collector's answers, totalled
    cpu_s: dict[str, float] = field(default_factory=dict)


def stored_count(db: Database) -> int:
    with db.read() as conn:
        return int(
            conn.exec_driver_sql("SELECT COALESCE(SUM(accepted), 0) FROM probes").scalar() or 0
        )


def run_case(
    case: Case,
    url: str,
    token: str,
    workdir: Path,
    wl: Workload,
    alerts: Sequence[Batch],
    args: argparse.Namespace,
    receiver: Receiver,
    bus_url: str,
    nats_pids: Sequence[int],
) -> CaseResult:
    t_case = time.perf_counter()
    receiver.reset()
    total_bytes = sum(len(b.body) for bs in wl.batches for b in bs)
    # every alert batch names a new deployment (and so a new model of it)
    room = str(len(alerts) + 100)
    settings = {
        "KVWATCH_MAX_NEW_DEPLOYMENTS_PER_HOUR": room,
        "KVWATCH_MAX_NEW_MODELS_PER_HOUR": room,
    }
    stream = ""
    if case.writers:
        tag = uuid.uuid4().hex[:10]
        stream = f"KVWATCH_BENCH_{case.name.upper()}_{tag}"
        settings |= {
            "KVWATCH_BUS_URL": bus_url,
            "KVWATCH_BUS_STREAM": stream,
            "KVWATCH_BUS_SUBJECT": f"kvwatch.bench.{tag}",
            "KVWATCH_BUS_PARTITIONS": str(args.partitions),
            # room for the whole workload unwritten: the run measures, never spools
            "KVWATCH_BUS_MAX_BYTES": str(max(64 << 20, 2 * total_bytes)),
        }
    try:
        # started together, as a deployment's collectors and writers are: both make sure
        # of the stream and its consumers
        procs: list[contextlib.AbstractContextManager[Any]] = [
            collector(url, workdir, wl, args.batch, 1, settings),
            writers(case.writers, url, workdir, settings),
        ]
        with entered_together(procs) as ((base, pid), writer_pids):
            return _send_and_wait(
                t_case, base, pid, writer_pids, nats_pids, token, url, wl, alerts, args, receiver
            )
    finally:
        if stream:
            delete_stream(bus_url, stream)


def _send_and_wait(
    t_case: float,
    base: str,
    pid: int,
    writer_pids: Sequence[int],
    nats_pids: Sequence[int],
    token: str,
    url: str,
    wl: Workload,
    alerts: Sequence[Batch],
    args: argparse.Namespace,
    receiver: Receiver,
) -> CaseResult:
    clients = args.clients
    plan = [wl.interleaved(range(i, len(wl.probes), clients)) for i in range(clients)]
    sender = Sender()
    http_clients = [ingest_client(base, token) for _ in range(clients + 1)]
    sent_at: dict[str, float] = {}  # alert deployment -> its batch's send time
    under_load = 0
    starts: list[float] = []
    answered: list[float] = []
    all_answered = threading.Event()
    workload_stored = threading.Event()
    stored_at: list[float] = []
    alerts_done = threading.Event()
    db = Database(url)

    def main_job(client: Any, batches: list[Batch]) -> None:
        starts.append(time.perf_counter())
        try:
            sender.send(client, batches)
        finally:
            answered.append(time.perf_counter())
            if len(answered) == clients:
                all_answered.set()

    def alert_job() -> None:
        # one every --alert-every s until the workload is stored, at least --min-alerts
        nonlocal under_load
        client = http_clients[-1]
        try:
            for k, b in enumerate(alerts):
                if sender.abort.is_set() or (workload_stored.is_set() and k >= args.min_alerts):
                    return
                name = f"bench-alert-{k:04d}"
                sent_at[name] = time.perf_counter()
                under_load += not workload_stored.is_set()
                sender.send(client, [b])
                time.sleep(max(0.0, sent_at[name] + args.alert_every - time.perf_counter()))
        finally:
            alerts_done.set()

    def poll_job() -> None:
        # Stored alert batches count in probes.accepted too: stored >= the workload and
        # every alert sent so far means the workload is all stored.
        deadline: float | None = None
        while not sender.abort.is_set():
            if all_answered.is_set():
                deadline = deadline or time.perf_counter() + STORE_TIMEOUT_S
                done = alerts_done.is_set()
                want = wl.expected.events + ALERT_EVENTS * len(sent_at)
                got = stored_count(db)
                if got >= want:
                    if not workload_stored.is_set():
                        stored_at.append(time.perf_counter())
                        workload_stored.set()
                    if done:
                        return
                if time.perf_counter() > deadline:
                    sender.abort.set()
                    raise BenchError(f"{got:,} of {want:,} events stored {STORE_TIMEOUT_S:g} s on")
            time.sleep(POLL_S)

    pids = {"collector": [pid], "writers": list(writer_pids), "nats": list(nats_pids)}
    try:
        for c in http_clients:  # open every connection before the clock starts
            c.get("/readyz").raise_for_status()
        gc.collect()
        cpu0 = {k: [cpu_seconds(p) for p in v] for k, v in pids.items()}
        jobs: list[Callable[[], None]] = [
            functools.partial(main_job, c, p)
            for c, p in zip(http_clients[:clients], plan, strict=True)
        ]
        run_parallel([*jobs, alert_job, poll_job])
        cpu1 = {k: [cpu_seconds(p) for p in v] for k, v in pids.items()}
        t0 = min(starts)
        answered_s = max(answered) - t0
        stored_s = stored_at[0] - t0
        deadline = time.monotonic() + WEBHOOK_TIMEOUT_S
        while set(sent_at) - set(receiver.first) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    finally:
        for c in http_clients:
            c.close()
        db.dispose()
    missing = sorted(set(sent_at) - set(receiver.first))
    if missing:
        raise BenchError(
            f"no webhook for {len(missing)} of {len(sent_at)} alert batches within "
            f"{WEBHOOK_TIMEOUT_S:g} s of the last store (first: {missing[0]}; "
            f"{receiver.deliveries} deliveries in all)"
        )
    cpu = {
        k: sum(
            b - a for a, b in zip(cpu0[k], cpu1[k], strict=True) if a is not None and b is not None
        )
        for k in pids
        if pids[k]
    }
    return CaseResult(
        events=wl.expected.events,
        stored_s=stored_s,
        setup_s=t0 - t_case,
        answered_s=answered_s,
        alerts_sent=len(sent_at),
        alerts_under_load=under_load,
        alert_latencies=[receiver.first[d] - t for d, t in sent_at.items()],
        batch_latencies=sender.latencies,
        answers=HttpResult(
            stored_s, sender.accepted, sender.duplicates, sender.gaps, sender.latencies, None
        ),
        cpu_s=cpu,
    )


def check_case(
    res: CaseResult, url: str, wl: Workload, alerts: Sequence[Batch], label: str
) -> None:
    """Every answer as expected, and the database holds the workload and the alert batches
    sent, each exactly once."""
    done = with_alerts(wl, alerts[: res.alerts_sent])
    _check_http(res.answers, done, label)
    verify(url, done, bookkeeping=True, label=label)


# -- driver ----------------------------------------------------------------------------------


def case_summary(name: str, res: CaseResult) -> dict[str, Any]:
    rate = res.events / res.stored_s
    lat = res.alert_latencies
    out = {
        "events_per_s": round(rate),
        "stored_s": round(res.stored_s, 3),
        "setup_s": round(res.setup_s, 1),
        "answered_events_per_s": round(res.events / res.answered_s),
        "batch_latency_p50_ms": round(pct(res.batch_latencies, 0.5) * 1e3, 1),
        "batch_latency_p99_ms": round(pct(res.batch_latencies, 0.99) * 1e3, 1),
        "alerts": res.alerts_sent,
        "alerts_under_load": res.alerts_under_load,
        "webhook_p50_s": round(pct(lat, 0.5), 3),
        "webhook_p99_s": round(pct(lat, 0.99), 3),
        "webhook_max_s": round(max(lat, default=0.0), 3),
        "cpu_s": {k: round(v, 2) for k, v in res.cpu_s.items()},
    }
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in res.cpu_s.items())
    print(
        f"  {name:<14} {rate:>9,.0f} events/s stored ({res.stored_s:.2f} s; answered in "
        f"{res.answered_s:.2f} s, batch p50/p99 {out['batch_latency_p50_ms']:.0f}/"
        f"{out['batch_latency_p99_ms']:.0f} ms); webhook p50 {out['webhook_p50_s']:.2f} s, "
        f"p99 {out['webhook_p99_s']:.2f} s over {res.alerts_sent} alerts "
        f"({res.alerts_under_load} under load); CPU s: {cpu}; set up in {res.setup_s:.1f} s",
        flush=True,
    )
    return out


def run_backend(
    name: str,
    new_db: Callable[[str, str | None], str],
    workdir: Path,
    wl: Workload,
    alerts: Sequence[Batch],
    args: argparse.Namespace,
    receiver: Receiver,
    bus_url: str,
    nats_pids: Sequence[int],
) -> dict[str, Any]:
    """``new_db(tag, template)``: a fresh database's URL (a copy of ``template``'s when given).
    Every case's database is a copy of one migrated once, with the token and the webhook."""
    print(f"{name}:", flush=True)
    template = new_db("template", None)
    token = ingest_token(template)
    add_webhook(template, receiver)
    out: dict[str, Any] = {}
    for case in CASES:
        url = new_db(case.name, template)
        res = run_case(case, url, token, workdir, wl, alerts, args, receiver, bus_url, nats_pids)
        check_case(res, url, wl, alerts, f"{name} {case.name}")
        out[case.name] = case_summary(case.name, res)
    direct = (out["direct"]["events_per_s"] + out["direct_b"]["events_per_s"]) / 2
    out["direct_mean_events_per_s"] = round(direct)
    out["direct_aa_ratio"] = round(
        out["direct"]["events_per_s"] / out["direct_b"]["events_per_s"], 4
    )
    for case in CASES:
        if case.writers:
            out[f"ratio_{case.name}"] = round(out[case.name]["events_per_s"] / direct, 4)
    out["writers_2_over_1"] = round(
        out["bus_2_writers"]["events_per_s"] / out["bus_1_writer"]["events_per_s"], 4
    )
    out["webhook_p99_s"] = max(out[c.name]["webhook_p99_s"] for c in CASES if c.writers)
    print(
        f"  {name}: bus/direct {out['ratio_bus_1_writer']:.3f} (1 writer), "
        f"{out['ratio_bus_2_writers']:.3f} (2 writers); direct A/A {out['direct_aa_ratio']:.3f}; "
        f"bus webhook p99 {out['webhook_p99_s']:.2f} s",
        flush=True,
    )
    print(
        f"  note: 1 -> 2 writers: x{out['writers_2_over_1']:.2f} stored events/s on "
        f"{os.cpu_count()} CPUs shared by the collector, the writers, 3 NATS nodes, the "
        f"database and this client; {args.partitions} partitions with one batch in flight "
        "each, so 2 writers store at most 2 batches at once, as 1 writer serving both does",
        flush=True,
    )
    return out


def sqlite_db(workdir: Path, tag: str, template: str | None) -> str:
    """A SQLite database in ``workdir``: a copy of ``template``'s file (closed: no WAL left)."""
    path = workdir / f"{tag}.db"
    if template is not None:
        shutil.copyfile(template.removeprefix("sqlite:///"), path)
    return f"sqlite:///{path}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvwatch.bus_cluster import ClusterError, LocalCluster

    t_start = time.perf_counter()
    load0 = load_at_start()
    wl = build_workload(args.events, args.probes, args.batch, args.seed)
    n_alerts = args.min_alerts + int(STORE_TIMEOUT_S / args.alert_every)
    alerts = alert_batches(len(wl.probes), n_alerts, datetime.now(UTC))
    gc.collect()
    gc.freeze()
    exp = wl.expected
    mib = sum(len(b.body) for bs in wl.batches for b in bs) / (1 << 20)
    print(
        f"workload: {exp.events:,} events from {len(wl.probes)} probes, batches of <= "
        f"{args.batch}, {mib:.1f} MiB JSON; an alert batch every {args.alert_every:g} s while "
        f"it is sent (at least {args.min_alerts}); {args.clients} clients; bus: 3 NATS nodes, "
        f"{args.partitions} partitions; built in {time.perf_counter() - t_start:.1f} s",
        flush=True,
    )
    result: dict[str, Any] = {
        "bench": "bus",
        "quick": args.quick,
        "events": exp.events,
        "batch": args.batch,
        "clients": args.clients,
        "probes": args.probes,
        "partitions": args.partitions,
        "alert_every_s": args.alert_every,
        "latency": "alert batch sent -> its alert.firing webhook received",
    }
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-bus-"))
    pg = PgServer(args.pg_url)
    cluster = LocalCluster(workdir / "nats")
    receiver = Receiver()
    try:
        try:
            cluster.start()
        except ClusterError as exc:
            raise BenchError(f"the NATS cluster did not start: {exc}") from None
        nats_pids = [p.pid for p in cluster._procs.values()]
        limit = max_payload(cluster.url)
        largest = max(len(b.body) for bs in wl.batches for b in bs)
        if largest > limit - 4096:  # the envelope's headers travel in the message too
            raise BenchError(
                f"a batch of {args.batch} events is {largest:,} bytes: more than the bus takes "
                f"(nats-server max_payload {limit:,} bytes, less headers); use a smaller --batch"
            )
        result["sqlite"] = run_backend(
            "sqlite",
            functools.partial(sqlite_db, workdir),
            workdir,
            wl,
            alerts,
            args,
            receiver,
            cluster.url,
            nats_pids,
        )
        why = "skipped (--skip-postgres)" if args.skip_postgres else None
        if why is None and (err := pg.reachable()) is not None:
            why = f"skipped: PostgreSQL unreachable at {args.pg_url} ({err})"
        if why is not None:
            print(f"postgresql: {why}", flush=True)
            result["postgresql"] = {"skipped": why}
        else:
            result["postgresql"] = run_backend(
                "postgresql",
                lambda tag, template: pg.create(tag.replace("_", ""), template)[1],
                workdir,
                wl,
                alerts,
                args,
                receiver,
                cluster.url,
                nats_pids,
            )
    finally:
        receiver.close()
        cluster.stop()
        pg.drop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    result["goal"] = {"min_bus_ratio": GOAL_MIN_BUS_RATIO, "webhook_p99_s": GOAL_WEBHOOK_P99_S}
    met: dict[str, bool | None] = {}
    for backend in ("sqlite", "postgresql"):
        r = result[backend]
        skipped = "skipped" in r
        for case in CASES:
            if case.writers:
                key = f"{backend}_ratio_{case.name}"
                met[key] = None if skipped else r[f"ratio_{case.name}"] >= GOAL_MIN_BUS_RATIO
        met[f"{backend}_webhook_p99"] = (
            None if skipped else r["webhook_p99_s"] <= GOAL_WEBHOOK_P99_S
        )
    result["met"] = met
    print(
        f"goals (not asserted): bus >= {GOAL_MIN_BUS_RATIO}x direct; ingest -> webhook p99 <= "
        f"{GOAL_WEBHOOK_P99_S:g} s: "
        + ", ".join(
            f"{k} {'met' if v else 'not met' if v is not None else 'n/a'}" for k, v in met.items()
        ),
        flush=True,
    )
    return finished(result, load0, t_start)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small workload (a minute or two)")
    p.add_argument(
        "--events", type=int, help="events in the workload (default 400,000; 80,000 with --quick)"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=2000,
        help="events per POST (default 2000, the probe's; nats-server takes 1 MiB a message)",
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent connections (default 4)")
    p.add_argument("--probes", type=int, default=8, help="probes (default 8)")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument(
        "--partitions", type=int, default=PARTITIONS, help=f"bus partitions (default {PARTITIONS})"
    )
    p.add_argument(
        "--alert-every", type=float, default=0.25, help="seconds between alert batches (0.25)"
    )
    p.add_argument(
        "--min-alerts", type=int, help="alert batches per case at least (default 20; 40)"
    )
    p.add_argument("--skip-postgres", action="store_true", help="SQLite only")
    add_pg_url(p)
    args = p.parse_args(argv)
    if args.events is None:
        args.events = 80_000 if args.quick else 400_000
    if args.min_alerts is None:
        args.min_alerts = 20 if args.quick else 40
    for name in ("events", "batch", "clients", "probes", "partitions", "min_alerts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.alert_every <= 0:
        p.error("--alert-every must be positive")
    args.clients = min(args.clients, args.probes)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("bus", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
