"""RecordingProbe, the in-memory probe tests and benchmarks hand to adapters: it records what
a real Probe would have sent, refuses what it refuses, and keeps order across threads."""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

import engine_probe
from engine_probe import events as ev
from engine_probe.errors import InvalidEventError
from engine_probe.probe import BaseProbe
from engine_probe.recording import RecordingProbe
from tests.probe_helpers import FakeCollector, fake_collector, make_probe, pool, settings

__all__ = ["fake_collector", "make_probe"]  # fixtures used here

WHEN = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def calls(probe: BaseProbe) -> None:
    """A little of what an adapter sends: defaults and overrides of ts and deployment_id."""
    pool(probe, used=3, ts=WHEN)
    probe.emit(
        ev.RequestAdmitted, ts=WHEN, request_id="r1", tenant="acme", model_id=None, prompt_tokens=12
    )
    probe.emit(
        ev.RequestFinished,
        ts=WHEN,
        deployment_id="other-dep",
        request_id="r1",
        tenant="acme",
        prompt_tokens=12,
        completion_tokens=3,
        status="completed",
    )


def test_it_records_what_a_real_probe_delivers(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    real = make_probe(settings(fake_collector))
    calls(real)
    assert real.force_flush(5)
    recording = RecordingProbe(deployment_id="test-dep")
    calls(recording)

    def unnamed(events: list[ev.Event]) -> list[ev.Event]:
        return [msgspec.structs.replace(e, probe_id="x") for e in events]

    assert unnamed(recording.events) == unnamed(fake_collector.events())
    assert {e.probe_id for e in recording.events} == {"test"}
    assert recording.decoded() == recording.events


def test_it_refuses_what_a_real_probe_refuses_without_consuming_seqs(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    fine = {"capacity_tokens": 1, "used_tokens": 0, "free_tokens": 0}
    bad_calls: list[tuple[Any, dict[str, Any]]] = [
        (ev.ProbeDrops, {"counts": {}}),  # the probe's own report
        (ev.ProbeStopped, {}),
        (dict, {"a": 1}),
        (ev.PoolSample, {"capacity_tokens": 1}),  # missing fields
        (ev.PoolSample, {**fine, "x": 1}),
        (ev.PoolSample, {**fine, "seq": 5}),  # the probe owns seq
        (ev.PoolSample, {**fine, "ts": datetime(2024, 1, 1)}),  # naive
    ]
    for probe in (make_probe(settings(fake_collector)), RecordingProbe()):
        for event_type, fields in bad_calls:
            with pytest.raises(InvalidEventError):
                probe.emit(event_type, **fields)
        assert probe.stats()["seq"] == 0
        assert pool(probe)
        assert probe.stats()["seq"] == 1


def test_events_keep_seq_order_without_gaps_across_threads() -> None:
    probe = RecordingProbe()
    start = threading.Barrier(4)

    def emit_many(worker: int) -> None:
        start.wait()
        for i in range(500):
            pool(probe, used=worker * 1000 + i)

    threads = [threading.Thread(target=emit_many, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = probe.events
    assert [e.seq for e in events] == list(range(1, 2001))
    for worker in range(4):  # each thread's own events in the order it emitted them
        mine = [e.used_tokens for e in probe.of(ev.PoolSample) if e.used_tokens // 1000 == worker]
        assert mine == [worker * 1000 + i for i in range(500)]
    assert probe.stats()["emitted"] == probe.stats()["buffered"] == 2000


def test_shutdown_records_probe_stopped_last_and_refuses_what_follows() -> None:
    probe = RecordingProbe()
    assert pool(probe)
    assert probe.force_flush() and probe.shutdown() and probe.shutdown()  # idempotent
    assert not pool(probe)
    assert [type(e) for e in probe.events] == [ev.PoolSample, ev.ProbeStopped]
    assert [e.seq for e in probe.events] == [1, 2]
    stats = probe.stats()
    assert stats["shut_down"] is True and stats["seq"] == 2
    assert stats["dropped"] == {**dict.fromkeys(stats["dropped"], 0), "shutdown": 1}


def test_queries() -> None:
    probe = RecordingProbe()
    with pytest.raises(LookupError, match="one event; recorded none"):
        probe.one()
    pool(probe)
    assert probe.one() is probe.one(ev.PoolSample) is probe.events[0]
    probe.emit(ev.RequestAdmitted, request_id="r1", tenant="acme", model_id=None, prompt_tokens=1)
    assert [type(e) for e in probe.of(ev.Event)] == [ev.PoolSample, ev.RequestAdmitted]
    assert probe.of(ev.RequestAdmitted)[0].request_id == "r1"
    assert probe.of(ev.CanaryHit) == []
    with pytest.raises(LookupError, match="one event; recorded 1 PoolSample, 1 RequestAdmitted"):
        probe.one()


def test_decoded_names_what_the_collector_would_refuse() -> None:
    """emit, like Probe.emit, does not range-check values; decoded() checks them all."""
    probe = RecordingProbe()
    pool(probe)
    assert probe.emit(
        ev.RequestAdmitted, request_id="r1", tenant="acme", model_id=None, prompt_tokens=-1
    )
    with pytest.raises(ev.DecodeError) as caught:
        probe.decoded()
    assert [(e.index, e.field) for e in caught.value.errors] == [(1, "prompt_tokens")]


def test_it_is_part_of_the_lazy_top_level() -> None:
    assert engine_probe.RecordingProbe is RecordingProbe
    assert RecordingProbe.enabled is True and issubclass(RecordingProbe, BaseProbe)


def test_the_documented_example_runs_as_written() -> None:
    """docs/using.md, "A probe in your own code": the RecordingProbe example."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "using.md").read_text()
    after = page.split("In your tests, hand the code that emits a `RecordingProbe`", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", after, re.S)
    assert snippet is not None
    exec(compile(snippet.group(1), "docs/using.md", "exec"), {})
