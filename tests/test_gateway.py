"""The gateway, over real HTTP on 127.0.0.1, in front of refengine's real server, driven by
the official ``openai`` client: proxying (chat and completions, streamed and not), the
safe-context guard and its three ways of counting, one record per request (into a real
collector, without text), errors in OpenAI's shape, and tenants kept apart."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine, inspect, text
from typer.testing import CliRunner

from engine_probe import events as ev
from engine_probe import recording
from engine_probe.probe import BaseProbe, Probe
from engine_probe.settings import ProbeSettings
from kvwatch.embedded import free_port, serve_in_thread
from kvwatch.gateway import GatewaySettings, create_app
from kvwatch.gateway.limits import Limit, LimitsSource, SafeContexts
from policies.limits import LimitInForce, from_json
from refengine import Engine, EngineConfig
from refengine.server import create_app as refengine_app
from tests.conftest import Collector

MODEL = "refengine-lab"
KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-2"}
PLATFORM_KEY = "sk-platform-3"  # the upstream's own tenant, for --upstream-key


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- what reaches the upstream ----------------------------------------------------------------


@dataclass
class Call:
    path: str
    authorization: str
    body: bytearray
    raw_path: bytes = b""  # as sent: percent-escapes kept, "?query" appended when there is one


@dataclass
class Tap:
    """An ASGI wrapper recording every request the upstream receives (path, auth, body);
    ``hide_tokenize`` makes it answer /tokenize with a 404, as an engine without one does."""

    app: Any
    calls: list[Call] = field(default_factory=list)
    hide_tokenize: bool = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        raw = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            raw += b"?" + scope["query_string"]
        call = Call(scope["path"], headers.get(b"authorization", b"").decode(), bytearray(), raw)
        self.calls.append(call)

        async def tapped() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                call.body.extend(message.get("body", b""))
            return message

        if self.hide_tokenize and scope["path"] == "/tokenize":
            while (await tapped()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        await self.app(scope, tapped, send)

    def with_marker(self, marker: str) -> list[Call]:
        return [c for c in self.calls if marker.encode() in c.body]


@dataclass
class Upstream:
    url: str
    tap: Tap


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    """refengine (hardened, byte tokenizer), knowing the gateway's tenant keys and its own."""
    engine = Engine(EngineConfig(advertised_context=4096, pool_tokens=2048, page_size=16))
    tap = Tap(refengine_app(engine, tenant_keys=KEYS | {"platform": PLATFORM_KEY}))
    with serve_in_thread(tap) as url:
        yield Upstream(url, tap)


@pytest.fixture
def tap(upstream: Upstream) -> Iterator[Tap]:
    upstream.tap.calls.clear()
    yield upstream.tap
    upstream.tap.hide_tokenize = False


# -- the gateway ------------------------------------------------------------------------------


class RecordingProbe(recording.RecordingProbe):
    """Reads its events back as the collector decodes them: the gateway builds its records
    from what clients send (model names, token counts), so every test here also checks that
    the collector would take them (a value it would refuse raises DecodeError here, in the
    test, where inside the gateway it would only be logged)."""

    @property
    def events(self) -> list[Any]:  # typed loosely: tests read each kind's own fields
        return self.decoded()


@contextmanager
def gateway(upstream_url: str, probe: BaseProbe | None = None, **settings: Any) -> Iterator[str]:
    settings.setdefault("gateway_tenant_keys", KEYS)
    config = GatewaySettings(gateway_upstream=upstream_url, **settings)
    with serve_in_thread(create_app(config, probe=probe or RecordingProbe())) as url:
        yield url


