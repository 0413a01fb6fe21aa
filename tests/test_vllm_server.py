"""kvwatch's plugin inside the real vLLM OpenAI server, end to end into a real collector.

The server (``tests/engine_servers.py``: one per test run, a tiny random Llama, block size
32) runs with ``KVWATCH_COLLECTOR_URL`` set and nothing else done: vLLM loads the plugin
through its ``vllm.general_plugins`` entry point in the engine-core process. Requests from
two tenants go through the real HTTP API (the tenant as the ``kvwatch_tenant`` vLLM extra
arg); what the collector then holds is checked against vLLM's own figures (its
``/metrics`` and its answers). The same server also exports vLLM's own OpenTelemetry spans
to the collector's ``/v1/traces`` (a second producer, under a deployment of its own).
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.engine_servers import (  # noqa: F401
    FAULT_TENANT,
    REPLICA_PROBES,
    SERVER_TEST_TIMEOUT,
    VllmServer,
    tokens,
    vllm_server,
    wait_for,
)

# serial: whether a client's disconnect lands mid-answer depends on the server keeping up
# with a sub-second decode; beside another worker's tests it sometimes cannot (CI, twice).
pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]

# tenants only this module uses: other modules may send requests to the same server
A, B, OVER, PAR = "vsrv-tenant-a", "vsrv-tenant-b", "vsrv-tenant-over", "vsrv-tenant-par"
OTLP = "vsrv-tenant-otlp"


def vllm_cache_config(server: VllmServer) -> dict[str, str]:
    """vLLM's own ``vllm:cache_config_info`` labels, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server.metrics_text()):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("vllm:cache_config_info not in the server's /metrics")


def requests_of(server: VllmServer, tenant: str) -> list[dict[str, Any]]:
    with server.collector.client() as c:
        r = c.get(
            "/v1/requests",
            params={"deployment_id": server.deployment_id, "tenant": tenant, "limit": 100},
        )
        r.raise_for_status()
        return list(r.json()["items"])


def page_events(server: VllmServer, kind: str) -> list[dict[str, Any]]:
    with server.collector.client() as c:
        r = c.get(
            "/v1/page-events",
            params={"deployment_id": server.deployment_id, "kind": kind, "limit": 100},
        )
        r.raise_for_status()
        return list(r.json()["items"])


def test_engine_config_is_vllms_own(vllm_server: VllmServer) -> None:  # noqa: F811
    cache = vllm_cache_config(vllm_server)
    blocks, block_size = int(cache["num_gpu_blocks"]), int(cache["block_size"])

    def configs() -> list[dict[str, Any]]:
        with vllm_server.collector.client() as c:
            deps = c.get("/v1/deployments").json()
        # the plugin's node (kvwatch kv-events reports the same node; a replica of the
        # deployment another: tests/test_vllm_replicas.py)
        return [cfg for d in deps if d["deployment_id"] == vllm_server.deployment_id
                for cfg in d["config"] if cfg["node"] == vllm_server.node]  # fmt: skip

    (cfg,) = wait_for(configs, bool)
    assert cfg["engine"] == "vllm"
    assert cfg["engine_version"] == "0.32.0"
    assert cfg["model_id"] == vllm_server.model
    assert cfg["advertised_context"] == vllm_server.max_model_len
    assert block_size == vllm_server.block_size
    assert cfg["page_size"] == block_size
    assert cfg["pool_capacity_tokens"] == blocks * block_size
    assert cfg["prefix_caching"] is (cache["enable_prefix_caching"] == "True")
    assert cfg["disaggregated"] is False
    assert cfg["cuda_graphs"] is False  # a CPU build has none
    # the KV dtype resolved (vLLM's own cache_config_info says "auto": the model's)
    assert cache["cache_dtype"] == "auto" and cfg["dtype"] in ("bfloat16", "float16", "float32")
    # and what the plugin publishes beside vLLM's metrics for scrapers to agree with it
    (info,) = [line for line in vllm_server.metrics_text().splitlines()
               if line.startswith("kvwatch:node_info{")]  # fmt: skip
    assert f'node="{vllm_server.node}"' in info and f'kv_dtype="{cfg["dtype"]}"' in info


