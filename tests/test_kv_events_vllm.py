"""``kvwatch kv-events`` against the KV-cache events of the run's one real vLLM server
(``tests/engine_servers.py``: the tiny model on CPU, block size 32, ``--kv-events-config``
with a ZMQ publisher and its replay socket), reporting into that server's collector under the
server's deployment (whose tenants the plugin's probe reports) as the node the plugin reports
(no ``--node``: the default derivation, from the ``--target``, is what is tested), with the
config the plugin reports (one config, one prefix_cache_unsalted for the engine)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from typer.testing import CliRunner

from kvwatch.cli import app
from kvwatch.kv_events import BlockStored, Decoded, Stream
from tests import engine_servers
from tests.engine_servers import KV_EVENTS_TOPIC, SERVER_TEST_TIMEOUT, VllmServer, tokens, wait_for

vllm_server = engine_servers.vllm_server  # the run's one server, shared with other modules

KVWATCH = str(Path(sys.executable).parent / "kvwatch")
# serial: the run's one vLLM server is started in the serial phase (tests/test_vllm_server.py)
pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]

# tenants and sessions only this module uses
A, B, W = "kvev-tenant-a", "kvev-tenant-b", "kvev-tenant-warm"


def turnovers(server: VllmServer) -> list[dict[str, Any]]:
    """The kv.turnover events of the server's node (the plugin's node id: only kv-events
    sends kv.turnover)."""
    with server.collector.client() as c:
        r = c.get(
            "/v1/page-events",
            params={"deployment_id": server.deployment_id, "kind": "kv.turnover", "limit": 1000},
        )
        r.raise_for_status()
        return [e for e in r.json()["items"] if e["node"] == server.node]


def summed(rows: list[dict[str, Any]]) -> dict[str, int]:
    out = {"stored_blocks": sum(r["page_count"] for r in rows)}
    for name in ("removed_blocks", "unsalted_blocks", "salted_blocks", "restored_blocks",
                 "cross_session_blocks", "lost_batches", "cleared"):  # fmt: skip
        out[name] = sum(r["detail"][name] for r in rows)
    return out


def test_kv_events_of_the_live_server_reach_its_collector(vllm_server: VllmServer) -> None:
    server = vllm_server
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    env["KVWATCH_COLLECTOR_URL"] = server.collector.url
    env["KVWATCH_INGEST_TOKEN"] = server.collector.ingest
    env["KVWATCH_PROBE_FLUSH_INTERVAL_S"] = "0.2"
    # beside the command, the stream in this process: the server's own events, decoded
    watch = Stream(server.kv_events_endpoint, topic=KV_EVENTS_TOPIC)
    proc = subprocess.Popen(
        [KVWATCH, "kv-events", "--endpoint", server.kv_events_endpoint,
         "--replay-endpoint", server.kv_events_replay_endpoint, "--topic", KV_EVENTS_TOPIC,
         "--deployment", server.deployment_id, "--target", server.base_url,
         "--interval", "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        # Until a warm-up request's blocks are counted, the subscription may not have
        # reached the publisher yet (ZMQ subscriptions propagate asynchronously). Salted:
        # the engine.config must come from the unsalted requests below.
        def warmed() -> bool:
            r = server.complete(tokens(random.randrange(1 << 30), 64), tenant=W,
                                cache_salt="kvev-warm", max_tokens=1)  # fmt: skip
            assert r.status_code == 200, r.text
            time.sleep(1.2)
            return sum(r["page_count"] for r in turnovers(server)) > 0

        wait_for(lambda: warmed(), bool, timeout_s=60)
        time.sleep(1.0)  # the warm-up's interval is sent
        before = summed(turnovers(server))

        a_prompt = tokens(11, 100)
        sent = {
            # 100 + 4 tokens: 3 full blocks, unsalted, session a
            "a": server.complete(a_prompt, tenant=A, session_id="kvev-sess-a", max_tokens=4),
            # 70 + 2: 2 full blocks, salted
            "b": server.complete(
                tokens(12, 70), tenant=B, cache_salt="kvev-salt-b", session_id="kvev-sess-b",
                max_tokens=2,
            ),
            # a's first 96 tokens and 20 more (+ 2): its 3 blocks are a prefix-cache hit, which
            # vLLM reports as stores in kv_cache_report_mode "full", naming session b
            "c": server.complete(
                a_prompt[:96] + tokens(13, 20), tenant=B, session_id="kvev-sess-b",
                max_tokens=2, xargs={"kv_cache_report_mode": "full"},
            ),
        }  # fmt: skip
        for name, r in sent.items():
            assert r.status_code == 200, (name, r.text)
        cached = sent["c"].json()["usage"].get("prompt_tokens_details") or {}
        time.sleep(1.5)
        seen = [e for b in watch.batches(1.0) if isinstance(b, Decoded) for e in b.events]
    finally:
        watch.close()
        proc.send_signal(signal.SIGINT)
        out, errors = proc.communicate(timeout=60)
    # What vLLM 0.32 sent for each request: one store per step that filled blocks; the
    # first block of a salted prompt carries the salt; every store names its session.
    stores = [e for e in seen if isinstance(e, BlockStored)]
    a_stores = [e for e in stores if e.session_id == "kvev-sess-a"]
    assert sum(len(e.block_hashes) for e in a_stores) == 3
    # unsalted: an entry per block, each None (0.32 sends the list, not None)
    assert a_stores[0].parent_block_hash is None
    assert all(k is None for e in a_stores for k in e.extra_keys or [])
    assert all(e.block_size == server.block_size for e in stores)
    assert [t for e in a_stores for t in e.token_ids] == a_prompt[:96]
    b_first = next(e for e in stores if e.session_id == "kvev-sess-b")
    assert b_first.salt_of_first_block() == "kvev-salt-b"
    c_hit = [e for e in stores if e.session_id == "kvev-sess-b" and e.salt_of_first_block() is None]
    assert [h for e in c_hit for h in e.block_hashes] == [
        h for e in a_stores for h in e.block_hashes
    ]
    assert proc.returncode == 0, errors
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stream"]["lost"] == 0 and summary["stream"]["malformed"] == 0, summary
    assert summary["config_sent"] is True and summary["lost"] == 0
    assert summary["blocks"]["block_sizes"] == [server.block_size]

    rows = turnovers(server)
    total = summed(rows)
    # everything the consumer counted reached the collector
    assert total["stored_blocks"] == summary["blocks"]["stored_blocks"]
    assert total["restored_blocks"] == summary["blocks"]["restored_blocks"]
    got = {k: total[k] - before[k] for k in total}
    assert got == {
        "stored_blocks": 3 + 2 + 3,
        "removed_blocks": 0,  # the pool (1 GiB) evicts nothing this early
        "unsalted_blocks": 3 + 3,
        "salted_blocks": 2,
        "restored_blocks": 3,
        "cross_session_blocks": 3,
        "lost_batches": 0,
        "cleared": 0,
    }, (got, cached)

    # the node it reported: the plugin's, derived (no --node given)
    assert summary["node"] == server.node
    # the engine.config it sent: vLLM's figures (from --target), prefix caching on, unsalted,
    # and exactly the plugin's (KV dtype resolved, settings from kvwatch:node_info): the
    # node's config is stored once, not flipped between two producers' versions
    with server.collector.client() as c:
        history = c.get(f"/v1/deployments/{server.deployment_id}/config-history").json()
        (cfg,) = [h for h in history if h["node"] == server.node]
        assert (cfg["engine"], cfg["model_id"], cfg["page_size"]) == (
            "vllm",
            server.model,
            server.block_size,
        )
        assert cfg["prefix_caching"] is True and cfg["prefix_cache_salting"] is False
        assert cfg["advertised_context"] == server.max_model_len

    # and with the deployment's tenants (the plugin reported A and B), the rule fires
    def unsalted() -> list[dict[str, Any]]:
        with server.collector.client() as c:
            alerts = c.get("/v1/alerts", params={"rule": "prefix_cache_unsalted"}).json()
        mine = [a for a in alerts if a["labels"].get("deployment_id") == server.deployment_id]
        return [a for a in mine if a["state"] == "firing" and a["labels"].get("node") != "endpoint"]

    # one alert for the one engine, whichever producer said so
    (alert,) = wait_for(unsalted, bool, timeout_s=60)
    assert alert["labels"]["node"] == server.node
    assert alert["labels"]["deployment_id"] == server.deployment_id


def test_a_silent_stream_is_a_gap_never_zeros(vllm_server: VllmServer) -> None:
    """Beside the live server: an endpoint form that cannot work is refused; a port nobody
    publishes on (the server answering at --target), the server's own publisher on another
    topic, and a publisher that publishes nothing while the server serves are each, after
    --silent-after, a warning naming the cause and source.gap events, and no kv.turnover (no
    zeros) is stored for them; the telemetry_gap alert fired while they were silent and
    resolved at their clean stop. About 11 s on 2 cores."""
    from kvwatch.embedded import free_port

    server = vllm_server
    port = server.kv_events_endpoint.rsplit(":", 1)[1]
    # vLLM's endpoint as a subscriber would copy it from a config that makes vLLM connect:
    # refused before anything reaches out
    refused = CliRunner().invoke(
        app,
        ["kv-events", "--endpoint", f"tcp://0.0.0.0:{port}", "--target", server.base_url,
         "--dry-run"],
    )  # fmt: skip
    assert refused.exit_code == 2, refused.output
    said = " ".join(refused.output.split())
    assert f"--endpoint 'tcp://0.0.0.0:{port}'" in said, said
    assert "connects instead of binding" in said and "Traceback" not in said

    nodes = {
        "nobody": "vsrv-kv-silent-nobody",
        "topic": "vsrv-kv-silent-topic",
        "mute": "vsrv-kv-silent-mute",
    }
    # nobody: a port nobody binds; topic: the server's own publisher, on another topic;
    # mute: a publisher that publishes nothing (bound here) while the engine serves
    mute = zmq.Context.instance().socket(zmq.PUB)
    mute_port = mute.bind_to_random_port("tcp://127.0.0.1")
    endpoints = {
        "nobody": f"tcp://127.0.0.1:{free_port()}",
        "topic": server.kv_events_endpoint,
        "mute": f"tcp://127.0.0.1:{mute_port}",
    }
    expected = {"nobody": "not_connected", "topic": "other_topic", "mute": "engine_served"}

    env = {
        "KVWATCH_COLLECTOR_URL": server.collector.url,
        "KVWATCH_INGEST_TOKEN": server.collector.ingest,
        "KVWATCH_PROBE_FLUSH_INTERVAL_S": "0.2",
    }

    def run(name: str) -> Any:
        """In-process (no interpreter to start), in a thread of its own (signals are the main
        thread's), one at a time (CliRunner swaps the process's stdout)."""
        topic = "not-" + KV_EVENTS_TOPIC if name == "topic" else KV_EVENTS_TOPIC
        got: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: got.update(r=CliRunner().invoke(app, [
                "kv-events", "--endpoint", endpoints[name], "--topic", topic,
                "--deployment", server.deployment_id, "--target", server.base_url,
                "--node", nodes[name], "--interval", "0.3", "--silent-after", "1.0",
                "--duration", "2.5"], env=env))
        )  # fmt: skip
        t.start()
        t.join(60)
        return got["r"]

    results = {"nobody": run("nobody")}  # not connected: no traffic needed
    # the engine serves (new prompts: computed, not cache hits) while the others listen
    done = threading.Event()

    def serve() -> None:
        i = 0
        while not done.is_set():
            r = server.complete(tokens(9100 + i, 70), tenant=W, max_tokens=2)
            assert r.status_code == 200, r.text
            i += 1
            done.wait(0.5)  # a trickle: the server's two cores are shared

    traffic = threading.Thread(target=serve, daemon=True)
    traffic.start()
    try:
        results["topic"] = run("topic")
        results["mute"] = run("mute")
    finally:
        done.set()
        traffic.join(30)
        mute.close(linger=0)
    outs = {name: (r.stdout, r.output) for name, r in results.items()}
    for name, r in results.items():
        out, errors = outs[name]
        assert r.exit_code == 0, errors
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["gaps"] >= 1 and summary["intervals"] == 0, summary
    assert f"nothing accepts connections at {endpoints['nobody']}" in outs["nobody"][1]
    assert f"messages arrive on topic '{KV_EVENTS_TOPIC}'" in outs["topic"][1]
    assert "while the engine finished" in outs["mute"][1]
    with server.collector.client() as c:
        rows = c.get(
            "/v1/page-events", params={"deployment_id": server.deployment_id, "limit": 1000}
        ).json()["items"]
        alerts = c.get("/v1/alerts", params={"rule": "telemetry_gap"}).json()
    for name, node in nodes.items():
        mine = [r for r in rows if r["node"] == node]
        assert mine and {r["kind"] for r in mine} == {"source.gap"}, mine
        causes = {r["detail"]["cause"] for r in mine}
        assert causes == {expected[name]}, mine
        # the alert fired while it was silent, and resolved at its clean stop
        probe = json.loads(outs[name][0].strip().splitlines()[-1])["probe_id"]
        (alert,) = [a for a in alerts if a["labels"]["problem"] == "source_silent"
                    and a["labels"]["probe_id"] == probe]  # fmt: skip
        assert alert["fired_at"] is not None and alert["state"] == "resolved", alert
