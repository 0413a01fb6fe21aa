"""``kvwatch scrape`` and the collector's scheduled scraper, end to end: a real HTTP server
on 127.0.0.1 serving exposition text that SGLang's own metric classes rendered (in
``.venv-sglang``, see ``tests/engines/sglang/sglang_exposition.py``), a real collector, the
real CLI in a subprocess."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from collector import models as m
from collector.db import Database
from engine_probe import events as ev
from kvwatch.embedded import serve_in_thread
from kvwatch.scheduled_scrape import scrape_target
from tests.conftest import Collector, free_port, make_token

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
KVWATCH = (
    [sys.executable, "-m", "kvwatch.cli"]
    if False
    else [str(Path(sys.executable).parent / "kvwatch")]
)

# The incident's figures: a 681,280-token pool under a 1,048,576-token advertised context.
SMALL = {
    "max_total_num_tokens": 681_280,
    "context_len": 1_048_576,
    "page_size": 64,
    "kv_used_tokens": 200_000,
    "kv_available_tokens": 400_000,
    "prompts": [1_000, 30_000, 700_000],
}
LARGE = {
    "max_total_num_tokens": 4_194_304,
    "context_len": 1_048_576,
    "page_size": 64,
    "kv_used_tokens": 1_000_000,
    "kv_available_tokens": 3_000_000,
    "prompts": [2_000],
}
SERVER_ARGS = {"model_path": "glm-test", "dtype": "bfloat16"}


@pytest.fixture(scope="session")
def sglang_docs() -> dict[str, Any]:
    """SGLang's own exposition for SMALL and LARGE, and its /server_info document (one
    subprocess per test run)."""
    if not SGLANG_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-sglang is missing (make engines builds it)")
        pytest.skip(".venv-sglang is missing: `make engines` builds it")
    spec = {
        "variants": {
            name: {"model_name": "glm-test", **figures}
            for name, figures in (("small", SMALL), ("large", LARGE))
        },
        "server_args": SERVER_ARGS,
    }
    done = subprocess.run(
        [str(SGLANG_PY), str(ROOT / "tests/engines/sglang/sglang_exposition.py")],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    docs: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return docs


@pytest.fixture(scope="session")
def exposition(sglang_docs: dict[str, Any]) -> dict[str, str]:
    texts: dict[str, str] = sglang_docs["exposition"]
    return texts


class FakeEngine:
    """A real HTTP server on 127.0.0.1 answering /metrics with ``text`` (and SGLang's
    /server_info); it can go away (connection refused) and come back on the same port."""

    def __init__(self, text: str, server_info: dict[str, Any]) -> None:
        self.text = text
        self.server_info = server_info
        self.metrics_hits = 0
        self.lock = threading.Lock()
        self.port = free_port()
        self._server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    with engine.lock:
                        engine.metrics_hits += 1
                    body, ctype = engine.text.encode(), "text/plain; version=0.0.4"
                elif self.path == "/server_info":
                    body, ctype = json.dumps(engine.server_info).encode(), "application/json"
                elif self.path.startswith("/guarded/"):  # an API key in front, as vLLM's
                    body, ctype = b'{"error": "Unauthorized"}', "application/json"
                    self.send_response(401)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                else:
                    body, ctype = b"<html>not found</html>", "text/html"
                    self.send_response(404)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


@pytest.fixture
def engine(sglang_docs: dict[str, Any]) -> Iterator[FakeEngine]:
    e = FakeEngine(sglang_docs["exposition"]["small"], sglang_docs["server_info"])
    yield e
    e.stop()


def _env(collector: Collector | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    if collector is not None:
        env["KVWATCH_COLLECTOR_URL"] = collector.url
        env["KVWATCH_INGEST_TOKEN"] = collector.ingest
    return env | extra


def _scrape(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVWATCH, "scrape", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _pool_rows(db_url: str, deployment: str) -> list[Any]:
    db = Database(db_url)
    try:
        with db.read() as conn:
            return list(
                conn.execute(
                    select(m.PoolSample)
                    .where(m.PoolSample.deployment_id == deployment)
                    .order_by(m.PoolSample.probe_id, m.PoolSample.seq)
                ).all()
            )
    finally:
        db.dispose()


def _alert(client: httpx.Client, rule: str, deployment: str) -> dict[str, Any] | None:
    alerts = client.get("/v1/alerts", params={"rule": rule}).json()
    mine = [a for a in alerts if a["labels"].get("deployment_id") == deployment]
    return mine[0] if mine else None


# -- the CLI ---------------------------------------------------------------------------------


def test_one_scrape_stores_config_and_pool_and_the_pool_rule_fires(
    collector: Collector, engine: FakeEngine
) -> None:
    r = _scrape(
        ["--target", engine.url, "--engine", "sglang", "--deployment", "glm-prod"], _env(collector)
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["scrapes"], out["failed"], out["events"], out["lost"]) == (1, 0, 2, 0)
    (prompts,) = out["last"]["prompts"]
    # SGLang's histogram says 3 prompts; one (700,000 tokens) is longer than the pool, as
    # far as its buckets (..., 600,000, 800,000, ...) can tell.
    assert prompts["requests"] == 3 and prompts["prompt_tokens_total"] == 731_000
    assert prompts["over_pool_at_least"] <= 1 == prompts["over_pool_at_most"]
    assert "681280 tokens < advertised context 1048576" in r.stderr

    with collector.client(collector.admin) as c:
        (cfg,) = c.get("/v1/deployments/glm-prod/config-history").json()
        assert cfg["engine"] == "sglang"
        assert cfg["engine_version"] == engine.server_info["version"]
        assert cfg["model_id"] == "glm-test" and cfg["dtype"] == "bfloat16"
        assert (cfg["pool_capacity_tokens"], cfg["advertised_context"], cfg["page_size"]) == (
            681_280,
            1_048_576,
            64,
        )
        # the node rule (engine_probe/node.py): a loopback target is this machine's engine
        assert cfg["node"] == f"{socket.gethostname()}:{engine.port}" and cfg["role"] == "both"
        alert = _alert(c, "pool_below_advertised", "glm-prod")
        assert alert is not None and alert["state"] == "firing"
    (sample,) = _pool_rows(collector.db_url, "glm-prod")
    assert (sample.capacity_tokens, sample.used_tokens, sample.free_tokens) == (
        681_280,
        200_000,
        400_000,
    )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("not_http", "must be an http:// or https:// URL"),
        ("nothing_listens", "cannot reach http://127.0.0.1:"),
        ("wrong_engine", "vllm:cache_config_info not found at http://127.0.0.1:"),
        ("not_metrics", "answered HTTP 404"),
        ("needs_a_key", "answered HTTP 401 (the engine's own API key is needed: --api-key"),
        ("no_collector", "KVWATCH_COLLECTOR_URL is not set"),
        ("bad_deployment", "--deployment"),
    ],
)
def test_bad_targets_exit_2_and_say_what_is_wrong(
    engine: FakeEngine, case: str, message: str
) -> None:
    env = _env(None, KVWATCH_COLLECTOR_URL="http://127.0.0.1:9", KVWATCH_INGEST_TOKEN="t")
    args = ["--target", engine.url, "--engine", "sglang", "--deployment", "d"]
    if case == "not_http":
        args[1] = "ftp://127.0.0.1/metrics"
    elif case == "nothing_listens":
        args[1] = f"http://127.0.0.1:{free_port()}"
    elif case == "wrong_engine":
        args[3] = "vllm"
    elif case == "not_metrics":
        args[1] = f"{engine.url}/nothing/metrics"
    elif case == "needs_a_key":
        args[1] = f"{engine.url}/guarded/metrics"
    elif case == "no_collector":
        env = _env(None)
    elif case == "bad_deployment":
        args[5] = "no spaces allowed"
    r = _scrape(args, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_loop_sends_config_on_change_and_loses_nothing_while_the_target_is_down(
    collector: Collector, engine: FakeEngine, exposition: dict[str, str]
) -> None:
    proc = subprocess.Popen(
        [
            *KVWATCH,
            "scrape",
            "--target",
            engine.url,
            "--engine",
            "sglang",
            "--every",
            "0.1",
            "--silent-after",
            "0.2",
        ],
        env=_env(collector, KVWATCH_DEPLOYMENT_ID="loop", KVWATCH_PROBE_FLUSH_INTERVAL_S="0.05"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait("three samples", lambda: len(_pool_rows(collector.db_url, "loop")) >= 3)
        engine.stop()  # the target goes away for a while
        hits = engine.metrics_hits
        time.sleep(0.5)
        engine.text = exposition["large"]  # ... and comes back with a bigger pool
        engine.start()
        _wait("a scrape after the outage", lambda: engine.metrics_hits >= hits + 2)
        with collector.client(collector.admin) as c:
            _wait(
                "the second config",
                lambda: len(c.get("/v1/deployments/loop/config-history").json()) == 2,
            )
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["failed"] >= 1 and out["lost"] == 0, out
    assert "scrape failed" in stderr and "cannot reach" in stderr
    # down for 0.5 s, 0.2 s of it allowed: the rest is a gap, one per failed scrape, sent
    assert out["gaps"] >= 1 and "no metrics for" in stderr and "answers again" in stderr
    rows = _pool_rows(collector.db_url, "loop")
    # Every scrape that succeeded is stored: one pool sample each, and exactly two
    # engine.config events (the first scrape, the change), all with contiguous seqs.
    assert len(rows) == out["scrapes"]
    assert out["events"] == out["scrapes"] + 2 + out["gaps"]
    with collector.client(collector.admin) as c:
        items = c.get("/v1/page-events", params={"deployment_id": "loop"}).json()["items"]
        alerts = c.get("/v1/alerts", params={"rule": "telemetry_gap"}).json()
    gaps = [i for i in items if i["kind"] == "source.gap"]
    assert len(gaps) == out["gaps"]
    assert {(g["detail"]["source"], g["detail"]["cause"]) for g in gaps} == {
        ("metrics", "engine_down")
    }
    assert all("cannot reach" in g["detail"]["reason"] for g in gaps)
    # fired while the target was down, resolved by the next pool sample
    (alert,) = [a for a in alerts if a["labels"]["problem"] == "source_silent"]
    assert alert["fired_at"] is not None and alert["state"] == "resolved", alert
    with collector.client(collector.admin) as c:
        (probe,) = [p for p in c.get("/v1/probes").json() if p["deployment_id"] == "loop"]
        history = c.get("/v1/deployments/loop/config-history").json()
    assert probe["probe_id"] == out["probe_id"] and probe["probe_id"].startswith("scrape-loop-")
    # ... and the probe's probe.stopped when the loop ended
    assert (probe["max_seq"], probe["accepted"], probe["gaps"]) == (out["events"] + 1,) * 2 + ([],)
    assert probe["stopped_at"] is not None
    assert [h["pool_capacity_tokens"] for h in history] == [681_280, 4_194_304]
    assert {r.capacity_tokens for r in rows} == {681_280, 4_194_304}


# -- the collector's scheduled scraper ---------------------------------------------------------


def _targets(*entries: dict[str, Any]) -> str:
    return json.dumps(list(entries))


def _collector_settings(db_url: str, targets: str) -> Any:
    from collector.settings import Settings

    return Settings(
        database_url=db_url,
        auto_migrate=False,
        rollup_interval_s=0.2,
        notify_enabled=False,
        scrape_targets=targets,  # type: ignore[arg-type]
    )


class Replica:
    """One collector replica's scheduled scraper, built as ``create_app`` builds it, driven
    pass by pass (``clock``: the replica's own clock)."""

    def __init__(
        self, db_url: str, targets: str, name: str, clock: Callable[[], datetime] | None = None
    ) -> None:
        from collector.ingest import IngestService
        from collector.metrics import CollectorMetrics
        from collector.scrape import ScheduledScraper
        from collector.tokens import Authenticator

        settings = _collector_settings(db_url, targets)
        self.db = Database(db_url)
        metrics = CollectorMetrics(self.db)
        auth = Authenticator(
            self.db, ttl_s=settings.token_cache_s, use_audit_s=settings.token_use_audit_s
        )
        self.registry = metrics.registry
        self.scraper = ScheduledScraper(
            self.db,
            settings,
            IngestService(self.db, settings, metrics, auth),
            metrics.registry,
            scrape_target,
            replica=name,
            **({"clock": clock} if clock else {}),
        )

    def counter(self, result: str, deployment: str) -> int:
        from prometheus_client import generate_latest

        return _counter(generate_latest(self.registry).decode(), f'result="{result}"', deployment)

    def close(self) -> None:
        self.db.dispose()


def _configs(db_url: str, deployment: str) -> list[Any]:
    db = Database(db_url)
    try:
        with db.read() as conn:
            return list(
                conn.execute(
                    select(m.DeploymentConfig).where(m.DeploymentConfig.deployment_id == deployment)
                ).all()
            )
    finally:
        db.dispose()


@pytest.mark.postgres
def test_a_replica_whose_clock_runs_ahead_cannot_claim_early(
    pg_url: str, engine: FakeEngine
) -> None:
    """On PostgreSQL the claim reads the database's clock: a replica an hour ahead neither
    scrapes before the interval is over nor stamps its events an hour late."""
    from collector import migrate

    migrate.upgrade(pg_url)
    interval = 1.0
    targets = _targets(
        {"url": engine.url, "engine": "sglang", "deployment_id": "skew", "interval_s": interval}
    )
    honest = Replica(pg_url, targets, "honest")
    ahead = Replica(pg_url, targets, "ahead", clock=lambda: ev.utcnow() + timedelta(hours=1))
    try:
        honest.scraper.start()
        assert engine.metrics_hits == 1
        ahead.scraper.start()
        ahead.scraper.run_due()
        assert engine.metrics_hits == 1, "the replica ahead claimed the interval early"
        time.sleep(interval)
        ahead.scraper.run_due()  # now it is due by the database's clock
        assert engine.metrics_hits == 2
        assert ahead.counter("ok", "skew") == 1
    finally:
        honest.close()
        ahead.close()
    rows = _pool_rows(pg_url, "skew")
    assert len(rows) == 2
    first, second = sorted(r.ts for r in rows)
    assert interval <= (second - first).total_seconds() < interval + 30


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.empty_db  # no schema yet: the first pass must fail
def test_a_database_that_was_down_at_start_gets_the_targets_later(
    db_url: str, engine: FakeEngine
) -> None:
    """The first pass failed (no schema yet: the database was not ready); the targets'
    rows are made by the first claim that finds none."""
    from collector import migrate

    targets = _targets({"url": engine.url, "engine": "sglang", "deployment_id": "late"})
    replica = Replica(db_url, targets, "early")
    try:
        with pytest.raises(Exception, match="scrape_targets"):
            replica.scraper.start()
        assert engine.metrics_hits == 0
        migrate.upgrade(db_url)
        replica.scraper.run_due()
    finally:
        replica.close()
    assert engine.metrics_hits == 1
    assert len(_pool_rows(db_url, "late")) == 1
    assert len(_configs(db_url, "late")) == 1


_REFUSE_CONFIGS = {
    "sqlite": [
        "CREATE TRIGGER refuse BEFORE INSERT ON deployment_configs "
        "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
        "CREATE TRIGGER refuse BEFORE INSERT ON deployment_configs "
        "FOR EACH ROW EXECUTE FUNCTION refuse()",
    ],
}
_ALLOW_CONFIGS = {
    "sqlite": ["DROP TRIGGER refuse"],
    "postgresql": ["DROP TRIGGER refuse ON deployment_configs", "DROP FUNCTION refuse()"],
}


def test_a_config_whose_batch_was_not_stored_goes_out_again(
    db_url: str, engine: FakeEngine
) -> None:
    """Storing the batch that carried a target's engine.config failed with an error that
    is no outage (a trigger refuses the row: the database's own error, untranslated). The
    config's hash is not kept, so the next scrape sends the config again; the failure is
    the target's, counted, not the pass's."""
    from collector import migrate

    migrate.upgrade(db_url)
    targets = _targets(
        {"url": engine.url, "engine": "sglang", "deployment_id": "cfg", "interval_s": 0.05}
    )
    db = Database(db_url)
    replica = Replica(db_url, targets, "r")
    try:
        with db.write() as conn:
            for sql in _REFUSE_CONFIGS[db.dialect]:
                conn.exec_driver_sql(sql)
        replica.scraper.start()
        assert engine.metrics_hits == 1
        assert replica.counter("not_stored", "cfg") == 1
        assert _configs(db_url, "cfg") == [] and _pool_rows(db_url, "cfg") == []
        with db.write() as conn:
            for sql in _ALLOW_CONFIGS[db.dialect]:
                conn.exec_driver_sql(sql)
        _wait("the next scrape", lambda: replica.scraper.run_due() or engine.metrics_hits >= 2)
    finally:
        replica.close()
        db.dispose()
    assert replica.counter("ok", "cfg") == 1
    (config,) = _configs(db_url, "cfg")
    assert config.pool_capacity_tokens == SMALL["max_total_num_tokens"]
    assert len(_pool_rows(db_url, "cfg")) == 1


@pytest.mark.postgres
def test_two_replicas_scrape_each_interval_exactly_once(pg_url: str, engine: FakeEngine) -> None:
    from collector import migrate
    from collector.app import create_app

    migrate.upgrade(pg_url)
    interval = 0.25
    targets = _targets(
        {"url": engine.url, "engine": "sglang", "deployment_id": "glm-pg", "interval_s": interval}
    )
    apps = [
        create_app(_collector_settings(pg_url, targets), scraper=scrape_target) for _ in range(2)
    ]
    with serve_in_thread(apps[0]), serve_in_thread(apps[1]):
        _wait("eight scrapes", lambda: engine.metrics_hits >= 8)
    # Both collectors have stopped, each after finishing the pass it was in.
    ok = [_counter(_exposition(app), 'result="ok"', "glm-pg") for app in apps]
    rows = _pool_rows(pg_url, "glm-pg")
    # Every fetch of /metrics was stored exactly once, by whichever replica made it.
    assert len(rows) == engine.metrics_hits == sum(ok)
    db = Database(pg_url)
    try:
        with db.read() as conn:
            (target,) = conn.execute(select(m.ScrapeTarget)).all()
            probe = conn.execute(select(m.Probe).where(m.Probe.probe_id == target.probe_id)).one()
            gaps = conn.execute(select(m.SeqGap)).all()
            configs = conn.execute(select(m.DeploymentConfig)).all()
            alerts = conn.execute(
                select(m.Alert.state).where(
                    m.Alert.rule == "pool_below_advertised", m.Alert.deployment_id == "glm-pg"
                )
            ).all()
    finally:
        db.dispose()
    # One engine.config (the figures never changed) plus one pool.sample per scrape, seqs
    # 1..n without a gap or a duplicate.
    assert target.seq == probe.max_seq == probe.accepted == len(rows) + 1
    assert probe.duplicates == 0 and gaps == [] and len(configs) == 1
    assert [a.state for a in alerts] == ["firing"]  # one alert, whichever replica raised it
    # The claim spaces scrapes by the interval: never two in one interval.
    times = sorted(r.ts for r in rows)
    # (a few us: the claim floors the clock to microseconds, the stored ts rounds it)
    assert all((b - a).total_seconds() >= interval - 1e-5 for a, b in itertools.pairwise(times))


def _exposition(app: Any) -> str:
    from prometheus_client import generate_latest

    return generate_latest(app.state.metrics.registry).decode()


def _counter(text: str, result: str, deployment: str) -> int:
    total = 0
    for line in text.splitlines():
        mine = f'deployment_id="{deployment}"' in line
        if line.startswith("kvwatch_scrapes_total{") and result in line and mine:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_target_that_is_down_is_counted_and_nothing_else_stops(
    db_url: str, engine: FakeEngine, exposition: dict[str, str]
) -> None:
    from collector import migrate
    from collector.app import create_app

    migrate.upgrade(db_url)
    down = FakeEngine(exposition["large"], engine.server_info)
    down.stop()
    targets = _targets(
        {"url": engine.url, "engine": "sglang", "deployment_id": "up", "interval_s": 0.1},
        {"url": down.url, "engine": "sglang", "deployment_id": "down", "interval_s": 0.1},
        # an engine that is not SGLang at all
        {"url": engine.url, "engine": "vllm", "deployment_id": "wrong", "interval_s": 0.1},
    )
    with serve_in_thread(
        create_app(_collector_settings(db_url, targets), scraper=scrape_target)
    ) as url:
        _wait(
            "failures counted",
            lambda: _counter(httpx.get(f"{url}/metrics").text, 'result="target_down"', "down") >= 2,
        )
        text = httpx.get(f"{url}/metrics").text
        assert _counter(text, 'result="not_that_engine"', "wrong") >= 1
        assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
        _wait("samples of the live target", lambda: len(_pool_rows(db_url, "up")) >= 2)
        assert _pool_rows(db_url, "down") == []
        down.start()  # it comes up: its events start at seq 1, no gap for the outage
        _wait("samples once it is up", lambda: len(_pool_rows(db_url, "down")) >= 2)
    down.stop()
    db = Database(db_url)
    try:
        with db.read() as conn:
            assert conn.execute(select(m.SeqGap)).all() == []
            rows = {t.deployment_id: t for t in conn.execute(select(m.ScrapeTarget)).all()}
    finally:
        db.dispose()
    assert (
        rows["wrong"].last_error is not None
        and "vllm:cache_config_info" in rows["wrong"].last_error
    )
    assert rows["down"].last_error is None and rows["down"].failures == 0
    # The collector made each target its own ingest token, scoped to its deployment.
    assert len({r.token_id for r in rows.values()}) == 3


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_target_with_its_own_token_is_stored_as_that_token_would_post(
    db_url: str, engine: FakeEngine
) -> None:
    from collector import migrate
    from collector.app import create_app

    migrate.upgrade(db_url)
    mine = make_token(db_url, "ingest", deployment_id="tok")
    other = make_token(db_url, "ingest", deployment_id="elsewhere")
    targets = _targets(
        {"url": engine.url, "engine": "sglang", "deployment_id": "tok", "token": mine},
        {"url": engine.url, "engine": "sglang", "deployment_id": "scoped", "token": other},
    )
    app = create_app(_collector_settings(db_url, targets), scraper=scrape_target)
    with serve_in_thread(app):
        _wait("a sample", lambda: len(_pool_rows(db_url, "tok")) >= 1)
        _wait("a refusal", lambda: _counter(_exposition(app), 'result="not_stored"', "scoped") >= 1)
    db = Database(db_url)
    try:
        with db.read() as conn:
            rows = {t.deployment_id: t for t in conn.execute(select(m.ScrapeTarget)).all()}
            owner = conn.execute(
                select(m.Probe.token_id).where(m.Probe.probe_id == rows["tok"].probe_id)
            ).scalar_one()
            configured = conn.execute(
                select(m.ApiToken.id).where(m.ApiToken.deployment_id == "tok")
            ).scalar_one()
    finally:
        db.dispose()
    # Stored under the configured token (the collector minted none for these targets) ...
    assert owner == configured and {r.token_id for r in rows.values()} == {None}
    # ... and a token scoped to another deployment is refused, as POST /v1/events refuses it.
    assert "may only write deployment 'elsewhere'" in (rows["scoped"].last_error or "")
    assert _pool_rows(db_url, "scoped") == []


def test_bad_scrape_targets_setting_names_the_entry_and_field(tmp_path: Path) -> None:
    bad = _targets(
        {"url": "http://127.0.0.1:1", "engine": "sglang", "deployment_id": "ok"},
        {"url": "http://127.0.0.1:2", "engine": "tgi", "deployment_id": "d"},
    )
    r = subprocess.run(
        [*KVWATCH, "serve"],
        env=_env(
            None, KVWATCH_SCRAPE_TARGETS=bad, KVWATCH_DATABASE_URL=f"sqlite:///{tmp_path}/k.db"
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    said = " ".join(r.stderr.split())
    assert "KVWATCH_SCRAPE_TARGETS" in said and "entry 1 (http://127.0.0.1:2), field engine" in said


def test_a_target_the_scraper_cannot_read_stops_serve_naming_the_entry(tmp_path: Path) -> None:
    """A target's URL is the scraper's to read; kvwatch serve asks it before serving, so a
    URL it refuses ends the command like a bad setting (and before any worker starts)."""
    bad = _targets(
        {"url": "http://127.0.0.1:1", "engine": "sglang", "deployment_id": "ok"},
        {"url": "ftp://user:secret@127.0.0.1/metrics", "engine": "vllm", "deployment_id": "d"},
    )
    for workers in ("1", "2"):
        r = subprocess.run(
            [*KVWATCH, "serve", "--workers", workers],
            env=_env(
                None, KVWATCH_SCRAPE_TARGETS=bad, KVWATCH_DATABASE_URL=f"sqlite:///{tmp_path}/k.db"
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        said = " ".join(r.stderr.split())
        assert "KVWATCH_SCRAPE_TARGETS: entry 1 (deployment d)" in said, said
        assert "must be an http:// or https:// URL" in said and "secret" not in said
        assert "Traceback" not in said


def test_an_app_with_targets_but_no_scraper_refuses_to_start(tmp_path: Path) -> None:
    """Nothing would scrape them: said at once, not left to look like engines that are down."""
    from collector.app import create_app
    from collector.scrape import UnusableScrapeTargets

    targets = _targets({"url": "http://127.0.0.1:1", "engine": "vllm", "deployment_id": "d"})
    settings = _collector_settings(f"sqlite:///{tmp_path}/k.db", targets)
    with pytest.raises(UnusableScrapeTargets, match="lists 1 target, but this collector has no"):
        create_app(settings)
