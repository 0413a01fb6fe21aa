"""Policy evaluation benchmark: ingest throughput with the default rule pack on and off, and
alert latency from ingest to a signed webhook delivered on loopback.

**Throughput.** One workload (``bench.ingest``'s: per request a ``request.admitted`` and a
``request.finished``, one ``pool.sample`` per 4 requests, one ``page.reuse`` per 50; plus,
for the policies, one ``engine.config`` per deployment, glm-prod's pool below its advertised
context as in the incident, and one request in ``--near-every`` per probe with a prompt of
0.7-1.1x its deployment's context bound, so ``context_pressure`` fires at warning and at
critical rather than only evaluating) goes to three ``kvwatch serve`` collectors, each on its
own fresh database, that differ only in ``KVWATCH_POLICIES_ENABLED``:

* **off** (the ceiling): policies disabled;
* **off_b** (the A/A control): a second policies-off collector; its ratio to ``off`` is the
  noise floor of this run on this machine;
* **on**: the default pack evaluated on every batch, in the batch's transaction, and on the
  timer (``policy_timer_s``, default 15 s).

Each client connection owns whole probes (a probe's batches arrive in seq order). The batches
are cut into rounds; in each round every collector takes that round's batches, collectors in
an order rotated from round to round, each timed alone (first send to last response). The
first round is a warm-up. The headline ratio is the median over rounds of (on's events/s /
off's in the same round): paired in time, so drift and other load largely cancel. Afterwards
every collector's answers and stored rows are checked (``bench.ingest.verify``: nothing
missing, nothing doubled), the on collector must report no failed policy evaluation or rule
error, its database must hold ``context_pressure`` and ``pool_below_advertised`` alerts, and
the off databases none.

**Latency.** The on collector's database (with the throughput run's history) gets a webhook
endpoint (``add_endpoint``, min severity critical) pointing at a threading ``http.server`` on
127.0.0.1, and a collector with ``KVWATCH_NOTIFY_POLL_S`` = ``--poll`` (default 0.05 s). Per
trial, one batch (``--latency-batch`` events: requests and one ``page.stale_read``, read by a
new tenant each time, so each trial is a new alert fingerprint that fires the critical
``stale_page_read`` rule at once) is POSTed; the latency runs from just before the POST to the
receiver holding the webhook whose alert names that tenant, its signature checked with
``collector.notify.signing.verify``. Trials are spaced by a random pause under one poll
interval, so they land at random phases of the dispatcher's loop. The first trials are a
warm-up (the very first opens the deployment's incident). A second series with
``--poll-fine`` (default 0.01 s) shows how much of the latency is the poll interval, and the
same kind of batches POSTed to a policies-off collector (the off database) how much of the
POST is ingest alone; together they split the p50 into ingest, policies, the wait for the
dispatcher's next pass and the dispatch itself.

**Context**: the pure evaluation of the pack over the same batches in this process (no
database), to split the collector's added time per batch into rule evaluation and the
database work around it.

The last line printed is one JSON object with the headline figures.

    python -m bench.policy_eval --quick [--database sqlite|postgresql]
    python -m bench.policy_eval [--events N] [--batch N] [--rounds N] [--trials N] [--poll S]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BenchError,
    bench_main,
    finished,
    ingest_token,
    load_at_start,
    pct,
    rotated_rounds,
    run_parallel,
)
from bench.ingest import (
    DEPLOYMENTS,
    ROUTES,
    TENANTS,
    Batch,
    PgServer,
    PolicyMix,
    Sender,
    Workload,
    add_pg_url,
    build_workload,
    collector,
    ingest_client,
    verify,
)
from collector import deployment_facts as F
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.notify.signing import WebhookVerificationError
from collector.notify.signing import verify as verify_signature
from engine_probe import events as ev
from policies import KINDS, BatchFacts, NodeConfig, evaluate_batch, load_ruleset

GOAL_MAX_COST = 0.10  # policies may cost at most 10% of ingest throughput
PURE_BATCHES = 100  # batches the in-process evaluation timing runs over
NOISY_AA = 0.05  # an A/A ratio further than this from 1: the run is too noisy to judge the goal
ROLLUPS_DEFERRED_S = 3600.0  # the refresher's interval in the rounds: longer than any run
# Advertised context per bench.ingest.DEPLOYMENTS: glm-prod advertises 1,048,576 tokens on a
# 681,280-token pool (the incident's configuration: pool_below_advertised fires); the others
# have at least twice their advertised context in pool.
ADVERTISED = (1_048_576, 131_072, 131_072)
ALERT_RULE = "stale_page_read"
LATENCY_PROBE = "bench-latency-probe"
WEBHOOK_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    label: str
    policies: bool


VARIANTS = (
    Variant("off", "policies off", False),
    Variant("off_b", "policies off, 2nd collector (A/A)", False),
    Variant("on", "policies on (default pack)", True),
)


# -- the webhook receiver ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    arrived: float  # perf_counter when the body had been read
    msg_id: str
    doc: Any
    error: str | None  # why the signature (or the body) is bad; None when valid


class WebhookReceiver:
    """A webhook receiver on 127.0.0.1 (``ThreadingHTTPServer``): records when each POST's
    body has arrived, checks its Standard Webhooks signature with the public ``verify``,
    answers 200. Firing ``stale_page_read`` alerts are indexed by their reader tenant."""

    def __init__(self) -> None:
        self.secret: str | None = None
        self.deliveries: list[Delivery] = []
        self.by_reader: dict[str, list[Delivery]] = {}
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real receiver would offer

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                arrived = time.perf_counter()
                receiver._record(arrived, dict(self.headers.items()), body)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="bench-webhook-receiver", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/kvwatch"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _record(self, arrived: float, headers: dict[str, str], body: bytes) -> None:
        error: str | None = None
        doc: Any = None
        if self.secret is None:
            error = "no secret configured"
        else:
            try:
                verify_signature(self.secret, headers, body)
            except WebhookVerificationError as exc:
                error = exc.message
        try:
            doc = json.loads(body)
        except ValueError as exc:
            error = error or f"body is not JSON: {exc}"
        lower = {k.lower(): v for k, v in headers.items()}
        d = Delivery(arrived, lower.get("webhook-id", ""), doc, error)
        with self._cond:
            self.deliveries.append(d)
            if isinstance(doc, dict) and doc.get("type") == "alert.firing":
                for a in doc.get("alerts") or []:
                    reader = (a.get("labels") or {}).get("reader_tenant")
                    if a.get("rule") == ALERT_RULE and reader:
                        self.by_reader.setdefault(reader, []).append(d)
            self._cond.notify_all()

    def wait_for(self, reader: str, timeout: float) -> Delivery | None:
        """The first firing stale_page_read webhook naming ``reader``, or None at timeout."""
        with self._cond:
            if self._cond.wait_for(lambda: reader in self.by_reader, timeout):
                return self.by_reader[reader][0]
        return None

    def bad(self) -> list[Delivery]:
        with self._cond:
            return [d for d in self.deliveries if d.error is not None]


# -- throughput ------------------------------------------------------------------------------


@dataclass(slots=True)
class Running:
    """One collector of the throughput run: its database, connections and timings."""

    variant: Variant
    url: str
    base: str = ""
    pid: int = 0
    clients: list[httpx.Client] = field(default_factory=list)
    sender: Sender = field(default_factory=Sender)
    seconds: list[float] = field(default_factory=list)  # per timed round


def _split(items: Sequence[Batch], n: int) -> list[list[Batch]]:
    """``items`` cut into ``n`` contiguous, nearly equal parts (order kept)."""
    return [list(items[len(items) * k // n : len(items) * (k + 1) // n]) for k in range(n)]


def plan_rounds(wl: Workload, clients: int, rounds: int) -> list[list[list[Batch]]]:
    """Per round, per client connection: the batches it sends (each client owns whole
    probes; a probe's batches stay in seq order across rounds)."""
    per_client = [wl.interleaved(range(i, len(wl.probes), clients)) for i in range(clients)]
    parts = [_split(b, rounds) for b in per_client]
    return [[parts[c][r] for c in range(clients)] for r in range(rounds)]


def _metric_sum(base: str, prefix: str) -> float:
    """The sum of every sample of one metric family in the collector's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and line[len(prefix) : len(prefix) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _alert_counts(url: str) -> dict[str, int]:
    """Alerts stored, as ``rule/severity/state`` -> count."""
    db = Database(url)
    try:
        with db.read() as conn:
            rows = conn.exec_driver_sql(
                "SELECT rule, severity, state, COUNT(*) FROM alerts "
                "GROUP BY rule, severity, state ORDER BY rule, severity, state"
            ).all()
    finally:
        db.dispose()
    return {f"{r}/{s}/{st}": int(n) for r, s, st, n in rows}


def throughput(
    urls: dict[str, str],
    workdir: Path,
    wl: Workload,
    args: argparse.Namespace,
) -> tuple[list[Running], list[int], dict[str, float]]:
    """Run the rounds against the three collectors. Returns them (with per-round seconds),
    the events of each timed round, and the on collector's policy failure counters."""
    plan = plan_rounds(wl, args.clients, args.rounds + 1)
    round_events = [sum(b.events for part in rnd for b in part) for rnd in plan]
    runs = [Running(v, urls[v.name]) for v in VARIANTS]
    tokens = {r.variant.name: ingest_token(r.url) for r in runs}
    with contextlib.ExitStack() as stack:
        for r in runs:
            settings = {
                "KVWATCH_POLICIES_ENABLED": "true" if r.variant.policies else "false",
                # The rollup refresher's passes are no policy cost, yet one landing in a round
                # (this workload's closed buckets are re-marked by every batch, so each pass
                # re-reads them whole) took that round's rate anywhere from 0.5 to 1.7 of its
                # pair's. Every collector defers them alike; bench.ingest keeps them.
                "KVWATCH_ROLLUP_INTERVAL_S": str(ROLLUPS_DEFERRED_S),
            }
            r.base, r.pid = stack.enter_context(
                collector(r.url, workdir, wl, args.batch, settings=settings)
            )
            print(f"  {r.variant.label}: collector pid {r.pid} at {r.base}", flush=True)
            r.clients = [ingest_client(r.base, tokens[r.variant.name]) for _ in plan[0]]
            for c in r.clients:
                stack.callback(c.close)
                c.get("/readyz").raise_for_status()  # connections open before the clock

        def one(r: Running, k: int) -> None:
            seconds = run_parallel(
                [
                    functools.partial(r.sender.send, c, part)
                    for c, part in zip(r.clients, plan[k], strict=True)
                ]
            )
            if k > 0:  # round 0 warms every collector up
                r.seconds.append(seconds)

        def done(k: int) -> None:
            if k > 0:
                rates = "  ".join(
                    f"{r.variant.name} {round_events[k] / r.seconds[-1]:>9,.0f}" for r in runs
                )
                print(f"  round {k:>2}: events/s {rates}", flush=True)

        rotated_rounds(runs, len(plan), one, done)
        on = next(r for r in runs if r.variant.policies)
        failures = {
            "policy_evaluation_failures": _metric_sum(
                on.base, "kvwatch_policy_evaluation_failures_total"
            ),
            "rule_errors": _metric_sum(on.base, "kvwatch_rule_errors_total"),
        }
    for r in runs:
        s = r.sender
        if (s.accepted, s.duplicates, s.gaps) != (wl.expected.events, 0, 0):
            raise BenchError(
                f"{r.variant.label}: collector answered accepted={s.accepted} "
                f"duplicates={s.duplicates} gaps={s.gaps}; expected accepted="
                f"{wl.expected.events}, no duplicates, no gaps"
            )
    return runs, round_events[1:], failures


@dataclass(frozen=True, slots=True)
class PureEvaluation:
    """Median µs per batch of ``evaluate_batch`` over the default pack, and of each rule."""

    batches: int
    total_us: float
    by_rule_us: dict[str, float]


def pure_evaluation(batches: Sequence[Batch], passes: int = 3) -> PureEvaluation:
    """The default pack evaluated over ``batches`` in this process: the facts the collector
    would load (node configs folded from the batches so far, every deployment's tenant count)
    built in memory and untimed, then ``evaluate_batch`` timed, and each rule's ``on_batch``
    alone. Each batch's time is its best of ``passes`` (transient load on the machine only
    ever adds); the figures are medians over batches. No database, no alert bookkeeping."""
    rules = load_ruleset(None)
    enabled = list(rules.enabled())
    tenants = {dep: len(TENANTS) for dep, _, _ in DEPLOYMENTS}
    now = datetime.now(UTC)
    prepared: list[BatchFacts] = []
    configs: dict[tuple[str, str], NodeConfig] = {}
    for b in batches:
        events = ev.decode_json_batch(b.body)
        folded = F.fold_configs(configs, events)
        deps = {e.deployment_id for e in events}
        prepared.append(
            BatchFacts(
                events=events,
                deployments=F.deployment_facts(folded, F.Verdicts(), tenants, deps),
                prior_configs=configs,
                seq_gaps=[],
            )
        )
        configs = folded
    inf = float("inf")
    total = [inf] * len(prepared)
    by_rule = {r.name: [inf] * len(prepared) for r in enabled}
    for _ in range(passes):
        for i, facts in enumerate(prepared):
            t0 = time.perf_counter()
            evaluate_batch(rules, facts, now)
            total[i] = min(total[i], time.perf_counter() - t0)
            for r in enabled:
                t0 = time.perf_counter()
                list(KINDS[r.kind].on_batch(r, facts, now))
                by_rule[r.name][i] = min(by_rule[r.name][i], time.perf_counter() - t0)
    return PureEvaluation(
        len(prepared),
        1e6 * statistics.median(total),
        {name: 1e6 * statistics.median(ts) for name, ts in by_rule.items()},
    )


# -- latency -----------------------------------------------------------------------------------


@dataclass(slots=True)
class LatencyProbe:
    """The latency trials' probe: its seq space, and a new reader tenant per trial."""

    seq: int = 0
    trial: int = 0

    def batch(self, n_events: int) -> tuple[str, int, bytes]:
        """(reader tenant, events, body): ``(n_events - 1) // 2`` requests of known tenants
        (admitted and finished) and one cross-tenant ``page.stale_read`` by a tenant never
        seen before, all stamped now."""
        self.trial += 1
        reader = f"reader-{self.trial:05d}"
        now = datetime.now(UTC)
        out: list[ev.Event] = []
        dep, model, _ = DEPLOYMENTS[0]  # glm-prod, the incident's deployment

        def base() -> dict[str, Any]:
            self.seq += 1
            return {
                "schema_version": 1,
                "probe_id": LATENCY_PROBE,
                "seq": self.seq,
                "ts": now,
                "deployment_id": dep,
            }

        for j in range((n_events - 1) // 2):
            rid = f"lat-{self.trial:05d}-{j:04d}"
            tenant = TENANTS[j % len(TENANTS)]
            out.append(
                ev.RequestAdmitted(
                    **base(),
                    request_id=rid,
                    tenant=tenant,
                    route=ROUTES[0],
                    model_id=model,
                    prompt_tokens=900 + j,
                    max_tokens=512,
                    node="node-0",
                )
            )
            out.append(
                ev.RequestFinished(
                    **base(),
                    request_id=rid,
                    tenant=tenant,
                    prompt_tokens=900 + j,
                    completion_tokens=200,
                    status="completed",
                    node="node-0",
                )
            )
        out.append(
            ev.PageStaleRead(
                **base(),
                node="node-0",
                reader_request_id=f"lat-{self.trial:05d}-reader",
                reader_tenant=reader,
                page_ids=[4096 + self.trial, 4097 + self.trial],
                previous_request_id="lat-victim",
                previous_tenant=TENANTS[0],
            )
        )
        return reader, len(out), ev.encode_batch(out)


@dataclass(slots=True)
class Series:
    poll_s: float
    total_ms: list[float] = field(default_factory=list)  # POST start -> webhook received
    post_ms: list[float] = field(default_factory=list)  # POST start -> collector's answer
    after_ms: list[float] = field(default_factory=list)  # answer -> webhook received

    def summary(self) -> dict[str, Any]:
        def q(values: list[float], p: float) -> float:
            return round(pct(values, p), 1)

        out: dict[str, Any] = {"poll_s": self.poll_s}
        if self.total_ms:
            out.update(
                p50=q(self.total_ms, 0.5),
                p99=q(self.total_ms, 0.99),
                max=round(max(self.total_ms), 1),
                mean=round(statistics.fmean(self.total_ms), 1),
                n=len(self.total_ms),
                after_post_p50=q(self.after_ms, 0.5),
                after_post_p99=q(self.after_ms, 0.99),
            )
        out.update(
            post_p50=q(self.post_ms, 0.5),
            post_p99=q(self.post_ms, 0.99),
            post_max=round(max(self.post_ms), 1),
            post_n=len(self.post_ms),
        )
        return out


def latency_series(
    url: str,
    workdir: Path,
    wl: Workload,
    args: argparse.Namespace,
    token: str,
    receiver: WebhookReceiver | None,
    probe: LatencyProbe,
    poll_s: float,
    trials: int,
    rng: random.Random,
) -> Series:
    """``args.latency_warmup`` untimed trials, then ``trials`` timed ones, against a collector
    whose dispatcher polls every ``poll_s``: with policies on, each timed until ``receiver``
    holds its webhook; with ``receiver`` None, policies off and only the POST is timed."""
    policies = receiver is not None
    settings = {
        "KVWATCH_POLICIES_ENABLED": "true" if policies else "false",
        "KVWATCH_NOTIFY_POLL_S": str(poll_s),
    }
    out = Series(poll_s)
    with (
        collector(url, workdir, wl, args.batch, settings=settings) as (base, pid),
        ingest_client(base, token) as client,
    ):
        what = f"dispatcher poll {poll_s * 1e3:g} ms" if policies else "policies off, POST only"
        print(f"  collector pid {pid} at {base}, {what}", flush=True)
        client.get("/readyz").raise_for_status()
        for k in range(args.latency_warmup + trials):
            reader, n, body = probe.batch(args.latency_batch)
            t0 = time.perf_counter()
            r = client.post("/v1/events", content=body)
            t1 = time.perf_counter()
            if r.status_code != 200 or r.json().get("accepted") != n:
                raise BenchError(f"latency trial: POST /v1/events -> {r.status_code}: {r.text}")
            timed = k >= args.latency_warmup
            if timed:
                out.post_ms.append(1e3 * (t1 - t0))
            if receiver is not None:
                got = receiver.wait_for(reader, WEBHOOK_WAIT_S)
                if got is None:
                    raise BenchError(
                        f"no firing {ALERT_RULE} webhook for reader tenant {reader} within "
                        f"{WEBHOOK_WAIT_S:g} s of the batch being accepted (poll {poll_s} s)"
                    )
                if got.error is not None:
                    raise BenchError(f"webhook {got.msg_id} for {reader}: {got.error}")
                if timed:
                    out.total_ms.append(1e3 * (got.arrived - t0))
                    out.after_ms.append(1e3 * (got.arrived - t1))
            # Land the next trial at a random phase of the dispatcher's poll loop.
            time.sleep(rng.uniform(0, poll_s))
    return out


@dataclass(slots=True)
class Latency:
    series: list[Series]  # poll, then poll_fine
    post_off: Series | None  # the same batches' POST to a policies-off collector
    extra: dict[str, Any]


def latency(urls: dict[str, str], workdir: Path, wl: Workload, args: argparse.Namespace) -> Latency:
    """The trials on the policies-on database (``--poll`` then ``--poll-fine``), and the
    same kind of batches POSTed to the policies-off one (what ingest alone takes)."""
    url = urls["on"]
    token = ingest_token(url)
    receiver = WebhookReceiver()
    db = Database(url)
    try:
        with db.write() as conn:
            _, secret = add_endpoint(
                conn,
                "bench-receiver",
                receiver.url,
                kind="webhook",
                format="kvwatch",
                min_severity="critical",
                now_us=int(time.time() * 1e6),
                actor="bench",
            )
    finally:
        db.dispose()
    receiver.secret = secret
    receiver.start()
    rng = random.Random(args.seed)
    probe = LatencyProbe()
    series: list[Series] = []
    polls = [(args.poll, args.trials)]
    if args.poll_fine > 0:
        polls.append((args.poll_fine, args.fine_trials))
    try:
        for poll_s, trials in polls:
            series.append(
                latency_series(url, workdir, wl, args, token, receiver, probe, poll_s, trials, rng)
            )
    finally:
        receiver.stop()
    bad = receiver.bad()
    if bad:
        raise BenchError(f"{len(bad)} webhook(s) failed verification, e.g. {bad[0].error}")
    post_off = None
    if args.poll_fine > 0:
        post_off = latency_series(
            urls["off"],
            workdir,
            wl,
            args,
            ingest_token(urls["off"]),
            None,
            LatencyProbe(),
            args.poll,
            args.fine_trials,
            rng,
        )
    repeats = sum(len(v) - 1 for v in receiver.by_reader.values())
    extra = {
        "webhooks_received": len(receiver.deliveries),
        "webhooks_verified": len(receiver.deliveries) - len(bad),
        "duplicate_alert_webhooks": repeats,
        "trials_posted": probe.trial,
    }
    if repeats:
        print(
            f"  warning: {repeats} stale_page_read alert(s) were delivered more than once to a "
            "receiver that answered 200 every time",
            flush=True,
        )
    return Latency(series, post_off, extra)


# -- driver ------------------------------------------------------------------------------------


def _databases(
    args: argparse.Namespace, workdir: Path, pg: PgServer | None
) -> tuple[dict[str, str], str]:
    """A fresh database URL per variant, and how they were made."""
    if pg is None:
        return {v.name: f"sqlite:///{workdir / (v.name + '.db')}" for v in VARIANTS}, (
            "SQLite files (WAL), one per collector"
        )
    return {v.name: pg.create(v.name)[1] for v in VARIANTS}, (
        f"PostgreSQL databases on {args.pg_url.rsplit('@', 1)[-1]}, one per collector"
    )


def explain(
    off_rate: float,
    on_rate: float,
    ratio: float,
    aa: float,
    added_us_per_batch: float,
    pure: PureEvaluation,
    batch: int,
    lat: Latency,
) -> dict[str, Any]:
    """Print, and return, what the ratio means and what the latency is made of."""
    cost = 1 - ratio
    pure_us = pure.total_us
    out: dict[str, Any] = {
        "cost": round(cost, 4),
        "added_ms_per_batch": round(added_us_per_batch / 1e3, 2),
        "pure_evaluation_ms_per_batch": round(pure_us / 1e3, 3),
    }
    print("what it means:", flush=True)
    print(
        f"  ratio on/off {ratio:.3f}: with the default pack evaluated on every batch (in the "
        f"batch's own transaction) the collector ingests {ratio:.1%} of the events per second "
        f"it does with policies off, a cost of {cost:.1%} (goal <= {GOAL_MAX_COST:.0%}); the "
        f"A/A control (two policies-off collectors) is {aa:.3f}, the noise floor of this run. "
        f"Aggregate: {off_rate:,.0f} vs {on_rate:,.0f} events/s.",
        flush=True,
    )
    rule, rule_us = max(pure.by_rule_us.items(), key=lambda kv: kv[1])
    out["costliest_rule"] = rule
    if added_us_per_batch > 0:
        share = pure_us / added_us_per_batch
        out["pure_evaluation_share_of_added"] = round(share, 3)
        print(
            f"  policies add ~{added_us_per_batch / 1e3:.2f} ms per {batch}-event batch. The "
            f"pure evaluation of the pack over such a batch (this process, no database) takes "
            f"{pure_us / 1e3:.2f} ms, {share:.0%} of that; its costliest rule is {rule} "
            f"({rule_us / 1e3:.2f} ms). The rest is the work around it in the batch's "
            "transaction: the facts queries (the touched deployments' node configs before and "
            "after the batch, verifications, tenant counts), the deployment_tenants upsert and "
            "the alert writes, plus the timer's passes and, in a collector that is also "
            "receiving the next batches, contention for its one core.",
            flush=True,
        )
    else:
        out["pure_evaluation_share_of_added"] = None
        print(
            "  policies added no measurable time per batch in this run (within the noise).",
            flush=True,
        )
    head = lat.series[0].summary()
    poll = lat.series[0].poll_s * 1e3
    out["latency_p50_ms"] = head["p50"]
    if len(lat.series) < 2 or lat.post_off is None:
        print(
            f"  alert latency (poll {poll:g} ms): p50 {head['p50']:.1f} ms = the POST itself "
            f"(ingest, evaluation and commit; p50 {head['post_p50']:.1f} ms) + "
            f"{head['after_post_p50']:.1f} ms until the webhook arrives, of which the wait "
            f"for the dispatcher's next pass is ~{poll / 2:g} ms on average (--poll-fine 0: "
            "not split further).",
            flush=True,
        )
        return out
    fine = lat.series[1].summary()
    fine_poll = lat.series[1].poll_s * 1e3
    off = lat.post_off.summary()
    # Medians, so the parts add up only roughly. The dispatch itself (claim the endpoint,
    # read the head, render, sign, POST, record) is the fine series' wait after the POST
    # less half its poll interval (the mean wait for the next pass).
    dispatch = max(0.0, fine["after_post_p50"] - fine_poll / 2)
    parts = {
        "ingest (POST with policies off)": off["post_p50"],
        "policies in the POST": max(0.0, head["post_p50"] - off["post_p50"]),
        "waiting for the dispatcher's next pass": max(0.0, head["after_post_p50"] - dispatch),
        "the dispatch itself": dispatch,
    }
    largest = max(parts, key=lambda k: parts[k])
    out.update(
        latency_parts_p50_ms={k: round(v, 1) for k, v in parts.items()},
        latency_dominated_by=largest,
        fine_poll_s=lat.series[1].poll_s,
        fine_p50_ms=fine["p50"],
    )
    print(
        f"  alert latency, p50 {head['p50']:.1f} ms with the dispatcher polling every "
        f"{poll:g} ms, is roughly: "
        + "; ".join(f"{k} {v:.1f} ms" for k, v in parts.items())
        + f". Largest: {largest}. The dispatcher runs a pass, then sleeps {poll:g} ms, so a "
        f"notification committed at a random moment waits {poll / 2:g} ms on average (up to "
        f"{poll:g}) for the next pass. Polling every {fine_poll:g} ms instead: p50 "
        f"{fine['p50']:.1f} ms, p99 {fine['p99']:.1f} (the dispatch's ~{dispatch:.1f} ms is "
        f"its wait after the POST, {fine['after_post_p50']:.1f} ms, less half that interval). "
        f"The tail: p99 {head['p99']:.1f} ms overall; the POST's own p99 "
        f"{head['post_p99']:.1f} ms (with policies off {off['post_p99']:.1f}), the wait "
        f"after it p99 {head['after_post_p99']:.1f} ms (a whole poll interval plus the "
        "dispatch, or a pass slowed by other work on the database).",
        flush=True,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    load0 = load_at_start("the paired ratios less so; see the A/A control")
    mix = PolicyMix(ADVERTISED, near_every=args.near_every)
    wl = build_workload(args.events, args.probes, args.batch, args.seed, mix)
    gc.collect()
    gc.freeze()
    exp = wl.expected
    n_batches = sum(len(b) for b in wl.batches)
    min_per_client = min(
        len(wl.interleaved(range(i, len(wl.probes), args.clients))) for i in range(args.clients)
    )
    if min_per_client < args.rounds + 1:
        raise BenchError(
            f"{args.rounds} rounds (+1 warm-up) need at least {args.rounds + 1} batches per "
            f"client; a client has {min_per_client}: raise --events, or lower --batch, "
            "--rounds or --clients"
        )
    per_probe = exp.requests // len(wl.probes)
    near = len(wl.probes) * len(range(args.near_every // 2, per_probe, args.near_every))
    print(
        f"workload: {exp.events:,} events ({exp.requests:,} requests admitted+finished, "
        f"{exp.pool_samples:,} pool.sample, {exp.page_events:,} page.reuse, "
        f"{len(DEPLOYMENTS)} engine.config; {near} prompts at 0.7-1.1x their context "
        f"bound) from {len(wl.probes)} probes; {n_batches} batches of <= {args.batch} "
        f"over {args.clients} connections; {args.rounds} timed rounds (+1 warm-up) per "
        f"collector; database {args.database}",
        flush=True,
    )
    pure = pure_evaluation(wl.interleaved()[:PURE_BATCHES])
    pure_us = pure.total_us
    top = sorted(pure.by_rule_us.items(), key=lambda kv: -kv[1])
    print(
        f"pure evaluation of the default pack (this process, no database): "
        f"{pure_us / 1e3:.2f} ms per batch (median of {pure.batches}, best of 3); by rule: "
        + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in top),
        flush=True,
    )

    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-policy-"))
    pg: PgServer | None = None
    if args.database == "postgresql":
        pg = PgServer(args.pg_url)
        if (err := pg.reachable()) is not None:
            shutil.rmtree(workdir, ignore_errors=True)
            raise BenchError(f"PostgreSQL unreachable at {args.pg_url} ({err})")
    try:
        urls, db_note = _databases(args, workdir, pg)
        print(f"throughput ({db_note}):", flush=True)
        runs, round_events, failures = throughput(urls, workdir, wl, args)
        for r in runs:
            verify(r.url, wl, bookkeeping=True, label=r.variant.label)
        if any(failures.values()):
            raise BenchError(
                f"the policies-on collector did not evaluate every batch: {failures} "
                "(see its log); its throughput would mean nothing"
            )
        alerts = {r.variant.name: _alert_counts(r.url) for r in runs}
        for r in runs:
            if not r.variant.policies and alerts[r.variant.name]:
                raise BenchError(f"{r.variant.label} stored alerts: {alerts[r.variant.name]}")
        on_alerts = alerts["on"]
        for rule in ("context_pressure", "pool_below_advertised"):
            if not any(k.startswith(rule + "/") for k in on_alerts):
                raise BenchError(
                    f"no {rule} alert after the workload: the policies did not fire as the "
                    f"workload intends ({on_alerts})"
                )
        print(
            "  alerts stored by the policies-on collector: "
            + ", ".join(f"{k} {n}" for k, n in on_alerts.items()),
            flush=True,
        )

        print("latency (the policies-on database, with its history):", flush=True)
        lat = latency(urls, workdir, wl, args)
        for sr in lat.series:
            sm = sr.summary()
            print(
                f"  poll {sr.poll_s * 1e3:g} ms: ingest -> webhook p50 {sm['p50']:.1f} ms, p99 "
                f"{sm['p99']:.1f}, max {sm['max']:.1f} (n={sm['n']}); the POST alone p50 "
                f"{sm['post_p50']:.1f} ms, p99 {sm['post_p99']:.1f}",
                flush=True,
            )
        if lat.post_off is not None:
            sm = lat.post_off.summary()
            print(
                f"  the same batches to a policies-off collector: POST p50 {sm['post_p50']:.1f}"
                f" ms, p99 {sm['post_p99']:.1f} (n={sm['post_n']})",
                flush=True,
            )
    finally:
        if pg is not None:
            pg.drop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    by = {r.variant.name: r for r in runs}
    timed = sum(round_events)

    def rate(name: str) -> float:
        return timed / sum(by[name].seconds)

    def ratios(name: str) -> list[float]:
        return [o / x for o, x in zip(by["off"].seconds, by[name].seconds, strict=True)]

    on_ratios, aa_ratios = ratios("on"), ratios("off_b")
    ratio, aa = statistics.median(on_ratios), statistics.median(aa_ratios)
    batches_per_round = [
        sum(1 for part in rnd for _ in part)
        for rnd in plan_rounds(wl, args.clients, args.rounds + 1)[1:]
    ]
    added_us = statistics.median(
        1e6 * (on - off) / nb
        for on, off, nb in zip(by["on"].seconds, by["off"].seconds, batches_per_round, strict=True)
    )
    off_rate, on_rate = rate("off"), rate("on")
    print(
        f"throughput: policies off {off_rate:,.0f} events/s, on {on_rate:,.0f} (A/A "
        f"{rate('off_b'):,.0f}); ratio on/off median over {len(on_ratios)} rounds "
        f"{ratio:.3f} (rounds {min(on_ratios):.3f}-{max(on_ratios):.3f}); A/A {aa:.3f}",
        flush=True,
    )
    why = explain(off_rate, on_rate, ratio, aa, added_us, pure, args.batch, lat)
    met = 1 - ratio <= GOAL_MAX_COST
    noisy = abs(aa - 1) > NOISY_AA
    print(
        f"goal: policies cost <= {GOAL_MAX_COST:.0%} of throughput: cost {1 - ratio:.1%} -> "
        f"{'met' if met else 'not met'}"
        + (
            f" (but the A/A control is {aa:.3f}, more than {NOISY_AA:.0%} off 1: this run is "
            f"too noisy to judge a {GOAL_MAX_COST:.0%} goal; rerun on a quiet machine, or with "
            "more --rounds)"
            if noisy
            else ""
        ),
        flush=True,
    )
    head = lat.series[0].summary()
    result: dict[str, Any] = {
        "bench": "policy_eval",
        "quick": args.quick,
        "database": args.database,
        "throughput_events_per_s": {
            "policies_off": round(off_rate),
            "policies_on": round(on_rate),
            "policies_off_b": round(rate("off_b")),
        },
        "ratio_on_to_off": round(ratio, 4),
        "aa_ratio": round(aa, 4),
        "ratio_of_totals": round(on_rate / off_rate, 4),
        "round_ratios": [round(x, 4) for x in on_ratios],
        "ceiling": "policies-off collector (KVWATCH_POLICIES_ENABLED=false), same workload, "
        "same run, paired per round",
        "goal": {"max_cost": GOAL_MAX_COST},
        "met": met,
        "noisy": noisy,
        "alert_latency_ms": {k: head[k] for k in ("p50", "p99", "max", "n")}
        | {"poll_s": args.poll, "post_p50": head["post_p50"], "post_p99": head["post_p99"]},
        "alert_latency_by_poll_ms": [sr.summary() for sr in lat.series],
        "post_policies_off_ms": None if lat.post_off is None else lat.post_off.summary(),
        "latency": lat.extra,
        "alerts_on": on_alerts,
        "pure_evaluation_ms_per_batch": round(pure_us / 1e3, 3),
        "pure_evaluation_by_rule_ms": {k: round(v / 1e3, 3) for k, v in top},
        "explanation": why,
        "events": exp.events,
        "timed_events_per_collector": timed,
        "batch": args.batch,
        "clients": args.clients,
        "probes": args.probes,
        "rounds": args.rounds,
        "latency_batch_events": args.latency_batch,
    }
    return finished(result, load0, t_start)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smaller run (under a minute)")
    p.add_argument(
        "--database",
        choices=("sqlite", "postgresql"),
        default="sqlite",
        help="the collectors' backend (default sqlite)",
    )
    p.add_argument("--events", type=int, help="events in the workload (default 1,000,000)")
    p.add_argument(
        "--batch", type=int, default=2000, help="events per POST (default 2000, the probe's)"
    )
    p.add_argument("--clients", type=int, default=4, help="connections per collector (4)")
    p.add_argument("--probes", type=int, default=8, help="probes (default 8)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 12; --quick 6)")
    p.add_argument(
        "--near-every",
        type=int,
        default=500,
        help="one request in this many per probe has a prompt near its context bound (500)",
    )
    p.add_argument("--trials", type=int, help="timed latency trials (default 200; --quick 40)")
    p.add_argument(
        "--fine-trials", type=int, help="trials of the --poll-fine series (default 100; 20)"
    )
    p.add_argument(
        "--latency-warmup", type=int, default=2, help="untimed trials per series (default 2)"
    )
    p.add_argument(
        "--latency-batch",
        type=int,
        default=101,
        help="events in a latency trial's batch, the stale read included (default 101)",
    )
    p.add_argument(
        "--poll", type=float, default=0.05, help="notify_poll_s for the latency (default 0.05)"
    )
    p.add_argument(
        "--poll-fine",
        type=float,
        default=0.01,
        help="notify_poll_s of the comparison series (default 0.01; 0 skips it)",
    )
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    add_pg_url(p)
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "events": 120_000 if q else 1_000_000,
        "rounds": 6 if q else 12,
        "trials": 40 if q else 200,
        "fine_trials": 20 if q else 100,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("events", "batch", "clients", "probes", "rounds", "trials", "near_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.fine_trials < 1 and args.poll_fine > 0:
        p.error("--fine-trials must be at least 1")
    if args.latency_warmup < 0:
        p.error("--latency-warmup must be at least 0")
    if args.latency_batch < 1:
        p.error("--latency-batch must be at least 1")
    if args.poll <= 0 or args.poll_fine < 0:
        p.error("--poll must be positive and --poll-fine not negative")
    args.clients = min(args.clients, args.probes)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("policy_eval", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
