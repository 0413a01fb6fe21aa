"""OTLP trace ingest benchmark: GenAI spans/s through ``POST /v1/traces`` beside the very same
requests through ``POST /v1/events``, in the same run, on SQLite and on PostgreSQL.

**Workload** (deterministic, ``--seed``): ``--sources`` producers (an engine replica each: a
deployment of ``bench.ingest.DEPLOYMENTS``, its own ingest token and one connection), each
with its own OpenTelemetry SDK ``TracerProvider`` (resource ``service.name`` = the
deployment, seeded trace and span ids) and an in-memory exporter. Per request one GenAI span
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.response.id`` = a unique request
id, ``gen_ai.usage.input_tokens``/``output_tokens``, ``gen_ai.request.max_tokens``,
``gen_ai.response.finish_reasons``, ``http.route``, ``tenant.id`` from 6 tenants; 2% with an
ERROR status), started and ended at given times. Every ``--batch`` spans of a source are one
export request, encoded before anything is timed by the OpenTelemetry exporters' own encoders:
protobuf (``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans``), OTLP/JSON
(the JSON exporter's ``encode_spans(...).to_json()``) and gzip'd protobuf (level 9, as the
exporters' gzip). The ``/v1/events`` batch carrying the same requests holds exactly the
``request.admitted`` + ``request.finished`` pairs the collector makes of those spans (its own
``wire.decode`` and GenAI ``Mapper``), under the source's probe id, numbered 1, 2, ...: 2 x
``--batch`` events per POST, JSON-encoded up front.

**Variants**, each a ``kvwatch serve`` subprocess on its own fresh database, same settings:

* **events** (the ceiling): the events batches to ``/v1/events``;
* **events_b** (the A/A control): the same, to a second collector; its ratio to events is
  this run's noise floor;
* **protobuf**, **json**, **protobuf_gzip**: the export requests to ``/v1/traces``.

Each source's token is its own lineage, so on ``/v1/traces`` each source has its own probe
(``otlp.<lineage>.<deployment>``), as on ``/v1/events`` each has its own ``probe_id``: no
source waits on another's probe lock. The batches are cut into rounds (the first a warm-up);
each round goes to every collector in turn, the order rotated from round to round, each timed
alone (first send to last response, one thread per source). A ratio is the median over rounds
of (OTLP spans/s / events requests/s in the same round). Afterwards every collector's answers
(no OTLP partial success; ``/v1/events`` accepted every event, no duplicate, no gap), its
``kvwatch_otlp_spans_total`` counters (every span accepted, none duplicate, rejected or not
GenAI) and its stored rows (``bench.ingest.verify``: every request once and finished, token
sums, deployments, each probe's max_seq and accepted, no seq gaps; on ``/v1/traces`` also
every span once in ``otlp_spans``, each under its own request id) are checked, or the run
fails. **Goal**: OTLP >= 0.5 of ``/v1/events`` per request, protobuf and JSON.

**Context**: in this process on one core, ``/v1/events``' decode (and decode + shape_rows) per
request, and the OTLP path's inflate + ``wire.decode`` and decode + GenAI mapping per span.

The last line printed is one JSON object with the headline figures.

    python -m bench.otlp --quick
    python -m bench.otlp [--requests N] [--batch N] [--sources N] [--rounds N] [--skip-postgres]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.common import (
    BenchError,
    bench_main,
    cpu_seconds,
    entered_together,
    finished,
    ingest_tokens,
    load_at_start,
    rotated_rounds,
    run_parallel,
)
from bench.ingest import (
    DEPLOYMENTS,
    ROUTE_WEIGHTS,
    ROUTES,
    STATUS_WEIGHTS,
    STATUSES,
    T0,
    TENANT_WEIGHTS,
    TENANTS,
    Batch,
    Expected,
    PgServer,
    Sender,
    Workload,
    add_pg_url,
    bench_decode,
    collector,
    ingest_client,
    verify,
)
from bench.policy_eval import NOISY_AA, plan_rounds
from collector.db import Database
from collector.otlp import wire
from collector.otlp.genai import Mapper, SpanRequest, is_genai, read_attributes
from collector.otlp.service import probe_id as otlp_probe_id
from collector.settings import Settings
from collector.store import shape_rows
from engine_probe import events as ev

GOAL_MIN_RATIO = 0.5  # OTLP spans/s at least half of /v1/events requests/s
CONTEXT_BATCHES = 8  # export requests the in-process context timing runs over
FINISH_REASONS = {"completed": ["stop"], "length": ["length"], "aborted": ["abort"]}
_NO_ROWS = shape_rows([])  # no raw ceiling here: the batches need no rows of their own


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    label: str
    content_type: str | None = None  # None: /v1/events; else an OTLP encoding
    gzip: bool = False

    @property
    def otlp(self) -> bool:
        return self.content_type is not None


EVENTS = Variant("events", "/v1/events")
VARIANTS = (
    EVENTS,
    Variant("events_b", "/v1/events, 2nd collector (A/A)"),
    Variant("protobuf", "/v1/traces protobuf", wire.PROTOBUF),
    Variant("json", "/v1/traces JSON", wire.JSON),
    Variant("protobuf_gzip", "/v1/traces protobuf+gzip", wire.PROTOBUF, gzip=True),
)
OTLP_VARIANTS = tuple(v for v in VARIANTS if v.otlp)


#: the attributes the collector's decoder keeps, under its default settings
KEEP = read_attributes(Settings().otlp_tenant_attributes, Settings().otlp_deployment_attributes)

# -- workload ----------------------------------------------------------------------------


@dataclass(slots=True)
class Built:
    """Every variant's batches (the same requests, source by source, batch by batch), what
    the events databases must hold, and each source's deployment."""

    bodies: dict[str, Workload]  # variant name -> batches (probe index = source)
    expected: Expected
    requests_per_source: list[int]
    deployments: list[str]
    build_s: float


