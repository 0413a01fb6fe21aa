"""refengine's /metrics in vLLM's names: the counters and histograms move with requests over
real HTTP, the gauges follow the engine's queues and pools, promtool accepts the exposition
(but for the colon in vLLM's names), and kvwatch's scraper reads it as it reads vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from kvwatch.cli import app as cli
from kvwatch.embedded import serve_in_thread
from refengine import Engine, EngineConfig
from refengine.metrics import ServerMetrics
from refengine.server import create_app
from tests.metrics_text import Samples, samples
from tests.promtool import metric_problems

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "refengine-lab"
KEY = "sk-acme"
ME = {"model_name": MODEL, "engine": "0"}


@contextmanager
def serve(**config: Any) -> Iterator[str]:
    base: dict[str, Any] = {"advertised_context": 4096, "pool_tokens": 2048, "page_size": 16}
    engine = Engine(EngineConfig(**(base | config)))
    with serve_in_thread(create_app(engine, tenant_keys={"acme": KEY})) as url:
        yield url


def complete(url: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens} | extra,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    if extra.get("stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
        return {"usage": chunks[-1]["usage"], "finish": chunks[-2]["choices"][0]["finish_reason"]}
    body = r.json()
    return {"usage": body["usage"], "finish": body["choices"][0]["finish_reason"]}


def scrape(url: str) -> tuple[str, Samples]:
    r = httpx.get(f"{url}/metrics", timeout=10)  # no token: Prometheus scrapes it as is
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text, samples(r.text)


def test_requests_move_the_counters_and_histograms_and_promtool_accepts_it() -> None:
    with serve() as url:
        _, before = scrape(url)
        assert before.get("vllm:prompt_tokens_total", ME) == 0
        assert {
            labels["finished_reason"] for labels, _ in before.series("vllm:request_success_total")
        } == {"stop", "length", "abort"}
        answers = [
            complete(url, "hello, metrics", 50),  # read back, then end of text: stop
            complete(url, "x" * 300, 7),  # cut at max_tokens: length
            complete(url, "streamed " * 20, 5, stream=True, stream_options={"include_usage": True}),
        ]
        over = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "y" * 5000},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert over.status_code == 400  # refused before the engine: vLLM does not count it
        text, after = scrape(url)

    prompts = [a["usage"]["prompt_tokens"] for a in answers]
    generated = [a["usage"]["completion_tokens"] for a in answers]
    assert after.get("vllm:prompt_tokens_total", ME) == sum(prompts)
    assert after.get("vllm:generation_tokens_total", ME) == sum(generated)
    for reason in ("stop", "length", "abort"):
        want = sum(a["finish"] == reason for a in answers)
        got = after.get("vllm:request_success_total", ME | {"finished_reason": reason})
        assert got == want, reason
    assert after.get("vllm:request_prompt_tokens_count", ME) == 3
    assert after.get("vllm:request_prompt_tokens_sum", ME) == sum(prompts)
    assert after.get("vllm:request_generation_tokens_sum", ME) == sum(generated)
    # 1-2-5 buckets up to the advertised context, as vLLM's: 14 and 180 tokens under 20 and
    # 200, the 300-token prompt in (200, 500]
    assert after.get("vllm:request_prompt_tokens_bucket", ME | {"le": "20.0"}) == 1
    assert after.get("vllm:request_prompt_tokens_bucket", ME | {"le": "200.0"}) == 2
    assert after.get("vllm:request_prompt_tokens_bucket", ME | {"le": "500.0"}) == 3
    assert after.get("vllm:request_prompt_tokens_bucket", ME | {"le": "2000.0"}) == 3
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"):
        assert after.get(f"{name}_count", ME) == 3
        assert 0 < (after.get(f"{name}_sum", ME) or 0) < 60
    assert after.get("vllm:num_requests_running", ME) == 0
    assert after.get("vllm:num_requests_waiting", ME) == 0
    pool = ME | {"node": "kv", "role": "both"}
    assert after.get("vllm:kv_cache_usage_perc", pool) == 0  # every page freed
    ((info, one),) = after.series("vllm:cache_config_info")
    assert one == 1 and info == pool | {
        "block_size": "16",
        "num_gpu_blocks": "128",
        "kv_cache_size_tokens": "2048",
        "cache_dtype": "float32",
        "enable_prefix_caching": "False",
    }
    capacity = {"model_name": MODEL, "node": "kv", "role": "both"}
    assert after.get("kvwatch_refengine_pool_capacity_tokens", capacity) == 2048
    # every series says which model, as vLLM's do; none says which tenant or request
    for name, labels, _ in after.all():
        assert labels.get("model_name") == MODEL, name
    assert "acme" not in text and "cmpl-" not in text
    assert metric_problems(text) == []


def test_the_gauges_follow_the_queues_and_the_pools() -> None:
    """Read from the engine at scrape time: queued; then one request decoding from the
    decode pool while the other, prefilled, waits on its prefill pages for room there."""
    engine = Engine(
        EngineConfig(
            topology="disaggregated",
            advertised_context=4096,
            pool_tokens=1024,  # 64 pages
            decode_pool_tokens=256,  # 16 pages
            page_size=16,
        )
    )
    metrics = ServerMetrics(engine, MODEL)

    def now() -> tuple[float | None, ...]:
        s = samples(generate_latest(metrics.registry).decode())
        return (
            s.get("vllm:num_requests_waiting", ME),
            s.get("vllm:num_requests_running", ME),
            s.get("vllm:kv_cache_usage_perc", ME | {"node": "prefill", "role": "prefill"}),
            s.get("vllm:kv_cache_usage_perc", ME | {"node": "decode", "role": "decode"}),
        )

    engine.submit("a" * 160, "acme", 8)  # decode block table: 160 + 8 - 1 tokens, 11 pages
    engine.submit("b" * 100, "globex", 8)  # 107 tokens, 7 pages: not in the 5 left
    assert now() == (2, 0, 0, 0)
    engine.step()
    assert now() == (1, 1, 7 / 64, 11 / 16)
    engine.run_until_idle()
    assert now() == (0, 0, 0, 0)
    s = samples(generate_latest(metrics.registry).decode())
    for pool, tokens in (("prefill", 1024), ("decode", 256)):
        capacity = {"model_name": MODEL, "node": pool, "role": pool}
        assert s.get("kvwatch_refengine_pool_capacity_tokens", capacity) == tokens


def test_kvwatch_scrape_reads_it_as_vllm() -> None:
    """``kvwatch scrape --engine vllm`` against the incident's engine (legacy, disaggregated,
    a prefill pool below the advertised context): one node per pool, with its role."""
    with serve(
        mode="legacy",
        topology="disaggregated",
        advertised_context=8192,
        pool_tokens=2048,
        decode_pool_tokens=8192,
    ) as url:
        complete(url, "p" * 1500, 4)
        r = CliRunner().invoke(
            cli,
            ["scrape", "--target", url, "--engine", "vllm", "--node", "lab", "--dry-run"],
            env={"KVWATCH_SCRAPE_API_KEY": KEY},
        )
    assert r.exit_code == 0, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])["last"]
    nodes = {n["node"]: n for n in last["nodes"]}
    assert set(nodes) == {"lab/prefill", "lab/decode"}
    assert (nodes["lab/prefill"]["role"], nodes["lab/decode"]["role"]) == ("prefill", "decode")
    for n in nodes.values():
        assert (n["engine"], n["model_id"], n["advertised_context"]) == ("vllm", MODEL, 8192)
        assert n["disaggregated"] and n["page_size"] == 16 and n["used_tokens"] == 0
    assert nodes["lab/prefill"]["pool_capacity_tokens"] == 2048
    assert nodes["lab/decode"]["pool_capacity_tokens"] == 8192
    (prompts,) = last["prompts"]  # counted once, at prefill
    assert prompts["node"] == "lab/prefill"
    assert (prompts["requests"], prompts["prompt_tokens_total"]) == (1, 1500)
    assert "lab/prefill (prefill, refengine-lab): pool 2048 tokens < advertised context" in (
        r.stderr
    )
