"""Nothing is lost across a collector outage: SIGKILL the real collector process mid-stream,
restart it, and find every event exactly once in the database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from collector import migrate
from engine_probe import Probe, ProbeSettings
from engine_probe.events import PoolSample, RequestAdmitted
from tests.conftest import free_port, make_token

pytestmark = pytest.mark.slow


# How long a process may take to start serving. It imports pandas, fpdf and the app (seen
# taking 19 s on a slow 2-core machine): a start is judged a failure only well past that.
START_TIMEOUT_S = 120


def start_collector(
    db_url: str, port: int, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``kvwatch serve`` as a process, ready; ``env``: more settings (the ingest bus)."""
    env = (
        os.environ | {"KVWATCH_DATABASE_URL": db_url, "KVWATCH_AUTO_MIGRATE": "false"} | (env or {})
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("collector did not become ready")


def test_sigkill_mid_stream_loses_nothing(db_url: str, tmp_path: Path) -> None:
    migrate.upgrade(db_url)
    token = make_token(db_url, "ingest")
    port = free_port()
    log = tmp_path / "collector.log"
    proc = start_collector(db_url, port, log)
    probe = Probe(
        ProbeSettings(
            collector_url=f"http://127.0.0.1:{port}",
            ingest_token=token,
            deployment_id="outage-test",
            probe_spool_dir=tmp_path / "spool",
            probe_batch_size=40,
            probe_flush_interval_s=0.02,
            probe_backoff_base_s=0.02,
            probe_backoff_max_s=0.2,
            probe_request_timeout_s=2,
        )
    )
    total = 3000
    emitted = 0

    def produce(n: int) -> None:
        nonlocal emitted
        for i in range(emitted, emitted + n):
            if i % 2:
                probe.emit(
                    PoolSample, node="n0", capacity_tokens=10**6, used_tokens=i, free_tokens=0
                )
            else:
                probe.emit(
                    RequestAdmitted, request_id=f"r{i}", tenant="acme", model_id="m",
                    prompt_tokens=i,
                )  # fmt: skip
        emitted += n

    try:
        produce(1000)
        # Kill while batches are in flight: some landed, the rest are being sent.
        deadline = time.monotonic() + 30
        while probe.stats()["sent"] < 200 and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        sent_at_kill = probe.stats()["sent"]
        produce(1000)  # nobody listens: this goes to the spool
        deadline = time.monotonic() + 30
        while probe.stats()["spooled"]["events"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        spooled_during_outage = probe.stats()["spooled"]["events"]
        proc = start_collector(db_url, port, log)
        produce(1000)
        assert probe.force_flush(60), probe.stats()
        # force_flush guarantees "delivered or spooled"; wait for the spool to drain too.
        deadline = time.monotonic() + 60
        while probe.stats()["sent"] < total and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        probe.shutdown(10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)

    stats = probe.stats()
    assert sum(stats["dropped"].values()) == 0, stats
    assert sent_at_kill < 1000  # the kill landed mid-stream, with batches still to send
    assert spooled_during_outage > 0  # and the outage really went through the spool
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            n_req = conn.execute(text("SELECT count(*), count(DISTINCT request_id) FROM requests"))
            assert tuple(n_req.one()) == (total // 2, total // 2)
            n_pool = conn.execute(
                text("SELECT count(*), count(DISTINCT used_tokens) FROM pool_samples")
            )
            assert tuple(n_pool.one()) == (total // 2, total // 2)
            probe_row = conn.execute(
                text("SELECT max_seq, accepted FROM probes WHERE probe_id = :p"),
                {"p": probe.probe_id},
            ).one()
            assert tuple(probe_row) == (total + 1, total + 1)  # and probe.stopped
            assert conn.execute(text("SELECT count(*) FROM seq_gaps")).scalar_one() == 0
    finally:
        engine.dispose()
