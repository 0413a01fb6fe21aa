"""``kvwatch scrape`` and the collector's scheduled scraper against the live ``/metrics`` of
a real vLLM OpenAI server (``tests/engine_servers.py``: one per test run, a tiny model on
CPU, ``--block-size 32``, ``--max-model-len 2048``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from collector import models as m
from collector.db import Database
from kvwatch.embedded import serve_in_thread
from kvwatch.scheduled_scrape import scrape_target
from tests import engine_servers
from tests.engine_servers import SERVER_TEST_TIMEOUT, VllmServer, wait_for

vllm_server = engine_servers.vllm_server  # the run's one server, shared with other modules

KVWATCH = str(Path(sys.executable).parent / "kvwatch")
# serial: the run's one vLLM server is started in the serial phase for tests/test_vllm_server.py;
# these tests run there too, so the run starts it once (about 40 s of a core) instead of twice
pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]


def _scrape(server: VllmServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    env["KVWATCH_COLLECTOR_URL"] = server.collector.url
    env["KVWATCH_INGEST_TOKEN"] = server.collector.ingest
    return subprocess.run(
        [KVWATCH, "scrape", "--target", server.base_url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _summary(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def _logged_pool_tokens(server: VllmServer) -> int:
    """The KV cache size vLLM logs at start ("CPU KV cache size: 12,345 tokens, ...")."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", server.log_tail(10**7))
    assert found, "vLLM did not log its KV cache size"
    return int(found[-1].replace(",", ""))


def test_scrape_of_the_live_server(vllm_server: VllmServer) -> None:
    server = vllm_server
    before = _summary(_scrape(server, "--engine", "vllm", "--dry-run"))["last"]["prompts"][0]
    for length in (100, 300):  # token ids inside the tiny model's 300-token vocabulary
        r = server.complete([10 + i % 250 for i in range(length)], max_tokens=2)
        assert r.status_code == 200, r.text
    r = _scrape(server, "--engine", "vllm", "--deployment", "vllm-scraped")
    out = _summary(r)
    assert (out["scrapes"], out["events"], out["lost"]) == (1, 2, 0)

    (node,) = out["last"]["nodes"]
    version = httpx.get(f"{server.base_url}/version", timeout=10).json()["version"]
    assert (node["engine"], node["engine_version"], node["model_id"]) == (
        "vllm",
        version,
        server.model,
    )
    assert node["advertised_context"] == server.max_model_len  # from /v1/models
    assert node["page_size"] == server.block_size
    # vLLM's own figure for its pool, as its engine core logs it at start.
    assert node["pool_capacity_tokens"] == _logged_pool_tokens(server)
    # vLLM refuses to start with a pool smaller than max_model_len: kvwatch sees why.
    assert node["pool_capacity_tokens"] >= server.max_model_len
    assert node["used_tokens"] + node["free_tokens"] == node["pool_capacity_tokens"]
    # the node the plugin inside reports, and its resolved KV dtype (kvwatch:node_info;
    # vLLM's cache_config_info says "auto")
    assert node["node"] == server.node
    assert node["dtype"] not in ("auto", "unknown")

    # The prompt counters moved by exactly what was sent (no request events are made).
    (after,) = out["last"]["prompts"]
    assert after["requests"] - before["requests"] == 2
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 400

    with server.collector.client() as c:
        (cfg,) = c.get("/v1/deployments/vllm-scraped/config-history").json()
        assert cfg["pool_capacity_tokens"] == node["pool_capacity_tokens"]
        assert cfg["advertised_context"] == server.max_model_len
        assert c.get("/v1/requests", params={"deployment_id": "vllm-scraped"}).json()["items"] == []
        alerts = c.get("/v1/alerts", params={"rule": "pool_below_advertised"}).json()
    assert not [
        a
        for a in alerts
        if a["labels"].get("deployment_id") == "vllm-scraped" and a["state"] == "firing"
    ]


def test_the_vllm_server_is_not_sglang(vllm_server: VllmServer) -> None:
    r = _scrape(vllm_server, "--engine", "sglang", "--deployment", "x")
    assert r.returncode == 2
    assert "sglang:max_total_num_tokens not found at" in " ".join(r.stderr.split())


def test_the_collector_scrapes_the_live_server_on_schedule(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings

    db_url = f"sqlite:///{tmp_path / 'scheduled.db'}"
    migrate.upgrade(db_url)
    target = {"url": vllm_server.base_url, "engine": "vllm", "deployment_id": "vllm-sched"}
    settings = Settings(
        database_url=db_url,
        auto_migrate=False,
        notify_enabled=False,
        scrape_targets=json.dumps([{**target, "interval_s": 0.5}]),  # type: ignore[arg-type]
    )
    db = Database(db_url)
    try:
        with serve_in_thread(create_app(settings, scraper=scrape_target)):

            def samples() -> list[Any]:
                with db.read() as conn:
                    return list(conn.execute(select(m.PoolSample.seq)).all())

            wait_for(samples, lambda rows: len(rows) >= 2)
        with db.read() as conn:
            (config,) = conn.execute(select(m.DeploymentConfig)).all()
    finally:
        db.dispose()
    assert (config.engine, config.model_id, config.advertised_context, config.page_size) == (
        "vllm",
        vllm_server.model,
        vllm_server.max_model_len,
        vllm_server.block_size,
    )
