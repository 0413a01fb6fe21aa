"""The hot path: seq stamping, the bounded buffer, drop counting, the no-op probe, settings."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

import engine_probe
from engine_probe import events as ev
from engine_probe.buffer import DropCounter, EventBuffer
from engine_probe.errors import InvalidEventError, ProbeConfigError
from engine_probe.probe import NoopProbe, Probe, configure_probe, get_probe, shutdown_probe
from engine_probe.settings import ProbeSettings, derive_probe_id, sanitize_id
from tests.probe_helpers import FakeCollector, fake_collector, make_probe, pool, settings, wait_for

__all__ = ["fake_collector", "make_probe"]  # fixtures used here


def make_buffer(
    capacity: int = 10, batch_size: int = 5, on_batch: Any = None
) -> tuple[EventBuffer, DropCounter]:
    drops = DropCounter()
    buf = EventBuffer(
        capacity=capacity,
        batch_size=batch_size,
        probe_id="p-1",
        deployment_id="dep",
        drops=drops,
        on_batch=on_batch or (lambda: None),
    )
    return buf, drops


def add(buf: EventBuffer, used: int = 1, **fields: Any) -> bool:
    return buf.append(
        ev.PoolSample,
        ev.utcnow(),
        "dep",
        {"capacity_tokens": 100, "used_tokens": used, "free_tokens": 0, **fields},
    )


# -- EventBuffer -------------------------------------------------------------------------


def test_events_are_stamped_with_strictly_increasing_seqs_from_one() -> None:
    buf, _ = make_buffer()
    for i in range(3):
        assert add(buf, used=i)
    taken = buf.take()
    assert [e.seq for e in taken.events] == [1, 2, 3]
    assert taken.upto == 3
    first = taken.events[0]
    assert isinstance(first, ev.PoolSample)
    assert (first.schema_version, first.probe_id, first.deployment_id) == (1, "p-1", "dep")
    # What the buffer builds is what the collector accepts.
    assert ev.decode_json_batch(ev.encode_batch(taken.events)) == taken.events


def test_full_buffer_drops_the_new_event_after_giving_it_a_seq() -> None:
    buf, drops = make_buffer(capacity=3)
    results = [add(buf, used=i) for i in range(5)]
    assert results == [True, True, True, False, False]
    assert len(buf) == 3
    assert buf.seq == 5  # the dropped events consumed seqs 4 and 5: a visible gap
    assert drops.totals() == {"buffer_full": 2}

    taken = buf.take()
    data, report = taken.events[:-1], taken.events[-1]
    assert [e.seq for e in data] == [1, 2, 3]
    assert [e.used_tokens for e in data] == [0, 1, 2]  # type: ignore[attr-defined]
    # The report goes out with the batch, past the buffer's capacity, after every seq it
    # explains.
    assert isinstance(report, ev.ProbeDrops)
    assert report.seq == 6 and report.counts == {"buffer_full": 2}
    assert taken.upto == 6
    assert not drops.has_pending()
    assert drops.totals() == {"buffer_full": 2}  # totals survive the report
    assert buf.take().events == []  # nothing new: no empty report


def test_invalid_fields_raise_and_consume_no_seq() -> None:
    buf, drops = make_buffer()
    with pytest.raises(InvalidEventError, match="PoolSample"):
        buf.append(ev.PoolSample, ev.utcnow(), "dep", {"capacity_tokens": 1, "nope": 2})
    with pytest.raises(InvalidEventError, match="exceeds capacity"):
        add(buf, used=500)  # __post_init__ cross-field check
    assert buf.seq == 0 and len(buf) == 0 and drops.totals() == {}
    assert add(buf)
    assert buf.take().events[0].seq == 1


def test_on_batch_fires_once_when_a_batch_is_ready() -> None:
    calls: list[int] = []
    buf, _ = make_buffer(capacity=20, batch_size=4, on_batch=lambda: calls.append(1))
    for _ in range(7):
        add(buf)
    assert calls == [1]
    buf.take()
    for _ in range(4):
        add(buf)
    assert calls == [1, 1]


def test_closed_buffer_counts_shutdown_drops_without_seqs() -> None:
    buf, drops = make_buffer()
    add(buf)
    buf.close()
    assert not add(buf)
    assert buf.seq == 1
    assert drops.totals() == {"shutdown": 1}
    assert not drops.has_pending()  # nothing after the last report can be explained
    assert [e.seq for e in buf.take().events] == [1]


def test_concurrent_appends_keep_seqs_unique_gapless_and_ordered() -> None:
    buf, _ = make_buffer(capacity=100_000, batch_size=100_000)
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        for _ in range(2000):
            add(buf)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [e.seq for e in buf.take().events]
    assert seqs == list(range(1, 16001))


def test_drop_counter_restore_and_unreported_drops() -> None:
    drops = DropCounter()
    drops.add("spool_full", 3)
    drops.add("rejected_by_collector", 2, report=False)
    assert drops.take_pending() == {"spool_full": 3}
    drops.restore({"spool_full": 3, "not-a-reason": 7}.items())
    assert drops.take_pending() == {"spool_full": 3}
    assert drops.totals() == {"spool_full": 3, "rejected_by_collector": 2}


# -- Probe.emit ----------------------------------------------------------------------------


def test_probe_emit_stamps_defaults_and_overrides(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector))
    before = datetime.now(UTC)
    assert pool(probe)
    when = datetime(2024, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    assert pool(probe, ts=when, deployment_id="other-dep")
    assert probe.force_flush(5)
    first, second = fake_collector.events()
    assert first.probe_id == second.probe_id == probe.probe_id
    assert (first.seq, second.seq) == (1, 2)
    assert first.deployment_id == "test-dep" and second.deployment_id == "other-dep"
    assert first.ts >= before and first.ts.utcoffset() == timedelta(0)
    assert second.ts == when


def test_probe_emit_rejects_caller_bugs_without_consuming_seqs(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    probe = make_probe(settings(fake_collector))
    with pytest.raises(InvalidEventError):
        probe.emit(ev.ProbeDrops, counts={})  # the probe's own report
    with pytest.raises(InvalidEventError):
        probe.emit(dict, a=1)
    with pytest.raises(InvalidEventError, match="timezone"):
        pool(probe, ts=datetime(2024, 1, 1))
    with pytest.raises(InvalidEventError):
        probe.emit(ev.PoolSample, capacity_tokens=1)
    with pytest.raises(InvalidEventError, match="seq"):  # the probe owns seq
        probe.emit(ev.PoolSample, seq=5, capacity_tokens=1, used_tokens=0, free_tokens=0)
    assert probe.stats()["seq"] == 0
    assert pool(probe)
    assert probe.stats()["seq"] == 1


def test_probe_requires_a_collector_url() -> None:
    with pytest.raises(ProbeConfigError):
        Probe(ProbeSettings(collector_url=None))


# -- the process's probe -------------------------------------------------------------------


def test_noop_probe_until_configured(fake_collector: FakeCollector) -> None:
    assert isinstance(get_probe(), NoopProbe)
    noop = get_probe()
    assert not noop.enabled
    assert noop.emit(ev.PoolSample, anything="goes") is False  # checks nothing, costs nothing
    assert noop.force_flush() and noop.shutdown()
    assert noop.stats() == {"enabled": False, "probe_id": None}

    # No collector: the no-op probe stays.
    assert configure_probe(ProbeSettings(collector_url=None)) is noop
    assert get_probe() is noop

    probe = configure_probe(settings(fake_collector))
    try:
        assert isinstance(probe, Probe) and get_probe() is probe and probe.enabled
        get_probe().emit(ev.PoolSample, capacity_tokens=5, used_tokens=1, free_tokens=4)
        # Reconfiguring shuts the previous probe down (flushing it) and installs the new one.
        replacement = configure_probe(settings(fake_collector))
        assert replacement is not probe and probe.stats()["shut_down"]
        sent = fake_collector.events()
        assert [(e.probe_id, ev.kind_of(e)) for e in sent] == [
            (probe.probe_id, "pool.sample"),
            (probe.probe_id, "probe.stopped"),
        ]
    finally:
        assert shutdown_probe(2.0)
    assert get_probe() is noop
    wait_for(lambda: not any(t.name.startswith("kvwatch-probe") for t in threading.enumerate()))


def test_package_exports_the_public_api_and_never_imports_torch() -> None:
    assert engine_probe.Probe is Probe
    assert engine_probe.ProbeSettings is ProbeSettings
    assert engine_probe.get_probe is get_probe
    assert engine_probe.configure_probe is configure_probe
    # A fresh interpreter, since other test modules may import torch themselves.
    code = (
        "import sys, engine_probe, engine_probe.exporter, engine_probe.spool; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


# -- settings ------------------------------------------------------------------------------


def test_settings_come_from_kvwatch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://collector.example:8000/")
    monkeypatch.setenv("KVWATCH_INGEST_TOKEN", "s3cret")
    monkeypatch.setenv("KVWATCH_PROBE_BUFFER_SIZE", "4096")
    monkeypatch.setenv("KVWATCH_PROBE_SPOOL_DIR", "/var/spool/kvwatch")
    s = ProbeSettings()
    assert s.collector_url == "http://collector.example:8000"
    assert s.events_url == "http://collector.example:8000/v1/events"
    assert s.ingest_token == "s3cret"
    assert "s3cret" not in repr(s)
    assert s.probe_buffer_size == 4096
    assert str(s.probe_spool_dir) == "/var/spool/kvwatch"
    assert s.probe_id is None and s.deployment_id == "default"
    assert s.probe_max_spool_bytes == 1 << 30


@pytest.mark.parametrize(
    "overrides",
    [
        {"probe_buffer_size": 0},
        {"probe_batch_size": -1},
        {"probe_buffer_size": 10, "probe_batch_size": 11},
        {"probe_flush_interval_s": 0},
        {"probe_max_spool_bytes": 0},
        {"probe_backoff_base_s": 5, "probe_backoff_max_s": 1},
        {"collector_url": "collector:8000"},
        {"collector_url": "ftp://collector"},
        {"probe_id": "has space"},
        {"probe_id": "-leading-dash"},
        {"probe_id": "engine-0\n"},
        {"probe_id": "x" * 129},
        {"deployment_id": "x" * 200},
        {"deployment_id": "prod\n"},
        {"probe_max_attempts": 0},
    ],
)
def test_settings_refuse_what_cannot_work(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ProbeSettings(**overrides)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVWATCH_PROBE_ID", "engine-0\n"),
        ("KVWATCH_PROBE_ID", "engine 0"),
        ("KVWATCH_DEPLOYMENT_ID", "prod\n"),
    ],
)
def test_bad_ids_from_the_environment_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    # "$" in a regex also matches before a trailing newline: the check must use the wire
    # contract's own rule (fullmatch), or the collector would refuse every event later.
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError, match=var):
        ProbeSettings()


def test_probe_max_attempts_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ProbeSettings().probe_max_attempts == 8
    monkeypatch.setenv("KVWATCH_PROBE_MAX_ATTEMPTS", "3")
    assert ProbeSettings().probe_max_attempts == 3


def test_generated_probe_ids_fit_the_wire_contract() -> None:
    pid = derive_probe_id()
    assert ev.is_valid_id(pid)
    assert derive_probe_id() != pid
    child = derive_probe_id("node-a")
    assert child.startswith("node-a-") and ev.is_valid_id(child)
    # A root of the longest valid id is cut so that the suffix still fits.
    long_root = "r" * ev.ID_MAX
    assert ev.is_valid_id(long_root)
    derived = derive_probe_id(long_root)
    assert ev.is_valid_id(derived) and derived.startswith("r" * 100)


def test_a_configured_probe_id_is_a_root_each_probe_extends(
    fake_collector: FakeCollector, make_probe: Any
) -> None:
    # A restarted process with the same KVWATCH_PROBE_ID starts its seq at 1 again: under
    # the same id the collector would store its events as duplicates of the previous run's.
    first = make_probe(settings(fake_collector, probe_id="engine-0"))
    second = make_probe(settings(fake_collector, probe_id="engine-0"))
    assert first.probe_id != second.probe_id
    for probe in (first, second):
        assert probe.probe_id.startswith(f"engine-0-{os.getpid()}-")
        assert ev.is_valid_id(probe.probe_id)
        assert probe.stats()["probe_id"] == probe.probe_id
    longest = make_probe(settings(fake_collector, probe_id="x" * ev.ID_MAX))
    assert ev.is_valid_id(longest.probe_id)
    assert pool(first) and pool(second) and pool(longest)
    for probe in (first, second, longest):
        assert probe.force_flush(5)
    by_probe = fake_collector.by_probe()
    assert set(by_probe) == {first.probe_id, second.probe_id, longest.probe_id}
    assert all([e.seq for e in events] == [1] for events in by_probe.values())


@given(st.text(max_size=300))
def test_sanitize_id_always_yields_a_valid_id(raw: str) -> None:
    value = sanitize_id(raw)
    assert ev.is_valid_id(value)
    assert ev.is_valid_id(derive_probe_id(raw))
