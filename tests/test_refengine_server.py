"""refengine's OpenAI-compatible server, over real HTTP on 127.0.0.1: shapes, streaming,
tenants, clean refusals, and the incident itself answered 200 in legacy mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvwatch.embedded import free_port, serve_in_thread
from refengine import Engine, EngineConfig, EngineObserver, Request
from refengine.server import create_app
from tests.conftest import Collector

TENANTS = ("acme", "globex", "initech", "umbrella")
KEYS = {t: f"sk-{t}-{i}" for i, t in enumerate(TENANTS)} | {"mallory": "sk-mallory"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Admitted(EngineObserver):
    tenants: dict[str, str] = field(default_factory=dict)  # request id -> tenant
    routes: dict[str, str | None] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)  # request id -> final status
    fail_after_steps: int | None = None  # raise in on_step: an engine (observer) bug
    steps: int = 0

    def on_request_admitted(self, req: Request) -> None:
        self.tenants[req.request_id] = req.tenant
        self.routes[req.request_id] = req.route

    def on_request_finished(self, req: Request) -> None:
        self.ended[req.request_id] = req.status

    def on_step(self, engine: Engine) -> None:
        self.steps += 1
        if self.fail_after_steps is not None and self.steps >= self.fail_after_steps:
            raise RuntimeError("injected engine failure")


@dataclass
class Served:
    client: httpx.Client
    engine: Engine
    seen: Admitted

    def post(self, path: str, body: Any, key: str | None = "sk-acme-0", **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return self.client.post(path, json=body, headers=headers, **kw)


@contextmanager
def serve(tenant_keys: dict[str, str] | None = KEYS, **config: Any) -> Iterator[Served]:
    base: dict[str, Any] = {"advertised_context": 4096, "pool_tokens": 2048, "page_size": 16}
    engine = Engine(EngineConfig(**(base | config)))
    seen = Admitted()
    engine.add_observer(seen)
    app = create_app(engine, tenant_keys=tenant_keys)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield Served(client, engine, seen)


def secret(tenant: str, i: int) -> str:
    return f"[{tenant}] memo #{i}: merger code {tenant.upper()}-{(i + 1) * 7919:06d}, ✓. " * 3


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


def sse(r: httpx.Response) -> list[Any]:
    """The data lines of an SSE response: JSON chunks, then the literal "[DONE]"."""
    assert r.status_code == 200, r.read()
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for line in r.iter_lines():
        if line:
            assert line.startswith("data: ")
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- answers ----------------------------------------------------------------------------------


def test_completion_and_chat_read_back_the_prompt() -> None:
    prompt = "The quick brown fox — jumps over 13 lazy dogs. ✓ "
    n = len(prompt.encode())
    with serve(topology="disaggregated") as s:
        r = s.post(
            "/v1/completions", {"model": "refengine-lab", "prompt": prompt, "max_tokens": 500}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "refengine-lab"
        assert body["id"].startswith("cmpl-") and r.headers["x-request-id"] == body["id"]
        assert isinstance(body["created"], int)
        (choice,) = body["choices"]
        assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, prompt, "stop")
        # The prompt's bytes read back, then the end-of-text token.
        assert body["usage"] == {
            "prompt_tokens": n,
            "completion_tokens": n + 1,
            "total_tokens": 2 * n + 1,
            "prompt_tokens_details": {"cached_tokens": 0},  # the prefix cache is off
        }
        assert s.seen.tenants[body["id"]] == "acme"  # the engine's request id is the answer's
        assert s.seen.routes[body["id"]] == "/v1/completions"

        # OpenAI's default budget for completions is 16 tokens; a list of one prompt is fine
        r = s.post("/v1/completions", {"prompt": [prompt]})
        assert r.json()["choices"][0] == {
            "index": 0,
            "text": prompt.encode()[:16].decode(),
            "logprobs": None,
            "finish_reason": "length",
        }

        messages = [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
            },
        ]
        r = s.post("/v1/chat/completions", {"model": "refengine-lab", "messages": messages})
        assert r.status_code == 200, r.text
        body = r.json()
        templated = "system: Be brief.\nuser: Hello, world\n"  # the documented template
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": templated}
        assert choice["finish_reason"] == "stop"
        m = len(templated)
        assert body["usage"] == {
            "prompt_tokens": m,
            "completion_tokens": m + 1,
            "total_tokens": 2 * m + 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        # max_completion_tokens wins over max_tokens
        r = s.post(
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 100, "max_completion_tokens": 6},
        )
        assert r.json()["choices"][0]["message"]["content"] == "system"
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 6


def test_streaming_concatenates_to_the_non_streamed_answer() -> None:
    prompt = secret("acme", 1)  # multi-byte characters: pieces must not split them
    messages = [{"role": "user", "content": prompt}]
    with serve(topology="disaggregated", max_batch=4) as s:
        plain = s.post("/v1/completions", {"prompt": prompt, "max_tokens": 1000}).json()
        h = {"Authorization": "Bearer sk-acme-0"}
        body = {"prompt": prompt, "max_tokens": 1000, "stream": True}
        with s.client.stream("POST", "/v1/completions", json=body, headers=h) as r:
            events = sse(r)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        # The count of chunks is the scheduler's: text the engine produced while the client was
        # not reading is coalesced into one chunk, so a busy machine may send a single one.
        assert chunks
        assert {c["object"] for c in chunks} == {"text_completion"}
        assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
        assert (
            "".join(c["choices"][0]["text"] for c in chunks)
            == plain["choices"][0]["text"]
            == prompt
        )
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])

        chat_plain = s.post("/v1/chat/completions", {"messages": messages}).json()
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
        with s.client.stream("POST", "/v1/chat/completions", json=body, headers=h) as r:
            events = sse(r)
        assert events[-1] == "[DONE]"
        *chunks, usage = events[:-1]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == chat_plain["choices"][0]["message"]["content"] == f"user: {prompt}\n"
        assert chunks[-1]["choices"][0] == {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "stop",
        }
        assert usage["choices"] == [] and usage["usage"] == chat_plain["usage"]


def test_a_client_that_leaves_has_its_request_aborted() -> None:
    # The lab model reads its prompt back: a long prompt makes a long answer (~4000 steps).
    with serve(advertised_context=8192, pool_tokens=8192) as s:
        body = {"prompt": "z" * 4000, "max_tokens": 5000, "stream": True}
        h = {"Authorization": "Bearer sk-acme-0"}
        with s.client.stream("POST", "/v1/completions", json=body, headers=h) as r:
            rid = r.headers["x-request-id"]
            next(r.iter_lines())  # the first chunk, then hang up
        deadline = time.monotonic() + 10
        while rid not in s.seen.ended:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.02)
        assert s.seen.ended[rid] == "aborted"
        assert all(p.used_pages == 0 for p in s.engine.pools.values())


def test_an_engine_failure_answers_503_and_health_says_so() -> None:
    with serve() as s:
        s.seen.fail_after_steps = 3
        e = error_of(s.post("/v1/completions", {"prompt": "a" * 100, "max_tokens": 100}), 503)
        assert (e["type"], e["code"]) == ("server_error", "engine_unavailable")
        assert "injected" not in e["message"]  # details go to the log, not the client
        error_of(s.post("/v1/completions", {"prompt": "b"}), 503)
        assert s.client.get("/health").status_code == 503


# -- models, auth, tenants --------------------------------------------------------------------


def test_models_and_auth() -> None:
    with serve() as s:
        r = s.client.get("/v1/models", headers={"Authorization": "Bearer sk-globex-1"})
        assert r.status_code == 200
        assert r.json() == {
            "object": "list",
            "data": [
                {
                    "id": "refengine-lab",
                    "object": "model",
                    "created": r.json()["data"][0]["created"],
                    "owned_by": "refengine",
                    "max_model_len": 4096,
                    "prefix_caching": False,
                    "prefix_cache": "off",
                }
            ],
        }
        assert (
            s.client.get(
                "/v1/models/refengine-lab", headers={"Authorization": "Bearer sk-globex-1"}
            ).json()["id"]
            == "refengine-lab"
        )
        assert s.client.get("/health").json() == {"status": "ok"}  # no key needed
        doc = s.client.get("/openapi.json").json()
        assert {"CompletionRequest", "ChatCompletionRequest"} <= set(doc["components"]["schemas"])
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])

        body = {"prompt": "hi"}
        for headers in ({}, {"Authorization": "sk-acme-0"}, {"Authorization": "Bearer"}):
            e = error_of(s.client.post("/v1/completions", json=body, headers=headers), 401)
            assert e["code"] == "invalid_api_key" and e["type"] == "invalid_request_error"
        r = s.post("/v1/completions", body, key="sk-unknown")
        e = error_of(r, 401)
        assert e["code"] == "invalid_api_key" and "sk-unknown" not in r.text
        assert r.headers["www-authenticate"] == "Bearer"
        error_of(s.client.get("/v1/models"), 401)
        error_of(s.post("/v1/chat/completions", {"messages": []}, key=None), 401)  # auth first
        assert s.seen.tenants == {}  # nothing reached the engine


def test_tenant_keys_name_the_tenants() -> None:
    with serve() as s:
        for t in ("acme", "globex", "mallory"):
            r = s.post("/v1/completions", {"prompt": f"from {t}"}, key=KEYS[t])
            assert s.seen.tenants[r.json()["id"]] == t
    # Without tenant keys every key is accepted and is its own tenant, named by a hash of it.
    with serve(tenant_keys=None) as s:
        ids = [
            s.post("/v1/completions", {"prompt": "x"}, key=key).json()["id"]
            for key in ("alpha-secret", "beta-secret", "alpha-secret")
        ]
        a, b, a2 = (s.seen.tenants[i] for i in ids)
        assert a == a2 != b
        assert a.startswith("key-") and "alpha" not in a and len(a) == 20


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "hardened"])
def test_over_advertised_context_is_a_clean_400(mode: str) -> None:
    with serve(mode=mode, topology="disaggregated", pool_tokens=512) as s:
        r = s.post("/v1/completions", {"prompt": "x" * 4097, "max_tokens": 5})
        e = error_of(r, 400)
        assert e == {
            "message": "This model's maximum context length is 4096 tokens. However, your "
            "prompt has 4097 tokens. Please reduce the length of the prompt.",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
        body = {"messages": [{"role": "user", "content": "x" * 5000}], "stream": True}
        e = error_of(s.post("/v1/chat/completions", body), 400)  # JSON, not a stream
        assert (e["code"], e["param"]) == ("context_length_exceeded", "messages")
        assert s.seen.tenants == {}  # refused before admission
        assert s.post("/v1/completions", {"prompt": "ok"}).status_code == 200


def test_hardened_disaggregated_over_pool_prompt_is_a_clean_400() -> None:
    with serve(
        mode="hardened", topology="disaggregated", pool_tokens=512, decode_pool_tokens=4096
    ) as s:
        e = error_of(s.post("/v1/completions", {"prompt": "y" * 1000, "max_tokens": 400}), 400)
        assert (e["code"], e["type"], e["param"]) == (
            "context_length_exceeded",
            "invalid_request_error",
            "prompt",
        )
        assert "512 tokens" in e["message"]


@pytest.mark.parametrize("mode", ["legacy", "hardened"])
def test_the_incident_through_http(mode: str) -> None:
    """Legacy, disaggregated, prefill pool smaller than the advertised context: after other
    tenants' requests, a new tenant's over-pool prompt is answered 200 with their text.
    Hardened: the same workload gets a clean 400."""
    with serve(
        mode=mode,
        topology="disaggregated",
        advertised_context=4096,
        pool_tokens=512,
        decode_pool_tokens=4096,
        max_batch=4,
    ) as s:
        prompts = {t: secret(t, i) for i, t in enumerate(TENANTS)}

        def ask(t: str) -> Any:
            return s.post("/v1/completions", {"prompt": prompts[t], "max_tokens": 400}, key=KEYS[t])

        with ThreadPoolExecutor(len(TENANTS)) as pool:
            for t, r in zip(TENANTS, pool.map(ask, TENANTS), strict=True):
                assert r.json()["choices"][0]["text"] == prompts[t]

        r = s.post(
            "/v1/completions", {"prompt": "y" * 1000, "max_tokens": 400}, key=KEYS["mallory"]
        )
        if mode == "hardened":
            assert error_of(r, 400)["code"] == "context_length_exceeded"
            return
        assert r.status_code == 200, r.text
        body = r.json()
        text = body["choices"][0]["text"]
        assert "y" not in text
        victims = [t for t, p in prompts.items() if p[40:80] in text]
        assert victims, text
        assert s.seen.tenants[body["id"]] == "mallory"
        # Nothing in the answer says it was rejected: a plain OpenAI completion.
        assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
        assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
        assert body["usage"]["prompt_tokens"] == 1000
        assert set(r.headers) & {"x-rejected", "x-kvwatch"} == set()


def test_bad_input_is_a_400_never_a_500() -> None:
    with serve() as s:
        h = {"Authorization": "Bearer sk-acme-0", "Content-Type": "application/json"}
        for raw in (b"{not json", b"", b"[1, 2]", b'"prompt"', b"\xff\xfe"):
            e = error_of(s.client.post("/v1/completions", content=raw, headers=h), 400)
            assert e["type"] == "invalid_request_error"
        cases: list[tuple[str, dict[str, Any], str | None]] = [
            ("/v1/completions", {}, "prompt"),
            ("/v1/completions", {"prompt": 42}, "prompt"),
            ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
            ("/v1/completions", {"prompt": ""}, "prompt"),
            ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
            ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
            ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
            ("/v1/completions", {"prompt": "a", "n": 2}, "n"),
            ("/v1/completions", {"prompt": "a", "model": 7}, "model"),
            ("/v1/chat/completions", {"messages": []}, "messages"),
            ("/v1/chat/completions", {"messages": "hi"}, "messages"),
            ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages.0.content.0",
            ),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1},
                "max_completion_tokens",
            ),
        ]
        for path, body, param in cases:
            e = error_of(s.post(path, body), 400)
            assert (e["type"], e["param"]) == ("invalid_request_error", param), (body, e)
        e = error_of(s.post("/v1/completions", {"prompt": "a", "model": "gpt-4"}), 404)
        assert (e["code"], e["param"]) == ("model_not_found", "model")
        assert (
            error_of(s.client.get("/v1/models/gpt-4", headers=h), 404)["code"] == "model_not_found"
        )
        assert error_of(s.client.get("/v1/nope", headers=h), 404)["type"] == "invalid_request_error"
        error_of(s.client.get("/v1/completions", headers=h), 405)
        assert s.seen.tenants == {}
        # unknown fields (sampling settings) are accepted and ignored
        ok = s.post("/v1/completions", {"prompt": "ab", "temperature": 0.2, "user": "u", "n": 1})
        assert ok.json()["choices"][0]["text"] == "ab"


def test_over_body_limit_is_a_413() -> None:
    engine = Engine(EngineConfig(advertised_context=64, pool_tokens=256))
    app = create_app(engine, max_body_bytes=1000)
    with serve_in_thread(app) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "x" * 2000},
            headers={"Authorization": "Bearer k"},
        )
        assert error_of(r, 413)["type"] == "invalid_request_error"


# -- the CLI ----------------------------------------------------------------------------------


def _kvwatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvwatch.cli", *args]


def _start_engine(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``kvwatch engine serve ARGS`` on a free port, once it answers /health."""
    port = free_port()
    proc = subprocess.Popen(
        _kvwatch("engine", "serve", "--port", str(port), "--torch-threads", "1", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"} | env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[0])
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"kvwatch engine serve did not start:\n{proc.communicate()[0]}")
        time.sleep(0.1)


def test_cli_engine_serve_answers_and_stops() -> None:
    proc, url = _start_engine(
        "--mode", "hardened", "--topology", "disaggregated", "--advertised-context", "4096",
        "--pool-tokens", "1024", "--decode-pool-tokens", "4096", "--tenant-key", "acme=k1",
        env={},
    )  # fmt: skip
    try:
        auth = {"Authorization": "Bearer k1"}
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 50}, headers=auth
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "hello"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "y" * 2000}, headers=auth)
        assert error_of(r, 400)["code"] == "context_length_exceeded"  # pool 1024 < 2000
        assert (
            httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
        )
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    # SIGTERM is how a service is stopped: after its graceful shutdown it exits 0, so a
    # shell's `kill $ENGINE; wait $ENGINE` (the docs' way) succeeds under `set -e`
    assert proc.returncode == 0, out
    assert "Application shutdown complete" in out
    assert "k1" not in out  # the key is never printed
    assert "hardened disaggregated" in out


