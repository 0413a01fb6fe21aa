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
from engine_probe import events as ev
from tests import factories as f
from tests.conftest import Collector, make_token
from tests.metrics_text import samples
from tests.promtool import metric_problems

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
    safe = "kvwatch_deployment_safe_context_tokens"
    yes, no = ("verified", "true"), ("verified", "false")
    pool, verified_src = ("source", "pool"), ("source", "verified")
    fresh, stale_ = ("stale", "false"), ("stale", "true")

    def glm_safe(text: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {k: v for k, v in _samples(text, safe).items() if glm in k}

    # unverified: min(advertised, prefill pool), and no verified series
    assert glm_safe(text) == {(glm, model, pool, fresh, no): 681_280}
    assert _samples(text, "kvwatch_deployment_verified_safe_context_tokens") == {}
    # stale reads and canary hits, as the stale_page_read rule counts them (a canary's owner
    # is unknown: foreign, so cross-tenant); canary hits also on their own
    quiet = ("deployment", "quiet")
    assert _samples(text, "kvwatch_deployment_stale_reads_1h") == {
        (("cross_tenant", "false"), glm): 0,
        (("cross_tenant", "true"), glm): 3,
        (("cross_tenant", "false"), quiet): 0,
        (("cross_tenant", "true"), quiet): 0,
    }
    assert _samples(text, "kvwatch_deployment_canary_hits_1h") == {(glm,): 1, (quiet,): 0}

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
    assert glm_safe(text) == {(glm, model, verified_src, fresh, yes): 600_000}
    verified = "kvwatch_deployment_verified_safe_context_tokens"
    assert _samples(text, verified) == {(glm, model): 600_000}
    passed = "kvwatch_deployment_last_passed_verification_timestamp_seconds"
    assert _samples(text, passed)[(glm, model)] == pytest.approx(now.timestamp(), abs=1e-3)

    # a pool that no longer matches the verification withdraws it from the line the rule
    # uses (verified="false"); the verification's own figure and time stay published
    _post(collector.url, collector.ingest, [f.config(6, pool_tokens=500_000, ts=now)])
    text = httpx.get(f"{collector.url}/metrics").text
    assert glm_safe(text) == {(glm, model, pool, stale_, no): 500_000}
    assert _samples(text, verified) == {(glm, model): 600_000}
    assert (glm, model) in _samples(text, passed)


def test_what_the_prometheus_rules_read_is_published(collector: Collector) -> None:
    """The series deploy/prometheus/kvwatch-rules.yaml compares (verdicts, per-route
    pressure, stale reads, rejected prefills that transferred KV), and promtool's lint."""
    now = datetime.now(UTC)
    chat, embed = "/v1/chat/completions", "/v1/embeddings"
    url, ingest, admin = collector.url, collector.ingest, collector.admin
    events: list[Any] = [f.config(1, ts=now)]
    # 12 chat requests (enough to publish), 3 on another route (too few)
    events += [
        f.admitted(2 + i, f"c-{i}", prompt=400_000 + i, route=chat, ts=now) for i in range(12)
    ]
    events += [f.admitted(20 + i, f"e-{i}", prompt=900_000, route=embed, ts=now) for i in range(3)]
    events += [
        f.stale_read(30, ts=now),  # acme's pages read by globex
        f.stale_read(31, ts=now, reader_tenant="acme", previous_tenant="acme"),
        ev.KvTransfer(
            **f.base(32, ts=now),
            request_id="c-0",
            tenant="acme",
            from_node="prefill-0",
            to_node="decode-0",
            pages=3,
            prefill_rejected=True,
        ),
        ev.KvTransfer(
            **f.base(33, ts=now),
            request_id="c-1",
            tenant="acme",
            from_node="prefill-0",
            to_node="decode-0",
            pages=3,
        ),
    ]
    _post(url, ingest, events)
    for model, passed, result in (
        ("glm-5.3", True, "pass"),
        ("glm-5.3", False, "fail"),  # the latest verdict: failed
        ("glm-5.3", False, "error"),  # reached none: changes nothing
        ("glm-4.6", True, "pass"),
    ):
        body: dict[str, Any] = {"deployment_id": "glm-prod", "model_id": model}
        body |= {"passed": passed, "evidence": {"result": result}}
        if passed:
            body["verified_safe_context"] = 500_000
        r = httpx.post(
            f"{url}/v1/verifications",
            json=body,
            headers={"Authorization": f"Bearer {admin}"},
            timeout=30,
        )
        assert r.status_code == 201, r.text
    text = httpx.get(f"{url}/metrics", timeout=30).text

    s = samples(text)
    dep = {"deployment": "glm-prod"}
    assert s.series("kvwatch_deployment_route_max_prompt_tokens_1h") == [
        (dep | {"model": "glm-5.3", "route": chat}, math.ceil(bin_high(bin_of(400_011))))
    ]
    assert s.get("kvwatch_deployment_verification_failed", dep | {"model": "glm-5.3"}) == 1
    assert s.get("kvwatch_deployment_verification_failed", dep | {"model": "glm-4.6"}) == 0
    assert s.series("kvwatch_deployment_verified_safe_context_tokens") == [
        (dep | {"model": "glm-4.6"}, 500_000)  # glm-5.3's latest verdict is a failure
    ]
    passed = s.series("kvwatch_deployment_last_passed_verification_timestamp_seconds")
    assert {labels["model"] for labels, _ in passed} == {"glm-5.3", "glm-4.6"}
    assert all(abs(at - now.timestamp()) < 120 for _, at in passed)
    assert s.get("kvwatch_deployment_stale_reads_1h", dep | {"cross_tenant": "true"}) == 1
    assert s.get("kvwatch_deployment_stale_reads_1h", dep | {"cross_tenant": "false"}) == 1
    assert s.get("kvwatch_deployment_rejected_prefill_transfers_1h", dep) == 1
    assert "400011" not in text and "900000" not in text
    assert metric_problems(text) == []