def client(url: str, key: str = KEYS["acme"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def marker() -> str:
    return f"m{uuid.uuid4().hex[:10]}"


def assert_openai_error(body: Any, code: str | None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["code"] == code


def auth(key: str = KEYS["acme"]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- proxying ---------------------------------------------------------------------------------


def test_chat_and_completions_streamed_and_not(upstream: Upstream, tap: Tap) -> None:
    probe = RecordingProbe()
    m = marker()
    prompt = f"{m} the quick brown fox ✓ "
    with gateway(upstream.url, probe) as url:
        c = client(url)
        done = c.completions.create(model=MODEL, prompt=prompt, max_tokens=200)
        assert done.choices[0].text == prompt  # the lab model reads its KV back
        assert done.usage is not None and done.usage.prompt_tokens == len(prompt.encode())
        cut = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert cut.choices[0].finish_reason == "length"

        chat = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=200
        )
        assert chat.choices[0].message.content == f"user: {prompt}\n"

        # A stream without include_usage: the usage chunk the gateway asked for is held back.
        # (How many chunks carry the text depends on scheduling: the engine coalesces what it
        # produced while the client was not reading, so a busy machine may send one.)
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=200, stream=True))
        assert chunks and all(ch.choices for ch in chunks)
        assert "".join(ch.choices[0].text for ch in chunks) == prompt
        # With include_usage the client gets it, last, as from any OpenAI server.
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks2 = list(stream)
        assert chunks2[-1].choices == [] and chunks2[-1].usage is not None
        assert chunks2[-1].usage.prompt_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks2 if ch.choices)
        assert text == chat.choices[0].message.content

        assert [m_.id for m_ in c.models.list()] == [MODEL]

    # The upstream was asked for usage on both streams, and got the bodies otherwise unchanged.
    streamed = [
        json.loads(bytes(call.body)) for call in tap.with_marker(m) if b'"stream"' in call.body
    ]
    assert len(streamed) == 2
    assert all(b["stream_options"]["include_usage"] is True for b in streamed)

    records = probe.events
    assert [type(r) for r in records] == [ev.RequestFinished] * 5
    assert [r.status for r in records] == [
        "completed",
        "length",
        "completed",
        "completed",
        "completed",
    ]
    assert [r.route for r in records] == ["/v1/completions"] * 2 + ["/v1/chat/completions"] + [
        "/v1/completions",
        "/v1/chat/completions",
    ]
    assert {r.tenant for r in records} == {"acme"} and {r.model_id for r in records} == {MODEL}
    assert records[0].prompt_tokens == len(prompt.encode())
    assert records[0].completion_tokens == done.usage.completion_tokens
    assert records[2].prompt_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    # streamed: the counts come from the usage chunk, held back from the client or not
    assert (records[3].prompt_tokens, records[3].completion_tokens) == (
        done.usage.prompt_tokens,
        done.usage.completion_tokens,
    )
    assert records[4].completion_tokens == chunks2[-1].usage.completion_tokens
    assert all(r.latency_ms is not None and r.latency_ms >= 0 for r in records)
    assert all(r.prompt_count_method is None for r in records)  # no limit: nothing counted
    assert len({r.request_id for r in records}) == 5


def test_guard_refuses_over_limit_prompts_before_the_upstream(upstream: Upstream, tap: Tap) -> None:
    probe = RecordingProbe()
    m = marker()
    long_prompt = f"{m} " + "x" * 200
    with gateway(upstream.url, probe, gateway_safe_contexts={MODEL: 128}) as url:
        c = client(url)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5)
        assert info.value.status_code == 400
        assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
        assert_openai_error(info.value.response.json(), "context_length_exceeded")
        assert "128 tokens" in info.value.message

        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": long_prompt}],
                max_tokens=5,
                stream=True,
            )
        assert info.value.code == "context_length_exceeded" and info.value.param == "messages"

        short = c.completions.create(model=MODEL, prompt=f"{m} short", max_tokens=50)
        assert short.choices[0].text == f"{m} short"

    # The upstream's tokenizer saw the long prompts; its completion routes never did.
    seen = tap.with_marker(m)
    assert [c.path for c in seen if long_prompt.encode() in c.body] == ["/tokenize", "/tokenize"]
    assert [c.path for c in seen if b"short" in c.body] == ["/tokenize", "/v1/completions"]

    rejected, rejected_chat, admitted = probe.events
    assert isinstance(rejected, ev.RequestRejected) and isinstance(
        rejected_chat, ev.RequestRejected
    )
    assert rejected.reason == "context_length_exceeded" and rejected.limit_tokens == 128
    assert rejected.prompt_tokens == len(long_prompt.encode())
    assert rejected.prompt_count_method == "tokenize_endpoint"
    assert rejected_chat.prompt_tokens == len(f"user: {long_prompt}\n".encode())
    assert rejected_chat.route == "/v1/chat/completions"
    assert isinstance(admitted, ev.RequestFinished) and admitted.status == "completed"
    assert admitted.prompt_count_method == "tokenize_endpoint"


