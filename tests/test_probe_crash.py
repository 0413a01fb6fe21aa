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

# argv: collector url, token, spool root, log path, journal bytes, flush interval, mode
# mode "delivered": everything is delivered before the kill, but the journal on disk is put
# back as it was before (nothing committed), so the next probe replays events the collector
# already has
_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from engine_probe.events import RequestFinished
    from engine_probe.journal import segment_paths
    from engine_probe.probe import Probe
    from engine_probe.settings import ProbeSettings

    url, token, root, log_path, journal, interval, mode = sys.argv[1:8]
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
    if mode == "delivered":
        (seg,) = segment_paths(Path(root) / probe.probe_id)
        before = seg.read_bytes()
        assert probe.force_flush(10)
        with open(seg, "r+b") as f:
            f.write(before)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _run_child(
    collector: Collector, root: Path, log: Path, journal: int, interval: float, mode: str
) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [collector.url, collector.ingest, str(root), str(log), str(journal), str(interval)]
    args.append(mode)
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


def _stored(db_url: str, probe_id: str) -> tuple[set[str], tuple[int, int, int] | None, int]:
    """The completed finishes stored, the probe's (max_seq, accepted, duplicates), and how
    many seq gaps it has open."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT request_id FROM requests WHERE deployment_id = :d AND status = :s"),
                {"d": DEPLOYMENT, "s": "completed"},
            )
            finishes = {r for (r,) in rows}
            probe = conn.execute(
                text("SELECT max_seq, accepted, duplicates FROM probes WHERE probe_id = :p"),
                {"p": probe_id},
            ).first()
            gaps = conn.execute(
                text("SELECT count(*) FROM seq_gaps WHERE probe_id = :p"), {"p": probe_id}
            ).scalar_one()
            counts = None if probe is None else (int(probe[0]), int(probe[1]), int(probe[2]))
            return finishes, counts, int(gaps)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("interval", "journal", "mode"),
    [
        pytest.param(0.5, 64 << 20, "plain", id="default-interval"),
        # nothing is ever sent by the child: every finish comes back from its journal
        pytest.param(3600.0, 64 << 20, "plain", id="nothing-sent-before-the-kill"),
        # everything was sent, the journal says nothing was: the replay is all duplicates
        pytest.param(3600.0, 64 << 20, "delivered", id="replay-of-delivered-events"),
        pytest.param(3600.0, 0, "plain", id="control-without-journal"),
    ],
)
def test_finishes_emitted_before_a_sigkill_are_all_stored(
    collector: Collector, tmp_path: Path, interval: float, journal: int, mode: str
) -> None:
    root, log = tmp_path / "spool", tmp_path / "emitted.log"
    dead_id = _run_child(collector, root, log, journal, interval, mode)
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
    stored, counts, gaps = _stored(collector.db_url, dead_id)
    if not journal:
        assert stored == set() and counts is None and stats["journal"]["replayed"] == 0
        return
    assert emitted - stored == set()
    # every seq of the dead probe is stored once: 240 finishes, no gap left open
    assert counts is not None and counts[:2] == (240, 240) and gaps == 0
    assert stats["journal"]["replayed"] > 0 and stats["journal"]["replay_torn"] == 0
    if mode == "delivered":
        assert stats["journal"]["replayed"] == 240 and counts[2] == 240  # all duplicates
        assert stats["duplicates"] == 240
    elif interval > 60:
        assert stats["journal"]["replayed"] == 240 and counts[2] == 0  # all new, none twice
