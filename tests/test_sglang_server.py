"""kvwatch's plugin inside a real SGLang OpenAI server, end to end into a real collector.

The server (``tests/engine_servers.py``: one per test run, SGLang 0.5.23 on the CPU with the
tests' tiny random Llama, SGLang's plain-PyTorch paths) runs with ``KVWATCH_SGLANG_PROBE=1``
and the collector settings, nothing else: SGLang loads the plugin through its
``sglang.srt.plugins`` entry point in every process it starts. Requests from two tenants
go through the real HTTP API, the tenant as SGLang's routing key header; what the collector
then holds is checked against SGLang's own figures (``/get_server_info`` and its answers).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from tests.engine_servers import (  # noqa: F401
    FAULT_TENANT,
    SERVER_TEST_TIMEOUT,
    SGLANG_POOL_TOKENS,
    SglangServer,
    sglang_server,
    tokens,
    wait_for,
)
from tests.engine_servers import collector_get as get

# The gateway in front of this same server: collected here so they share its one start.
from tests.sglang_gateway_checks import (  # noqa: F401
    test_positive_control_unsalted_tenants_share_the_prefix,
    test_salted_per_tenant_no_prefix_is_shared_and_the_tenant_reaches_the_probe,
)

pytestmark = [pytest.mark.slow, SERVER_TEST_TIMEOUT]

A, B = "ssrv-tenant-a", "ssrv-tenant-b"


def requests_of(server: SglangServer, tenant: str) -> list[dict[str, Any]]:
    return list(get(server, "/v1/requests", tenant=tenant, limit=100)["items"])


def info_page_size(server: SglangServer) -> int:
    return int(server.server_info()["page_size"])


def stale_reads(server: SglangServer) -> list[dict[str, Any]]:
    return list(get(server, "/v1/page-events", kind="page.stale_read", limit=100)["items"])


def test_engine_config_is_sglangs_own(sglang_server: SglangServer) -> None:  # noqa: F811
    info = sglang_server.server_info()

    def configs() -> list[dict[str, Any]]:
        with sglang_server.collector.client() as c:
            deps = c.get("/v1/deployments").json()
        return [cfg for d in deps if d["deployment_id"] == sglang_server.deployment_id
                for cfg in d["config"]]  # fmt: skip

    (cfg,) = wait_for(configs, bool)
    assert cfg["engine"] == "sglang"
    assert cfg["engine_version"] == "0.5.23"
    assert cfg["advertised_context"] == info["context_length"]
    assert cfg["pool_capacity_tokens"] == info["max_total_num_tokens"] == SGLANG_POOL_TOKENS
    assert cfg["page_size"] == info["page_size"]
    assert cfg["disaggregated"] is False
    # the node rule (engine_probe/node.py): --host 127.0.0.1 is the machine, then the port
    assert cfg["node"] == f"{socket.gethostname()}:{sglang_server.base_url.rsplit(':', 1)[1]}"
    assert cfg["role"] == "both"


def test_two_tenants_token_counts_and_no_stale_read(
    sglang_server: SglangServer,  # noqa: F811
) -> None:
    shared = tokens(1, 96)
    answers = {
        "a1": sglang_server.complete(shared + tokens(2, 10), tenant=A, max_tokens=5),
        "b1": sglang_server.complete(tokens(3, 40), tenant=B, max_tokens=3),
        # b's prompt starts with a's: SGLang's radix cache serves it from a's KV
        "b2": sglang_server.complete(shared + tokens(4, 20), tenant=B, max_tokens=2),
    }
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
    usage = {name: r.json()["usage"] for name, r in answers.items()}
    assert usage["b2"]["prompt_tokens_details"]["cached_tokens"] >= 64, usage["b2"]
    a_rows = wait_for(
        lambda: requests_of(sglang_server, A),
        lambda rows: len(rows) == 1 and rows[0]["status"] != "admitted",
    )
    b_rows = wait_for(
        lambda: requests_of(sglang_server, B),
        lambda rows: len(rows) == 2 and all(r["status"] != "admitted" for r in rows),
    )
    (a1,) = a_rows
    assert (a1["prompt_tokens"], a1["completion_tokens"]) == (
        usage["a1"]["prompt_tokens"],
        usage["a1"]["completion_tokens"],
    )
    by_prompt = {r["prompt_tokens"]: r for r in b_rows}
    for name in ("b1", "b2"):
        row = by_prompt[usage[name]["prompt_tokens"]]
        assert row["completion_tokens"] == usage[name]["completion_tokens"]
        assert row["status"] == "length"
    # the radix-cache prefix b2 reused is a's legitimately: no stale read, but a
    # cross-tenant prefix_cache.hit naming both requests
    assert not [e for e in stale_reads(sglang_server) if e["tenant"] in (A, B)]
    hits = wait_for(
        lambda: [
            e
            for e in get(sglang_server, "/v1/page-events", kind="prefix_cache.hit", limit=100)[
                "items"
            ]
            if e["tenant"] == B
        ],
        bool,
    )
    (hit,) = hits
    assert (hit["other_tenant"], hit["other_request_id"]) == (A, a1["request_id"])
    assert hit["request_id"] == by_prompt[usage["b2"]["prompt_tokens"]]["request_id"]
    assert hit["cross_tenant"] is True
    assert hit["page_count"] * info_page_size(sglang_server) >= 64
    probes = [p for p in get(sglang_server, "/v1/probes")
              if p["deployment_id"] == sglang_server.deployment_id]  # fmt: skip
    assert probes and all(p["missing"] == 0 and p["reported_drops"] == {} for p in probes)
    log = sglang_server.log_tail(10**7)
    for failure in ("kvwatch SGLang hook", "kvwatch could not watch", "failed to register"):
        assert failure not in log, failure


def test_clients_that_leave_cause_no_false_stale_read(
    sglang_server: SglangServer,  # noqa: F811
) -> None:
    """A client that disconnects mid-answer (SGLang aborts the request), then another
    tenant sending the same prefix: the pages the leaver wrote are reused legitimately."""
    prefix = tokens(11, 128)
    host, _, port = sglang_server.base_url.removeprefix("http://").partition(":")
    request = {
        "model": sglang_server.model,
        "prompt": prefix,
        "max_tokens": 200,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    body = json.dumps(request).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nx-smg-routing-key: {A}-leaver\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.5)
    r = sglang_server.complete(prefix + tokens(12, 8), tenant=f"{B}-after", max_tokens=3)
    assert r.status_code == 200, r.text
    wait_for(
        lambda: requests_of(sglang_server, f"{A}-leaver"),
        lambda rows: len(rows) == 1 and rows[0]["status"] in ("aborted", "length"),
    )
    wait_for(lambda: requests_of(sglang_server, f"{B}-after"), lambda rows: len(rows) == 1)
    assert not [e for e in stale_reads(sglang_server) if e["tenant"].startswith((A, B))]


def test_positive_control_an_injected_stale_read_is_caught(
    sglang_server: SglangServer,  # noqa: F811
) -> None:
    """The server's probe is told (test-only fault injection) to leave the KV writes of
    FAULT_TENANT's first request out of its ledger. That request's own attention reads of
    its prompt then read pages the ledger never saw written: the probe reports them as
    stale reads through the real collector, so "no stale read" elsewhere in this module
    comes from a probe whose read checks run in the live server. (Another tenant reusing
    those pages from the radix cache is not flagged: a prefix page with no recorded writer
    is a grant of unknown provenance, not checked, as for pages written before the attach.)
    """
    prefix = tokens(21, 96)
    first = sglang_server.complete(prefix + tokens(22, 4), tenant=FAULT_TENANT, max_tokens=2)
    assert first.status_code == 200, first.text
    found = wait_for(
        lambda: [e for e in stale_reads(sglang_server) if e["tenant"] == FAULT_TENANT], bool
    )
    (row,) = wait_for(lambda: requests_of(sglang_server, FAULT_TENANT), bool)
    assert {e["request_id"] for e in found} == {row["request_id"]}
    assert sum(e["page_count"] for e in found) >= 1
