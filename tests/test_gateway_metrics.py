"""The gateway's /metrics, over real HTTP in front of refengine's real server: requests by
outcome, refusals by reason, upstream latency, guarded prompt sizes and the limit in force per
model move as requests pass; model names nobody vouches for fold into ``_other``; promtool's
lint finds nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from engine_probe.probe import NoopProbe
from kvwatch.embedded import free_port, serve_in_thread
from kvwatch.gateway import GatewaySettings, create_app
from kvwatch.gateway.limits import SafeContexts
from kvwatch.gateway.metrics import NO_MODEL, OTHER, GatewayMetrics
from policies.limits import from_json
from refengine import Engine, EngineConfig
from refengine.server import create_app as refengine_app
from tests.metrics_text import Samples, samples
from tests.promtool import metric_problems

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "refengine-lab"
KEY = "sk-acme-1"
LIMIT = 1000


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    engine = Engine(EngineConfig(advertised_context=4096, pool_tokens=2048, page_size=16))
    with serve_in_thread(refengine_app(engine, tenant_keys={"acme": KEY})) as url:
        yield url


@contextmanager
def gateway(upstream: str, **settings: Any) -> Iterator[tuple[str, Any]]:
    config = GatewaySettings(
        gateway_upstream=upstream,
        gateway_tenant_keys={"acme": KEY},
        gateway_safe_contexts={MODEL: LIMIT},
        gateway_tokenizer="bytes",
        **settings,
    )
    app = create_app(config, probe=NoopProbe())
    with serve_in_thread(app) as url:
        yield url, app


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


def scrape(url: str) -> tuple[str, Samples]:
    r = httpx.get(f"{url}/metrics", timeout=10)  # no token, as Prometheus scrapes
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text, samples(r.text)


def requests_of(s: Samples, model: str, outcome: str) -> float | None:
    return s.get("kvwatch_gateway_requests_total", {"model": model, "outcome": outcome})


def test_requests_refusals_latency_and_limits_move(upstream: str) -> None:
    with gateway(upstream) as (url, app):
        _, before = scrape(url)
        for outcome in ("forwarded", "refused", "error"):  # every series from the start, at 0
            assert requests_of(before, MODEL, outcome) == 0
        assert before.get("kvwatch_gateway_limit_tokens", {"model": MODEL, "source": "configured"})
        assert post(url, {"model": MODEL, "prompt": "a" * 100, "max_tokens": 3}).status_code == 200
        assert post(url, {"prompt": "b" * 300, "max_tokens": 2}).status_code == 200  # no model
        streamed = post(url, {"model": MODEL, "prompt": "c" * 50, "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        over = post(url, {"model": MODEL, "prompt": "d" * 1500})
        assert over.json()["error"]["code"] == "context_length_exceeded"
        sprayed = [f"nope-{i}" for i in range(12)]
        for name in sprayed:  # the upstream does not serve them: refused there
            assert post(url, {"model": name, "prompt": "e" * 10}).status_code == 404
        app.state.limits.set_served(
            {
                MODEL: from_json(
                    {
                        "deployment_id": "d",
                        "model_id": MODEL,
                        "tokens": 800,
                        "source": "verified",
                        "verified_safe_context": 800,
                    }
                ),
                "leaky-model": from_json(
                    {
                        "deployment_id": "d",
                        "model_id": "leaky-model",
                        "tokens": 0,
                        "source": "failed-verification",
                        "warning": "a leak",
                    }
                ),
            }
        )
        text, after = scrape(url)

    assert requests_of(after, MODEL, "forwarded") == 3  # the unnamed one is the upstream's
    assert requests_of(after, MODEL, "refused") == 1
    assert requests_of(after, MODEL, "error") == 0
    refused = {"model": MODEL, "reason": "context_length_exceeded"}
    assert after.get("kvwatch_gateway_refusals_total", refused) == 1
    assert requests_of(after, OTHER, "refused") == len(sprayed)
    sprayed_refused = {"model": OTHER, "reason": "invalid_request"}
    assert after.get("kvwatch_gateway_refusals_total", sprayed_refused) == len(sprayed)
    models = {labels["model"] for _, labels, _ in after.all() if "model" in labels}
    assert not models & set(sprayed)
    assert models <= {MODEL, OTHER, NO_MODEL, "leaky-model"}
    mine = {"model": MODEL}
    # upstream latency: the three forwarded (the twelve the upstream refused are _other's)
    assert after.get("kvwatch_gateway_upstream_latency_seconds_count", mine) == 3
    assert 0 < (after.get("kvwatch_gateway_upstream_latency_seconds_sum", mine) or 0) < 60
    # guarded prompts, counted with the byte tokenizer: 100, 300, 50 and the refused 1500
    assert after.get("kvwatch_gateway_prompt_tokens_count", mine) == 4
    assert after.get("kvwatch_gateway_prompt_tokens_sum", mine) == 100 + 300 + 50 + 1500
    assert after.get("kvwatch_gateway_prompt_tokens_bucket", mine | {"le": "500.0"}) == 3
    assert after.get("kvwatch_gateway_prompt_tokens_bucket", mine | {"le": "2000.0"}) == 4
    # the limit in force per model, by source: read at scrape time
    limits = {
        (labels["model"], labels["source"]): value
        for labels, value in after.series("kvwatch_gateway_limit_tokens")
    }
    assert limits == {(MODEL, "verified"): 800, ("leaky-model", "failed-verification"): 0}
    assert "acme" not in text and "gw-" not in text  # no tenant, no request id
    assert metric_problems(text) == []


def test_an_upstream_that_is_down_counts_as_error() -> None:
    with gateway(f"http://127.0.0.1:{free_port()}") as (url, _):
        r = post(url, {"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 502
        _, s = scrape(url)
    assert requests_of(s, MODEL, "error") == 1
    assert requests_of(s, MODEL, "forwarded") == 0
    # it was forwarded, so its wait counts, as does the prompt the guard counted
    assert s.get("kvwatch_gateway_upstream_latency_seconds_count", {"model": MODEL}) == 1
    assert s.get("kvwatch_gateway_prompt_tokens_count", {"model": MODEL}) == 1


def test_models_the_upstream_answered_are_capped() -> None:
    metrics = GatewayMetrics(SafeContexts({"configured-model": 100}), max_models=2)
    for i in range(5):
        metrics.record(f"served-{i}", "forwarded")
    metrics.record("never-answered", "refused", reason="invalid_request")
    metrics.record(None, "refused", reason="invalid_request")
    s = samples(generate_latest(metrics.registry).decode())
    counted: dict[str, float] = {}
    for labels, value in s.series("kvwatch_gateway_requests_total"):
        counted[labels["model"]] = counted.get(labels["model"], 0) + value
    assert counted == {
        "served-0": 1,
        "served-1": 1,
        OTHER: 4,
        NO_MODEL: 1,
        "configured-model": 0,  # made at construction
    }
