"""The Grafana dashboards (deploy/grafana/): the committed JSON is what the script generates,
and every panel's query parses and returns data in a real Prometheus (Debian's package,
which ``.ci/run`` installs) scraping a real collector fed as probes feed it, the reference
engine's server (vLLM's names) and the real gateway in front of it, with completions driven
through the gateway; and the label values the panels name are those these servers publish.
SGLang's series alone are a static stand-in (see its section for why).

Grafana itself cannot run here: its part is substituting the template variables, which the
test does (``$deployment`` and ``$model`` as "All", ``.*``, and as each concrete value;
``$__rate_interval`` as a minute).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest

from deploy.grafana import generate
from kvwatch.embedded import free_port, serve_in_thread
from tests import factories as f
from tests.conftest import make_token
from tests.metrics_text import samples

pytestmark = pytest.mark.slow

PROMETHEUS_BIN = "/usr/bin/prometheus"
DASHBOARDS = {name: json.loads(text) for name, text in generate.render().items()}
RATE_INTERVAL = "1m"
# (deployment, model) of the fleet the test builds: a vLLM-style deployment (the reference
# engine, serving the model under this name) behind the gateway, and an SGLang one.
VLLM = ("glm-prod", "glm-5.3")
SGLANG = ("llama-dev", "llama-3.1-8b")


# ----------------------------------------------------------------- the committed JSON


def test_the_committed_json_is_what_the_script_generates() -> None:
    for name, text in generate.render().items():
        committed = (generate.HERE / name).read_text(encoding="utf-8")
        assert committed == text, (
            f"deploy/grafana/{name} differs from what the script generates: "
            "edit deploy/grafana/generate.py, then run python -m deploy.grafana.generate"
        )
    assert generate.main(["--check"]) == 0


def _panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc["panels"]:
        yield p
        yield from p.get("panels") or []


def test_every_panel_reads_the_datasource_variable() -> None:
    """Imported anywhere, the dashboards ask for a Prometheus instead of naming one."""
    for name, doc in DASHBOARDS.items():
        ids = [p["id"] for p in _panels(doc)]
        assert len(ids) == len(set(ids)), name
        (ds,) = [v for v in doc["templating"]["list"] if v["type"] == "datasource"]
        assert (ds["name"], ds["query"]) == ("datasource", "prometheus")
        for p in _panels(doc):
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", p["title"]


# ------------------------------------------------------------------ the collector, fed


@dataclass
class Kvwatch:
    url: str
    ingest: str
    admin: str

    def post(self, events: list[Any]) -> None:
        r = httpx.post(
            f"{self.url}/v1/events",
            json=[f.as_json(e) for e in events],
            headers={"Authorization": f"Bearer {self.ingest}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text


@contextmanager
def running_collector(tmp: Path, port: int) -> Iterator[Kvwatch]:
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings

    db_url = f"sqlite:///{tmp / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    app = create_app(Settings(database_url=db_url, auto_migrate=False, rollup_interval_s=0.2))
    with serve_in_thread(app, port=port) as url:
        yield Kvwatch(url, make_token(db_url, "ingest"), make_token(db_url, "admin"))


def feed(kv: Kvwatch) -> None:
    """A small fleet, as probes send it: glm-prod (disaggregated, verified, a stale read and
    a canary hit, a gap in its probe's sequence) and llama-dev (one node, unverified)."""
    now = datetime.now(UTC)
    dep, model = VLLM
    seq = iter(range(1, 1000))
    at = {"dep": dep, "ts": now, "model_id": model}
    events = [
        f.config(next(seq), **at),  # prefill-0: advertised 1,048,576, pool 681,280
        f.config(next(seq), **at, node="decode-0", role="decode", pool_tokens=2_000_000),
        f.pool(next(seq), used=450_000, dep=dep, ts=now, node="prefill-0", role="prefill"),
        f.pool(next(seq), used=900_000, cap=2_000_000, dep=dep, ts=now, node="decode-0"),
    ]
    for i in range(12):  # enough requests in the hour for the largest prompt to be published
        events.append(f.admitted(next(seq), f"g-{i}", prompt=480_000 + i * 1_000, **at))
    events.append(f.finished(next(seq), "g-0", dep=dep, ts=now))
    for _ in range(4):  # lost on the way: the probe's seq numbers show the gap
        next(seq)
    events.append(f.stale_read(next(seq), dep=dep, ts=now, role="decode"))
    events.append(f.canary_hit(next(seq), dep=dep, ts=now))
    kv.post(events)

    dep, model = SGLANG
    at = {"dep": dep, "probe": "probe-b", "ts": now}
    kv.post(
        [
            f.config(
                1,
                **at,
                model_id=model,
                engine="sglang",
                advertised_context=131_072,
                pool_tokens=200_000,
                node="node-0",
                role="both",
                disaggregated=False,
            ),
            f.pool(2, used=60_000, cap=200_000, **at, node="node-0", role="both"),
            *(
                f.admitted(3 + i, f"l-{i}", prompt=9_000 + i * 500, model_id=model, **at)
                for i in range(12)
            ),
        ]
    )
    with httpx.Client(base_url=kv.url, headers={"Authorization": f"Bearer {kv.admin}"}) as c:
        r = c.post(
            "/v1/verifications",
            json={
                "deployment_id": VLLM[0],
                "model_id": VLLM[1],
                "passed": True,
                "verified_safe_context": 600_000,
                "pool_capacity_tokens": 681_280,
                "verified_at": (now - timedelta(minutes=5)).isoformat(),
            },
        )
        assert r.status_code == 201, r.text
    # one batch refused, for the refusals panel
    bad = httpx.post(
        f"{kv.url}/v1/events",
        json=[{"kind": "no.such.kind"}],
        headers={"Authorization": f"Bearer {kv.ingest}"},
        timeout=30,
    )
    assert bad.status_code == 422, bad.text


# ------------------------------------------------------- the engine and the gateway, real
#
# The vLLM-style series come from the reference engine's own server (refengine: vLLM's names
# and labels) and the gateway's from the real `kvwatch gateway` in front of it, reading the
# deployment's verified safe context from the collector as it does in production. Requests go
# through the gateway once Prometheus has scraped both at rest (every series they publish
# exists from the start, at 0), so rates and quantiles have an increase to show.

KEY = "sk-acme-grafana"
# refengine at lab size: its pool and context are not the fleet's (those are what the probe
# reports to the collector), only its series' names and labels matter here.
ENGINE_CONFIG = {"advertised_context": 4096, "pool_tokens": 2048, "page_size": 16}
# The configured ceiling of the gateway: the advertised context. It names the model, so the
# gateway's series for it exist from its start; the collector's verification (600,000, fed
# below) is smaller and is the limit in force (source="verified").
ADVERTISED = 1_048_576
VERIFIED = 600_000


ANSWERED_BODIES: list[dict[str, Any]] = [
    {"prompt": "hello, dashboards", "max_tokens": 8},
    {"prompt": "x" * 300, "max_tokens": 4},
    {"prompt": "streamed " * 20, "max_tokens": 4, "stream": True},
]
ANSWERED = len(ANSWERED_BODIES)


@contextmanager
def running_engine(port: int) -> Iterator[str]:
    from refengine import Engine, EngineConfig
    from refengine.server import create_app as refengine_app

    engine = Engine(EngineConfig(**ENGINE_CONFIG, model_id=VLLM[1]))
    with serve_in_thread(refengine_app(engine, tenant_keys={"acme": KEY}), port=port) as url:
        yield url


@contextmanager
def running_gateway(port: int, upstream: str, kv: Kvwatch) -> Iterator[str]:
    from engine_probe.probe import NoopProbe
    from kvwatch.gateway import GatewaySettings, create_app

    settings = GatewaySettings(
        gateway_upstream=upstream,
        gateway_tenant_keys={"acme": KEY},
        gateway_safe_contexts={VLLM[1]: ADVERTISED},
        gateway_verification_refresh_s=0.2,
        collector_url=kv.url,
        ingest_token=kv.ingest,
        deployment_id=VLLM[0],
    )
    # Its records (request.finished, request.rejected) are not what the dashboards read:
    # they go nowhere here; the dashboards read its /metrics.
    with serve_in_thread(create_app(settings, probe=NoopProbe()), port=port) as url:
        yield url


def gateway_limit(url: str) -> tuple[str, float] | None:
    """The gateway's limit in force for the fleet's vLLM model: (source, tokens)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = [
        (labels["source"], value)
        for labels, value in samples(text).series("kvwatch_gateway_limit_tokens")
        if labels["model"] == VLLM[1]
    ]
    return found[0] if found else None


def drive(gateway: str) -> None:
    """Completions through the gateway: answered (one cut at max_tokens, one streamed) and
    one refused over the verified safe context before the engine sees it."""

    def complete(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{gateway}/v1/completions",
            json={"model": VLLM[1], **body},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )

    for body in ANSWERED_BODIES:
        r = complete(body)
        assert r.status_code == 200, r.text
    over = complete({"prompt": "y" * (VERIFIED + 1), "max_tokens": 1})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "context_length_exceeded"


# ------------------------------------------------------------------- SGLang, static
#
# STAND-IN, kept on purpose: no SGLang-compatible server is cheap to run here (SGLang's own
# needs a GPU and a model; refengine speaks vLLM's names only), so the SGLang series are
# static exposition text in SGLang's own names and labels (python/sglang/srt/metrics/
# collector.py: scheduler and tokenizer-manager series, labelled model_name and tp_rank),
# served by a tiny local server. It proves only that the panels' SGLang queries parse and
# join kvwatch's series on deployment and model_name, not that SGLang publishes them so.
# Counters and histograms grow with every scrape so that rates and quantiles have data.


def _histogram(name: str, labels: str, bounds: list[float], seen: list[float], n: int) -> str:
    lines = [f"# TYPE {name} histogram"]
    for le in [*bounds, math.inf]:
        count = sum(1 for v in seen if v <= le) * n
        le_s = "+Inf" if le == math.inf else repr(float(le))
        lines.append(f'{name}_bucket{{{labels},le="{le_s}"}} {count}')
    lines.append(f"{name}_sum{{{labels}}} {sum(seen) * n}")
    lines.append(f"{name}_count{{{labels}}} {len(seen) * n}")
    return "\n".join(lines)


def _metric(kind: str, name: str, samples: list[tuple[str, float]]) -> str:
    return "\n".join([f"# TYPE {name} {kind}", *(f"{name}{{{lv}}} {v}" for lv, v in samples)])


TOKENS = [100.0, 1_000.0, 10_000.0, 100_000.0, 1_000_000.0]
SECONDS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def sglang_metrics(n: int) -> str:
    m = f'model_name="{SGLANG[1]}",tp_rank="0"'
    return "\n".join(
        [
            _metric("gauge", "sglang:num_running_reqs", [(m, 5)]),
            _metric("gauge", "sglang:num_queue_reqs", [(m, 2)]),
            _metric("gauge", "sglang:token_usage", [(m, 0.31)]),
            _metric("gauge", "sglang:max_total_num_tokens", [(m, 200_000)]),
            _metric("gauge", "sglang:context_len", [(m, 131_072)]),
            _metric("counter", "sglang:prompt_tokens_total", [(m, 30_000 * n)]),
            _metric("counter", "sglang:generation_tokens_total", [(m, 700 * n)]),
            _metric("counter", "sglang:num_requests_total", [(m, 4 * n)]),
            _metric("counter", "sglang:num_aborted_requests_total", [(m, n)]),
            _histogram("sglang:prompt_tokens_histogram", m, TOKENS, [700, 9_000, 20_000], n),
            _histogram("sglang:generation_tokens_histogram", m, TOKENS, [40, 300], n),
            _histogram("sglang:time_to_first_token_seconds", m, SECONDS, [0.06, 0.2], n),
            _histogram("sglang:e2e_request_latency_seconds", m, SECONDS, [0.7, 2.2], n),
        ]
    )


class _SGLangExposition(BaseHTTPRequestHandler):
    scrapes = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        with self.lock:
            n = type(self).scrapes = type(self).scrapes + 1
        body = (sglang_metrics(n) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # Prometheus scrapes every second: quiet
        pass


@pytest.fixture(scope="module")
def sglang_standin() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLangExposition)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- Prometheus


@dataclass
class Prometheus:
    url: str
    http: httpx.Client

    def query(self, expr: str) -> dict[str, Any]:
        r = self.http.get(f"{self.url}/api/v1/query", params={"query": expr})
        body: dict[str, Any] = r.json()
        return body

    def label_values(self, label: str, match: str) -> list[str]:
        r = self.http.get(f"{self.url}/api/v1/label/{label}/values", params={"match[]": match})
        assert r.status_code == 200, r.text
        return list(r.json()["data"])


def _wait(what: str, check: Callable[[], bool], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(
                f"{what} within {timeout_s:.0f} s; Prometheus said:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.1)


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None, sglang_standin: str
) -> Iterator[Prometheus]:
    """A real Prometheus on 127.0.0.1, scraping every second: a real collector, the reference
    engine's server and the gateway in front of it, and the SGLang stand-in, the engine and
    gateway targets labelled with their kvwatch deployment as docs/grafana.md says.
    Prometheus starts first: it takes its first targets about 5 s after it starts (its
    discovery's fixed update interval), and the servers start meanwhile. Once each target has
    been scraped at rest, the collector is fed and requests go through the gateway; the
    fixture yields once Prometheus has scraped what they did."""
    if not os.path.exists(PROMETHEUS_BIN):
        if os.environ.get("CI"):
            pytest.fail(f"{PROMETHEUS_BIN} is missing: .ci/run installs prometheus")
        pytest.skip(f"{PROMETHEUS_BIN} not installed (apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    ports = {name: free_port() for name in ("collector", "engine", "gateway")}

    def job(name: str, target: str, deployment: str = "") -> str:
        labels = f", labels: {{deployment: {deployment}}}" if deployment else ""
        return f"  - job_name: {name}\n    static_configs: [{{targets: ['{target}']{labels}}}]\n"

    config = tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        + job("kvwatch", f"127.0.0.1:{ports['collector']}")
        + job("vllm", f"127.0.0.1:{ports['engine']}", VLLM[0])
        + job("kvwatch-gateway", f"127.0.0.1:{ports['gateway']}", VLLM[0])
        + job("sglang", sglang_standin, SGLANG[0])
    )
    port = free_port()
    log_path = tmp / "prometheus.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS_BIN,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", httpx.Client(timeout=10))

    def targets_up() -> bool:
        assert proc.poll() is None, "Prometheus exited"
        try:
            r = prom.http.get(f"{prom.url}/api/v1/targets")
        except httpx.HTTPError:
            return False
        active = r.json()["data"]["activeTargets"] if r.status_code == 200 else []
        return len(active) == 4 and all(t["health"] == "up" for t in active)

    def scraped(expr: str) -> Callable[[], bool]:
        return lambda: bool(prom.query(expr).get("data", {}).get("result"))

    try:
        with (
            running_collector(tmp, ports["collector"]) as kvwatch,
            running_engine(ports["engine"]) as engine,
            running_gateway(ports["gateway"], engine, kvwatch) as gateway,
        ):
            _wait("the four targets were not up", targets_up, 20, log_path)
            feed(kvwatch)  # after a first scrape: the ingest counters' rates see it happen
            _wait(
                "the gateway did not take the collector's verified safe context",
                lambda: gateway_limit(gateway) == ("verified", VERIFIED),
                10,
                log_path,
            )
            drive(gateway)
            for what, expr in (
                (
                    "the collector's feed",
                    'kvwatch_deployment_canary_hits_1h{deployment="glm-prod"} > 0',
                ),
                ("the engine's requests", f"sum(vllm:request_success_total) >= {ANSWERED}"),
                (
                    "the gateway's requests",
                    f'sum(kvwatch_gateway_requests_total{{outcome="forwarded"}}) >= {ANSWERED}'
                    " and on () sum(kvwatch_gateway_refusals_total) >= 1",
                ),
            ):
                _wait(f"Prometheus did not scrape {what}", scraped(expr), 10, log_path)
            yield prom
    finally:
        prom.http.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


# ------------------------------------------------------------------- the queries


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}: {self.expr}"


QUERIES = [
    PanelQuery(name, p["title"], t["refId"], t["expr"])
    for name, doc in DASHBOARDS.items()
    for p in _panels(doc)
    for t in p.get("targets") or []
]


def substitute(expr: str, deployment: str = ".*", model: str = ".*") -> str:
    """What Grafana does before it sends a query (multi-value variables become regexes;
    "All" is the variables' allValue, .*)."""
    out = (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$deployment", deployment)
        .replace("$model", model)
    )
    assert "$" not in out, f"a template variable the test does not know: {out}"
    return out


def _has_data(body: dict[str, Any]) -> bool:
    """Success, and at least one series with a number (a quantile of nothing is NaN)."""
    if body.get("status") != "success":
        return False
    data = body["data"]
    rows = data["result"] if data["resultType"] in ("vector", "matrix") else [data]
    return any(
        math.isfinite(float(v[1]))
        for row in rows
        for v in (row.get("values") or [row.get("value") or row["result"]])
    )


def _until_all_have_data(
    prom: Prometheus, exprs: dict[PanelQuery, list[str]], timeout_s: float = 15
) -> dict[PanelQuery, list[dict[str, Any]]]:
    """Each query's answers, retried until each has data in at least one of its variants
    (the first scrapes after the feed may still be arriving) or the time is up."""
    deadline = time.monotonic() + timeout_s
    pending = dict(exprs)
    answers: dict[PanelQuery, list[dict[str, Any]]] = {}
    while True:
        for q, variants in list(pending.items()):
            answers[q] = [prom.query(e) for e in variants]
            for e, body in zip(variants, answers[q], strict=True):
                # a query Prometheus cannot parse never will: fail at once, with its error
                assert body.get("status") == "success", f"{q}\n  as sent: {e}\n  -> {body}"
            if any(_has_data(b) for b in answers[q]):
                del pending[q]
        if not pending or time.monotonic() > deadline:
            return {q: answers[q] for q in pending}
        time.sleep(0.5)


def test_the_dashboards_have_the_panels_the_issue_asks_for() -> None:
    titles = {name: {p["title"] for p in _panels(doc)} for name, doc in DASHBOARDS.items()}
    operator, engines = titles["kvwatch-operator.json"], titles["kvwatch-engines.json"]
    assert {
        "Context per deployment: advertised vs pool vs verified safe context",
        "Context pressure: largest prompt of the hour / safe context",
        "KV pool occupancy",
        "Stale reads and canary hits, last hour",
        "Alerts by rule",
        "Events ingested",
        "Events lost per probe (sequence gaps)",
    } <= operator
    assert {"KV cache usage", "Prompt tokens p99 vs the safe context"} <= engines
    exprs = " ".join(q.expr for q in QUERIES if q.dashboard == "kvwatch-engines.json")
    assert "vllm:" in exprs and "sglang:" in exprs and "kvwatch_gateway_" in exprs


def test_every_panel_query_returns_data_for_all_deployments(prometheus: Prometheus) -> None:
    missing = _until_all_have_data(prometheus, {q: [substitute(q.expr)] for q in QUERIES})
    assert not missing, "no data:\n" + "\n".join(str(q) for q in missing)


def test_every_panel_query_returns_data_for_one_deployment_and_model(
    prometheus: Prometheus,
) -> None:
    """Picking one deployment and model in the dashboard: each query, as Grafana sends it
    then, parses, and returns data for the glm-prod (vLLM) or the llama-dev (SGLang) pick,
    so no filter names a label its series lack."""
    variants = {q: [substitute(q.expr, d, m) for d, m in (VLLM, SGLANG)] for q in QUERIES}
    missing = _until_all_have_data(prometheus, variants)
    assert not missing, "no data for either pick:\n" + "\n".join(str(q) for q in missing)


def test_the_variables_list_the_fleet(prometheus: Prometheus) -> None:
    """Each query variable (label_values(selector, label)) lists what the fleet has."""
    expected = {"deployment": {VLLM[0], SGLANG[0]}, "model": {VLLM[1], SGLANG[1]}}
    seen = set()
    for doc in DASHBOARDS.values():
        for v in doc["templating"]["list"]:
            if v["type"] != "query":
                continue
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
            assert found, v["query"]
            selector, label = found.groups()
            assert label == v["name"]
            values = prometheus.label_values(label, substitute(selector))
            assert set(values) == expected[label], (v["query"], values)
            seen.add(label)
    assert seen == set(expected)


def test_the_label_values_the_panels_name_are_the_servers(prometheus: Prometheus) -> None:
    """The values the panels' descriptions name (vLLM's finished_reason, the gateway's
    outcome, refusal reason and limit source) are those the real reference engine and gateway
    publish, as Prometheus scraped them; and the traffic the fixture drove is where the
    panels would show it (the refused prompt under context_length_exceeded, the limit in
    force the collector's verification)."""
    from kvwatch.gateway.metrics import OUTCOMES, REASONS
    from policies.limits import LimitSource

    def values(label: str, series: str) -> set[str]:
        return set(prometheus.label_values(label, series))

    # every value exists from the start, at 0: each one the dashboards name is there
    assert values("finished_reason", "vllm:request_success_total") == set(
        generate.VLLM_FINISHED_REASONS
    )
    assert values("outcome", "kvwatch_gateway_requests_total") == set(generate.GATEWAY_OUTCOMES)
    assert values("reason", "kvwatch_gateway_refusals_total") == set(
        generate.GATEWAY_REFUSAL_REASONS
    )
    # the limit's sources: only those in force are published; the code's own list for all
    assert values("source", "kvwatch_gateway_limit_tokens") <= set(generate.GATEWAY_LIMIT_SOURCES)
    assert set(generate.GATEWAY_LIMIT_SOURCES) == set(get_args(LimitSource))
    assert (set(OUTCOMES), set(REASONS)) == (
        set(generate.GATEWAY_OUTCOMES),
        set(generate.GATEWAY_REFUSAL_REASONS),
    )

    def one(expr: str) -> float:
        (row,) = prometheus.query(expr)["data"]["result"]
        return float(row["value"][1])

    at = f'deployment="{VLLM[0]}", model="{VLLM[1]}"'
    assert one(f'kvwatch_gateway_refusals_total{{{at}, reason="context_length_exceeded"}}') == 1
    assert one(f'kvwatch_gateway_requests_total{{{at}, outcome="refused"}}') == 1
    assert one(f'kvwatch_gateway_requests_total{{{at}, outcome="forwarded"}}') == ANSWERED
    assert one(f'kvwatch_gateway_limit_tokens{{{at}, source="verified"}}') == VERIFIED
    assert one(f'sum(vllm:request_success_total{{deployment="{VLLM[0]}"}})') == ANSWERED