def source_probe(index: int) -> str:
    """The probe id source ``index`` sends its ``/v1/events`` batches under."""
    return f"bench-otlp-{index:02d}"


def new_mapper(probe: str) -> Mapper:
    """The collector's GenAI mapping, with its default settings, for one probe."""
    s = Settings()
    return Mapper(
        tenant_attributes=s.otlp_tenant_attributes,
        deployment_attributes=s.otlp_deployment_attributes,
        scope=None,
        probe_id=lambda _dep: probe,
        now=datetime.now(UTC),
        max_clock_skew=timedelta(seconds=s.max_clock_skew_s),
    )


def map_spans(mapper: Mapper, spans: Sequence[wire.Span]) -> list[SpanRequest]:
    """What ``TraceIngest`` makes of an export's spans (every one a GenAI span here)."""
    return [mapper.request(s) for s in spans if is_genai(s)]


def _source_spans(index: int, n: int, seed: int, batch: int) -> Iterator[tuple[int, Any]]:
    """Source ``index``'s ``n`` requests as SDK ``ReadableSpan``s, ``batch`` at a time:
    (spans in the chunk, the chunk's spans)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import SpanKind, Status, StatusCode

    class SeededIds(IdGenerator):
        """Trace and span ids from a seeded generator: every run sends the same bytes."""

        def __init__(self, rng: random.Random) -> None:
            self._rng = rng

        def generate_span_id(self) -> int:
            return self._rng.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return self._rng.getrandbits(128) or 1

    rng = random.Random(seed * 1_000_003 + index)
    dep, model, cap = DEPLOYMENTS[index % len(DEPLOYMENTS)]
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": dep, "service.instance.id": f"src-{index}"}),
        id_generator=SeededIds(random.Random(seed * 2_000_003 + index)),
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kvwatch.bench.otlp")
    t_ns = int(T0.timestamp()) * 1_000_000_000
    try:
        for k in range(0, n, batch):
            for i in range(k, min(n, k + batch)):
                # ~100 requests/s per source, 0.2-6 s each
                t_ns += 1_000 + int(rng.expovariate(100.0) * 1e9)
                status = rng.choices(STATUSES, STATUS_WEIGHTS)[0]
                max_tokens = rng.choice((256, 512, 1024, 4096))
                completion = (
                    max_tokens
                    if status == "length"
                    else 0
                    if status == "error"
                    else rng.randint(1, max_tokens)
                )
                attrs: dict[str, Any] = {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": model,
                    "gen_ai.response.id": f"{source_probe(index)}-r{i:07d}",
                    "gen_ai.usage.input_tokens": min(
                        cap // 2, 1 + int(rng.lognormvariate(7.0, 1.2))
                    ),
                    "gen_ai.usage.output_tokens": completion,
                    "gen_ai.request.max_tokens": max_tokens,
                    "http.route": rng.choices(ROUTES, ROUTE_WEIGHTS)[0],
                    "tenant.id": rng.choices(TENANTS, TENANT_WEIGHTS)[0],
                }
                if status in FINISH_REASONS:
                    attrs["gen_ai.response.finish_reasons"] = FINISH_REASONS[status]
                span = tracer.start_span(
                    f"chat {model}", kind=SpanKind.SERVER, start_time=t_ns, attributes=attrs
                )
                if status == "error":
                    span.set_status(Status(StatusCode.ERROR, "engine error"))
                span.end(end_time=t_ns + int(rng.uniform(0.2, 6.0) * 1e9))
            spans = exporter.get_finished_spans()
            exporter.clear()
            yield len(spans), spans
    finally:
        provider.shutdown()


def build_workload(requests: int, sources: int, batch: int, seed: int) -> Built:
    from opentelemetry.exporter.otlp.json.common._internal.trace_encoder import (
        encode_spans as encode_json,
    )
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
        encode_spans as encode_protobuf,
    )

    t0 = time.perf_counter()
    exp = Expected()
    per_source = [
        requests // sources + (1 if i < requests % sources else 0) for i in range(sources)
    ]
    batches: dict[str, list[list[Batch]]] = {v.name: [] for v in VARIANTS}
    deployments: list[str] = []
    for p, n in enumerate(per_source):
        probe = source_probe(p)
        mapper = new_mapper(probe)
        mine: dict[str, list[Batch]] = {v.name: [] for v in VARIANTS}
        seq = 0
        for count, spans in _source_spans(p, n, seed, batch):
            pb = encode_protobuf(spans).SerializeToString()
            js = encode_json(spans).to_json().encode()
            # The events the collector makes of these spans, numbered in this probe's space.
            events: list[ev.Event] = []
            for r in map_spans(mapper, wire.decode(pb, wire.PROTOBUF, count, KEEP)):
                for e in r.events:
                    seq += 1
                    events.append(msgspec.structs.replace(e, seq=seq))
                    if isinstance(e, ev.RequestFinished):
                        exp.prompt_tokens += e.prompt_tokens or 0
                        exp.completion_tokens += e.completion_tokens or 0
            if len(events) != 2 * count:
                raise BenchError(f"{count} spans mapped to {len(events)} events, not 2 each")
            body = ev.encode_batch(events)
            for v in VARIANTS:
                if v.otlp:
                    raw = pb if v.content_type == wire.PROTOBUF else js
                    out = gzip.compress(raw, mtime=0) if v.gzip else raw
                    mine[v.name].append(Batch(p, count, out, _NO_ROWS))
                else:
                    mine[v.name].append(Batch(p, len(events), body, _NO_ROWS))
        for v in VARIANTS:
            batches[v.name].append(mine[v.name])
        dep = DEPLOYMENTS[p % len(DEPLOYMENTS)][0]
        deployments.append(dep)
        exp.requests += n
        exp.events += 2 * n
        exp.deployments.add(dep)
        exp.per_probe[probe] = 2 * n
    probes = [source_probe(p) for p in range(sources)]
    bodies = {name: Workload(probes, bs, exp) for name, bs in batches.items()}
    return Built(bodies, exp, per_source, deployments, time.perf_counter() - t0)


# -- context: the OTLP path's decode and mapping in this process --------------------------


def context_us(built: Built) -> dict[str, float]:
    """µs per request on one core: /v1/events' decode (and + shape_rows), and per OTLP
    encoding inflate + ``wire.decode`` (and + the GenAI mapping), over the first
    ``CONTEXT_BATCHES`` batches of the workload."""
    first = {name: wl.interleaved()[:CONTEXT_BATCHES] for name, wl in built.bodies.items()}
    n = sum(b.events for b in first[EVENTS.name]) // 2
    ctx = Workload([], [first[EVENTS.name]], Expected(events=2 * n))
    decode_rate, shape_rate = bench_decode(ctx)  # events/s
    out = {"events_decode": 2e6 / decode_rate, "events_decode_shape_rows": 2e6 / shape_rate}
    mapper = new_mapper("bench-context")
    for v in OTLP_VARIANTS:
        todo = [(b.body, b.events) for b in first[v.name]]  # (body, spans) per export
        enc, mime = ("gzip" if v.gzip else ""), v.content_type or ""
        t0 = time.perf_counter()
        for body, count in todo:
            wire.decode(wire.inflate(body, enc, 1 << 30), mime, count, KEEP)
        t1 = time.perf_counter()
        for body, count in todo:
            map_spans(mapper, wire.decode(wire.inflate(body, enc, 1 << 30), mime, count, KEEP))
        t2 = time.perf_counter()
        out[f"{v.name}_decode"] = 1e6 * (t1 - t0) / n
        out[f"{v.name}_decode_map"] = 1e6 * (t2 - t1) / n
    return out


# -- the timed rounds ---------------------------------------------------------------------


@dataclass(slots=True)
class TraceSender(Sender):
    """A :class:`Sender` for ``/v1/traces``: an answer with a partial success (a span
    rejected) fails the run; otherwise the batch's spans count as accepted (stored or
    duplicates: the collector's counters say which)."""

    def answer(self, r: httpx.Response, b: Batch) -> tuple[int, int, int]:
        if r.headers.get("content-type", "").startswith(wire.PROTOBUF):
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                ExportTraceServiceResponse,
            )

            resp = ExportTraceServiceResponse.FromString(r.content)
            rejected = resp.partial_success.rejected_spans
            message = resp.partial_success.error_message
        else:
            partial = r.json().get("partialSuccess") or {}
            rejected = int(partial.get("rejectedSpans") or 0)
            message = partial.get("errorMessage") or ""
        if rejected or message:
            self.abort.set()
            raise BenchError(f"POST {self.path}: partial success, {rejected} rejected: {message}")
        return b.events, 0, 0


