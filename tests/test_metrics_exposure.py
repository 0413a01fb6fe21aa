"""/metrics is open by default (Prometheus scrapes it), so it carries no figure of a single
request and its size does not grow with whatever deployments a batch names (issue 20, items
6 and 7); KVWATCH_METRICS_TOKEN closes it."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

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