@pytest.mark.parametrize(
    ("settings", "hide_tokenize", "method"),
    [
        ({}, False, "tokenize_endpoint"),
        ({"gateway_tokenize_endpoint": False, "gateway_tokenizer": "bytes"}, False, "bytes"),
        ({"gateway_tokenizer": "bytes"}, True, "bytes"),  # no /tokenize: falls back
        ({"gateway_tokenize_endpoint": False}, False, "estimate"),
    ],
    ids=["tokenize-endpoint", "bytes", "no-endpoint-falls-back", "estimate"],
)
def test_count_methods(
    upstream: Upstream, tap: Tap, settings: dict[str, Any], hide_tokenize: bool, method: str
) -> None:
    """Exact methods admit a prompt of exactly the limit and refuse one token more; the
    estimate never counts below the truth."""
    tap.hide_tokenize = hide_tokenize
    limit = 64
    m = marker()
    exact = f"{m} ✓".ljust(limit - 2, "-")  # "✓" is 3 bytes
    assert len(exact.encode()) == limit
    chat_exact = f"{m} ✓".ljust(limit - len("user: \n") - 2, "-")
    assert len(f"user: {chat_exact}\n".encode()) == limit
    probe = RecordingProbe()
    with gateway(upstream.url, probe, gateway_safe_contexts={"*": limit}, **settings) as url:
        c = client(url)
        attempts = [
            ("completion", exact),
            ("completion", exact + "-"),
            ("chat", chat_exact),
            ("chat", chat_exact + "-"),
        ]
        refused = []
        for kind, prompt in attempts:
            try:
                if kind == "completion":
                    c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
                else:
                    c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2
                    )
                refused.append(False)
            except openai.BadRequestError as exc:
                assert exc.code == "context_length_exceeded"
                refused.append(True)
    assert {r.prompt_count_method for r in probe.events} == {method}
    counts = [r.prompt_tokens for r in probe.events]
    truth = [limit, limit + 1, limit, limit + 1]
    if method == "estimate":
        assert refused == [True] * 4
        assert all(n >= t for n, t in zip(counts, truth, strict=True))
    else:
        assert refused == [False, True, False, True]
        assert counts == truth
    tokenize_calls = [c for c in tap.with_marker(m) if c.path == "/tokenize"]
    expected = {"tokenize_endpoint": 4, "bytes": 1 if hide_tokenize else 0, "estimate": 0}[method]
    assert len(tokenize_calls) == expected  # a missing endpoint is asked for once


def test_an_unknown_model_does_not_switch_the_tokenize_endpoint_off(
    upstream: Upstream, tap: Tap
) -> None:
    """refengine (like vLLM) answers /tokenize for a model it lacks with a 404: that is one
    request's problem, not a missing endpoint."""
    probe = RecordingProbe()
    with gateway(upstream.url, probe, gateway_safe_contexts={"*": 1000}) as url:
        with pytest.raises(openai.NotFoundError):
            client(url).completions.create(model="other-model", prompt="hi")
        client(url).completions.create(model=MODEL, prompt="hi")
    assert [r.prompt_count_method for r in probe.events] == ["estimate", "tokenize_endpoint"]


def test_refengine_tokenize_counts_what_usage_charges(upstream: Upstream) -> None:
    prompt = "naïve café ✓"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    with httpx.Client(base_url=upstream.url, timeout=30) as h:
        r = h.post("/tokenize", json={"model": MODEL, "prompt": prompt}, headers=auth)
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == len(prompt.encode()) == len(body["tokens"])
        assert body["max_model_len"] == 4096
        usage = h.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, headers=auth
        ).json()["usage"]
        r = h.post("/tokenize", json={"messages": messages}, headers=auth)
        assert r.json()["count"] == usage["prompt_tokens"]
        assert h.post("/tokenize", json={"prompt": "x"}).status_code == 401
        bad = h.post("/tokenize", json={"prompt": "x", "messages": messages}, headers=auth)
        assert bad.status_code == 400
        assert_openai_error(bad.json(), None)


# -- records in the collector -----------------------------------------------------------------


def test_records_reach_the_collector_without_text(upstream: Upstream, collector: Collector) -> None:
    deployment = f"gw-{uuid.uuid4().hex[:8]}"
    admin = collector.client(collector.admin)
    # Newest first: a failed sweep, then the latest passing one (300), then an older pass.
    for passed, safe, at in [
        (True, 1000, "2026-01-01T00:00:00Z"),
        (True, 300, "2026-02-01T00:00:00Z"),
        (False, 50, "2026-03-01T00:00:00Z"),
    ]:
        r = admin.post(
            "/v1/verifications",
            json={
                "deployment_id": deployment,
                "model_id": MODEL,
                "passed": passed,
                "verified_safe_context": safe,
                "verified_at": at,
            },
        )
        assert r.status_code == 201, r.text
    secret = f"SECRET-{uuid.uuid4().hex} merger code"
    probe = Probe(
        ProbeSettings(
            collector_url=collector.url,
            ingest_token=collector.ingest,
            deployment_id=deployment,
            probe_flush_interval_s=0.05,
        )
    )
    try:
        with gateway(
            upstream.url,
            probe,
            collector_url=collector.url,
            ingest_token=collector.ingest,
            deployment_id=deployment,
            gateway_tokenize_endpoint=False,
            gateway_tokenizer="bytes",
        ) as url:
            answer = client(url).completions.create(model=MODEL, prompt=secret, max_tokens=100)
            assert secret in answer.choices[0].text
            stream = client(url, KEYS["globex"]).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": secret}], stream=True
            )
            assert secret in "".join(ch.choices[0].delta.content or "" for ch in stream)
            with pytest.raises(openai.BadRequestError):  # 301 bytes > the verified 300
                client(url).completions.create(model=MODEL, prompt="y" * 301)
        assert probe.force_flush(10)
    finally:
        probe.shutdown()

    rows = admin.get("/v1/requests", params={"deployment_id": deployment}).json()["items"]
    got = sorted(
        (r["tenant"], r["route"], r["model_id"], r["prompt_tokens"], r["status"]) for r in rows
    )
    n = len(secret.encode())
    assert got == [
        ("acme", "/v1/completions", MODEL, n, "completed"),
        ("acme", "/v1/completions", MODEL, 301, "rejected"),
        ("globex", "/v1/chat/completions", MODEL, len(f"user: {secret}\n".encode()), "completed"),
    ]
    assert all(r["completion_tokens"] for r in rows if r["status"] == "completed")
    (refused,) = [r for r in rows if r["status"] == "rejected"]
    assert refused["reject_reason"] == "context_length_exceeded" and refused["limit_tokens"] == 300

    engine = create_engine(collector.db_url)
    try:
        with engine.connect() as conn:
            for table in inspect(engine).get_table_names():
                for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                    dump = repr(tuple(row))
                    assert "SECRET-" not in dump and KEYS["acme"] not in dump, table
    finally:
        engine.dispose()