@dataclass(slots=True)
class Running:
    """One collector of a backend's run: its database, tokens, connections and timings."""

    variant: Variant
    url: str
    tokens: list[tuple[int, str]]
    plan: list[list[list[Batch]]]  # per round, per source
    base: str = ""
    pid: int = 0
    clients: list[httpx.Client] = field(default_factory=list)
    sender: Sender = field(default_factory=Sender)
    seconds: list[float] = field(default_factory=list)  # per timed round
    cpu_s: list[float] = field(default_factory=list)  # the collector's, per timed round

    def expected(self, built: Built) -> Expected:
        """What its database must hold: on /v1/traces each source's events are under the
        probe the collector numbers its token lineage's spans of that deployment in."""
        if not self.variant.otlp:
            return built.expected
        per_probe = {
            otlp_probe_id(lineage, dep): 2 * n
            for (lineage, _), dep, n in zip(
                self.tokens, built.deployments, built.requests_per_source, strict=True
            )
        }
        return replace(built.expected, per_probe=per_probe)


def fresh_databases(
    backend: str, workdir: Path, pg: PgServer, sources: int
) -> tuple[dict[str, str], list[tuple[int, str]]]:
    """A fresh database per variant (its URL), migrated once and copied, so each holds the
    same ``sources`` ingest tokens (returned: id and secret each)."""
    names = [v.name for v in VARIANTS]
    if backend == "sqlite":
        files = {n: workdir / f"{n}.db" for n in names}
        tokens = ingest_tokens(f"sqlite:///{files[names[0]]}", sources)
        for n in names[1:]:
            shutil.copyfile(files[names[0]], files[n])
        return {n: f"sqlite:///{f}" for n, f in files.items()}, tokens
    first = pg.create(names[0])[1]
    tokens = ingest_tokens(first, sources)
    return {names[0]: first} | {n: pg.create(n, template=first)[1] for n in names[1:]}, tokens


