"""The probe's write-ahead journal (``engine_probe.journal``): what it writes, what survives a
process killed mid-write, what a full journal does, and how the next probe adopts a dead
probe's journal (``Spool.adopt_orphans``). Processes are really killed (SIGKILL) where the
test is about a dead process; truncation simulates a kill inside one record's write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine_probe import events as ev
from engine_probe.journal import (
    JOURNAL_MIN_BYTES,
    SEGMENT_MIN,
    Journal,
    read_dir,
    read_segment,
    segment_paths,
)
from engine_probe.settings import ProbeSettings
from engine_probe.spool import Spool
from tests.probe_helpers import TOKEN, FakeCollector, wait_for

ROOT = Path(__file__).resolve().parents[1]


def finish(seq: int, probe_id: str = "dead-1") -> ev.RequestFinished:
    return ev.RequestFinished(
        schema_version=ev.SCHEMA_VERSION,
        probe_id=probe_id,
        seq=seq,
        ts=ev.utcnow(),
        deployment_id="dep",
        request_id=f"req-{seq}",
        tenant="t1",
        completion_tokens=seq % 50,
        status="completed",
    )


def opened(directory: Path, max_bytes: int = JOURNAL_MIN_BYTES) -> Journal:
    directory.mkdir(parents=True, exist_ok=True)
    journal = Journal(directory, max_bytes)
    journal.open()
    return journal


def seqs(records: list[bytes]) -> list[int]:
    return [ev.decode_event(r).seq for r in records]


def test_every_appended_event_reads_back_as_the_bytes_the_exporter_sends(tmp_path: Path) -> None:
    journal = opened(tmp_path / "p")
    events = [finish(s) for s in range(1, 201)]
    for e in events:
        journal.append(e)
    found = read_dir(tmp_path / "p")
    assert found.records == [ev.encode_event(e) for e in events]
    assert (found.committed, found.skipped, found.torn) == (0, 0, 0)
    assert journal.stats()["appends"] == 200


def test_release_deletes_covered_segments_and_replay_skips_committed_records(
    tmp_path: Path,
) -> None:
    journal = opened(tmp_path / "p", max_bytes=16 * SEGMENT_MIN)
    seq = 0
    while len(segment_paths(tmp_path / "p")) < 3:
        seq += 1
        journal.append(finish(seq))
    first_of_last = read_segment(segment_paths(tmp_path / "p")[-1].read_bytes())[0]
    last_sealed_max = seqs(first_of_last)[0] - 1
    # every record of the first segment is handled, not yet those of the second
    first_max = seqs(read_segment(segment_paths(tmp_path / "p")[0].read_bytes())[0])[-1]
    assert journal.release(first_max) == 1
    assert len(segment_paths(tmp_path / "p")) == 2
    found = read_dir(tmp_path / "p")
    assert found.committed == first_max
    assert seqs(found.records) == list(range(first_max + 1, seq + 1))
    assert journal.release(last_sealed_max) == 1
    assert len(segment_paths(tmp_path / "p")) == 1
    assert seqs(read_dir(tmp_path / "p").records) == list(range(last_sealed_max + 1, seq + 1))
    # the committed seq carries over into segments created afterwards
    journal.release(seq - 3)
    while len(segment_paths(tmp_path / "p")) < 2:
        seq += 1
        journal.append(finish(seq))
    journal.release(seq - 1)  # no sealed segment is fully covered: nothing deleted
    found = read_dir(tmp_path / "p")
    assert found.committed == seq - 1 and seqs(found.records) == [seq]
    journal.close(discard=True)
    assert segment_paths(tmp_path / "p") == []


def test_a_full_journal_counts_what_it_could_not_keep_and_never_raises(tmp_path: Path) -> None:
    journal = opened(tmp_path / "p")  # two segments of 64 KiB
    for s in range(1, 3001):
        journal.append(finish(s))
    stats = journal.stats()
    assert stats["segments"] == 2 and stats["not_journaled_full"] > 0
    assert stats["appends"] + stats["not_journaled_full"] == 3000
    kept = seqs(read_dir(tmp_path / "p").records)
    assert kept == list(range(1, stats["appends"] + 1))
    # once the exporter has handled the first segment, appending resumes
    journal.release(kept[-1])
    journal.append(finish(3001))
    assert journal.stats()["appends"] == stats["appends"] + 1
    assert seqs(read_dir(tmp_path / "p").records)[-1] == 3001


def test_a_record_cut_anywhere_is_skipped_and_everything_before_it_kept(tmp_path: Path) -> None:
    journal = opened(tmp_path / "p")
    events = [finish(s) for s in range(1, 6)]
    for e in events:
        journal.append(e)
    data = segment_paths(tmp_path / "p")[0].read_bytes()
    journal.close(discard=False)
    encoded = [ev.encode_event(e) for e in events]
    ends = []
    pos = 24
    for record in encoded:
        pos += 8 + len(record)
        ends.append(pos)
    for cut in range(len(data[: ends[-1]]) + 1):
        # a kill inside a record: the bytes past the cut never made it (zeros), or the
        # file itself ends there
        for damaged in (data[:cut] + bytes(len(data) - cut), data[:cut]):
            records, _, _ = read_segment(damaged)
            whole = sum(1 for end in ends if end <= cut)
            assert records == encoded[:whole], cut
    # a flipped byte inside the third payload: the first two survive, the tail is torn
    bad = bytearray(data)
    bad[ends[1] + 8 + 5] ^= 0xFF
    records, _, torn = read_segment(bytes(bad))
    assert records == encoded[:2] and torn
    # garbage never raises
    for junk in (b"", b"KVWJRNL1", os.urandom(4096), b"KVWJRNL1" + os.urandom(4096)):
        read_segment(junk)


_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from tests.test_probe_journal import finish
    from engine_probe.journal import Journal
    from engine_probe.spool import Spool
    spool = Spool(Path(sys.argv[1]), "dead-1", 1 << 20)
    spool.open()
    journal = Journal(spool.dir, 1 << 20)
    journal.open()
    n = int(sys.argv[2])
    for s in range(1, n + 1):
        journal.append(finish(s))
    journal.release(n // 2)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_process_journal_is_adopted_under_its_own_probe_id(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, str(root), "300", str(ROOT)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    # a second record half written when the process died: a torn tail
    seg = segment_paths(root / "dead-1")[-1]
    data = bytearray(seg.read_bytes())
    tail = data.rstrip(b"\0")
    data[len(tail) : len(tail) + 12] = (40).to_bytes(4, "little") + b"\1\2\3\4" + b'{"ki'
    seg.write_bytes(bytes(data))

    live = Spool(root, "live-1", 1 << 20)
    live.open()
    adopted = live.adopt_orphans(batch_events=64)
    assert adopted == 3  # 150 uncommitted records in batches of at most 64
    assert (live.journal_replayed, live.journal_torn) == (150, 1)
    replayed: list[int] = []
    while (entry := live.oldest()) is not None:
        batch = ev.decode_json_batch(live.read(entry))
        assert {e.probe_id for e in batch} == {"dead-1"}
        replayed += [e.seq for e in batch]
        live.remove(entry)
    assert replayed == list(range(151, 301))
    assert not (root / "dead-1").exists()
    live.close()


def test_a_probe_journals_appends_releases_and_cleans_up_after_a_clean_shutdown(
    tmp_path: Path,
) -> None:
    from engine_probe.probe import Probe

    collector = FakeCollector()
    try:
        probe = Probe(
            ProbeSettings(
                collector_url=collector.url,
                ingest_token=TOKEN,
                probe_spool_dir=tmp_path / "spool",
                probe_flush_interval_s=0.05,
                probe_batch_size=10,
            )
        )
        for used in range(40):
            probe.emit(ev.PoolSample, capacity_tokens=100, used_tokens=used, free_tokens=100 - used)
        probe_dir = tmp_path / "spool" / probe.probe_id
        assert len(segment_paths(probe_dir)) == 1
        assert probe.force_flush(10)
        wait_for(lambda: read_dir(probe_dir).records == [], timeout=10)
        stats = probe.stats()["journal"]
        assert stats["enabled"] and stats["appends"] == 40
        assert stats["not_journaled_full"] == stats["not_journaled_error"] == 0
        assert probe.shutdown(10)
        assert not probe_dir.exists()  # nothing left behind for anyone to adopt
    finally:
        collector.stop()


def test_journal_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="probe_journal_bytes"):
        ProbeSettings(probe_journal_bytes=1000)
    assert ProbeSettings(probe_journal_bytes=0).probe_journal_bytes == 0


def test_the_engine_plugins_journal_in_a_per_user_state_directory_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from engine_probe.adapters.defaults import plugin_settings

    for name in list(os.environ):
        if name.startswith("KVWATCH_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    # no collector: nothing is configured, nothing created
    assert plugin_settings().probe_spool_dir is None
    assert not (tmp_path / "state").exists()
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    default = tmp_path / "state" / "kvwatch" / "probe-spool"
    assert plugin_settings().probe_spool_dir == default and default.is_dir()
    monkeypatch.setenv("KVWATCH_PROBE_SPOOL_DIR", str(tmp_path / "mine"))
    assert plugin_settings().probe_spool_dir == tmp_path / "mine"
    monkeypatch.delenv("KVWATCH_PROBE_SPOOL_DIR")
    monkeypatch.setenv("KVWATCH_PROBE_JOURNAL_BYTES", "0")
    assert plugin_settings().probe_spool_dir is None  # off: memory only, as before
    monkeypatch.delenv("KVWATCH_PROBE_JOURNAL_BYTES")
    # a default directory that cannot be made: a warning, and the probe runs memory-only
    (tmp_path / "ro").write_text("a file, not a directory")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "ro"))
    assert plugin_settings().probe_spool_dir is None
    assert "KVWATCH_PROBE_SPOOL_DIR" in caplog.text


def test_a_spool_directory_that_cannot_hold_a_journal_leaves_the_probe_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from engine_probe.probe import Probe

    (tmp_path / "not-a-dir").write_text("")
    collector = FakeCollector()
    try:
        probe = Probe(
            ProbeSettings(
                collector_url=collector.url,
                ingest_token=TOKEN,
                probe_spool_dir=tmp_path / "not-a-dir",
                probe_flush_interval_s=0.05,
            )
        )
        assert probe.emit(ev.PoolSample, capacity_tokens=10, used_tokens=1, free_tokens=9)
        journal = probe.stats()["journal"]
        assert journal["enabled"] is False and "not-a-dir" in str(journal["last_error"])
        assert "journal unavailable" in caplog.text
        assert probe.force_flush(10)  # delivered all the same
        wait_for(lambda: sum(len(b) for b in collector.batches) >= 1, timeout=10)
        probe.shutdown(5)
    finally:
        collector.stop()