def served(model: str, tokens: int | None, source: str, **fields: Any) -> LimitInForce:
    """A limit in force as the collector serves it (GET /v1/limits)."""
    doc = {"deployment_id": "d1", "model_id": model, "tokens": tokens, "source": source}
    return from_json(doc | fields)


def test_the_collectors_limit_joined_by_the_configured_and_kept_while_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1_000_000.0]
    limits = SafeContexts(
        {"a": 25, "*": 1000}, deployment_id="d1", keep_s=600, clock=lambda: now[0]
    )

    def tokens(*models: str | None) -> tuple[int | None, ...]:
        return tuple(None if (lim := limits.limit(m)) is None else lim.tokens for m in models)

    assert tokens("a", "other", None) == (25, 1000, 1000)
    assert limits.limit("a") == Limit(25, "configured")
    limits.set_served(
        {
            "a": served("a", 20, "verified", verified_safe_context=20),
            "c": served("c", 7, "verified", verified_safe_context=7),
            "p": served("p", 4096, "pool", structural=4096),
        }
    )
    assert tokens("a", "c") == (20, 7)  # the smaller applies
    assert limits.limit("a") == Limit(20, "verified")
    assert limits.limit("p") == Limit(1000, "configured")  # '*' tightens the pool's bound

    down = GatewaySettings(
        gateway_upstream="http://127.0.0.1:1",
        collector_url=f"http://127.0.0.1:{free_port()}",
        ingest_token="t",
        deployment_id="d1",
    )
    source = LimitsSource(down, limits)

    async def refresh() -> bool:
        async with httpx.AsyncClient(timeout=5) as h:
            return await source.refresh(h)

    with caplog.at_level(logging.WARNING, logger="engine_probe.gateway"):
        assert asyncio.run(refresh()) is False
    assert tokens("a", "c") == (20, 7)  # the last known stay
    assert "cannot read the limits in force of d1" in caplog.text and "keeping" in caplog.text
    # past keep_s, refuse (the default) refuses every prompt; warn keeps them, and says so
    now[0] += 601
    refused = limits.limit("a")
    assert refused is not None and (refused.tokens, refused.source) == (0, "none")
    assert "could not be read since" in (refused.warning or "")
    limits.on_failed = "warn"
    kept = limits.limit("a")
    assert kept is not None and kept.tokens == 20 and "could not be read" in (kept.warning or "")


def test_a_failed_verification_refuses_above_the_last_clean_value_or_warns() -> None:
    """The collector's decision under a failed verification holds; ``warn`` enforces what
    would hold without the failure, and passes the failure on."""
    failed = {"warning": "the latest verification of a failed: UNSAFE: x"}
    a = served(
        "a",
        299,
        "failed-verification",
        verified_safe_context=300,
        leaked_at=300,
        without_failure={"tokens": 300, "source": "verified"},
        **failed,
    )
    b = served(
        "b",
        0,
        "failed-verification",
        structural=8192,
        without_failure={"tokens": 8192, "source": "pool"},
        warning="UNSAFE: y",
    )
    refuse = SafeContexts({}, "refuse")
    refuse.set_served({"a": a, "b": b})
    got_a, got_b = refuse.limit("a"), refuse.limit("b")
    assert got_a is not None and (got_a.tokens, got_a.source) == (299, "failed-verification")
    assert "UNSAFE: x" in (got_a.warning or "")
    assert got_b is not None and (got_b.tokens, got_b.source) == (0, "failed-verification")
    # a configured limit counts as known safe: the failure holds prompts below it
    configured = SafeContexts({"b": 4000}, "refuse")
    configured.set_served({"b": b})
    got = configured.limit("b")
    assert got is not None and (got.tokens, got.source) == (4000, "failed-verification")
    warn = SafeContexts({"b": 4000}, "warn")
    warn.set_served({"a": a, "b": b})
    got_b = warn.limit("b")
    assert got_b is not None and (got_b.tokens, got_b.source) == (4000, "configured")
    assert got_b.warning == "UNSAFE: y"
    got_a = warn.limit("a")
    assert got_a is not None and (got_a.tokens, got_a.source) == (300, "verified")