#: docs/using.md's engine example: the incident's sizing, two tenants
README_ENGINE = (
    "--mode", "legacy", "--topology", "disaggregated", "--advertised-context", "8192",
    "--pool-tokens", "2048", "--decode-pool-tokens", "8192",
    "--tenant-key", "acme=sk-acme", "--tenant-key", "globex=sk-globex",
)  # fmt: skip


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cli_engine_serve_reports_the_incident_to_a_collector(collector: Collector) -> None:
    """With the collector settings, the legacy engine's own probe and ledger report: the
    over-pool prompt's stale read names both tenants, and the collector raises the critical
    alert and opens the incident. Nothing but the engine's own flags and two settings."""
    proc, url = _start_engine(
        *README_ENGINE,
        "--deployment",
        "lab-by-hand",
        env={
            "KVWATCH_COLLECTOR_URL": collector.url,
            "KVWATCH_INGEST_TOKEN": collector.ingest,
            "KVWATCH_PROBE_FLUSH_INTERVAL_S": "0.2",
        },
    )
    secret = "ACME CONFIDENTIAL: merger with Initech closes Friday, do not share."
    try:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": secret, "max_tokens": 64},
            headers={"Authorization": "Bearer sk-acme"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "Summarise this contract. " + "clause " * 400, "max_tokens": 96},
            headers={"Authorization": "Bearer sk-globex"},
            timeout=60,
        )
        assert r.status_code == 200, r.text  # legacy: answered over pages nobody sent
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert "reporting to " + collector.url in out and "'lab-by-hand'" in out, out
    assert "sk-acme" not in out

    admin = {"Authorization": f"Bearer {collector.admin}"}
    with httpx.Client(base_url=collector.url, headers=admin, timeout=30) as c:
        stale = c.get(
            "/v1/page-events", params={"deployment_id": "lab-by-hand", "kind": "page.stale_read"}
        ).json()["items"]
        crossed = [e for e in stale if e["cross_tenant"]]
        assert crossed, stale
        assert {(e["tenant"], e["other_tenant"]) for e in crossed} == {("globex", "acme")}
        (alert,) = [
            a
            for a in c.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
            if a["deployment_id"] == "lab-by-hand" and a["labels"]["cross_tenant"] == "true"
        ]
        assert alert["severity"] == "critical" and alert["incident_id"] is not None
        incident = c.get(f"/v1/incidents/{alert['incident_id']}").json()
        assert incident["state"] == "open"
        rows = c.get("/v1/requests", params={"deployment_id": "lab-by-hand"}).json()["items"]
        assert {r["tenant"] for r in rows} == {"acme", "globex"}


