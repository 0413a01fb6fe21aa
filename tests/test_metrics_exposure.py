"""/metrics is open by default (Prometheus scrapes it), so it carries no figure of a single
request and its size does not grow with whatever deployments a batch names (issue 20, items
6 and 7); KVWATCH_METRICS_TOKEN closes it."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collector.rollups.buckets import bin_high, bin_of
from tests import factories as f
from tests.conftest import Collector, make_token

SECRET_PROMPT = 123_457  # one tenant's rejected prompt: never on /metrics as such


def _post(url: str, token: str, events: list[Any]) -> None:
    r = httpx.post(
        f"{url}/v1/events",
        json=[f.as_json(e) for e in events],
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def _max_prompt(text: str, dep: str) -> float | None:
    found = re.search(
        rf'^kvwatch_deployment_max_prompt_tokens_1h{{deployment="{dep}"}} (\S+)$', text, re.M
    )
    return None if found is None else float(found.group(1))


def test_one_request_is_not_published(collector: Collector) -> None:
    now = datetime.now(UTC)
    first = [f.config(1, ts=now), f.rejected(2, "r-1", prompt=SECRET_PROMPT, ts=now)]
    _post(collector.url, collector.ingest, first)
    text = httpx.get(f"{collector.url}/metrics").text
    assert _max_prompt(text, "glm-prod") is None and str(SECRET_PROMPT) not in text
    # with enough requests in the hour, the largest is published, rounded up to its bin
    more = [f.admitted(3 + i, f"r-{i + 2}", prompt=1_000 + i, ts=now) for i in range(12)]
    _post(collector.url, collector.ingest, more)
    text = httpx.get(f"{collector.url}/metrics").text
    shown = _max_prompt(text, "glm-prod")
    assert shown == math.ceil(bin_high(bin_of(SECRET_PROMPT))) and shown > SECRET_PROMPT
    assert str(SECRET_PROMPT) not in text


@contextmanager
def _collector(tmp_path: Path, **settings: Any) -> Iterator[tuple[str, str]]:
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import serve_in_thread

    db_url = f"sqlite:///{tmp_path / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    app = create_app(Settings(database_url=db_url, auto_migrate=False, **settings))
    with serve_in_thread(app) as url:
        yield url, make_token(db_url, "ingest")


def test_per_deployment_series_are_capped_and_the_rest_counted(tmp_path: Path) -> None:
    with _collector(tmp_path, metrics_max_deployments=3) as (url, ingest):
        for i in range(5):
            _post(url, ingest, [f.config(1, dep=f"dep-{i}", probe=f"p-{i}")])
        text = httpx.get(f"{url}/metrics").text
        series = set(
            re.findall(r'kvwatch_deployment_pool_capacity_tokens{deployment="([^"]+)"', text)
        )
        assert len(series) == 3 and series <= {f"dep-{i}" for i in range(5)}
        assert re.search(r"^kvwatch_metrics_deployments_omitted 2\.0$", text, re.M), text


def test_a_scrape_token_closes_metrics(tmp_path: Path) -> None:
    with _collector(tmp_path, metrics_token="scrape-me") as (url, _):
        assert httpx.get(f"{url}/metrics").status_code == 401
        wrong = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "KVWATCH_METRICS_TOKEN" in wrong.text
        ok = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert ok.status_code == 200 and "kvwatch_ingest_events" in ok.text
        assert httpx.get(f"{url}/healthz").status_code == 200  # the probes stay open


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_safe_context_and_leaks_of_the_hour_are_published(collector: Collector) -> None:
    """The line context_pressure measures against, whether a verification backs it, and the
    hour's stale reads and canary hits: what a Grafana panel of them needs."""
    now = datetime.now(UTC)
    old = now - timedelta(hours=2)
    _post(
        collector.url,
        collector.ingest,
        [
            f.config(1, ts=now),  # advertised 1,048,576, prefill pool 681,280
            f.stale_read(2, ts=now),
            f.stale_read(3, ts=now),
            f.canary_hit(4, ts=now),
            f.stale_read(5, ts=old),  # before the hour: not counted
        ],
    )
    _post(collector.url, collector.ingest, [f.config(1, dep="quiet", probe="probe-q", ts=now)])
    text = httpx.get(f"{collector.url}/metrics").text
    glm, model = ("deployment", "glm-prod"), ("model", "glm-5.3")
    # unverified: min(advertised, prefill pool), and no verified series
    assert _samples(text, "kvwatch_deployment_safe_context_tokens")[(glm, model)] == 681_280
    assert _samples(text, "kvwatch_deployment_verified_safe_context_tokens") == {}
    assert _samples(text, "kvwatch_deployment_stale_reads_1h") == {
        (glm,): 2,
        (("deployment", "quiet"),): 0,
    }
    assert _samples(text, "kvwatch_deployment_canary_hits_1h")[(glm,)] == 1

    with collector.client(collector.admin) as c:
        r = c.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": "glm-5.3",
                "passed": True,
                "verified_safe_context": 600_000,
                "pool_capacity_tokens": 681_280,
                "verified_at": now.isoformat(),
            },
        )
        assert r.status_code == 201, r.text
    text = httpx.get(f"{collector.url}/metrics").text
    assert _samples(text, "kvwatch_deployment_safe_context_tokens")[(glm, model)] == 600_000
    assert _samples(text, "kvwatch_deployment_verified_safe_context_tokens") == {
        (glm, model): 600_000
    }
    at = _samples(text, "kvwatch_deployment_last_verified_timestamp_seconds")[(glm, model)]
    assert at == pytest.approx(now.timestamp(), abs=1e-3)

    # a pool that no longer matches the verification withdraws it (the same bound the rule
    # uses); when it last passed stays published
    _post(collector.url, collector.ingest, [f.config(6, pool_tokens=500_000, ts=now)])
    text = httpx.get(f"{collector.url}/metrics").text
    assert _samples(text, "kvwatch_deployment_safe_context_tokens")[(glm, model)] == 500_000
    assert _samples(text, "kvwatch_deployment_verified_safe_context_tokens") == {}
    assert (glm, model) in _samples(text, "kvwatch_deployment_last_verified_timestamp_seconds")
