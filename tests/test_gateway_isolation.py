"""The gateway's isolation by construction (``kvwatch/gateway/isolation.py``), over real HTTP on
127.0.0.1: what it adds to each forwarded completion (the tenant's tags for the probe inside
vLLM and SGLang, and the tenant's prefix-cache salt, overriding the client's), that the rest
of the body is what the client sent, that refengine's real server (which takes unknown
fields) still answers, that ``off`` changes nothing, and that the salt secret is never shown.
Against a real vLLM server, with the probe's view of it: ``tests/test_gateway_vllm.py``."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from engine_probe.probe import NoopProbe
from kvwatch.embedded import serve_in_thread
from kvwatch.gateway import GatewaySettings, create_app
from kvwatch.gateway.isolation import Isolation, derive_salt
from refengine import Engine, EngineConfig
from refengine.server import create_app as refengine_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "refengine-lab"
KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-2"}
SECRET = "s3cret-" + "0123456789abcdef" * 2  # 39 characters
ROUTING = "x-smg-routing-key"


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytearray


@dataclass
class Tap:
    """An ASGI wrapper keeping what the upstream receives (path, headers, body)."""

    app: Any
    seen: list[Seen] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        seen = Seen(scope["path"], headers, bytearray())
        self.seen.append(seen)

        async def tapped() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                seen.body.extend(message.get("body", b""))
            return message

        await self.app(scope, tapped, send)

    def completions(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/") and "completions" in s.path]


@pytest.fixture(scope="module")
def refengine() -> Iterator[tuple[str, Tap]]:
    """refengine's real server (byte tokenizer), knowing the gateway's tenant keys."""
    engine = Engine(EngineConfig(advertised_context=4096, pool_tokens=2048, page_size=16))
    tap = Tap(refengine_app(engine, tenant_keys=KEYS))
    with serve_in_thread(tap) as url:
        yield url, tap


@pytest.fixture
def tap(refengine: tuple[str, Tap]) -> Tap:
    refengine[1].seen.clear()
    return refengine[1]


@contextmanager
def gateway(upstream_url: str, **settings: Any) -> Iterator[str]:
    settings.setdefault("gateway_tenant_keys", KEYS)
    config = GatewaySettings(gateway_upstream=upstream_url, **settings)
    with serve_in_thread(create_app(config, probe=NoopProbe())) as url:
        yield url


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_the_salt_is_an_hmac_of_the_tenant_under_the_secret() -> None:
    salt = derive_salt(SECRET.encode(), "acme")
    expected = hmac.new(
        SECRET.encode(), b"kvwatch-cache-salt/v1\x00acme", hashlib.sha256
    ).hexdigest()[:32]
    assert salt == expected and len(salt) == 32 and int(salt, 16) >= 0
    assert derive_salt(SECRET.encode(), "acme") == salt  # stable: the cache survives restarts
    assert derive_salt(SECRET.encode(), "globex") != salt
    assert derive_salt(b"another secret entirely, rotated", "acme") != salt  # rotation
    assert "acme" not in salt
    # no secret given: one per process, so two gateways without one never share salts
    a, b = (Isolation(salting="per-tenant", tag_tenants=True, secret=None) for _ in range(2))
    assert a.generated and a.salt("acme") != b.salt("acme")
    assert not Isolation(salting="off", tag_tenants=True, secret=None).generated


def test_tags_and_the_tenants_salt_replace_the_clients_and_nothing_else_changes(
    refengine: tuple[str, Tap], tap: Tap
) -> None:
    url_up, _ = refengine
    acme_salt, globex_salt = (derive_salt(SECRET.encode(), t) for t in ("acme", "globex"))
    # acme tries to pass as globex, in the probe's records and in the prefix cache
    forged = {
        "cache_salt": globex_salt,
        "vllm_xargs": {"kvwatch_tenant": "globex", "kvwatch_route": "/x", "custom": 7},
    }
    completion = {"model": MODEL, "prompt": "Hello from acme ✓", "max_tokens": 40, "seed": 3}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    with gateway(url_up, gateway_salt_secret=SECRET) as url:
        answers = [
            httpx.post(f"{url}/v1/completions", json=completion | forged, headers=auth("acme")),
            httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth("acme")),
            httpx.post(
                f"{url}/v1/completions", json=completion | {"stream": True}, headers=auth("acme")
            ),
            httpx.post(f"{url}/v1/completions", json=completion, headers=auth("globex")),
        ]
    for r in answers:
        assert r.status_code == 200, r.text  # refengine takes the extra fields
        assert globex_salt not in r.text and acme_salt not in r.text
    assert answers[0].json()["choices"][0]["text"] == completion["prompt"]
    assert "data: [DONE]" in answers[2].text

    sent = [(s.path, s.headers, json.loads(bytes(s.body))) for s in tap.completions()]
    assert [path for path, _, _ in sent] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/completions",
    ]
    tenants = ["acme", "acme", "acme", "globex"]
    originals: list[dict[str, Any]] = [
        completion | forged,
        chat,
        completion | {"stream": True},
        completion,
    ]
    for (path, headers, body), tenant, original in zip(sent, tenants, originals, strict=True):
        assert headers[ROUTING] == tenant
        assert body["cache_salt"] == derive_salt(SECRET.encode(), tenant)
        xargs = body.pop("vllm_xargs")
        assert xargs["kvwatch_tenant"] == tenant and xargs["kvwatch_route"] == path
        # the client's other extra args are kept
        theirs = original.get("vllm_xargs", {})
        assert {k: v for k, v in xargs.items() if not k.startswith("kvwatch_")} == {
            k: v for k, v in theirs.items() if not k.startswith("kvwatch_")
        }
        body.pop("cache_salt")
        body.pop("stream_options", None)  # the gateway's own usage request, as before
        want = {k: v for k, v in original.items() if k not in ("cache_salt", "vllm_xargs")}
        assert body == want
    assert sent[0][2] == {"model": MODEL, "prompt": completion["prompt"], "max_tokens": 40,
                          "seed": 3}  # fmt: skip


def test_off_forwards_the_clients_body_byte_for_byte(refengine: tuple[str, Tap], tap: Tap) -> None:
    url_up, _ = refengine
    raw = b'{"model":"refengine-lab", "prompt":"as sent", "max_tokens":4,  "cache_salt":"mine",' \
        b' "vllm_xargs":{"seed_offset":1}}'  # fmt: skip
    with gateway(url_up, gateway_salt_prefix_cache="off", gateway_tag_tenants=False) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            content=raw,
            headers=auth("acme") | {"Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
    (seen,) = tap.completions()
    assert bytes(seen.body) == raw and ROUTING not in seen.headers


def test_without_tags_a_clients_own_tenant_tags_are_taken_out(
    refengine: tuple[str, Tap], tap: Tap
) -> None:
    """With --no-tag-tenants the gateway had forwarded the client's own vllm_xargs tenant and
    SGLang extra_key, so a tenant could be recorded as another (issue 40)."""
    url_up, _ = refengine
    raw = b'{"model":"refengine-lab", "prompt":"as sent", "max_tokens":4, "cache_salt":"mine",' \
        b' "extra_key":"globex", "vllm_xargs":{"kvwatch_tenant":"globex",' \
        b' "kvwatch_route":"/admin", "seed_offset":1}}'  # fmt: skip
    with gateway(url_up, gateway_salt_prefix_cache="off", gateway_tag_tenants=False) as url:
        r = httpx.post(f"{url}/v1/completions", content=raw, headers=auth("acme"))
        assert r.status_code == 200, r.text
    # each switch alone
    with gateway(url_up, gateway_salt_prefix_cache="off") as url:
        r = httpx.post(f"{url}/v1/completions", content=raw, headers=auth("acme"))
        assert r.status_code == 200, r.text
    with gateway(url_up, gateway_tag_tenants=False, gateway_salt_secret=SECRET) as url:
        r = httpx.post(f"{url}/v1/completions", content=raw, headers=auth("acme"))
        assert r.status_code == 200, r.text
    untagged, tagged, salted = (json.loads(bytes(s.body)) for s in tap.completions())
    assert untagged["vllm_xargs"] == {"seed_offset": 1} and "extra_key" not in untagged
    assert untagged["cache_salt"] == "mine" and untagged["prompt"] == "as sent"
    assert tagged["cache_salt"] == "mine" and tagged["vllm_xargs"]["kvwatch_tenant"] == "acme"
    assert salted["vllm_xargs"] == {"seed_offset": 1} and "extra_key" not in salted
    assert salted["cache_salt"] == derive_salt(SECRET.encode(), "acme")


def test_vllm_xargs_that_is_not_an_object_is_refused(refengine: tuple[str, Tap], tap: Tap) -> None:
    url_up, _ = refengine
    with gateway(url_up, gateway_salt_secret=SECRET) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "vllm_xargs": ["kvwatch_tenant", "globex"]},
            headers=auth("acme"),
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs"
    assert tap.completions() == []


@contextmanager
def echoing_upstream() -> Iterator[str]:
    """An upstream that refuses every completion with an error quoting the body it got."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            got = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
            error = {"message": f"bad request: {got}", "type": "invalid_request_error"}
            body = json.dumps({"error": error | {"param": None, "code": None}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_salt_never_comes_back_in_an_upstream_error() -> None:
    """A client that learnt its salt could send it to the engine directly, past the gateway."""
    salt = derive_salt(SECRET.encode(), "acme")
    with echoing_upstream() as echo, gateway(echo, gateway_salt_secret=SECRET) as url:
        for stream in (False, True):
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": "x", "stream": stream},
                headers=auth("acme"),
            )
            assert r.status_code == 400
            assert "kvwatch_tenant" in r.text  # the echo is relayed ...
            assert salt not in r.text and "***" in r.text  # ... without the salt


def test_the_secret_is_checked_never_shown_and_its_absence_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvwatch.cli import app

    for name in ("KVWATCH_GATEWAY_UPSTREAM", "KVWATCH_GATEWAY_SALT_SECRET"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    monkeypatch.setenv("KVWATCH_GATEWAY_SALT_SECRET", "too-short-9")
    r = runner.invoke(app, ["gateway", "--upstream", "http://x"])
    assert r.exit_code == 2, r.output
    assert "KVWATCH_GATEWAY_SALT_SECRET" in r.output and "at least 32" in r.output
    assert "too-short-9" not in r.output
    r = runner.invoke(app, ["gateway", "--upstream", "http://x", "--salt-prefix-cache", "some"])
    assert r.exit_code == 2 and "per-tenant" in r.output, r.output

    monkeypatch.setenv("KVWATCH_GATEWAY_SALT_SECRET", SECRET)
    s = GatewaySettings(gateway_upstream="http://x")
    assert s.gateway_salt_prefix_cache == "per-tenant" and s.gateway_tag_tenants
    assert SECRET not in repr(s) and SECRET not in str(s.describe())
    assert s.describe()["prefix_cache_salt"] == "per-tenant (secret set)"
    with caplog.at_level(logging.INFO, logger="engine_probe.gateway"):
        create_app(s, probe=NoopProbe())
    assert "generated" not in caplog.text and SECRET not in caplog.text

    monkeypatch.delenv("KVWATCH_GATEWAY_SALT_SECRET")
    s = GatewaySettings(gateway_upstream="http://x")
    assert s.describe()["prefix_cache_salt"] == "per-tenant (secret generated at start)"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine_probe.gateway"):
        create_app(s, probe=NoopProbe())
    assert "KVWATCH_GATEWAY_SALT_SECRET is not set" in caplog.text
    off = GatewaySettings(gateway_upstream="http://x", gateway_salt_prefix_cache="off")
    assert off.describe()["prefix_cache_salt"] == "off"
