"""The ingest bus on a real 3-node NATS JetStream cluster (the installed ``nats-server``, on
loopback): ``kvwatch serve --bus`` and ``kvwatch writer`` as processes, real probes sending.
Every scenario counts each event by ``(probe_id, seq)`` in the database: 0 lost, 0 stored
twice, and the alert a direct ingest would raise raised once.

Each scenario runs on one backend, to keep the suite's time bounded: PostgreSQL where two
writers really write at once (the order test) or a killed writer's transaction must roll
back on the server (the writer kill), and for the database restart; SQLite elsewhere (the
bus is what is under test there, and the store is the same code)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from sqlalchemy import create_engine, text

from engine_probe import Probe, ProbeSettings
from engine_probe.events import PoolSample
from kvwatch.bus_cluster import LocalCluster
from tests import factories as f
from tests.conftest import free_port, make_token
from tests.test_dashboard_app import open_page
from tests.test_faults import _pg_ctl, _pg_up, can_restart_pg
from tests.test_outage import START_TIMEOUT_S, start_collector

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KVWATCH = [sys.executable, "-m", "kvwatch.cli"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("nats")) as c:
        yield c


class Bus:
    """One scenario's stream on the cluster (its own name), and the processes around it."""

    def __init__(self, cluster: LocalCluster, db_url: str, tmp: Path, **settings: str):
        tag = uuid.uuid4().hex[:8]
        self.cluster = cluster
        self.db_url = db_url
        self.tmp = tmp
        self.stream = f"T{tag}"
        self.env = {
            "KVWATCH_BUS_URL": cluster.url,
            "KVWATCH_BUS_STREAM": self.stream,
            "KVWATCH_BUS_SUBJECT": f"t{tag}",
            "KVWATCH_BUS_PARTITIONS": "2",
            "KVWATCH_BUS_ACK_WAIT_S": "2",
            "KVWATCH_BUS_RETRY_AFTER_S": "1",
            "KVWATCH_BUS_STATUS_INTERVAL_S": "0.5",
            "KVWATCH_BUS_CONNECT_TIMEOUT_S": "20",
            **settings,
        }
        self.collectors: list[subprocess.Popen[bytes]] = []
        self.writers: list[subprocess.Popen[bytes]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def collector(self) -> subprocess.Popen[bytes]:
        proc = start_collector(self.db_url, self.port, self.tmp / "collector.log", self.env)
        self.collectors.append(proc)
        return proc

    def writer(self, *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"writer{len(self.writers)}.log"
        env = os.environ | {"KVWATCH_DATABASE_URL": self.db_url} | self.env
        proc = subprocess.Popen(
            [*KVWATCH, "writer", *args], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while "writer: stream" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"writer did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.writers.append(proc)
        return proc

    def probe(self, token: str, name: str, dep: str, batch: int = 500) -> Probe:
        return Probe(
            ProbeSettings(
                collector_url=self.url,
                ingest_token=token,
                deployment_id=dep,
                probe_id=name,
                probe_spool_dir=self.tmp / f"spool-{name}",
                probe_batch_size=batch,
                probe_flush_interval_s=0.02,
                probe_backoff_base_s=0.05,
                probe_backoff_max_s=1.0,
                probe_request_timeout_s=10,
            )
        )

    def info(self) -> Any:
        async def read() -> Any:
            nc = await nats.connect(self.cluster.url.split(","))
            try:
                return await nc.jetstream(timeout=5).stream_info(self.stream)
            finally:
                await nc.close()

        return asyncio.run(read())

    def stop(self) -> None:
        for p in self.collectors + self.writers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.collectors + self.writers:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def bus_factory(cluster: LocalCluster, tmp_path: Path) -> Iterator[Any]:
    made: list[Bus] = []

    def make(db_url: str, **settings: str) -> Bus:
        b = Bus(cluster, db_url, tmp_path, **settings)
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


def _emit_samples(probe: Probe, start: int, n: int) -> None:
    for i in range(start, start + n):
        probe.emit(PoolSample, node="n0", capacity_tokens=10**6, used_tokens=i, free_tokens=0)


def _sent(probe: Probe, total: int, timeout_s: float = 120) -> None:
    assert probe.force_flush(timeout_s), probe.stats()
    deadline = time.monotonic() + timeout_s
    while probe.stats()["sent"] < total and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = probe.stats()
    assert stats["sent"] == total, stats
    assert sum(stats["dropped"].values()) == 0, stats


def _stored(db_url: str, total: int, timeout_s: float = 120) -> tuple[int, int]:
    """Pool samples stored: (rows, distinct (probe_id, seq)), once the writers caught up to
    ``total`` (or the time is up: then what is there)."""
    engine = create_engine(db_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with engine.connect() as conn:
                rows, distinct = conn.execute(
                    text(
                        "SELECT count(*), count(DISTINCT probe_id || ':' || CAST(seq AS TEXT)) "
                        "FROM pool_samples"
                    )
                ).one()
            if rows >= total or time.monotonic() > deadline:
                time.sleep(0.5)  # nothing more may come (a duplicate would come late)
                with engine.connect() as conn:
                    again = conn.execute(text("SELECT count(*) FROM pool_samples")).scalar_one()
                return int(again), int(distinct)
            time.sleep(0.1)
    finally:
        engine.dispose()


def _query(db_url: str, sql: str) -> list[Any]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)).all())
    finally:
        engine.dispose()


def _post(url: str, token: str, events: list[Any]) -> httpx.Response:
    body = [f.as_json(e) for e in events]
    return httpx.post(
        f"{url}/v1/events",
        content=json.dumps(body, default=str),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        timeout=20,
    )


def _firing(url: str, admin: str, rule: str) -> list[dict[str, Any]]:
    got = httpx.get(
        f"{url}/v1/alerts",
        params={"state": "firing", "rule": rule},
        headers={"Authorization": f"Bearer {admin}"},
        timeout=10,
    )
    got.raise_for_status()
    return list(got.json())


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_stream_leader_killed_during_100k_events_loses_nothing(
    bus_factory: Any, db_url: str
) -> None:
    bus = bus_factory(db_url)
    token = make_token(db_url, "ingest")
    bus.collector()
    bus.writer()
    probe = bus.probe(token, "leader-kill", "dep-a", batch=2000)
    total = 100_000
    killed = None
    try:
        _emit_samples(probe, 0, 40_000)
        time.sleep(0.3)
        leader = bus.info().cluster.leader
        killed = int(leader.removeprefix("n"))
        bus.cluster.kill_node(killed)
        _emit_samples(probe, 40_000, total - 40_000)
        _sent(probe, total)
        # a stale page read, published after the election: its alert is raised once
        assert _post(bus.url, token, [f.stale_read(1, probe="reader", dep="dep-a")]).is_success
        assert _stored(db_url, total) == (total, total)
        assert bus.info().cluster.leader != leader  # a new leader took over
    finally:
        probe.shutdown(10)
        if killed is not None:
            bus.cluster.start_node(killed)
            bus.cluster.wait()
    alerts = _query(db_url, "SELECT rule FROM alerts WHERE rule = 'stale_page_read'")
    assert len(alerts) == 1, alerts


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_a_writer_sigkilled_three_times_loses_nothing(bus_factory: Any, db_url: str) -> None:
    bus = bus_factory(db_url)
    token = make_token(db_url, "ingest")
    bus.collector()
    writer = bus.writer()
    probe = bus.probe(token, "writer-kill", "dep-b", batch=200)
    total = 30_000
    try:
        for k in range(3):
            _emit_samples(probe, k * 10_000, 10_000)
            time.sleep(0.4)  # the writer is mid-stream
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
            writer = bus.writer()
        _sent(probe, total)
        assert _stored(db_url, total) == (total, total)
    finally:
        probe.shutdown(10)
    ((max_seq, accepted),) = _query(
        db_url, f"SELECT max_seq, accepted FROM probes WHERE probe_id = '{probe.probe_id}'"
    )
    assert max_seq == accepted >= total  # every seq stored once (and its probe.stopped)
    assert _query(db_url, "SELECT * FROM seq_gaps") == []


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_retried_batch_is_stored_once(bus_factory: Any, db_url: str, tmp_path: Path) -> None:
    """The collector published, then died before answering: the probe sends the batch again
    (to the restarted collector). The stream de-duplicates it; were it past the stream's
    window, the store would."""
    bus = bus_factory(db_url)
    token = make_token(db_url, "ingest")
    batch = [f.pool(i, probe="retry", dep="dep-c") for i in range(1, 51)]
    first = bus.collector()
    assert _post(bus.url, token, batch).json() == {"accepted": 50, "duplicates": 0, "gaps": []}
    first.send_signal(signal.SIGKILL)  # its answer never reached the probe
    first.wait(10)
    bus.collector()
    assert _post(bus.url, token, batch).json() == {"accepted": 0, "duplicates": 50, "gaps": []}
    bus.writer()
    assert _stored(db_url, 50) == (50, 50)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_collector_killed_mid_stream_loses_nothing(bus_factory: Any, db_url: str) -> None:
    bus = bus_factory(db_url)
    token = make_token(db_url, "ingest")
    bus.writer()
    collector = bus.collector()
    probe = bus.probe(token, "collector-kill", "dep-d", batch=300)
    total = 20_000
    try:
        for k in range(2):
            _emit_samples(probe, k * 10_000, 10_000)
            time.sleep(0.2)
            collector.send_signal(signal.SIGKILL)
            collector.wait(10)
            collector = bus.collector()
        _sent(probe, total)
        assert _stored(db_url, total) == (total, total)
    finally:
        probe.shutdown(10)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_full_stream_answers_503_and_the_probe_replays_after_it_drains(
    bus_factory: Any, db_url: str
) -> None:
    bus = bus_factory(db_url, KVWATCH_BUS_MAX_MSGS="3")
    token = make_token(db_url, "ingest")
    bus.collector()
    # no writer yet: the stream fills
    answers = [_post(bus.url, token, [f.pool(i, probe="direct", dep="dep-e")]) for i in range(1, 6)]
    assert [a.status_code for a in answers] == [200, 200, 200, 503, 503]
    full = answers[-1]
    assert full.headers["Retry-After"] == "1"
    assert full.json()["error"]["code"] == "bus_full"
    probe = bus.probe(token, "spooler", "dep-e", batch=100)
    total = 2_000
    try:
        _emit_samples(probe, 0, total)
        time.sleep(1.5)
        stats = probe.stats()
        assert stats["sent"] < total and stats["spooled"]["events"] > 0, stats
        bus.writer()  # the stream drains; the probe replays its spool
        _sent(probe, total)
    finally:
        probe.shutdown(10)
    assert _stored(db_url, total + 3) == (total + 3, total + 3)


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_a_deployment_is_stored_in_order_by_two_writers(bus_factory: Any, db_url: str) -> None:
    """Eight deployments over four partitions, two writers taking turns: were one
    deployment's batches stored out of order, its probe would show seq gaps while the later
    batch waited (the store records them, and telemetry_gap alerts on them)."""
    bus = bus_factory(db_url, KVWATCH_BUS_PARTITIONS="4")
    token = make_token(db_url, "ingest")
    bus.collector()
    bus.writer()
    bus.writer("--partitions", "0,1,2,3")
    probes = [bus.probe(token, f"order-{d}", f"dep-{d}", batch=50) for d in range(8)]
    per = 2_000
    try:
        for i in range(0, per, 50):
            for p in probes:
                _emit_samples(p, i, 50)
        for p in probes:
            _sent(p, per)
        assert _stored(db_url, per * len(probes)) == (per * len(probes),) * 2
    finally:
        for p in probes:
            p.shutdown(10)
    # no gap ever opened: every batch found its predecessor stored
    gaps = _query(db_url, "SELECT count(*) FROM alerts WHERE labels LIKE '%seq_gap%'")
    assert gaps == [(0,)]
    assert _query(db_url, "SELECT count(*) FROM seq_gaps") == [(0,)]


@pytest.mark.postgres
@pytest.mark.serial  # every other test's PostgreSQL goes down with it
@can_restart_pg
def test_postgresql_restarted_during_ingest_never_reaches_the_probes(
    bus_factory: Any, pg_url: str
) -> None:
    bus = bus_factory(pg_url)
    token = make_token(pg_url, "ingest")
    bus.collector()
    bus.writer()
    statuses: Counter[int] = Counter()
    stop = threading.Event()

    def watch() -> None:
        """Tiny batches straight at the collector: what does it answer while the database
        is away?"""
        seq = 0
        with httpx.Client(base_url=bus.url, headers={"Authorization": f"Bearer {token}"}) as h:
            while not stop.is_set():
                seq += 1
                body = [f.as_json(f.pool(seq, probe="watcher", dep="pg-restart"))]
                try:
                    r = h.post("/v1/events", content=json.dumps(body, default=str), timeout=10)
                    statuses[r.status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    probe = bus.probe(token, "pg-probe", "pg-restart", batch=100)
    total = 3_000
    try:
        watcher.start()
        _emit_samples(probe, 0, 1_000)
        _pg_ctl("stop")
        try:
            _emit_samples(probe, 1_000, 1_000)
            time.sleep(6.0)  # past the token cache: known tokens ride out the outage
        finally:
            _pg_ctl("start")
            _pg_up()
        _emit_samples(probe, 2_000, 1_000)
        _sent(probe, total)
    finally:
        stop.set()
        watcher.join(20)
        probe.shutdown(10)
    assert set(statuses) == {200}, statuses  # never a 503: the stream had room
    watched = statuses[200]
    assert _stored(pg_url, total + watched) == (total + watched, total + watched)
    # batches handed back while the database was away kept their place: no seq ever
    # arrived ahead of its predecessor (that would have opened a gap, and a seq_gap alert)
    gaps = _query(pg_url, "SELECT count(*) FROM alerts WHERE labels LIKE '%seq_gap%'")
    assert gaps == [(0,)]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_bus_lag_is_seen_in_status_metrics_alerts_and_the_fleet(
    bus_factory: Any, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("KVWATCH_COLLECTOR_URL", "KVWATCH_DASHBOARD_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KVWATCH_DASHBOARD_REFRESH_S", "0")
    dashboard_env = monkeypatch
    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "ops.yaml").write_text(
        "pack: ops\nrules:\n  - name: bus_lag_fast\n    kind: bus_lag\n"
        "    params: {lag_after: 1s}\n"
    )
    bus = bus_factory(db_url, KVWATCH_POLICY_PACKS_DIR=str(packs), KVWATCH_POLICY_TIMER_S="0.5")
    token = make_token(db_url, "ingest")
    admin = make_token(db_url, "admin")
    bus.collector()
    assert _post(bus.url, token, [f.pool(1, probe="lagging", dep="dep-f")]).is_success
    env = os.environ | bus.env
    deadline = time.monotonic() + 30
    firing: list[dict[str, Any]] = []
    while not firing and time.monotonic() < deadline:
        time.sleep(0.5)
        firing = _firing(bus.url, admin, "bus_lag_fast")
    assert firing, "bus_lag did not fire"
    assert firing[0]["labels"]["problem"] == "lag"
    ready = httpx.get(f"{bus.url}/readyz")  # the bus answers: ready, lag or not
    assert ready.status_code == 200 and ready.json()["status"] == "ok", ready.text
    metrics = httpx.get(f"{bus.url}/metrics").text
    lags = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvwatch_bus_lag_seconds{")
    ]
    assert max(lags) > 1.0, lags
    status = subprocess.run(
        [*KVWATCH, "bus", "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 1, status.stderr
    assert "bus_lag: partition" in status.stderr and "waited" in status.stderr
    as_json = subprocess.run(
        [*KVWATCH, "bus", "status", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    doc = json.loads(as_json.stdout)
    assert doc["pending"] == 1 and doc["replicas"] == 3 and doc["stream"] == bus.stream
    # where a person looks: the fleet page, above the cards (no deployment would show it)
    fleet = open_page(dashboard_env, bus.url, admin, "views/fleet.py")
    (banner,) = [w.value for w in fleet.warning if w.value.startswith("**bus_lag_fast**")]
    assert "whole installation" in banner and "has waited" in banner
    assert any("Events wait on the ingest bus" in i.value for i in fleet.info)
    bus.writer()
    assert _stored(db_url, 1) == (1, 1)
    deadline = time.monotonic() + 30
    while firing and time.monotonic() < deadline:
        time.sleep(0.5)
        firing = _firing(bus.url, admin, "bus_lag_fast")
    assert not firing, "bus_lag did not resolve once the writer caught up"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_bus_that_cannot_be_reached_is_one_line_without_its_password(
    db_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = os.environ | {
        "KVWATCH_DATABASE_URL": db_url,
        "KVWATCH_BUS_CONNECT_TIMEOUT_S": "1",
    }
    for cmd in (
        ["serve", "--port", str(free_port()), "--bus", f"nats://kv:s3cret@127.0.0.1:{port}"],
        ["writer", "--bus", f"nats://kv:s3cret@127.0.0.1:{port}"],
        ["bus", "status", "--bus", f"nats://kv:s3cret@127.0.0.1:{port}"],
    ):
        r = subprocess.run([*KVWATCH, *cmd], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "s3cret" not in r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        assert f"nats://127.0.0.1:{port}" in r.stderr, r.stderr


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_cluster_down_is_not_ready_and_answers_503(bus_factory: Any, db_url: str) -> None:
    bus = bus_factory(db_url)
    token = make_token(db_url, "ingest")
    bus.collector()
    assert httpx.get(f"{bus.url}/readyz").status_code == 200
    nodes = range(bus.cluster.nodes)
    try:
        for i in nodes:
            bus.cluster.kill_node(i)
        deadline = time.monotonic() + 20
        ready = httpx.get(f"{bus.url}/readyz")
        while ready.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            ready = httpx.get(f"{bus.url}/readyz")
        assert ready.status_code == 503, ready.text
        assert "bus" in ready.json()["detail"]
        refused = _post(bus.url, token, [f.pool(1, probe="down", dep="dep-g")])
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "bus_unavailable"
        assert refused.headers["Retry-After"] == "1"
        metrics = httpx.get(f"{bus.url}/metrics").text
        assert "kvwatch_bus_up 0.0" in metrics, [
            line for line in metrics.splitlines() if "bus_up" in line
        ]
    finally:
        for i in nodes:
            bus.cluster.start_node(i)
        bus.cluster.wait()
    # back: the same batch is accepted and stored once
    deadline = time.monotonic() + 30
    answer = _post(bus.url, token, [f.pool(1, probe="down", dep="dep-g")])
    while answer.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        answer = _post(bus.url, token, [f.pool(1, probe="down", dep="dep-g")])
    assert answer.status_code == 200, answer.text
    bus.writer()
    assert _stored(db_url, 1) == (1, 1)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_bus_refuses_what_direct_ingest_refuses(bus_factory: Any, db_url: str) -> None:
    """Over the token's new-name limits: 429 before publishing (the probe keeps the batch),
    not a batch a writer would have to drop. Over the servers' max_payload: 413, which
    makes a probe split the batch (a 503 would have it resend it for ever)."""
    bus = bus_factory(
        db_url, KVWATCH_MAX_NEW_DEPLOYMENTS_PER_HOUR="1", KVWATCH_MAX_BATCH_EVENTS="60000"
    )
    token = make_token(db_url, "ingest")
    bus.collector()
    bus.writer()
    assert _post(bus.url, token, [f.pool(1, probe="names-1", dep="dep-h1")]).status_code == 200
    assert _stored(db_url, 1) == (1, 1)
    over = _post(bus.url, token, [f.pool(1, probe="names-2", dep="dep-h2")])
    assert over.status_code == 429, over.text
    assert "KVWATCH_MAX_NEW_DEPLOYMENTS_PER_HOUR" in over.json()["error"]["message"]
    big = [f.pool(i, probe="names-1", dep="dep-h1") for i in range(2, 40_002)]
    too_large = _post(bus.url, token, big)
    assert too_large.status_code == 413, too_large.text
    assert "max_payload" in too_large.json()["error"]["message"]
    halves = [big[: len(big) // 2], big[len(big) // 2 :]]
    assert [_post(bus.url, token, h).status_code for h in halves] == [200, 200]
    assert _stored(db_url, 40_001) == (40_001, 40_001)