# -- errors -----------------------------------------------------------------------------------


def test_wrong_or_missing_key_is_a_401_in_openai_shape(upstream: Upstream, tap: Tap) -> None:
    probe = RecordingProbe()
    with gateway(upstream.url, probe) as url:
        with pytest.raises(openai.AuthenticationError) as info:
            client(url, "sk-wrong").completions.create(model=MODEL, prompt="hi")
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert_openai_error(info.value.response.json(), "invalid_api_key")
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert_openai_error(r.json(), "invalid_api_key")
        r = httpx.get(f"{url}/v1/nothing-here", headers={"Authorization": "Bearer x"})
        assert r.status_code == 404
        assert_openai_error(r.json(), None)
        r = httpx.post(
            f"{url}/v1/completions",
            content=b"{not json",
            headers={"Authorization": f"Bearer {KEYS['acme']}"},
        )
        assert r.status_code == 400
        assert_openai_error(r.json(), None)
    assert tap.calls == []  # nothing reached the upstream
    (invalid,) = probe.events  # the unauthenticated are not recorded: no tenant is known
    assert isinstance(invalid, ev.RequestRejected) and invalid.reason == "invalid_request"


@dataclass
class Slow:
    """A tiny upstream: /v1/completions answers late, /v1/chat/completions starts a stream and
    stalls, /v1/models sets a cookie; it records the Cookie header of every request."""

    url: str
    release: threading.Event
    cookies: list[str | None]


@contextmanager
def slow_upstream() -> Iterator[Slow]:
    release = threading.Event()
    cookies: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            cookies.append(self.headers.get("Cookie"))
            body = b'{"object": "list", "data": []}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Set-Cookie", f"session={self.headers['Authorization']}; Path=/")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            cookies.append(self.headers.get("Cookie"))
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/v1/chat/completions":
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0}
                chunk |= {"model": MODEL, "choices": [{"index": 0, "delta": {"content": "hi"}}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            release.wait(10)
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Slow(f"http://127.0.0.1:{server.server_address[1]}", release, cookies)
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_upstream_down_is_502_and_slow_is_504() -> None:
    probe = RecordingProbe()
    with gateway(f"http://127.0.0.1:{free_port()}", probe) as url:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client(url).completions.create(model=MODEL, prompt="hi", stream=stream)
            assert info.value.status_code == 502
            assert_openai_error(info.value.response.json(), "upstream_unavailable")
    with slow_upstream() as slow, gateway(slow.url, probe, gateway_timeout_s=0.3) as url:
        with pytest.raises(openai.InternalServerError) as info:
            client(url).completions.create(model=MODEL, prompt="hi")
        assert info.value.status_code == 504
        assert_openai_error(info.value.response.json(), "upstream_timeout")
        # A stream that stalls after it started: the error comes down the stream.
        stalled = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError) as mid:
            for _ in stalled:
                pass
        assert "did not answer" in str(mid.value)
    statuses = [(type(r).__name__, r.status) for r in probe.events]
    assert statuses == [("RequestFinished", "error")] * 4
    assert [r.completion_tokens for r in probe.events] == [0, 0, 0, None]


def test_upstream_errors_pass_through_in_openai_shape(upstream: Upstream, tap: Tap) -> None:
    probe = RecordingProbe()
    with gateway(upstream.url, probe) as url:
        with pytest.raises(openai.NotFoundError) as info:
            client(url).completions.create(model="no-such-model", prompt="hi")
        assert info.value.code == "model_not_found"
        assert_openai_error(info.value.response.json(), "model_not_found")
        # Unguarded, the upstream's own refusal of a prompt over its context comes back as is.
        with pytest.raises(openai.BadRequestError) as info:
            client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "z" * 5000}], stream=True
            )
        assert info.value.code == "context_length_exceeded"
        assert "4096" in info.value.message
        # No model named: recorded under the one the upstream says served it.
        auth = {"Authorization": f"Bearer {KEYS['acme']}"}
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert r.status_code == 200
    missing, too_long, unnamed = probe.events
    assert unnamed.model_id == MODEL and unnamed.status == "completed"
    assert (missing.reason, missing.model_id) == ("invalid_request", "no-such-model")
    assert too_long.reason == "context_length_exceeded"
    assert too_long.prompt_count_method is None and too_long.prompt_tokens is None


