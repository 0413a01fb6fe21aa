"""The real exporter against the real collector app (SQLite and PostgreSQL): what reaches the
database when a batch can never be accepted, and across restarts with a fixed probe id root.

Counts are read from the database itself, so "stored exactly once" means one row per seq.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, text

from engine_probe import events as ev
from engine_probe.probe import Probe
from engine_probe.settings import ProbeSettings
from engine_probe.spool import REJECTED_DIR, Spool
from tests.conftest import Collector
from tests.probe_helpers import wait_for


@pytest.fixture
def db(collector: Collector) -> Iterator[Engine]:
    engine = create_engine(collector.db_url)
    try:
        yield engine
    finally:
        engine.dispose()


def probe_settings(collector: Collector, token: str, **overrides: Any) -> ProbeSettings:
    values: dict[str, Any] = {
        "collector_url": collector.url,
        "ingest_token": token,
        "deployment_id": "real-dep",
        "probe_buffer_size": 1000,
        "probe_batch_size": 10,
        "probe_flush_interval_s": 0.05,
        "probe_request_timeout_s": 10.0,
        "probe_backoff_base_s": 0.01,
        "probe_backoff_max_s": 0.05,
        "probe_max_attempts": 3,
    }
    values.update(overrides)
    return ProbeSettings(**values)


def pool_rows(db: Engine, probe_id: str) -> list[tuple[int, int]]:
    """(seq, used_tokens) of every stored pool sample of ``probe_id``, by seq."""
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT seq, used_tokens FROM pool_samples WHERE probe_id = :p ORDER BY seq"),
            {"p": probe_id},
        )
        return [(int(seq), int(used)) for seq, used in rows]


def probe_row(db: Engine, probe_id: str) -> tuple[int, int, int] | None:
    """(max_seq, accepted, duplicates) the collector holds for ``probe_id``."""
    with db.connect() as conn:
        row = conn.execute(
            text("SELECT max_seq, accepted, duplicates FROM probes WHERE probe_id = :p"),
            {"p": probe_id},
        ).one_or_none()
    return None if row is None else (int(row[0]), int(row[1]), int(row[2]))


def seq_gaps(db: Engine, probe_id: str) -> list[tuple[int, int]]:
    """The seq ranges the collector saw missing for ``probe_id``."""
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT first_seq, last_seq FROM seq_gaps WHERE probe_id = :p ORDER BY 1"),
            {"p": probe_id},
        )
        return [(int(a), int(b)) for a, b in rows]


def dead_letters(spool_dir: Path) -> list[tuple[list[dict[str, Any]], str]]:
    return [
        (json.loads(p.read_bytes()), p.with_suffix(".txt").read_text())
        for p in sorted((spool_dir / REJECTED_DIR).glob("*.json"))
        if not p.name.startswith(".")
    ]


def emit_pool(probe: Probe, used: int) -> bool:
    return probe.emit(ev.PoolSample, capacity_tokens=10**6, used_tokens=used, free_tokens=0)


def drained(probe: Probe) -> None:
    """Everything emitted so far is delivered or dead-lettered, the report included."""
    assert probe.force_flush(10)
    wait_for(lambda: probe.stats()["spooled"]["files"] == 0, 20, "the spool to drain")
    assert probe.force_flush(10)  # the report of whatever was dead-lettered meanwhile
    wait_for(lambda: probe.stats()["spooled"]["files"] == 0, 20, "the report to go out")


def test_one_invalid_event_is_dead_lettered_and_everything_else_stored_once(
    collector: Collector, db: Engine, probes: list[Probe], tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    probe = Probe(probe_settings(collector, collector.ingest, probe_spool_dir=spool_dir))
    probes.append(probe)
    for i in range(30):
        if i == 15:
            # Not range-checked on the hot path; the collector refuses it with a 422 that
            # names the event.
            probe.emit(ev.PoolSample, capacity_tokens=100, used_tokens=-5, free_tokens=0)
        else:
            assert emit_pool(probe, i)
    drained(probe)
    assert probe.shutdown(5)

    rows = pool_rows(db, probe.probe_id)
    assert [used for _, used in rows] == [i for i in range(30) if i != 15]
    assert [seq for seq, _ in rows] == [i + 1 for i in range(30) if i != 15]
    stats = probe.stats()
    assert stats["dropped"]["rejected_by_collector"] == 1
    assert sum(stats["dropped"].values()) == 1
    # 29 samples, the drop report that explains the one missing seq, and probe.stopped.
    assert probe_row(db, probe.probe_id) == (32, 31, 0)
    assert seq_gaps(db, probe.probe_id) == [(16, 16)]
    [(kept, note)] = dead_letters(spool_dir)
    assert [(e["seq"], e["used_tokens"]) for e in kept] == [(16, -5)]
    assert "HTTP 422" in note


def test_an_adopted_batch_refused_with_403_is_dead_lettered_after_the_cap(
    collector: Collector, db: Engine, probes: list[Probe], tmp_path: Path
) -> None:
    # A process that spooled during an outage and died; its probe id is registered to a
    # token that was rotated since, so the collector answers 403 to its batches forever.
    spool_dir = tmp_path / "spool"
    old_token = collector.token("ingest")
    orphan_id = "engine-0-4242-abcdef"
    first = ev.PoolSample(
        schema_version=1, probe_id=orphan_id, seq=1, ts=ev.utcnow(),
        deployment_id="real-dep", capacity_tokens=100, used_tokens=1, free_tokens=0,
    )  # fmt: skip
    with collector.client(old_token) as client:
        client.post("/v1/events", content=ev.encode_batch([first])).raise_for_status()
    orphan = Spool(spool_dir, orphan_id, 1 << 20)
    bodies = []
    for b in range(3):
        batch = [
            ev.PoolSample(schema_version=1, probe_id=orphan_id, seq=2 + b * 2 + i,
                          ts=ev.utcnow(), deployment_id="real-dep", capacity_tokens=100,
                          used_tokens=2 + b * 2 + i, free_tokens=0)
            for i in range(2)
        ]  # fmt: skip
        bodies.append(ev.encode_batch(batch))
        orphan.push(bodies[-1], len(batch))
    orphan.close()  # unlocked, batches left on disk: what a dead process leaves
    with collector.client(collector.ingest) as client:
        refused = client.post("/v1/events", content=bodies[0])
    assert refused.status_code == 403  # what the probe will get for every orphan batch

    probe = Probe(probe_settings(collector, collector.ingest, probe_spool_dir=spool_dir))
    probes.append(probe)
    for i in range(25):
        assert emit_pool(probe, i)
    drained(probe)
    assert probe.shutdown(5)

    stats = probe.stats()
    assert stats["adopted_files"] == 3
    assert stats["dropped"]["rejected_by_collector"] == 6  # the orphan's events, not ours
    assert [used for _, used in pool_rows(db, probe.probe_id)] == list(range(25))
    # Foreign drops are not this probe's to report: its own stream has no gap at all (25
    # samples, then probe.stopped).
    assert probe_row(db, probe.probe_id) == (26, 26, 0)
    assert seq_gaps(db, probe.probe_id) == []
    assert pool_rows(db, orphan_id) == [(1, 1)]
    kept = dead_letters(spool_dir)
    assert [e["seq"] for events, _ in kept for e in events] == [2, 3, 4, 5, 6, 7]
    assert all("HTTP 403" in note and "another ingest token" in note for _, note in kept)
    # The spool directory of the dead process was adopted and removed.
    assert not (spool_dir / orphan_id).exists()


def test_restarts_with_a_fixed_probe_id_root_store_every_event(
    collector: Collector, db: Engine, probes: list[Probe], tmp_path: Path
) -> None:
    # Two process lifetimes configured with the same KVWATCH_PROBE_ID: each starts its seq
    # at 1, so each needs its own id, or the second run's events count as duplicates.
    ids = []
    for run in range(2):
        probe = Probe(
            probe_settings(
                collector, collector.ingest, probe_id="engine-0", probe_spool_dir=tmp_path / "sp"
            )
        )
        probes.append(probe)
        for i in range(15):
            assert emit_pool(probe, run * 100 + i)
        assert probe.force_flush(10)
        assert probe.shutdown(5)
        assert probe.stats()["duplicates"] == 0
        ids.append(probe.probe_id)

    assert len(set(ids)) == 2 and all(i.startswith("engine-0-") for i in ids)
    for run, probe_id in enumerate(ids):
        rows = pool_rows(db, probe_id)
        assert rows == [(i + 1, run * 100 + i) for i in range(15)]
        assert probe_row(db, probe_id) == (16, 16, 0)  # and seq 16: probe.stopped
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pool_samples")).scalar_one() == 30


def test_the_collector_answers_what_the_exporter_expects(collector: Collector) -> None:
    """The status codes the exporter's classification relies on, from the real app."""
    event = ev.PoolSample(
        schema_version=1, probe_id="contract-probe", seq=1, ts=ev.utcnow(),
        deployment_id="real-dep", capacity_tokens=100, used_tokens=-1, free_tokens=0,
    )  # fmt: skip
    with collector.client(collector.ingest) as client:
        bad = client.post("/v1/events", content=ev.encode_batch([event]))
    assert bad.status_code == 422
    assert [d["index"] for d in bad.json()["error"]["details"]] == [0]
    with httpx.Client(base_url=collector.url) as client:
        assert client.post("/v1/events", content=b"[]").status_code == 401