def test_cli_engine_serve_says_when_it_reports_nowhere() -> None:
    proc, _ = _start_engine(*README_ENGINE, env={"KVWATCH_COLLECTOR_URL": ""})
    proc.terminate()
    out = proc.communicate(timeout=30)[0]
    assert "not reporting" in out and "KVWATCH_COLLECTOR_URL" in out, out


def test_cli_engine_serve_names_a_bad_collector_setting() -> None:
    r = subprocess.run(
        _kvwatch("engine", "serve", "--deployment", "no spaces allowed"),
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"KVWATCH_COLLECTOR_URL": "http://127.0.0.1:9"},
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "KVWATCH_DEPLOYMENT_ID" in r.stdout + r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tenant-key", "acme"], "NAME=KEY"),
        (["--tenant-key", "acme=k1", "--tenant-key", "acme=k2"], "given twice"),
        (["--mode", "reckless"], "reckless"),
        (["--pool-tokens", "0"], "pool-tokens"),
        (["--decode-pool-tokens", "4096"], "disaggregated"),
        (["--pool-tokens", "8", "--page-size", "16"], "at least one page"),
        (["--device", "tpu"], "--device"),
        (["--prefix-cache", "shared", "--topology", "disaggregated"], "monolithic"),
        (["--prefix-cache", "on"], "on"),
    ],
)
def test_cli_engine_serve_bad_flags_exit_2(args: list[str], needle: str) -> None:
    r = subprocess.run(
        _kvwatch("engine", "serve", *args), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stdout + r.stderr


def test_tenant_keys_are_checked_when_the_app_is_built() -> None:
    engine = Engine(EngineConfig(advertised_context=64, pool_tokens=256))
    for keys in ({"a": "k", "b": "k"}, {"a": ""}, {"": "k"}):
        with pytest.raises(ValueError):
            create_app(engine, tenant_keys=keys)