def test_a_client_gone_mid_stream_is_recorded_as_aborted() -> None:
    probe = RecordingProbe()
    with slow_upstream() as slow, gateway(slow.url, probe) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        headers = {"Authorization": f"Bearer {KEYS['acme']}"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 10
        while not probe.events and time.monotonic() < deadline:
            time.sleep(0.02)
    record = probe.one()
    assert (record.status, record.tenant, record.completion_tokens) == ("aborted", "acme", None)


# -- tenants ----------------------------------------------------------------------------------


def test_two_tenants_concurrently_never_see_each_others_keys(upstream: Upstream, tap: Tap) -> None:
    m = marker()

    def ask(tenant: str, i: int) -> tuple[str, str]:
        tag = f"{m}-{tenant}-{i}"
        c = client(url, KEYS[tenant])
        if i % 2:
            chunks = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": tag}], stream=True
            )
            return tenant, "".join(ch.choices[0].delta.content or "" for ch in chunks)
        answer = c.completions.create(model=MODEL, prompt=tag, max_tokens=100)
        return tenant, answer.choices[0].text

    jobs = [(t, i) for i in range(6) for t in KEYS]
    for upstream_key in (None, PLATFORM_KEY):
        probe = RecordingProbe()
        tap.calls.clear()
        extra = {"gateway_upstream_key": upstream_key} if upstream_key else {}
        with (
            gateway(upstream.url, probe, gateway_safe_contexts={MODEL: 1000}, **extra) as url,
            ThreadPoolExecutor(8) as pool,
        ):
            answers = list(pool.map(lambda job: ask(*job), jobs))
        for tenant, answer in answers:
            other = next(t for t in KEYS if t != tenant)
            assert f"{m}-{tenant}-" in answer and f"{m}-{other}-" not in answer
        calls = tap.with_marker(m)
        assert len(calls) == 2 * len(jobs)  # each: /tokenize, then the completion
        for call in calls:
            tenant = "acme" if f"{m}-acme-".encode() in call.body else "globex"
            expected = upstream_key or KEYS[tenant]
            assert call.authorization == f"Bearer {expected}", (call.path, tenant)
        by_tenant = sorted(r.tenant for r in probe.events)
        assert by_tenant == ["acme"] * 6 + ["globex"] * 6

    # Nothing of one tenant's exchange is kept for the next: not even the upstream's cookies.
    with slow_upstream() as cookie_jar, gateway(cookie_jar.url) as url:
        client(url, KEYS["acme"]).models.list()
        client(url, KEYS["globex"]).models.list()
        assert cookie_jar.cookies == [None, None]


# -- settings and the command -----------------------------------------------------------------


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWATCH_GATEWAY_UPSTREAM", "http://engine:8000/v1/")
    monkeypatch.setenv("KVWATCH_GATEWAY_TENANT_KEYS", "acme=sk-a globex=sk-b==")
    monkeypatch.setenv("KVWATCH_GATEWAY_SAFE_CONTEXTS", '{"org/model=x": 4096}')
    s = GatewaySettings()  # type: ignore[call-arg]
    assert s.gateway_upstream == "http://engine:8000"
    assert s.gateway_tenant_keys == {"acme": "sk-a", "globex": "sk-b=="}
    assert s.gateway_safe_contexts == {"org/model=x": 4096}
    assert "sk-a" not in repr(s) and not s.reads_verifications


