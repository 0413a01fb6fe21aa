"""The demo's day of synthetic history (``kvwatch/synthetic.py``): diurnal, with one
context-pressure episode that crosses 80% and resolves, sent through a real probe to a real
collector, and read back as a day of points rather than a dot."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from collector.alerting.service import AlertingService
from collector.db import Database
from engine_probe import Probe, ProbeSettings
from kvwatch import synthetic
from policies import load_ruleset
from tests.conftest import Collector
from tests.probe_helpers import wait_for

END = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_the_day_is_diurnal_and_only_the_episode_nears_the_safe_context() -> None:
    day = synthetic.generate(END - timedelta(days=1))
    assert day == synthetic.generate(END - timedelta(days=1))  # deterministic
    per_hour = Counter(r.start.hour for r in day)
    assert len(per_hour) == 24
    busiest, quietest = max(per_hour.values()), min(per_hour.values())
    assert busiest >= 3 * quietest, per_hour
    assert per_hour[16] > per_hour[4]  # afternoon over night, UTC
    lo, hi = (END - timedelta(days=1) + timedelta(hours=h) for h in synthetic.EPISODE)
    near = [r for r in day if r.prompt >= 0.8 * synthetic.ADVERTISED]
    assert len(near) > 20
    assert all(lo <= r.start < hi and r.tenant == synthetic.EPISODE_TENANT for r in near)
    assert all(r.prompt < synthetic.ADVERTISED for r in day)
    # the batch job sends one document at a time
    docs = sorted(near)
    assert all(a.end < b.start for a, b in itertools.pairwise(docs))
    assert len({r.rid for r in day}) == len(day)


# ends whose day's last minute has no request (seed 7), and two busy ones
@pytest.mark.parametrize("ends_at", ["01:17", "03:02", "03:16", "05:08", "12:00", "16:00"])
def test_a_day_ending_at_any_time_has_a_pool_sample_every_minute(ends_at: str) -> None:
    # a CI run ending its day in the quiet hours once got 1,439: the minutes after the
    # last request went unsampled
    hour, minute = map(int, ends_at.split(":"))
    end = datetime(2026, 12, 5, hour, minute, tzinfo=UTC)
    start = end - timedelta(days=1)
    requests = synthetic.generate(start)
    quiet_end = not any(r.start >= end - timedelta(minutes=1) for r in requests)
    assert quiet_end == (ends_at not in ("12:00", "16:00"))  # still the case it was chosen for
    series = synthetic.pool_series(requests, start, end)
    assert [at for at, _ in series] == [start + timedelta(minutes=m) for m in range(24 * 60)]
    assert all(0 <= used <= synthetic.POOL and used % synthetic.PAGE == 0 for _, used in series)
    for at, used in series[::97] + series[-1:]:  # the tokens in flight, in whole pages
        held = sum(r.tokens for r in requests if r.start < at < r.end)
        assert used == min(synthetic.POOL, -(-held // synthetic.PAGE) * synthetic.PAGE)


def test_a_day_through_the_probe_reads_back_as_lines_and_its_episode_resolves(
    collector: Collector, probes: list[Any], tmp_path: Path
) -> None:
    end = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
    probe = Probe(
        ProbeSettings(
            collector_url=collector.url,
            ingest_token=collector.ingest,
            probe_id="synthetic-probe",
            deployment_id=synthetic.DEPLOYMENT,
            probe_spool_dir=tmp_path / "spool",
            probe_batch_size=1000,  # the test collector's batch limit
            probe_flush_interval_s=0.05,
        )
    )
    probes.append(probe)
    day = synthetic.drive(probe, collector.url, collector.ingest, end)
    assert probe.shutdown(30)
    assert probe.stats()["sent"] == probe.stats()["emitted"] == day.events + 1  # + stopped
    summary = day.to_json()
    assert summary["label"].startswith("synthetic")
    assert summary["pool_samples"] == 24 * 60
    assert 0.8 <= summary["context_pressure_episode"]["max_ratio_of_safe_context"] < 1.0
    assert sum(summary["requests_by_tenant"].values()) == day.requests

    with collector.client(collector.admin) as c:
        got = c.get(
            "/v1/requests", params={"deployment_id": synthetic.DEPLOYMENT, "limit": 1}
        ).json()
        assert got["items"] and got["items"][0]["tenant"] in synthetic.TENANTS
        # a day of points, not a dot: every 8-minute bucket of the day has a sample
        window = {"since": (end - timedelta(days=1)).isoformat(), "until": end.isoformat()}
        params = {**window, "deployment_id": synthetic.DEPLOYMENT, "max_points": 200}
        wait_for(  # long windows read the pool rollup, refreshed every 0.2 s here
            lambda: len(c.get("/v1/pool-samples", params=params).json()["items"]) >= 170,
            30,
            "a day of pool buckets",
        )
        (verification,) = c.get(
            "/v1/verifications", params={"deployment_id": synthetic.DEPLOYMENT}
        ).json()
        assert verification["passed"] and verification["verified_safe_context"] == 16_384
        events = c.get("/v1/page-events", params={"deployment_id": synthetic.DEPLOYMENT})
        assert events.json()["items"] == []

        def pressure() -> dict[str, Any]:
            (a,) = c.get(
                "/v1/alerts",
                params={"deployment_id": synthetic.DEPLOYMENT, "rule": "context_pressure"},
            ).json()
            return dict(a)

        # the episode's prompts reached 80% of the verified safe context and fired...
        alert = pressure()
        assert alert["labels"]["verified"] == "true"
        # (the summary names the last batch's largest prompt: 82-97% of the safe context)
        reached = re.search(
            r"on route /v1/completions reached (\d+)%", alert["annotations"]["summary"]
        )
        assert reached and 80 <= int(reached[1]) < 100, alert["annotations"]["summary"]
        # ...and, its last prompt hours old, the next timer pass resolves it
        db = Database(collector.db_url)
        try:
            AlertingService(db, load_ruleset()).tick(datetime.now(UTC))
        finally:
            db.dispose()
        assert pressure()["state"] == "resolved"
        firing = c.get(
            "/v1/alerts", params={"deployment_id": synthetic.DEPLOYMENT, "state": "firing"}
        ).json()
        assert firing == []  # a healthy deployment