def _otlp_counters(base: str) -> dict[str, float]:
    """``kvwatch_otlp_spans_total`` by result, from the collector's /metrics."""
    prefix = 'kvwatch_otlp_spans_total{result="'
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(prefix):
            result, value = line[len(prefix) :].split('"}', 1)
            out[result] = float(value)
    return out


def _check_spans(url: str, requests: int, label: str) -> None:
    """Every span remembered once (``otlp_spans``), each under a request id of its own."""
    db = Database(url)
    try:
        with db.read() as conn:
            got = tuple(
                conn.exec_driver_sql(
                    "SELECT COUNT(*), COUNT(DISTINCT request_id) FROM otlp_spans"
                ).one()
            )
    finally:
        db.dispose()
    if got != (requests, requests):
        raise BenchError(
            f"{label}: otlp_spans holds {got[0]} spans under {got[1]} request ids; expected "
            f"{requests} of each"
        )


def _check_answers(r: Running, built: Built, counters: dict[str, float] | None) -> None:
    exp = built.expected
    s = r.sender
    if r.variant.otlp:
        want_counters = {"accepted": exp.requests, "duplicate": 0, "not_genai": 0, "rejected": 0}
        if s.accepted != exp.requests or counters != want_counters:
            raise BenchError(
                f"{r.variant.label}: {s.accepted} spans answered without rejection, counters "
                f"{counters}; expected {exp.requests} and {want_counters}"
            )
    elif (s.accepted, s.duplicates, s.gaps) != (exp.events, 0, 0):
        raise BenchError(
            f"{r.variant.label}: collector answered accepted={s.accepted} duplicates="
            f"{s.duplicates} gaps={s.gaps}; expected accepted={exp.events}, no duplicates, no gaps"
        )


