"""Faults survived with nothing lost or half-written: PostgreSQL restarted under ingest, and
a collector process killed (SIGKILL) while it builds a breach report or runs migrations."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, insert, select, text

from collector import audit, migrate
from collector import models as m
from collector.db import Database
from engine_probe import Probe, ProbeSettings
from engine_probe.events import RequestAdmitted
from tests import factories as f
from tests.conftest import free_port, make_token
from tests.test_outage import start_collector

pytestmark = pytest.mark.slow
KVWATCH = [sys.executable, "-m", "kvwatch.cli"]


def _pg_ctl(action: str) -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    cmd = ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action]
    if action == "stop":
        cmd += ["-m", "fast"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


def _pg_up(timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1"], check=False).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("PostgreSQL did not come back")


can_restart_pg = pytest.mark.skipif(
    shutil.which("pg_ctlcluster") is None
    or not os.path.isdir("/etc/postgresql")
    or os.geteuid() != 0,
    reason="restarting PostgreSQL needs pg_ctlcluster and root (as in CI)",
)


@pytest.mark.postgres
@pytest.mark.serial  # every other test's PostgreSQL goes down with it
@can_restart_pg
def test_postgresql_restarted_under_ingest_answers_503_and_loses_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    migrate.upgrade(pg_url)
    token = make_token(pg_url, "ingest")
    port = free_port()
    proc = start_collector(pg_url, port, tmp_path / "collector.log")
    url = f"http://127.0.0.1:{port}"
    probe = Probe(
        ProbeSettings(
            collector_url=url,
            ingest_token=token,
            deployment_id="restart-test",
            probe_spool_dir=tmp_path / "spool",
            probe_batch_size=50,
            probe_flush_interval_s=0.02,
            probe_backoff_base_s=0.05,
            probe_backoff_max_s=0.5,
            probe_request_timeout_s=5,
        )
    )
    statuses: Counter[int] = Counter()
    stop = threading.Event()

    def watch() -> None:
        """A second producer posting tiny batches straight at the collector: what does it
        answer while the database is away?"""
        seq = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as h:
            while not stop.is_set():
                seq += 1
                body = [f.as_json(f.pool(seq, probe="watcher", dep="restart-test"))]
                try:
                    statuses[h.post("/v1/events", json=body, timeout=10).status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    total = 3000
    try:
        watcher.start()
        for i in range(1000):
            probe.emit(RequestAdmitted, request_id=f"r{i}", tenant="acme", model_id="m",
                       prompt_tokens=i)  # fmt: skip
        _pg_ctl("stop")
        try:
            for i in range(1000, 2000):
                probe.emit(RequestAdmitted, request_id=f"r{i}", tenant="acme", model_id="m",
                           prompt_tokens=i)  # fmt: skip
            time.sleep(2.0)  # the outage: batches are refused, retried, spooled
        finally:
            _pg_ctl("start")
            _pg_up()
        for i in range(2000, total):
            probe.emit(RequestAdmitted, request_id=f"r{i}", tenant="acme", model_id="m",
                       prompt_tokens=i)  # fmt: skip
        assert probe.force_flush(60), probe.stats()
        deadline = time.monotonic() + 60
        while probe.stats()["sent"] < total and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let the watcher land a few batches after the restart
    finally:
        stop.set()
        watcher.join(20)
        probe.shutdown(10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)

    assert statuses[500] == 0, statuses  # never a 500
    assert statuses[503] > 0, statuses  # the outage was seen, and answered "retry"
    assert set(statuses) <= {200, 503}, statuses
    stats = probe.stats()
    assert sum(stats["dropped"].values()) == 0, stats
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            n = conn.execute(text("SELECT count(*), count(DISTINCT request_id) FROM requests"))
            assert tuple(n.one()) == (total, total)
            watched = conn.execute(
                text("SELECT count(*) FROM pool_samples WHERE probe_id = 'watcher'")
            ).scalar_one()
            assert watched == statuses[200]  # every accepted batch stored, none twice
    finally:
        engine.dispose()


def _seed_big_window(db_url: str, n: int) -> None:
    migrate.upgrade(db_url)
    t0 = int(f.T0.timestamp() * 10**6)
    db = Database(db_url)
    try:
        with db.write() as conn:
            conn.execute(
                insert(m.Request),
                [
                    {
                        "deployment_id": "glm-prod",
                        "request_id": f"r{i}",
                        "tenant": f"t{i % 7}",
                        "route": "/v1/chat/completions",
                        "model_id": "glm-5.3",
                        "prompt_tokens": i,
                        "status": "completed",
                        "first_ts": t0 + i * 1000,
                        "part_ts": t0 + i * 1000,
                        "last_ts": t0 + i * 1000,
                    }
                    for i in range(n)
                ],
            )
    finally:
        db.dispose()


def _reports_and_audit(db_url: str) -> tuple[int, bool]:
    db = Database(db_url)
    try:
        with db.read() as conn:
            n = int(conn.execute(select(func.count()).select_from(m.Report)).scalar_one())
            return n, audit.verify(conn).ok
    finally:
        db.dispose()


def test_a_report_build_killed_midway_leaves_nothing_half_written(
    db_url: str, tmp_path: Path
) -> None:
    _seed_big_window(db_url, 150_000)
    since = f.T0.isoformat()
    until = (f.T0 + timedelta(days=1)).isoformat()
    out = tmp_path / "out"
    args = [*KVWATCH, "report", "breach", "--model", "glm-5.3", "--since", since,
            "--until", until, "--out", str(out), "--database-url", db_url]  # fmt: skip
    # Killed at several points (the build, storing, the CSV, the JSON, the PDF: which one
    # each delay hits depends on the machine): whatever a kill interrupts, the database holds
    # whole reports only, the audit chain verifies, and every file named as a report's is
    # whole (what was being written is left as .part).
    stored = 0
    for delay in (0.5, 1.5, 2.5, 3.5):
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        n, intact = _reports_and_audit(db_url)
        assert intact and n in (stored, stored + 1), (delay, n)
        stored = n
        _assert_whole(out, db_url)
    # The next run starts clean and completes.
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert _reports_and_audit(db_url) == (stored + 1, True)
    _assert_whole(out, db_url)
    finished = [p for p in out.iterdir() if not p.name.endswith(".part")]
    assert len({p.stem for p in finished}) <= stored + 1 and len(finished) >= 3


def _assert_whole(out: Path, db_url: str) -> None:
    """Every report file in ``out`` is whole: its JSON parses and its hash holds, its CSV
    verifies against it (and both against the signature, with the keys of ``db_url``'s
    collector), its PDF ends as a PDF ends."""
    if not out.exists():
        return
    for path in out.iterdir():
        if path.name.endswith(".part"):
            continue
        if path.suffix == ".pdf":
            data = path.read_bytes()
            assert data.startswith(b"%PDF") and data.rstrip().endswith(b"%%EOF"), path
        elif path.suffix == ".json" or (
            path.suffix == ".csv" and path.with_suffix(".json").exists()
        ):
            verified = subprocess.run(
                [*KVWATCH, "report", "verify", str(path), "--database-url", db_url],
                capture_output=True,
                text=True,
            )
            assert verified.returncode == 0, verified.stdout + verified.stderr


def _heads(db_url: str) -> set[str]:
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(migrate.alembic_config(db_url)).get_heads())


@pytest.mark.empty_db
def test_migrations_killed_at_any_point_are_recovered_by_the_next_run(
    db_url: str, tmp_path: Path
) -> None:
    env = os.environ | {"KVWATCH_DATABASE_URL": db_url}
    kills = 0
    for delay in (0.6, 0.9, 1.2, 1.5, 1.8):
        proc = subprocess.Popen(
            [*KVWATCH, "db", "upgrade"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        if migrate.current_heads(db_url) == _heads(db_url):
            break
    done = subprocess.run([*KVWATCH, "db", "upgrade"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert migrate.current_heads(db_url) == _heads(db_url)
    assert kills >= 1, "no run was killed mid-way"
    # the schema is whole: every table the models know exists and answers
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            for table in m.Base.metadata.sorted_tables:
                conn.execute(select(func.count()).select_from(table)).scalar_one()
    finally:
        engine.dispose()