def test_two_tenants_token_counts_prefix_hit_and_no_stale_read(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    a_prompt = tokens(1, 100)
    answers = {
        "a1": vllm_server.complete(a_prompt, tenant=A, max_tokens=5, route="/chat"),
        "b1": vllm_server.complete(tokens(2, 40), tenant=B, max_tokens=3),
        # b's prompt starts with a's first 96 tokens: 3 full blocks of a's, a prefix-cache hit
        "b2": vllm_server.complete(a_prompt[:96] + tokens(3, 20), tenant=B, max_tokens=2),
    }
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
    usage = {name: r.json()["usage"] for name, r in answers.items()}
    assert usage["a1"]["prompt_tokens"] == 100 and usage["b2"]["prompt_tokens"] == 116

    # Longer than max_model_len: vLLM's front end answers 400 before the engine core
    # (where the probe runs) ever sees it, so no request event can exist for it.
    over = vllm_server.complete(tokens(4, vllm_server.max_model_len + 10), tenant=OVER)
    assert over.status_code == 400
    assert "context length" in over.text or "max_model_len" in over.text or "maximum" in over.text

    a_rows = wait_for(
        lambda: requests_of(vllm_server, A), lambda rows: [r["status"] for r in rows] == ["length"]
    )
    b_rows = wait_for(
        lambda: requests_of(vllm_server, B),
        lambda rows: sorted(r["status"] for r in rows) == ["length", "length"],
    )
    (a1,) = a_rows
    assert a1["request_id"].startswith(answers["a1"].json()["id"])
    assert (a1["prompt_tokens"], a1["completion_tokens"], a1["max_tokens"]) == (100, 5, 5)
    assert a1["model_id"] == vllm_server.model
    assert a1["route"] == "/chat"
    by_prompt = {r["prompt_tokens"]: r for r in b_rows}
    assert by_prompt[40]["completion_tokens"] == 3
    assert by_prompt[116]["completion_tokens"] == 2
    assert requests_of(vllm_server, OVER) == []

    hits = wait_for(
        lambda: [e for e in page_events(vllm_server, "prefix_cache.hit") if e["tenant"] == B],
        bool,
    )
    (hit,) = hits
    assert hit["other_tenant"] == A
    assert hit["other_request_id"] == a1["request_id"]
    assert hit["request_id"] == by_prompt[116]["request_id"]
    assert hit["page_count"] == 96 // vllm_server.block_size
    assert hit["cross_tenant"] is True
    assert hit["detail"]["salted"] is False

    assert stale_reads_by(vllm_server, {A, B, OVER}) == []
    # one running probe (the engine core's), every seq it sent accounted for; kvwatch
    # kv-events reports the same deployment's KV-cache events under probes of its own
    # (tests/test_kv_events_vllm.py), and a replica's are its own (tests/test_vllm_replicas.py)
    with vllm_server.collector.client() as c:
        probes = [p for p in c.get("/v1/probes").json()
                  if p["deployment_id"] == vllm_server.deployment_id
                  and not p["probe_id"].startswith("kv-events-")
                  and p["probe_id"] not in REPLICA_PROBES]  # fmt: skip
    assert len(probes) == 1
    assert probes[0]["missing"] == 0 and probes[0]["reported_drops"] == {}
    assert "kvwatch: the vLLM adapter failed" not in vllm_server.log_tail(10**7)


def test_parallel_sampling_counts_the_shared_prompt_once(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    """``n=3``: vLLM's engine core runs three children with the same prompt. Each is
    stored as a request with its own completion tokens; two of them name the third as the
    request whose prompt they share, so the prompt is counted once."""
    r = vllm_server.complete(tokens(41, 70), tenant=PAR, max_tokens=4, n=3)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert len(r.json()["choices"]) == 3
    rows = wait_for(
        lambda: requests_of(vllm_server, PAR),
        lambda rows: len(rows) == 3 and all(x["status"] == "length" for x in rows),
    )
    assert [x["prompt_tokens"] for x in rows] == [70, 70, 70]
    assert sum(x["completion_tokens"] for x in rows) == usage["completion_tokens"] == 12
    firsts = [x for x in rows if x["prompt_shared_with"] is None]
    assert len(firsts) == 1, rows
    assert (
        sorted(x["prompt_shared_with"] for x in rows if x not in firsts)
        == [firsts[0]["request_id"]] * 2
    )
    # the prompt once: what vLLM itself reports as the request's prompt tokens
    once = sum(x["prompt_tokens"] for x in rows if x["prompt_shared_with"] is None)
    assert once == usage["prompt_tokens"] == 70


def test_pool_samples_report_vllms_capacity(vllm_server: VllmServer) -> None:  # noqa: F811
    from tests.conftest import wait_rollups

    cache = vllm_cache_config(vllm_server)
    capacity = int(cache["num_gpu_blocks"]) * int(cache["block_size"])
    assert vllm_server.complete(tokens(5, 50), tenant=A, max_tokens=2).status_code == 200

    def buckets() -> list[dict[str, Any]]:
        wait_rollups(vllm_server.collector.db_url)
        with vllm_server.collector.client() as c:
            r = c.get("/v1/pool-samples", params={"deployment_id": vllm_server.deployment_id})
            r.raise_for_status()
            return list(r.json()["items"])

    items = wait_for(buckets, bool)
    assert {b["capacity"] for b in items} == {capacity}
    assert all(0 <= b["used_max"] <= capacity for b in items)


def stale_reads_by(server: VllmServer, tenants: set[str]) -> list[dict[str, Any]]:
    """The stale reads whose reader is one of ``tenants`` (tests share the server)."""
    return [e for e in page_events(server, "page.stale_read") if e["tenant"] in tenants]


def test_a_prefix_cache_hit_on_a_request_aborted_mid_prefill_is_no_stale_read(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    """Tenant A sends a long prompt and disconnects while vLLM prefills it; tenant B then
    sends the same prefix and is served a prefix-cache hit on A's blocks. vLLM's engine
    core runs the step, then processes the abort, then the step's output: A's KV was
    written, so B's reads are legitimate and no stale read may be reported.

    The disconnect lands in the prefill only when timed right, so rounds are tried until
    one shows it (A aborted with no output token, B's hit naming A's request)."""
    n, shared = 1900, 59 * vllm_server.block_size  # 1888 tokens: 59 full blocks
    delays = [0.05, 0.05, 0.03, 0.08, 0.12, 0.02, 0.2, 0.3, 0.04, 0.06]
    readers: set[str] = set()
    reproduced = 0
    for i, delay in enumerate(delays):
        a, b = f"vsrv-abort-a{i}", f"vsrv-abort-b{i}"
        readers.add(b)
        a_prompt = tokens(1000 + i, n)
        vllm_server.abandon(a_prompt, tenant=a, after_s=delay, stream=bool(i % 2), max_tokens=140)
        (a_row,) = wait_for(
            lambda a=a: requests_of(vllm_server, a),
            lambda rows: bool(rows) and rows[0]["status"] != "admitted",
        )
        r = vllm_server.complete(a_prompt[:shared] + tokens(2000 + i, 20), tenant=b, max_tokens=4)
        assert r.status_code == 200, r.text
        wait_for(
            lambda b=b: requests_of(vllm_server, b),
            lambda rows: [r["status"] for r in rows] == ["length"],
        )
        hits = [e for e in page_events(vllm_server, "prefix_cache.hit") if e["tenant"] == b]
        # (a streamed request whose client left may still run to its end: vLLM's front
        # end notices a streaming client's disconnect only now and then)
        mid_prefill = a_row["status"] == "aborted" and a_row["completion_tokens"] == 0
        if mid_prefill and any(h["other_request_id"] == a_row["request_id"] for h in hits):
            reproduced += 1
            if reproduced >= 2:
                break
    assert reproduced, "no disconnect landed in A's prefill: the scenario was not exercised"
    # (the probe sends B's stale reads, if any, before B's finish, which was waited for)
    stale = stale_reads_by(vllm_server, readers)
    assert stale == [], [
        (e["request_id"], e["other_request_id"], e["page_count"], reproduced) for e in stale
    ]


def test_stop_string_finishes_are_completed_and_disconnects_aborted(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    """vLLM's front end finds stop strings and ends those requests by aborting them in the
    engine core, as it does when a client leaves; the client got ``finish_reason: "stop"``
    and its ``usage``, and that is what the collector must hold. A client that leaves
    mid-answer is still an abort."""
    prompt = tokens(3000, 40)
    # greedy: the same prompt gives the same text, so a piece of it is a stop string that hits
    free = vllm_server.complete(prompt, tenant="vsrv-stop-free", max_tokens=40)
    assert free.status_code == 200, free.text
    text = free.json()["choices"][0]["text"]
    stops = []
    for at in (len(text) // 5, len(text) // 3, len(text) // 2):
        for i in range(at, len(text) - 2):
            piece = text[i : i + 2]
            if piece.strip() and "\ufffd" not in piece and text.find(piece) == i:
                stops.append(piece)
                break
    assert len(set(stops)) >= 2, text
    usage = []
    for stop in dict.fromkeys(stops):
        r = vllm_server.complete(prompt, tenant="vsrv-stop", max_tokens=40, stop=[stop])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop", (stop, r.json())
        usage.append(r.json()["usage"]["completion_tokens"])
    rows = wait_for(
        lambda: requests_of(vllm_server, "vsrv-stop"),
        lambda rows: len(rows) == len(usage) and all(r["status"] != "admitted" for r in rows),
    )
    assert sorted((r["status"], r["completion_tokens"]) for r in rows) == sorted(
        ("completed", n) for n in usage
    )

    # this model decodes a long answer in well under a second: try until one client left
    # after the first token and before the last. On a loaded machine a plain request's
    # disconnect can be noticed only after the answer is done; a stream's is noticed at its
    # next chunk, so the tries alternate between the two.
    leavers = []
    # twice over: a fresh-clone CI run saw eight tries in a row answered in full (the loop
    # stops at the first try that left mid-answer, so more tries cost only when they fail)
    delays = (0.1, 0.05, 0.2, 0.02, 0.3, 0.01, 0.5, 0.15) * 2
    for i, after_s in enumerate(delays):
        leaver = f"vsrv-leaver-{i}"
        vllm_server.abandon(
            tokens(3001, 100), tenant=leaver, after_s=after_s, stream=bool(i % 2), max_tokens=1900
        )
        (row,) = wait_for(
            lambda leaver=leaver: requests_of(vllm_server, leaver),
            lambda rows: bool(rows) and rows[0]["status"] != "admitted",
        )
        leavers.append((row["status"], row["completion_tokens"]))
        if 0 < row["completion_tokens"] < 1900:
            break
    status, completion = leavers[-1]
    assert 0 < completion < 1900, leavers
    assert status == "aborted"


def test_the_plugin_says_in_vllms_log_that_it_attached(vllm_server: VllmServer) -> None:  # noqa: F811
    log = vllm_server.log_tail(10**7)
    (line,) = [ln for ln in log.splitlines() if "kvwatch: probe attached" in ln]
    assert "INFO" in line and "EngineCore" in line  # vLLM's format, the engine-core process
    assert f"collector {vllm_server.collector.url}" in line
    assert f"deployment {vllm_server.deployment_id}" in line
    for hook in ("add_request", "schedule", "finish_requests", "update_from_output"):
        assert f"Scheduler.{hook}" in line
    assert "KVCacheManager.allocate_slots" in line
    assert "page ledger on" in line
    # the plugin's default spool/journal directory (XDG_STATE_HOME: the server's workdir)
    spool = vllm_server.log_path.parent / "state" / "kvwatch" / "probe-spool"
    assert f"journal on in {spool} (64 MiB" in line
    assert vllm_server.collector.ingest not in log
    # the fault injection the positive control needs says so, loudly
    assert "TEST FAULT INJECTION ON" in log and FAULT_TENANT in log


def test_positive_control_an_injected_stale_read_is_caught(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    """The server's probe is told (test-only switch) to lose the KV writes of
    FAULT_TENANT's first request. Another tenant then reuses those blocks through the prefix
    cache: what the probe believes is a read of KV nobody wrote, and it must say so
    through the real collector. A probe that saw nothing would pass every "no stale read"
    test; it cannot pass this one."""
    shared = tokens(4000, 100)
    r = vllm_server.complete(shared, tenant=FAULT_TENANT, max_tokens=2)
    assert r.status_code == 200, r.text
    reader = "vsrv-control-reader"
    r = vllm_server.complete(shared[:96] + tokens(4001, 20), tenant=reader, max_tokens=2)
    assert r.status_code == 200, r.text
    (row,) = wait_for(
        lambda: requests_of(vllm_server, reader),
        lambda rows: [x["status"] for x in rows] == ["length"],
    )
    stale = stale_reads_by(vllm_server, {reader})  # one event per previous writer
    assert stale and {e["request_id"] for e in stale} == {row["request_id"]}
    # the 3 blocks it reused, each read every step (reported once per request)
    assert sum(e["page_count"] for e in stale) == 96 // vllm_server.block_size
    # Its alert names the previous tenant as the probe's page ledger recorded it: the fault
    # kept FAULT_TENANT's writes out of the ledger, so the ledger names whoever it last saw
    # write those pages, or nobody (fresh pages), never FAULT_TENANT, whose KV they hold.
    # The alert's line says whose record that is, so the control is not read as a leak of
    # that tenant's data.
    previous = {e["other_tenant"] or "none" for e in stale}
    assert FAULT_TENANT not in previous

    def alerts() -> list[dict[str, Any]]:
        with vllm_server.collector.client() as c:
            got = c.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
        return [a for a in got if a["labels"]["reader_tenant"] == reader]

    said = wait_for(alerts, lambda got: {a["labels"]["previous_tenant"] for a in got} == previous)
    for a in said:
        prev, summary = a["labels"]["previous_tenant"], a["annotations"]["summary"]
        assert f"tenant {reader} read " in summary, summary
        if prev == "none":
            assert "the probe's page ledger holds no write of since the pool was created" in summary
        else:
            assert "as the probe's page ledger recorded, by " in summary, summary
            assert "the ledger's last recorded writer" in summary, summary
        assert FAULT_TENANT not in summary


def test_a_seeded_random_mix_is_reported_exactly(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    """A seeded random mix, many at once: tenants, shared prefixes, cache salts, stop strings,
    clients that leave at random points (before, during and after prefill, mid-decode), eight
    at a time. (Preemption is exercised in-process by bench/vllm_overhead.py: this server's
    pool is too large for this mix to run it out.) What a client got back and what
    the collector holds must agree exactly (token counts = vLLM's usage, status = its finish
    reason), and there is no stale read anywhere: vLLM does not leak here, so any would be
    the probe's. KVWATCH_LIVE_SEED replays a run; the seed is in every failure message."""
    seed = int(os.environ.get("KVWATCH_LIVE_SEED") or random.SystemRandom().randrange(10**6))
    print(f"KVWATCH_LIVE_SEED={seed}")
    rng = random.Random(seed)
    tenants = [f"vsrv-mix{seed}-t{i}" for i in range(4)]
    prefixes = [tokens(seed * 7 + i, rng.choice((64, 320, 960))) for i in range(3)]
    jobs: list[dict[str, Any]] = []
    for k in range(90):
        prompt = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = prompt + tokens(seed * 1000 + k, rng.randrange(1, 160))
        max_tokens = rng.choice((1, 4, 16, 48))
        what = rng.choices(("complete", "stop", "leave"), weights=(6, 2, 2))[0]
        jobs.append(
            {
                "tenant": rng.choice(tenants),
                "prompt": prompt[: vllm_server.max_model_len - max_tokens],
                "max_tokens": max_tokens,
                "what": what,
                "salt": rng.choice((None, None, "salt-x", f"salt-{k % 3}")),
                "stop": [rng.choice(("a", "e", " t", "in"))] if what == "stop" else None,
                "leave_after_s": rng.choice((0.0, 0.01, 0.05, 0.2, 0.5)),
                "stream": rng.random() < 0.5,
            }
        )

    def run(job: dict[str, Any]) -> dict[str, Any] | None:
        if job["what"] == "leave":
            vllm_server.abandon(
                job["prompt"],
                tenant=job["tenant"],
                after_s=job["leave_after_s"],
                stream=job["stream"],
                max_tokens=job["max_tokens"],
            )
            return None
        r = vllm_server.complete(
            job["prompt"],
            tenant=job["tenant"],
            max_tokens=job["max_tokens"],
            cache_salt=job["salt"],
            stop=job["stop"],
        )
        assert r.status_code == 200, (seed, r.text)
        body = r.json()
        return {"id": body["id"], "usage": body["usage"], "finish": body["choices"][0]}

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(run, jobs))

    expected = {"length": "length", "stop": "completed"}
    # every answered request has its row; a client that left at once may never have reached
    # the engine core, so a leaver's row may be missing
    ids = {t: [a["id"] for j, a in zip(jobs, answers, strict=True) if a and j["tenant"] == t]
           for t in tenants}  # fmt: skip

    def complete(rows: list[dict[str, Any]], t: str) -> bool:
        return all(r["status"] != "admitted" for r in rows) and all(
            any(r["request_id"].startswith(i) for r in rows) for i in ids[t]
        )

    rows = {
        t: wait_for(
            lambda t=t: requests_of(vllm_server, t),
            lambda rows, t=t: complete(rows, t),
            timeout_s=60,
        )
        for t in tenants
    }
    for t in tenants:
        assert len(rows[t]) <= sum(j["tenant"] == t for j in jobs), (seed, t)
    for job, answer in zip(jobs, answers, strict=True):
        mine = rows[job["tenant"]]
        if answer is None:  # the client left: whatever vLLM did, the row ended and is sane
            continue
        (row,) = [r for r in mine if r["request_id"].startswith(answer["id"])]
        got = (row["status"], row["prompt_tokens"], row["completion_tokens"])
        status = expected[answer["finish"]["finish_reason"]]
        if status == "completed" and answer["usage"]["completion_tokens"] == job["max_tokens"]:
            # A known gap: the stop string matched in the very step the engine core ended
            # the request at max_tokens; vLLM's front end then sends no abort, so the engine
            # core (and the probe) only ever saw a length finish.
            status = "length"
        want = (status, answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])
        if status == "completed" and got == ("length", want[1], job["max_tokens"]):
            # A second known gap: the engine core reached max_tokens before the front end's
            # stop abort arrived (it detects stop strings steps behind): the engine core
            # ended the request as length with every token it generated (docs/vllm.md,
            # "Aborts and stop strings"). Nothing else is allowed.
            continue
        assert got == want, (seed, job["what"], job["max_tokens"], got, want)
    for t in tenants:
        for r in rows[t]:
            assert r["status"] in ("aborted", "length", "completed"), (seed, r)
            assert 0 <= r["completion_tokens"] <= max(j["max_tokens"] for j in jobs), (seed, r)
    assert stale_reads_by(vllm_server, set(tenants)) == [], seed


def otlp_rows(server: VllmServer, since: datetime) -> list[dict[str, Any]]:
    """The requests vLLM's OTLP spans became since ``since`` (their deployment's rows)."""
    with server.collector.client() as c:
        r = c.get(
            "/v1/requests",
            params={
                "deployment_id": server.otlp_deployment_id,
                "since": since.isoformat(),
                "limit": 100,
            },
        )
        r.raise_for_status()
        return list(r.json()["items"])


def otlp_spans(server: VllmServer, result: str) -> float:
    """The collector's ``kvwatch_otlp_spans_total{result=...}``."""
    from tests.metrics_text import samples

    r = httpx.get(f"{server.collector.url}/metrics", timeout=30)
    r.raise_for_status()
    value = samples(r.text).get("kvwatch_otlp_spans_total", {"result": result})
    assert value is not None, f"no kvwatch_otlp_spans_total{{result={result!r}}}"
    return value


def test_vllms_own_otlp_span_becomes_a_request_row(vllm_server: VllmServer) -> None:  # noqa: F811
    """vLLM's tracing (``--otlp-traces-endpoint``, OTLP/HTTP protobuf) sends one
    ``llm_request`` span per finished request to the collector's ``/v1/traces``. It becomes
    a request row of its own deployment (``OTEL_SERVICE_NAME``), under the request id vLLM
    puts in ``gen_ai.request.id``, with vLLM's usage as its token counts and the model from
    the resource (``OTEL_RESOURCE_ATTRIBUTES``): the probe's row of the same request is
    another producer's, under another deployment and the engine core's id."""
    from collector.otlp.genai import UNKNOWN_TENANT
    from collector.otlp.service import probe_id

    server = vllm_server
    accepted = otlp_spans(server, "accepted")
    since = datetime.now(UTC) - timedelta(seconds=1)
    r = server.complete(tokens(5000, 37), tenant=OTLP, max_tokens=6)
    assert r.status_code == 200, r.text
    answer = r.json()
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (37, 6)
    # vLLM's front end answers as cmpl-<uuid> and submits the answer's prompt i as
    # cmpl-<uuid>-i: its "external" request id, the one its span names; the engine core
    # (where the probe runs) knows the request as that plus "-" and 8 random characters.
    span_rid = f"{answer['id']}-0"

    (row,) = wait_for(
        lambda: [x for x in otlp_rows(server, since) if x["request_id"] == span_rid], bool
    )
    assert row["deployment_id"] == server.otlp_deployment_id != server.deployment_id
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert row["max_tokens"] == 6  # gen_ai.request.max_tokens
    assert row["model_id"] == server.model  # from the resource: vLLM's span names no model
    assert row["tenant"] == UNKNOWN_TENANT  # nor a tenant (kvwatch_tenant is the probe's)
    assert row["route"] is None
    # vLLM's span has no gen_ai.response.finish_reasons: a request that ran to max_tokens
    # is stored as completed (the probe, which sees the engine core's finish, says length)
    assert row["status"] == "completed"

    # The probe's row of the same request: its own deployment and id, the same counts.
    (probe_row,) = wait_for(
        lambda: requests_of(server, OTLP), lambda rows: [x["status"] for x in rows] == ["length"]
    )
    assert probe_row["request_id"].startswith(f"{span_rid}-")
    assert len(probe_row["request_id"]) == len(span_rid) + 9
    assert (probe_row["prompt_tokens"], probe_row["completion_tokens"]) == (
        row["prompt_tokens"],
        row["completion_tokens"],
    )

    # Stored under the OTLP probe of the ingest token's lineage, the only one of its
    # deployment; the engine-core probe's deployment has no OTLP probe.
    lineage = server.collector.ingest_lineage
    with server.collector.client() as c:
        probes = c.get("/v1/probes").json()
    (mine,) = [p for p in probes if p["deployment_id"] == server.otlp_deployment_id]
    assert mine["probe_id"] == probe_id(lineage, server.otlp_deployment_id)
    assert mine["probe_id"] == f"otlp.{lineage}.{server.otlp_deployment_id}"
    assert mine["missing"] == 0 and mine["accepted"] >= 2  # admitted + finished
    assert not [
        p for p in probes
        if p["deployment_id"] == server.deployment_id and p["probe_id"].startswith("otlp.")
    ]  # fmt: skip

    # counted as accepted (the counter moves just after the commit that made the row)
    wait_for(lambda: otlp_spans(server, "accepted"), lambda n: n >= accepted + 1, timeout_s=10)
    assert otlp_spans(server, "rejected") == 0