def throughput(
    backend: str, workdir: Path, pg: PgServer, built: Built, args: argparse.Namespace
) -> list[Running]:
    """Every variant's collector through the rounds; their answers and rows checked."""
    urls, tokens = fresh_databases(backend, workdir, pg, args.sources)
    runs = [
        Running(
            v,
            urls[v.name],
            tokens,
            plan_rounds(built.bodies[v.name], args.sources, args.rounds + 1),
            sender=TraceSender(path="/v1/traces") if v.otlp else Sender(),
        )
        for v in VARIANTS
    ]
    round_requests = [
        sum(b.events for part in rnd for b in part)
        for rnd in runs[VARIANTS.index(OTLP_VARIANTS[0])].plan
    ]
    largest = max(len(b.body) for wl in built.bodies.values() for bs in wl.batches for b in bs)
    settings = {"KVWATCH_MAX_BODY_BYTES": str(max(16 << 20, 2 * largest))}
    counters: dict[str, dict[str, float]] = {}
    events_wl = built.bodies[EVENTS.name]
    with contextlib.ExitStack() as stack:
        started = stack.enter_context(
            entered_together(
                [
                    collector(r.url, workdir, events_wl, 2 * args.batch, settings=settings)
                    for r in runs
                ]
            )
        )
        for r, (base, pid) in zip(runs, started, strict=True):
            r.base, r.pid = base, pid
            print(f"  {r.variant.label}: collector pid {r.pid} at {r.base}", flush=True)
            headers: dict[str, str] = {}
            if r.variant.content_type is not None:
                headers["content-type"] = r.variant.content_type
            if r.variant.gzip:
                headers["content-encoding"] = "gzip"
            r.clients = [ingest_client(r.base, secret, headers) for _, secret in r.tokens]
            for c in r.clients:
                stack.callback(c.close)
                c.get("/readyz").raise_for_status()  # connections open before the clock

        def one(r: Running, k: int) -> None:
            cpu0 = cpu_seconds(r.pid)
            parts = zip(r.clients, r.plan[k], strict=True)
            seconds = run_parallel([functools.partial(r.sender.send, c, p) for c, p in parts])
            cpu1 = cpu_seconds(r.pid)
            if k > 0:  # round 0 warms every collector up
                r.seconds.append(seconds)
                r.cpu_s.append(math.nan if cpu0 is None or cpu1 is None else cpu1 - cpu0)

        def done(k: int) -> None:
            if k > 0:
                rates = "  ".join(
                    f"{r.variant.name} {round_requests[k] / r.seconds[-1]:>7,.0f}" for r in runs
                )
                print(f"  round {k:>2}: requests/s {rates}", flush=True)

        rotated_rounds(runs, args.rounds + 1, one, done)
        for r in runs:
            if r.variant.otlp:
                counters[r.variant.name] = _otlp_counters(r.base)
    for r in runs:
        _check_answers(r, built, counters.get(r.variant.name))
        verify(r.url, Workload([], [], r.expected(built)), bookkeeping=True, label=r.variant.label)
        if r.variant.otlp:
            _check_spans(r.url, built.expected.requests, r.variant.label)
    return runs