def test_a_clean_shutdown_tells_the_collector_and_a_restart_supersedes_the_old_probe(
    collector: Collector, probes: list[Probe]
) -> None:
    """The last event of a probe that shuts down is probe.stopped; the collector's probe
    list shows when. An engine restarted on the same host (same id root) whose old probe
    died without a word shows as superseded by the new one."""
    crashed = Probe(probe_settings(collector, collector.ingest, probe_id="engine-7"))
    probes.append(crashed)
    assert emit_pool(crashed, 1) and crashed.force_flush(10)
    # it goes quiet without shutting down (as a killed engine does): no probe.stopped
    restarted = Probe(probe_settings(collector, collector.ingest, probe_id="engine-7"))
    probes.append(restarted)
    assert emit_pool(restarted, 2) and restarted.force_flush(10)
    assert restarted.shutdown(5)
    with collector.client(collector.admin) as h:
        r = h.get("/v1/probes")
    assert r.status_code == 200, r.text
    mine = {p["probe_id"]: p for p in r.json() if p["probe_id"].startswith("engine-7-")}
    old, new = mine[crashed.probe_id], mine[restarted.probe_id]
    assert old["stopped_at"] is None and old["superseded_by"] == restarted.probe_id
    assert new["stopped_at"] is not None and new["superseded_by"] is None
    assert new["max_seq"] == 2 and new["missing"] == 0
