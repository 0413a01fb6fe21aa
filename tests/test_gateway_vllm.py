"""The gateway in front of the real vLLM server (``tests/engine_servers.py``: the run's one,
block size 32, prefix caching on, kvwatch's probe inside), over real HTTP, with clients that
never send ``vllm_xargs`` nor ``cache_salt`` themselves: the probe's request rows carry the
gateway's tenants and routes; with per-tenant salting two tenants' identical prompts share no
cached block (no ``prefix_cache.hit`` between them), even when one sends the other's salt;
with salting off they do (the positive control: the same requests, the same server)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvwatch.gateway.isolation import derive_salt
from tests.engine_servers import SERVER_TEST_TIMEOUT, VllmServer, tokens, vllm_server, wait_for  # noqa: F401
from tests.engine_servers import gateway_in_front as gateway

# serial and slow, as every test of the run's one vLLM server (tests/test_vllm_server.py)
pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]

SECRET = "gateway-vllm-test-secret-" + "5" * 16
# tenants only this module uses: other modules send requests to the same server
SALTED = {"gwv-salted-a": "sk-gwv-1", "gwv-salted-b": "sk-gwv-2"}
OPEN = {"gwv-open-a": "sk-gwv-3", "gwv-open-b": "sk-gwv-4"}
# 5 full blocks shared, then a tail of the reader's own: a hit would be 5 blocks
SHARED = 5 * 32


def complete(
    url: str, key: str, prompt: list[int], *, stream: bool = False, **extra: Any
) -> httpx.Response:
    body = {"model": "kvwatch-tiny-llama", "prompt": prompt, "max_tokens": 2}
    body |= {"temperature": 0.0, "ignore_eos": True, "stream": stream} | extra
    r = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r


def rows_of(server: VllmServer, tenant: str, n: int) -> list[dict[str, Any]]:
    """The probe's request rows of ``tenant``, once ``n`` of them have finished (its
    prefix-cache hits, emitted at admission, are in the collector by then)."""

    def fetch() -> list[dict[str, Any]]:
        with server.collector.client() as c:
            r = c.get(
                "/v1/requests",
                params={"deployment_id": server.deployment_id, "tenant": tenant, "limit": 100},
            )
            r.raise_for_status()
            return list(r.json()["items"])

    return list(
        wait_for(fetch, lambda rows: len(rows) == n and all(x["status"] == "length" for x in rows))
    )


def hits_read_by(server: VllmServer, tenants: set[str]) -> list[dict[str, Any]]:
    with server.collector.client() as c:
        r = c.get(
            "/v1/page-events",
            params={"deployment_id": server.deployment_id, "kind": "prefix_cache.hit"},
        )
        r.raise_for_status()
        return [e for e in r.json()["items"] if e["tenant"] in tenants]


def test_salted_per_tenant_no_prefix_is_shared_and_tags_reach_the_probe(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    a, b = SALTED
    first, second = tokens(7001, SHARED + 10), tokens(7002, SHARED + 10)
    with gateway(vllm_server.base_url, SALTED, gateway_salt_secret=SECRET) as url:
        complete(url, SALTED[a], first)
        complete(url, SALTED[b], first[:SHARED] + tokens(7003, 12), stream=True)
        # b sends the salt a's requests get: the gateway replaces it with b's own
        complete(url, SALTED[a], second)
        complete(
            url,
            SALTED[b],
            second[:SHARED] + tokens(7004, 12),
            cache_salt=derive_salt(SECRET.encode(), a),
            vllm_xargs={"kvwatch_tenant": a},  # nor can b pass as a in the probe's rows
        )
    a_rows, b_rows = rows_of(vllm_server, a, 2), rows_of(vllm_server, b, 2)
    assert sorted(x["prompt_tokens"] for x in a_rows) == [SHARED + 10] * 2
    assert sorted(x["prompt_tokens"] for x in b_rows) == [SHARED + 12] * 2
    assert {x["route"] for x in a_rows + b_rows} == {"/v1/completions"}
    assert hits_read_by(vllm_server, {a, b}) == []


def test_positive_control_unsalted_tenants_share_the_prefix(
    vllm_server: VllmServer,  # noqa: F811
) -> None:
    """The same requests with salting off: vLLM serves b a's cached blocks, and the probe
    says so, naming both of the gateway's tenants (so the test above can see a hit)."""
    a, b = OPEN
    first = tokens(7011, SHARED + 10)
    with gateway(vllm_server.base_url, OPEN, gateway_salt_prefix_cache="off") as url:
        complete(url, OPEN[a], first)
        complete(url, OPEN[b], first[:SHARED] + tokens(7013, 12))
    (a_row,), (b_row,) = rows_of(vllm_server, a, 1), rows_of(vllm_server, b, 1)
    (hit,) = hits_read_by(vllm_server, {a, b})
    assert (hit["tenant"], hit["other_tenant"]) == (b, a)
    assert (hit["request_id"], hit["other_request_id"]) == (
        b_row["request_id"],
        a_row["request_id"],
    )
    assert hit["page_count"] == SHARED // vllm_server.block_size
    assert hit["cross_tenant"] is True and hit["detail"]["salted"] is False