def _backend_result(name: str, runs: list[Running], timed_requests: int) -> dict[str, Any]:
    by = {r.variant.name: r for r in runs}
    base = by[EVENTS.name]

    def rate(v: str) -> float:
        return timed_requests / sum(by[v].seconds)

    def ratios(v: str) -> list[float]:
        return [e / o for e, o in zip(base.seconds, by[v].seconds, strict=True)]

    def cpu_us(v: str) -> float:
        return 1e6 * sum(by[v].cpu_s) / timed_requests

    aa = statistics.median(ratios("events_b"))
    out: dict[str, Any] = {
        "events_requests_per_s": round(rate(EVENTS.name)),
        "events_b_requests_per_s": round(rate("events_b")),
    }
    for v in OTLP_VARIANTS:
        out[f"otlp_{v.name}_spans_per_s"] = round(rate(v.name))
    for v in OTLP_VARIANTS:
        out[f"ratio_{v.name}"] = round(statistics.median(ratios(v.name)), 4)
    out["aa_ratio"] = round(aa, 4)
    out["noisy"] = abs(aa - 1) > NOISY_AA
    out["round_ratios"] = {
        v.name: [round(x, 3) for x in ratios(v.name)] for v in VARIANTS if v is not EVENTS
    }
    out["collector_cpu_us_per_request"] = {v.name: round(cpu_us(v.name), 1) for v in VARIANTS}
    out["met"] = {v: out[f"ratio_{v}"] >= GOAL_MIN_RATIO for v in ("protobuf", "json")}
    print(
        f"  {name}: /v1/events {out['events_requests_per_s']:,} requests/s (A/A "
        f"{out['events_b_requests_per_s']:,}: {aa:.3f}{', noisy' if out['noisy'] else ''}); "
        + "; ".join(
            f"{v} {out[f'otlp_{v}_spans_per_s']:,} spans/s, ratio {out[f'ratio_{v}']:.3f}"
            for v in (o.name for o in OTLP_VARIANTS)
        ),
        flush=True,
    )
    print(
        f"  {name} collector CPU per request: "
        + ", ".join(f"{k} {v:.0f} µs" for k, v in out["collector_cpu_us_per_request"].items()),
        flush=True,
    )
    return out


