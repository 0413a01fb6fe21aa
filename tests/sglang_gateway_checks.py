"""The gateway in front of the real SGLang server (``tests/engine_servers.py``: the run's one,
SGLang 0.5.23 on the CPU, radix cache on, kvwatch's probe inside), over real HTTP, with
clients that send neither a routing key nor a ``cache_salt``: SGLang takes the gateway's body
(its request models drop the ``vllm_xargs`` meant for vLLM), the probe's request rows carry
the gateway's tenants (the ``X-SMG-Routing-Key`` header, SGLang's ``routing_key``), and with
per-tenant salting SGLang's radix cache serves no tenant another's prefix (SGLang keys it by
``cache_salt``), while with salting off it does (the positive control).

Its tests run from ``tests/test_sglang_server.py``, which imports them: the run's SGLang
server is one per worker process, and ``--dist loadfile`` keeps one module's tests on one
worker, so a module of their own would start a second server (about 45 s of CI)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvwatch.gateway.isolation import derive_salt
from tests.engine_servers import SERVER_TEST_TIMEOUT, SglangServer, sglang_server, tokens, wait_for  # noqa: F401
from tests.engine_servers import collector_get as get
from tests.engine_servers import gateway_in_front as gateway

pytestmark = [pytest.mark.slow, SERVER_TEST_TIMEOUT]  # as every test of the run's one SGLang server

SECRET = "gateway-sglang-test-secret-" + "7" * 16
# tenants only this module uses: other modules send requests to the same server
SALTED = {"gws-salted-a": "sk-gws-1", "gws-salted-b": "sk-gws-2"}
OPEN = {"gws-open-a": "sk-gws-3", "gws-open-b": "sk-gws-4"}
SHARED = 96  # tokens of the prompt both tenants send before their own tails


def complete(url: str, key: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "kvwatch-tiny-llama", "prompt": prompt, "max_tokens": 2}
    body |= {"temperature": 0.0, "ignore_eos": True} | extra
    r = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def cached_tokens(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def rows_of(server: SglangServer, tenant: str, n: int) -> list[dict[str, Any]]:
    return list(
        wait_for(
            lambda: get(server, "/v1/requests", tenant=tenant, limit=100)["items"],
            lambda rows: len(rows) == n and all(x["status"] == "length" for x in rows),
        )
    )


def hits_read_by(server: SglangServer, tenants: set[str]) -> list[dict[str, Any]]:
    items = get(server, "/v1/page-events", kind="prefix_cache.hit", limit=100)["items"]
    return [e for e in items if e["tenant"] in tenants]


def test_salted_per_tenant_no_prefix_is_shared_and_the_tenant_reaches_the_probe(
    sglang_server: SglangServer,  # noqa: F811
) -> None:
    a, b = SALTED
    shared = tokens(8001, SHARED)
    with gateway(sglang_server.base_url, SALTED, gateway_salt_secret=SECRET) as url:
        complete(url, SALTED[a], shared + tokens(8002, 10))
        # a again: its own prefix is served from the cache (the salt keeps a's cache a's)
        again = complete(url, SALTED[a], shared + tokens(8003, 10))
        # b, with a's would-be salt: the gateway replaces it with b's own
        b_answer = complete(
            url, SALTED[b], shared + tokens(8004, 12), cache_salt=derive_salt(SECRET.encode(), a)
        )
    assert cached_tokens(again) >= 64, again["usage"]
    assert cached_tokens(b_answer) == 0, b_answer["usage"]
    a_rows, (b_row,) = rows_of(sglang_server, a, 2), rows_of(sglang_server, b, 1)
    assert sorted(x["prompt_tokens"] for x in a_rows) == [SHARED + 10] * 2
    assert b_row["prompt_tokens"] == SHARED + 12
    assert hits_read_by(sglang_server, {a, b}) == []


def test_positive_control_unsalted_tenants_share_the_prefix(
    sglang_server: SglangServer,  # noqa: F811
) -> None:
    a, b = OPEN
    shared = tokens(8011, SHARED)
    with gateway(sglang_server.base_url, OPEN, gateway_salt_prefix_cache="off") as url:
        complete(url, OPEN[a], shared + tokens(8012, 10))
        b_answer = complete(url, OPEN[b], shared + tokens(8013, 12))
    assert cached_tokens(b_answer) >= 64, b_answer["usage"]
    (a_row,), (b_row,) = rows_of(sglang_server, a, 1), rows_of(sglang_server, b, 1)
    (hit,) = wait_for(lambda: hits_read_by(sglang_server, {a, b}), bool)
    assert (hit["tenant"], hit["other_tenant"]) == (b, a)
    assert (hit["request_id"], hit["other_request_id"]) == (
        b_row["request_id"],
        a_row["request_id"],
    )
    assert hit["cross_tenant"] is True