def test_gateway_command_checks_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwatch.cli import app

    for name in ("KVWATCH_GATEWAY_UPSTREAM", "KVWATCH_GATEWAY_TENANT_KEYS"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    r = runner.invoke(app, ["gateway", "--help"])
    assert r.exit_code == 0
    for option in ("--upstream", "--tenant-key", "--upstream-key", "--safe-context", "--tokenizer"):
        assert option in r.output
    cases = [
        ([], "KVWATCH_GATEWAY_UPSTREAM"),
        (["--upstream", "ftp://x"], "http"),
        (["--upstream", "http://x", "--safe-context", "m=lots"], "KVWATCH_GATEWAY_SAFE_CONTEXTS"),
        (["--upstream", "http://x", "--upstream-key", "sk-secret-9"], "needs tenant keys"),
        (["--upstream", "http://x", "--tenant-key", "acme"], "NAME=VALUE"),
    ]
    for args, fragment in cases:
        r = runner.invoke(app, ["gateway", *args])
        assert r.exit_code == 2, (args, r.output)
        assert fragment in r.output and "sk-secret-9" not in r.output, r.output


# -- review findings: routes, guard coverage, secrets -----------------------------------------


def test_model_ids_cannot_leave_the_models_route(upstream: Upstream, tap: Tap) -> None:
    """The id goes upstream as one quoted segment: no climbing to /metrics, no query."""
    with gateway(upstream.url) as url:
        for raw in ("..%2F..%2Fmetrics", "x%3Fa=b", "a%2F..%2F..%2Ftokenize"):
            r = httpx.get(f"{url}/v1/models/{raw}", headers=auth())
            assert r.status_code == 404, (raw, r.text)  # the upstream has no such model (route)
            assert_openai_error(r.json(), r.json()["error"]["code"])
        r = httpx.get(f"{url}/v1/models/%2E%2E", headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = httpx.get(f"{url}/v1/models/{MODEL}", headers=auth())
        assert r.status_code == 200 and r.json()["id"] == MODEL
    assert [c.raw_path for c in tap.calls] == [
        b"/v1/models/..%2F..%2Fmetrics",
        b"/v1/models/x%3Fa%3Db",
        b"/v1/models/a%2F..%2F..%2Ftokenize",
        f"/v1/models/{MODEL}".encode(),
    ]


def test_a_request_without_a_limit_of_its_own_gets_the_smallest(
    upstream: Upstream, tap: Tap
) -> None:
    limits = SafeContexts({})
    assert limits.limit(None) is None and limits.limit("x") is None  # nothing known: unguarded
    limits.set_served(
        {
            "a": served("a", 20, "verified", verified_safe_context=20),
            "b": served("b", 50, "verified", verified_safe_context=50),
        }
    )
    got = [limits.limit(m) for m in (None, "alias", "b")]
    assert [lim.tokens if lim else None for lim in got] == [20, 20, 50]

    probe = RecordingProbe()
    m = marker()
    long_prompt = f"{m} " + "x" * 200
    with gateway(upstream.url, probe, gateway_safe_contexts={MODEL: 128}) as url:
        for body in ({"prompt": long_prompt}, {"model": "an-alias", "prompt": long_prompt}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=auth())
            assert r.status_code == 400, r.text
            assert_openai_error(r.json(), "context_length_exceeded")
            assert "128 tokens" in r.json()["error"]["message"]
    assert [c.path for c in tap.with_marker(m) if c.path.startswith("/v1/")] == []
    assert [(r.reason, r.limit_tokens) for r in probe.events] == [
        ("context_length_exceeded", 128)
    ] * 2


@contextmanager
def echoing_upstream() -> Iterator[str]:
    """A tiny upstream that refuses everything with a 401 quoting the key it was sent."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _refuse(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            sent = self.headers.get("Authorization", "")
            error = {
                "message": f"Incorrect API key provided: {sent}",
                "type": "invalid_request_error",
                "param": sent.removeprefix("Bearer "),
                "code": "invalid_api_key",
            }
            body = json.dumps({"error": error, sent: [sent]}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_upstream_error_bodies_never_echo_a_key() -> None:
    with echoing_upstream() as echo:
        for extra in ({"gateway_upstream_key": PLATFORM_KEY}, {}):
            with gateway(echo, **extra) as url:
                answers = [
                    httpx.post(
                        f"{url}/v1/completions",
                        json={"model": MODEL, "prompt": "hi"},
                        headers=auth(),
                    ),
                    httpx.post(f"{url}/v1/chat/completions", json={"stream": True}, headers=auth()),
                    httpx.get(f"{url}/v1/models", headers=auth()),
                    httpx.get(f"{url}/v1/models/{MODEL}", headers=auth()),
                ]
            for r in answers:
                assert r.status_code == 401
                assert PLATFORM_KEY not in r.text and all(k not in r.text for k in KEYS.values())
                assert r.json()["error"]["message"] == "Incorrect API key provided: Bearer ***"
                assert r.json()["error"]["param"] == "***" and "Bearer ***" in r.json()


def test_a_stream_flag_that_is_not_a_boolean_is_refused(upstream: Upstream, tap: Tap) -> None:
    m = marker()
    with gateway(upstream.url) as url:
        for flag in (1, "yes", 0):
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": m, "stream": flag},
                headers=auth(),
            )
            assert r.status_code == 400, r.text
            assert_openai_error(r.json(), None)
            assert r.json()["error"]["param"] == "stream"
    assert tap.with_marker(m) == []


def test_input_the_guard_cannot_count_is_refused_when_guarded(upstream: Upstream, tap: Tap) -> None:
    m = marker()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": m}, image]}],
    }
    embeds = {"model": MODEL, "prompt": m, "prompt_embeds": "AAAA"}
    probe = RecordingProbe()
    with gateway(upstream.url, probe, gateway_safe_contexts={MODEL: 1000}) as url:
        for route, body, param in [
            ("chat/completions", chat, "messages.0.content.1"),
            ("completions", embeds, "prompt_embeds"),
        ]:
            r = httpx.post(f"{url}/v1/{route}", json=body, headers=auth())
            assert r.status_code == 400, r.text
            assert_openai_error(r.json(), "unsupported_content")
            assert r.json()["error"]["param"] == param
            assert "cannot count non-text input" in r.json()["error"]["message"]
    assert tap.with_marker(m) == []
    assert [r.reason for r in probe.events] == ["invalid_request"] * 2
    # Unguarded, they go upstream as before (refengine refuses images itself).
    with gateway(upstream.url) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth())
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
    assert [c.path for c in tap.with_marker(m)] == ["/v1/chat/completions"]


def test_token_id_prompts_count_as_their_length(upstream: Upstream, tap: Tap) -> None:
    probe = RecordingProbe()
    with gateway(upstream.url, probe, gateway_safe_contexts={"*": 64}) as url:
        for prompt in ([7] * 64, [[7] * 10, [7] * 64], [7] * 65):
            r = httpx.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt}, headers=auth()
            )
            assert r.status_code == 400  # refengine takes text only; the guard lets 64 pass
    codes = [getattr(r, "reason", None) for r in probe.events]
    assert codes == ["invalid_request", "invalid_request", "context_length_exceeded"]
    assert [r.prompt_tokens for r in probe.events] == [64, 64, 65]
    assert [c.path for c in tap.calls] == ["/v1/completions"] * 2  # no /tokenize needed


@pytest.mark.parametrize(
    ("n", "calls", "method"), [(16, 16, "tokenize_endpoint"), (17, 0, "estimate")]
)
def test_a_large_batch_is_counted_without_one_tokenize_call_each(
    upstream: Upstream, tap: Tap, n: int, calls: int, method: str
) -> None:
    probe = RecordingProbe()
    m = marker()
    prompts = [f"{m} {i}" for i in range(n - 1)] + [f"{m} " + "x" * 2000]
    with gateway(upstream.url, probe, gateway_safe_contexts={"*": 1000}) as url:
        r = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": prompts}, headers=auth()
        )
        assert r.status_code == 400
        assert_openai_error(r.json(), "context_length_exceeded")
    assert len([c for c in tap.with_marker(m) if c.path == "/tokenize"]) == calls
    assert probe.one().prompt_count_method == method


def test_keys_the_upstream_refuses_are_no_tenants_without_tenant_keys(
    upstream: Upstream, tap: Tap
) -> None:
    probe = RecordingProbe()
    m = marker()
    with gateway(
        upstream.url, probe, gateway_tenant_keys={}, gateway_safe_contexts={"*": 64}
    ) as url:
        for _ in range(3):
            stranger = client(url, f"sk-random-{uuid.uuid4().hex}")
            with pytest.raises(openai.AuthenticationError):
                stranger.completions.create(model=MODEL, prompt=f"{m} short", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):  # refused at /tokenize already
                stranger.completions.create(model=MODEL, prompt=f"{m} " + "y" * 100)
            with pytest.raises(openai.AuthenticationError):
                list(
                    stranger.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": m}], stream=True
                    )
                )
        client(url).completions.create(model=MODEL, prompt=f"{m} short", max_tokens=2)
    record = probe.one()  # only the real key's request
    assert record.tenant.startswith("key-") and record.status in ("completed", "length")
    assert not [c for c in tap.with_marker(m) if b"y" * 100 in c.body and c.path != "/tokenize"]


def test_chat_template_fields_reach_tokenize_and_the_estimate(upstream: Upstream, tap: Tap) -> None:
    m = marker()
    fields = {
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "documents": [{"title": "t", "text": "d" * 50}],
        "add_special_tokens": False,
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": m}], "max_tokens": 2}
    with gateway(upstream.url, gateway_safe_contexts={MODEL: 4000}) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body | fields, headers=auth())
        assert r.status_code == 200, r.text
    (tokenized,) = [c for c in tap.with_marker(m) if c.path == "/tokenize"]
    sent = json.loads(bytes(tokenized.body))
    assert {k: sent.get(k) for k in fields} == fields

    probe = RecordingProbe()
    big = fields | {"documents": [{"title": "t", "text": "d" * 300}]}
    with gateway(
        upstream.url, probe, gateway_safe_contexts={MODEL: 200}, gateway_tokenize_endpoint=False
    ) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body | big, headers=auth())
        assert r.status_code == 400
        assert_openai_error(r.json(), "context_length_exceeded")
    assert probe.one().prompt_tokens > 300 and probe.one().prompt_count_method == "estimate"