# -- driver ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    load0 = load_at_start("the paired ratios less so; see the A/A control")
    built = build_workload(args.requests, args.sources, args.batch, args.seed)
    gc.collect()
    gc.freeze()  # the workload is a large, long-lived heap: keep the cycle collector off it
    exp = built.expected
    size = {
        name: sum(len(b.body) for bs in wl.batches for b in bs) / exp.requests
        for name, wl in built.bodies.items()
        if name != "events_b"
    }
    print(
        f"workload: {exp.requests:,} requests from {args.sources} sources, exports of <= "
        f"{args.batch} spans (/v1/events batches of <= {2 * args.batch} events); bytes per "
        "request: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in size.items())
        + f"; built in {built.build_s:.1f} s",
        flush=True,
    )
    ctx = context_us(built)
    print(
        "in-process, one core, µs per request: "
        + ", ".join(f"{k} {v:.1f}" for k, v in ctx.items()),
        flush=True,
    )
    result: dict[str, Any] = {
        "bench": "otlp",
        "quick": args.quick,
        "requests": exp.requests,
        "events": exp.events,
        "batch_spans": args.batch,
        "batch_events": 2 * args.batch,
        "sources": args.sources,
        "rounds": args.rounds,
        "bytes_per_request": {k: round(v) for k, v in size.items()},
        "context_us_per_request": {k: round(v, 2) for k, v in ctx.items()},
    }
    timed = sum(
        b.events
        for rnd in plan_rounds(built.bodies["protobuf"], args.sources, args.rounds + 1)[1:]
        for part in rnd
        for b in part
    )
    result["timed_requests_per_collector"] = timed

    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-otlp-"))
    pg = PgServer(args.pg_url)
    try:
        for backend in ("sqlite", "postgresql"):
            why = None
            if backend == "postgresql":
                why = "skipped (--skip-postgres)" if args.skip_postgres else None
                if why is None and (err := pg.reachable()) is not None:
                    why = f"skipped: PostgreSQL unreachable at {args.pg_url} ({err})"
            if why is not None:
                print(f"{backend}: {why}", flush=True)
                result[backend] = {"skipped": why}
                continue
            print(f"{backend}:", flush=True)
            t0 = time.perf_counter()
            runs = throughput(backend, workdir, pg, built, args)
            result[backend] = _backend_result(backend, runs, timed)
            result[backend]["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        pg.drop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    result["goal"] = {
        "min_ratio": GOAL_MIN_RATIO,
        "ratio": "OTLP spans/s over /v1/events requests/s (the same requests as admitted + "
        "finished pairs), median over rounds paired in time",
    }
    result["met"] = {
        f"{backend}_{v}": None
        if "skipped" in result[backend]
        else result[backend][f"ratio_{v}"] >= GOAL_MIN_RATIO
        for backend in ("sqlite", "postgresql")
        for v in ("protobuf", "json")
    }
    return finished(result, load0, t_start)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small workload (under a minute)")
    p.add_argument(
        "--requests", type=int, help="requests (= spans) (default 200,000; --quick 16,000)"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1000,
        help="spans per OTLP export; the /v1/events batch of the same requests holds twice as "
        "many events (default 1000)",
    )
    p.add_argument(
        "--sources",
        type=int,
        default=4,
        help="producers, each with its own token, deployment probe and connection (default 4)",
    )
    p.add_argument("--rounds", type=int, help="timed rounds (default 10; --quick 3)")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--skip-postgres", action="store_true", help="SQLite only")
    add_pg_url(p)
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = 16_000 if args.quick else 200_000
    if args.rounds is None:
        args.rounds = 3 if args.quick else 10
    for name in ("requests", "batch", "sources", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    per_source = math.ceil(args.requests // args.sources / args.batch)
    if per_source < args.rounds + 1:
        p.error(
            f"{args.requests:,} requests from {args.sources} sources in exports of {args.batch} "
            f"are {per_source} per source: fewer than the {args.rounds} rounds + 1 warm-up "
            "(more --requests, a smaller --batch or fewer --rounds)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("otlp", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
