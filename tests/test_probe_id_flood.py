"""Probe ids are bounded like every other name (issue 40, finding 5).

The attack: 2,000 batches, each under a new probe id starting past seq 1, with one ingest
token. It gave 2,000 gap alerts, 2,000 new /metrics series, webhook notifications by the
hundred and verification uploads 26x slower. Now a token may introduce
KVWATCH_MAX_NEW_PROBES_PER_HOUR probe ids (429 naming it, nothing stored), probes first
heard from past seq 1 raise one alert per deployment, and /metrics shows the 100 probes
missing most with a count of the rest."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from collector import migrate
from collector import models as m
from collector.app import create_app
from collector.db import Database
from collector.settings import Settings
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token

LIMIT = 130


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, max_new_probes_per_hour=LIMIT)
    with serve_in_thread(create_app(settings)) as url:
        yield url, db_url


def _batch(probe: str) -> list[dict[str, object]]:
    now = datetime.now(UTC)
    return [f.as_json(f.pool(s, probe=probe, dep="flooded", ts=now)) for s in (40, 41)]


def test_a_flood_of_new_probe_ids_is_refused_past_the_limit_and_alerts_once(
    served: tuple[str, str],
) -> None:
    url, db_url = served
    admin = make_token(db_url, "admin")
    ingest = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {make_token(db_url, 'ingest')}"}
    )
    answers = [
        ingest.post("/v1/events", json=_batch(f"flood-{i:04d}")).status_code
        for i in range(LIMIT + 10)
    ]
    assert answers == [200] * LIMIT + [429] * 10, answers
    r = ingest.post("/v1/events", json=_batch("flood-late"))
    assert r.status_code == 429 and "KVWATCH_MAX_NEW_PROBES_PER_HOUR" in r.text, r.text
    assert r.json()["error"]["details"]["kind"] == "probe"
    # a probe already known still gets through
    known = [f.as_json(f.pool(42, probe="flood-0000", dep="flooded", ts=datetime.now(UTC)))]
    assert ingest.post("/v1/events", json=known).status_code == 200

    db = Database(db_url)
    try:
        with db.read() as conn:
            probes = conn.execute(select(func.count()).select_from(m.Probe)).scalar_one()
            samples = conn.execute(select(func.count()).select_from(m.PoolSample)).scalar_one()
    finally:
        db.dispose()
    assert (probes, samples) == (LIMIT, 2 * LIMIT + 1)  # nothing of a refused batch

    a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"})
    deadline = time.monotonic() + 30
    while True:
        gaps = a.get("/v1/alerts", params={"rule": "telemetry_gap"}).json()
        if gaps or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(g["labels"]["problem"], g["labels"].get("probe_id")) for g in gaps] == [
        ("seq_gap_at_start", None)
    ], gaps
    assert gaps[0]["occurrences"] == LIMIT  # one alert, every new probe counted in it

    families = {
        fam.name: fam for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    }
    series = families["kvwatch_probe_missing_events"].samples
    assert len(series) == 100, len(series)
    (omitted,) = families["kvwatch_metrics_probes_omitted"].samples
    assert omitted.value == LIMIT - 100
