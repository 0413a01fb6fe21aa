"""The exporter against a real HTTP server: batching, outages and the spool, 413/422/401,
drop reports, flush and shutdown, restarts, and fork.

Every test ends with every probe shut down and no exporter thread left (``make_probe``), and
the server stopped (``fake_collector``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from engine_probe import events as ev
from engine_probe.probe import Probe
from engine_probe.spool import REJECTED_DIR, Spool
from tests.probe_helpers import (
    TOKEN,
    FakeCollector,
    accounting,
    assert_in_seq_order_exactly_once,
    exporter_threads,
    fake_collector,
    make_probe,
    pool,
    settings,
    spool_files,
    wait_for,
)

__all__ = ["fake_collector", "make_probe"]  # fixtures used here


def delivered(fc: FakeCollector, probe_id: str) -> list[ev.Event]:
    return fc.by_probe().get(probe_id, [])


def used_tokens(events: list[ev.Event]) -> list[int]:
    return [e.used_tokens for e in events if isinstance(e, ev.PoolSample)]


def fully_accounted(fc: FakeCollector, probe_id: str) -> bool:
    events = delivered(fc, probe_id)
    if not events:
        return False
    _, missing, reported = accounting(events)
    return missing == reported


# -- batching ------------------------------------------------------------------------------


def test_a_full_batch_goes_out_without_waiting_for_the_interval(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector, probe_batch_size=10))
    for i in range(10):
        pool(probe, used=i)
    # The interval is 30 s: only the size trigger can send this batch.
    wait_for(lambda: fake_collector.batch_sizes() == [10], what="a size-triggered batch")
    for i in range(10, 13):
        pool(probe, used=i)
    assert probe.force_flush(5)
    assert fake_collector.batch_sizes() == [10, 3]
    assert used_tokens(fake_collector.events()) == list(range(13))
    headers = fake_collector.headers[0]
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["Content-Type"] == "application/json"
    stats = probe.stats()
    assert (stats["emitted"], stats["sent"], stats["accepted"]) == (13, 13, 13)
    assert stats["batches_sent"] == 2 and stats["last_error"] is None


def test_a_partial_batch_goes_out_after_the_flush_interval(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector, probe_flush_interval_s=0.05))
    for i in range(3):
        pool(probe, used=i)
    wait_for(lambda: len(fake_collector.events()) == 3, what="the interval flush")
    assert all(size < 100 for size in fake_collector.batch_sizes())
    assert_in_seq_order_exactly_once(fake_collector.events())


def test_large_batches_are_cut_to_batch_size(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector, probe_batch_size=4))
    for i in range(10):
        pool(probe, used=i)
    assert probe.force_flush(5)
    assert all(size <= 4 for size in fake_collector.batch_sizes())
    assert used_tokens(fake_collector.events()) == list(range(10))


# -- outages -------------------------------------------------------------------------------


def test_outage_spills_to_the_spool_and_replays_in_order_exactly_once(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    probe = make_probe(settings(fake_collector, probe_spool_dir=spool_dir, probe_batch_size=7))
    for i in range(5):
        pool(probe, used=i)
    assert probe.force_flush(5)
    fake_collector.stop()  # connection refused from now on
    for round_ in range(4):
        for i in range(10):
            pool(probe, used=100 + round_ * 10 + i)
        assert probe.force_flush(5)  # spooled counts as flushed
    stats = probe.stats()
    assert stats["spooled"]["events"] == 40 and stats["spooled"]["files"] >= 4
    assert not stats["collector_healthy"] and stats["last_error"]
    assert len(spool_files(spool_dir)) == stats["spooled"]["files"]

    fake_collector.start()
    for i in range(10):  # newer events, emitted while the spool replays
        pool(probe, used=200 + i)
    wait_for(lambda: len(fake_collector.events()) == 55, what="the replay")
    assert probe.force_flush(5)
    events = delivered(fake_collector, probe.probe_id)
    assert [e.seq for e in events] == list(range(1, 56))
    expected = list(range(5)) + list(range(100, 140)) + list(range(200, 210))
    assert used_tokens(events) == expected
    wait_for(lambda: probe.stats()["spooled"]["files"] == 0, what="the spool to empty")
    assert spool_files(spool_dir) == []
    assert sum(probe.stats()["dropped"].values()) == 0


def test_5xx_is_retried_with_backoff_and_nothing_is_lost(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    probe = make_probe(settings(fake_collector, probe_spool_dir=tmp_path / "spool"))
    fake_collector.status_override = 503
    for i in range(20):
        pool(probe, used=i)
    assert probe.force_flush(5)
    wait_for(lambda: fake_collector.statuses.count(503) >= 3, what="retries")
    assert fake_collector.events() == []
    fake_collector.status_override = None
    wait_for(lambda: len(fake_collector.events()) == 20, what="delivery after the outage")
    assert used_tokens(fake_collector.events()) == list(range(20))
    assert_in_seq_order_exactly_once(fake_collector.events())


def test_without_a_spool_an_outage_is_held_in_memory_and_flush_waits_for_it(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector))
    fake_collector.stop()
    for i in range(5):
        pool(probe, used=i)
    assert not probe.force_flush(0.3)  # not delivered, and there is no spool
    wait_for(lambda: probe.stats()["retry_pending_events"] == 5, what="the retry backlog")
    assert not probe.force_flush(0.05)
    fake_collector.start()
    assert probe.force_flush(5)
    assert used_tokens(fake_collector.events()) == list(range(5))
    assert_in_seq_order_exactly_once(fake_collector.events())


def test_401_keeps_the_data_until_the_token_is_fixed(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    probe = make_probe(settings(fake_collector, probe_spool_dir=tmp_path / "spool"))
    fake_collector.token = "rotated"
    for i in range(3):
        pool(probe, used=i)
    assert probe.force_flush(5)
    assert 401 in fake_collector.statuses
    assert "INGEST_TOKEN" in probe.stats()["last_error"]
    assert probe.stats()["spooled"]["events"] == 3
    fake_collector.token = TOKEN
    wait_for(lambda: len(fake_collector.events()) == 3, what="delivery with the right token")
    assert sum(probe.stats()["dropped"].values()) == 0


# -- 413 and 422 ---------------------------------------------------------------------------


def test_413_splits_batches_in_halves_until_they_fit(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    fake_collector.max_events = 3
    probe = make_probe(settings(fake_collector, probe_spool_dir=tmp_path / "spool"))
    for i in range(10):
        pool(probe, used=i)
    assert probe.force_flush(5)
    assert 413 in fake_collector.statuses
    assert all(size <= 3 for size in fake_collector.batch_sizes())
    assert used_tokens(fake_collector.events()) == list(range(10))
    assert_in_seq_order_exactly_once(fake_collector.events())
    assert sum(probe.stats()["dropped"].values()) == 0


def test_422_dead_letters_the_bad_event_counts_it_and_delivers_the_rest(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    probe = make_probe(settings(fake_collector, probe_spool_dir=spool_dir))
    pool(probe, used=0)
    # Field values are not range-checked on the hot path; the collector refuses this one.
    probe.emit(ev.RequestAdmitted, request_id="r1", tenant="not a valid id!", model_id="m",
               prompt_tokens=5)  # fmt: skip
    pool(probe, used=2)
    assert probe.force_flush(5)

    statuses = fake_collector.statuses
    assert statuses.count(422) == 1  # refused once, never retried
    events = delivered(fake_collector, probe.probe_id)
    assert used_tokens(events) == [0, 2]
    reports = [e for e in events if isinstance(e, ev.ProbeDrops)]
    assert [r.counts for r in reports] == [{"rejected_by_collector": 1}]
    assert [e.seq for e in events] == [1, 3, 4]
    assert probe.stats()["dropped"]["rejected_by_collector"] == 1

    dead = sorted((spool_dir / REJECTED_DIR).glob("*.json"))
    assert len(dead) == 1
    kept = json.loads(dead[0].read_bytes())
    assert [e["tenant"] for e in kept] == ["not a valid id!"]
    assert "422" in dead[0].with_suffix(".txt").read_text()


def test_422_for_a_whole_batch_is_not_retried_and_is_reported_later(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector))
    fake_collector.status_override = 422
    for i in range(4):
        pool(probe, used=i)
    assert probe.force_flush(5)
    # The batch, then the report of its drop: both refused, neither retried.
    assert fake_collector.statuses == [422, 422]
    assert probe.stats()["dropped"]["rejected_by_collector"] == 5
    fake_collector.status_override = None
    assert probe.force_flush(5)
    # The refused report gave its counts back: the next report explains every gap.
    [report] = delivered(fake_collector, probe.probe_id)
    assert isinstance(report, ev.ProbeDrops) and report.seq == 6
    assert report.counts == {"rejected_by_collector": 5}


# -- the attempt cap -----------------------------------------------------------------------


def dead_letters(spool_dir: Path) -> list[tuple[list[dict[str, Any]], str]]:
    """(events, note) of every dead-lettered batch, oldest first."""
    return [
        (json.loads(p.read_bytes()), p.with_suffix(".txt").read_text())
        for p in sorted((spool_dir / REJECTED_DIR).glob("*.json"))
        if not p.name.startswith(".")  # a dead letter being written
    ]


def test_a_batch_refused_with_500_forever_is_dead_lettered_after_the_cap(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    # A batch the collector can never take (a 500 on input it chokes on) must not block
    # every batch behind it: the backlog is replayed oldest first.
    spool_dir = tmp_path / "spool"
    fake_collector.refuse = lambda batch: 500 if 666 in used_tokens(batch) else None
    probe = make_probe(settings(fake_collector, probe_spool_dir=spool_dir, probe_max_attempts=3))
    pool(probe, used=0)
    pool(probe, used=666)
    pool(probe, used=2)
    assert probe.force_flush(5)  # spooled counts as handled
    for i in range(3, 8):
        pool(probe, used=i)
    assert probe.force_flush(5)
    wait_for(lambda: probe.stats()["spooled"]["files"] == 0, what="the spool to drain")
    assert probe.force_flush(5)  # sends the report of the dead-lettered batch
    wait_for(lambda: fully_accounted(fake_collector, probe.probe_id), what="the report")

    assert fake_collector.statuses.count(500) == 3  # exactly the cap, then never again
    events = delivered(fake_collector, probe.probe_id)
    assert_in_seq_order_exactly_once(events)
    # The whole refused batch (the collector named no culprit) is dead-lettered.
    assert used_tokens(events) == [3, 4, 5, 6, 7]
    reports = [e for e in events if isinstance(e, ev.ProbeDrops)]
    assert [r.counts for r in reports] == [{"rejected_by_collector": 3}]
    assert probe.stats()["dropped"]["rejected_by_collector"] == 3
    [(kept, note)] = dead_letters(spool_dir)
    assert [e["used_tokens"] for e in kept] == [0, 666, 2]
    assert "HTTP 500" in note and "after 3 refusals" in note and "probe_max_attempts=3" in note


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_500_for_everything_without_a_spool_dead_letters_each_batch_at_the_cap(
    fake_collector: FakeCollector, make_probe: Any, max_attempts: int
) -> None:
    probe = make_probe(settings(fake_collector, probe_max_attempts=max_attempts))
    fake_collector.status_override = 500
    for i in range(3):
        pool(probe, used=i)
    # Without a spool, flush waits for the retries: the cap is what ends them.
    assert probe.force_flush(5)
    assert fake_collector.statuses[:max_attempts] == [500] * max_attempts
    assert probe.stats()["dropped"]["rejected_by_collector"] >= 3
    assert "HTTP 500" in probe.stats()["last_error"]
    fake_collector.status_override = None
    assert probe.force_flush(5)
    wait_for(lambda: fully_accounted(fake_collector, probe.probe_id), what="the report")
    # Drop reports refused meanwhile gave their counts back: the last one explains it all.
    events = delivered(fake_collector, probe.probe_id)
    assert all(isinstance(e, ev.ProbeDrops) for e in events)
    assert accounting(events)[1] == probe.stats()["dropped"]["rejected_by_collector"]


@pytest.mark.parametrize("status", [401, 429, 502, 503, 504])
def test_unavailable_answers_are_retried_forever(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path, status: int
) -> None:
    # An outage (or a token being fixed) must never lose data, however long it lasts.
    probe = make_probe(
        settings(fake_collector, probe_spool_dir=tmp_path / "spool", probe_max_attempts=2)
    )
    fake_collector.status_override = status
    for i in range(4):
        pool(probe, used=i)
    assert probe.force_flush(5)
    wait_for(lambda: fake_collector.statuses.count(status) >= 6, what="retries past the cap")
    assert sum(probe.stats()["dropped"].values()) == 0
    assert probe.stats()["spooled"]["events"] == 4
    fake_collector.status_override = None
    wait_for(lambda: len(fake_collector.events()) == 4, what="delivery after the outage")
    assert used_tokens(fake_collector.events()) == [0, 1, 2, 3]
    assert not (tmp_path / "spool" / REJECTED_DIR).exists()


def test_transport_errors_between_refusals_do_not_count(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    probe = make_probe(
        settings(fake_collector, probe_spool_dir=tmp_path / "spool", probe_max_attempts=3)
    )
    answers = iter([500, 503, 503, 500, 503])
    fake_collector.refuse = lambda batch: next(answers, None)
    pool(probe, used=1)
    assert probe.force_flush(5)
    wait_for(lambda: len(fake_collector.events()) == 1, what="delivery on the 6th try")
    assert fake_collector.statuses == [500, 503, 503, 500, 503, 200]
    assert sum(probe.stats()["dropped"].values()) == 0


def test_adopted_batches_of_a_probe_id_refused_with_403_cannot_block_new_events(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    # A spool left by a process whose probe id is registered to a token that was rotated
    # since: the collector answers 403 to those batches forever.
    spool_dir = tmp_path / "spool"
    orphan_id = "old-engine-1-abc123"
    orphan = Spool(spool_dir, orphan_id, 1 << 20)
    for b in range(4):
        events = [
            ev.PoolSample(schema_version=1, probe_id=orphan_id, seq=b * 2 + i + 1,
                          ts=ev.utcnow(), deployment_id="test-dep", capacity_tokens=10,
                          used_tokens=1, free_tokens=0)
            for i in range(2)
        ]  # fmt: skip
        orphan.push(ev.encode_batch(events), len(events))
    orphan.close()
    fake_collector.refuse = lambda batch: 403 if batch[0].probe_id == orphan_id else None

    probe = make_probe(settings(fake_collector, probe_spool_dir=spool_dir, probe_max_attempts=3))
    for i in range(5):
        pool(probe, used=i)
    assert probe.force_flush(5)
    wait_for(lambda: len(delivered(fake_collector, probe.probe_id)) == 5, what="own events")
    wait_for(lambda: probe.stats()["spooled"]["files"] == 0, what="the spool to drain")
    stats = probe.stats()
    assert stats["adopted_files"] == 4
    # The first orphan batch gets the full cap; once its id is known to be refused, each
    # later batch of that id is dead-lettered at its first 403.
    assert fake_collector.statuses.count(403) == 3 + 3
    assert stats["dropped"]["rejected_by_collector"] == 8
    assert [e.seq for e in delivered(fake_collector, probe.probe_id)] == [1, 2, 3, 4, 5]
    assert orphan_id not in fake_collector.by_probe()
    kept = dead_letters(spool_dir)
    assert len(kept) == 4 and all("HTTP 403" in note for _, note in kept)
    assert [e["seq"] for events, _ in kept for e in events] == list(range(1, 9))


def test_403_keeps_the_data_until_the_token_is_fixed(
    fake_collector: FakeCollector,
    make_probe: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The probe's own batches refused with 403 (its token's deployment scope, say): a
    # configuration error like a 401, not a bad batch. Said once, and nothing dead-lettered
    # however often it is refused, so the spool goes out once the token is fixed.
    caplog.set_level(logging.INFO, logger="engine_probe.exporter")
    probe = make_probe(
        settings(
            fake_collector,
            probe_spool_dir=tmp_path / "spool",
            probe_max_attempts=2,
            probe_batch_size=2,
        )
    )
    fake_collector.status_override = 403
    for i in range(4):
        pool(probe, used=i)
    assert probe.force_flush(5)
    wait_for(lambda: fake_collector.statuses.count(403) >= 6, what="three times the cap")
    assert dead_letters(tmp_path / "spool") == []
    assert probe.stats()["spooled"]["events"] == 4
    assert sum(probe.stats()["dropped"].values()) == 0
    assert "KVWATCH_INGEST_TOKEN" in probe.stats()["last_error"]
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(loud) == 1 and "refused its token" in loud[0].getMessage(), loud
    assert "KVWATCH_INGEST_TOKEN" in loud[0].getMessage()
    assert "configuration error, not an outage" in loud[0].getMessage()
    assert "kept in the spool" in loud[0].getMessage()
    fake_collector.status_override = None
    wait_for(lambda: len(fake_collector.events()) == 4, what="delivery with the fixed token")
    assert used_tokens(delivered(fake_collector, probe.probe_id)) == [0, 1, 2, 3]
    assert sum(probe.stats()["dropped"].values()) == 0


# -- drops ---------------------------------------------------------------------------------


def test_a_full_buffer_drops_new_events_and_the_report_still_gets_through(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector, probe_buffer_size=5, probe_batch_size=5))
    fake_collector.gate.clear()  # hold the exporter inside its POST
    for i in range(5):
        pool(probe, used=i)
    wait_for(lambda: fake_collector.in_flight == 1, what="the exporter to be busy")
    results = [pool(probe, used=10 + i) for i in range(8)]
    assert results == [True] * 5 + [False] * 3
    assert probe.stats()["dropped"]["buffer_full"] == 3
    fake_collector.gate.set()
    assert probe.force_flush(5)

    events = delivered(fake_collector, probe.probe_id)
    assert used_tokens(events) == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    report = events[-1]
    assert isinstance(report, ev.ProbeDrops)
    assert report.counts == {"buffer_full": 3} and report.seq == 14
    assert accounting(events)[1:] == (3, 3)  # seqs 11-13 missing, 3 drops reported


def test_a_full_spool_counts_drops_and_reports_them_when_the_collector_is_back(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    s = settings(
        fake_collector,
        probe_spool_dir=tmp_path / "spool",
        probe_batch_size=5,
        probe_max_spool_bytes=2500,  # about two batches of five
    )
    probe = make_probe(s)
    fake_collector.stop()
    for round_ in range(5):
        for i in range(5):
            pool(probe, used=round_ * 5 + i)
        assert probe.force_flush(5)
    stats = probe.stats()
    assert stats["dropped"]["spool_full"] > 0
    assert 0 < stats["spooled"]["bytes"] <= 2500

    fake_collector.start()
    wait_for(lambda: probe.stats()["spooled"]["files"] == 0, what="the spool to drain")
    assert probe.force_flush(5)
    wait_for(lambda: fully_accounted(fake_collector, probe.probe_id), what="a full report")
    events = delivered(fake_collector, probe.probe_id)
    assert_in_seq_order_exactly_once(events)
    data, missing, reported = accounting(events)
    assert missing == reported > 0
    assert data == sorted(data) and used_tokens(events)[:5] == list(range(5))


def test_an_unusable_spool_counts_spool_errors(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    probe = make_probe(settings(fake_collector, probe_spool_dir=blocker / "spool"))
    fake_collector.stop()
    for i in range(5):
        pool(probe, used=i)
    assert probe.force_flush(5)  # counted as dropped: nothing is left unaccounted
    assert probe.stats()["dropped"]["spool_error"] >= 5
    fake_collector.start()
    assert probe.force_flush(5)
    wait_for(lambda: fully_accounted(fake_collector, probe.probe_id), what="the report")
    [report] = delivered(fake_collector, probe.probe_id)
    assert isinstance(report, ev.ProbeDrops) and report.counts["spool_error"] >= 5


# -- flush and shutdown ---------------------------------------------------------------------


def test_shutdown_delivers_everything_and_is_idempotent(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    probe = make_probe(settings(fake_collector, probe_spool_dir=spool_dir))
    for i in range(7):
        pool(probe, used=i)
    assert probe.shutdown(5)
    assert used_tokens(fake_collector.events()) == list(range(7))
    assert not exporter_threads()
    assert probe.shutdown(5)  # idempotent
    assert not pool(probe)  # after shutdown: dropped and counted
    stats = probe.stats()
    assert stats["dropped"]["shutdown"] == 1 and stats["shut_down"]
    assert list(spool_dir.iterdir()) == []  # the empty spool directory was removed
    assert probe.force_flush(0.1)  # nothing new was accepted, nothing to wait for


def test_shutdown_during_an_outage_spools_what_it_cannot_send(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    probe = make_probe(settings(fake_collector, probe_spool_dir=tmp_path / "spool"))
    fake_collector.stop()
    for i in range(6):
        pool(probe, used=i)
    assert probe.shutdown(2)
    # the six samples and probe.stopped; released, the files stay on disk
    assert probe.stats()["spooled"]["events"] == 7
    files = spool_files(tmp_path / "spool")
    assert sum(len(json.loads(f.read_bytes())) for f in files) == 7


def test_shutdown_without_a_spool_counts_what_it_could_not_send(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector))
    fake_collector.stop()
    for i in range(4):
        pool(probe, used=i)
    assert not probe.shutdown(1)
    assert probe.stats()["dropped"]["shutdown"] == 5  # the four samples and probe.stopped
    assert not exporter_threads()


# -- restarts ------------------------------------------------------------------------------


def test_a_new_probe_adopts_the_spool_a_stopped_probe_left(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    first = make_probe(settings(fake_collector, probe_spool_dir=spool_dir, probe_batch_size=4))
    fake_collector.stop()
    for i in range(10):
        pool(first, used=i)
    assert first.shutdown(2)
    assert spool_files(spool_dir)

    fake_collector.start()
    second = make_probe(settings(fake_collector, probe_spool_dir=spool_dir))
    wait_for(lambda: len(delivered(fake_collector, first.probe_id)) == 11, what="the adoption")
    events = delivered(fake_collector, first.probe_id)
    assert [e.seq for e in events] == list(range(1, 12))
    assert used_tokens(events) == list(range(10))
    assert isinstance(events[-1], ev.ProbeStopped)  # its shutdown, delivered last
    assert second.stats()["adopted_files"] == 3
    wait_for(lambda: second.stats()["spooled"]["files"] == 0, what="the spool to drain")
    assert sorted(p.name for p in spool_dir.iterdir()) == [second.stats()["probe_id"]]


def test_the_spool_of_a_crashed_process_is_replayed(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    fake_collector.stop()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process that spools during an outage and dies without shutting down
        code = 1
        try:
            os.close(read_end)
            probe = Probe(settings(fake_collector, probe_spool_dir=spool_dir))
            for i in range(15):
                pool(probe, used=i)
            if probe.force_flush(5):
                os.write(write_end, probe.probe_id.encode())
                code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        crashed_id = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and crashed_id

    fake_collector.start()
    make_probe(settings(fake_collector, probe_spool_dir=spool_dir))
    wait_for(lambda: len(delivered(fake_collector, crashed_id)) == 15, what="the replay")
    events = delivered(fake_collector, crashed_id)
    assert used_tokens(events) == list(range(15))
    assert_in_seq_order_exactly_once(events)


# -- fork ----------------------------------------------------------------------------------


def test_a_forked_child_gets_its_own_probe_id_and_seq_space(
    fake_collector: FakeCollector, make_probe: Any, tmp_path: Path
) -> None:
    probe = make_probe(settings(fake_collector, probe_spool_dir=tmp_path / "spool"))
    parent_id = probe.probe_id
    for i in range(5):
        pool(probe, used=i)  # still buffered at fork time (30 s interval)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            fresh = probe.stats()
            assert probe.probe_id != parent_id
            assert (fresh["seq"], fresh["buffered"], fresh["running"]) == (0, 0, False)
            for i in range(3):
                pool(probe, used=50 + i)  # restarts the exporter thread lazily
            ok = probe.force_flush(5) and probe.shutdown(5)
            os.write(write_end, json.dumps({"id": probe.probe_id, "ok": ok}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        child = json.loads(pipe.read() or b"{}")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and child["ok"]

    for i in range(2):
        pool(probe, used=10 + i)
    assert probe.force_flush(5)
    by_probe = fake_collector.by_probe()
    assert set(by_probe) == {parent_id, child["id"]}
    assert [e.seq for e in by_probe[parent_id]] == list(range(1, 8))
    assert used_tokens(by_probe[parent_id]) == [0, 1, 2, 3, 4, 10, 11]
    assert [e.seq for e in by_probe[child["id"]]] == [1, 2, 3, 4]  # 4: probe.stopped
    assert used_tokens(by_probe[child["id"]]) == [50, 51, 52]


def test_a_refused_token_without_a_spool_says_the_events_wait_in_memory_only(
    fake_collector: Any, make_probe: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Without KVWATCH_PROBE_SPOOL_DIR the refused events wait in memory: the line says so,
    and that a stop first loses them (it had said "kept", and the stop then counted them
    lost), naming the setting that keeps them on disk."""
    caplog.set_level(logging.INFO, logger="engine_probe.exporter")
    probe = make_probe(settings(fake_collector, probe_batch_size=2))
    fake_collector.status_override = 401
    pool(probe, used=1)
    probe.force_flush(2)
    wait_for(lambda: fake_collector.statuses.count(401) >= 1, what="the refusal")
    (loud,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "kept in memory" in loud and "lost if the process stops first" in loud, loud
    assert "KVWATCH_PROBE_SPOOL_DIR" in loud
    assert "kept in the spool" not in loud
