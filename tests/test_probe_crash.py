"""A probe process killed with SIGKILL right after it emitted request finishes loses none of
them: a real ``Probe`` in a child process, a real collector (in this process, SQLite and
PostgreSQL), then a second probe on the same spool root (this process) adopts the dead
probe's journal and every finish the child logged as emitted is stored.

The control runs the same child without the journal: its unsent finishes are lost, which is
what this test would see if the journal did nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from engine_probe.probe import Probe
from engine_probe.settings import ProbeSettings
from tests.conftest import Collector
from tests.probe_helpers import wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = "crash-dep"

# argv: collector url, token, spool root, log path, journal bytes, flush interval
_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from engine_probe.events import RequestFinished
    from engine_probe.probe import Probe
    from engine_probe.settings import ProbeSettings

    url, token, root, log_path, journal, interval = sys.argv[1:7]
    probe = Probe(ProbeSettings(
        collector_url=url, ingest_token=token, deployment_id="crash-dep", probe_id="crash",
        probe_spool_dir=root, probe_journal_bytes=int(journal),
        probe_flush_interval_s=float(interval),
    ))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for burst in range(6):
        for i in range(40):
            rid = f"r{burst}-{i}"
            if probe.emit(RequestFinished, request_id=rid, tenant="t1",
                          completion_tokens=i + 1, status="completed"):
                os.write(log, f"{probe.probe_id} {rid}\\n".encode())
        if burst < 5:
            time.sleep(0.15)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _run_child(collector: Collector, root: Path, log: Path, journal: int, interval: float) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [collector.url, collector.ingest, str(root), str(log), str(journal), str(interval)]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    lines = log.read_text().split()
    return lines[0]


def _stored_finishes(db_url: str) -> set[str]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT request_id FROM requests WHERE deployment_id = :d AND status = :s"),
                {"d": DEPLOYMENT, "s": "completed"},
            )
            return {r for (r,) in rows}
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("interval", "journal"),
    [
        pytest.param(0.5, 64 << 20, id="default-interval"),
        # nothing is ever sent by the child: every finish comes back from its journal
        pytest.param(3600.0, 64 << 20, id="nothing-sent-before-the-kill"),
        pytest.param(3600.0, 0, id="control-without-journal"),
    ],
)
def test_finishes_emitted_before_a_sigkill_are_all_stored(
    collector: Collector, tmp_path: Path, interval: float, journal: int
) -> None:
    root, log = tmp_path / "spool", tmp_path / "emitted.log"
    dead_id = _run_child(collector, root, log, journal, interval)
    emitted = {line.split()[1] for line in log.read_text().splitlines()}
    assert len(emitted) == 240
    assert {line.split()[0] for line in log.read_text().splitlines()} == {dead_id}

    # the next probe process on the node: same spool root
    probe = Probe(
        ProbeSettings(
            collector_url=collector.url,
            ingest_token=collector.ingest,
            deployment_id=DEPLOYMENT,
            probe_id="crash",
            probe_spool_dir=root,
            probe_flush_interval_s=0.05,
        )
    )
    try:
        wait_for(lambda: not (root / dead_id).exists(), timeout=20, what="adoption")
        wait_for(lambda: probe.stats()["spooled"]["files"] == 0, timeout=30, what="replay")
        assert probe.force_flush(10)
        stats = probe.stats()
    finally:
        assert probe.shutdown(10)
    stored = _stored_finishes(collector.db_url)
    if journal:
        assert emitted - stored == set()
        assert stats["journal"]["replayed"] > 0 and stats["journal"]["replay_torn"] == 0
        if interval > 60:
            assert stats["journal"]["replayed"] == 240  # all of them, none twice
    else:
        assert stored == set() and stats["journal"]["replayed"] == 0
