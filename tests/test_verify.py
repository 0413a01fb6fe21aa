"""``kvwatch verify`` end to end, run as a user runs it (the CLI, in-process) against real
HTTP servers on 127.0.0.1: refengine's OpenAI-compatible server (legacy + disaggregated
leaks, hardened passes at the engine's real limit), a small fake upstream that fails in
the ways a real one can (5xx, timeouts, unclean refusals, inconsistent limits), nothing at
all (endpoint down), and the real collector for the upload."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from collector import models as m
from collector.db import Database
from engine_probe.adapters.refengine import attach
from engine_probe.probe import Probe
from engine_probe.settings import ProbeSettings
from kvwatch.cli import app
from kvwatch.embedded import free_port, serve_in_thread
from kvwatch.verify.canaries import LeakMatcher, TenantText, new_canaries
from kvwatch.verify.client import Outcome, classify, redact_url
from refengine import Engine, EngineConfig
from refengine.server import create_app
from tests.conftest import Collector

KEYS = {"acme": "sk-acme-1111", "globex": "sk-globex-2222", "initech": "sk-initech-3333"}
MODEL = "refengine-lab"
# The incident's sizing, small: a prefill pool far below the advertised context, a decode
# pool that holds it. Few pages of 16 tokens; budgets of a few dozen requests.
SIZING: dict[str, Any] = {
    "topology": "disaggregated",
    "advertised_context": 1024,
    "pool_tokens": 256,
    "decode_pool_tokens": 2048,
    "page_size": 16,
    "max_batch": 8,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    report: dict[str, Any] | None


def kvwatch_verify(
    endpoint: str,
    keys: dict[str, str],
    *args: str,
    tmp_path: Path,
    env: dict[str, str | None] | None = None,
    keys_in_env: bool = False,
) -> Ran:
    out = tmp_path / f"report-{time.monotonic_ns()}.json"
    argv = ["verify", "--endpoint", endpoint, "--model", MODEL, "--json", str(out)]
    pairs = [f"{name}={key}" for name, key in keys.items()]
    base_env: dict[str, str | None] = {
        "KVWATCH_COLLECTOR_URL": None,
        "KVWATCH_INGEST_TOKEN": None,
        "KVWATCH_DEPLOYMENT_ID": None,
        "KVWATCH_VERIFY_TENANT_KEYS": " ".join(pairs) if keys_in_env else None,
    }
    if not keys_in_env:
        for pair in pairs:
            argv += ["--tenant-key", pair]
    r = CliRunner().invoke(app, [*argv, *args], env=base_env | (env or {}))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    report = json.loads(out.read_text()) if out.exists() else None
    return Ran(r.exit_code, r.stdout, r.stderr, report)


@contextmanager
def refengine(mode: str, keys: dict[str, str], **config: Any) -> Iterator[tuple[str, Engine]]:
    engine = Engine(EngineConfig(mode=mode, **(SIZING | config)))  # type: ignore[arg-type]
    with serve_in_thread(create_app(engine, tenant_keys=keys)) as url:
        yield f"{url}/v1", engine


def real_limit(engine: Engine) -> int:
    """The longest prompt refengine admits whole: the advertised context, and in hardened
    mode also every pool (it refuses what a pool cannot hold)."""
    cfg = engine.config
    if cfg.mode == "legacy":
        return cfg.advertised_context
    return min(cfg.advertised_context, *(p.capacity_tokens for p in engine.pools.values()))


def assert_no_keys(ran: Ran, keys: dict[str, str]) -> None:
    text = ran.stdout + ran.stderr + json.dumps(ran.report)
    for key in keys.values():
        assert key not in text


# -- refengine: the incident and its fix ------------------------------------------------------


def test_legacy_disaggregated_leaks_and_the_report_names_canary_tenants_and_length(
    tmp_path: Path,
) -> None:
    with refengine("legacy", KEYS) as (url, engine):
        ran = kvwatch_verify(url, KEYS, "--budget", "70", "--no-upload", tmp_path=tmp_path)
    assert ran.code == 1, ran.stdout + ran.stderr
    assert "FAIL" in ran.stdout and "LEAK" in ran.stdout
    rep = ran.report
    assert rep is not None
    assert rep["result"] == "fail" and rep["passed"] is False
    assert rep["verified_safe_context"] is None
    assert rep["tenants"] == list(KEYS) and rep["requests"] <= 70
    # legacy admits everything up to the advertised context: the prefill pool is not a limit
    assert rep["largest_accepted_tokens"] == real_limit(engine)
    assert rep["rejection_point"] == real_limit(engine) + 1
    assert rep["leaks"]
    pool = engine.config.prefill_pool_tokens
    probes = {p["seq"]: p for p in rep["probes"]}
    for leak in rep["leaks"]:
        assert leak["owner"] != leak["reader"] and {leak["owner"], leak["reader"]} <= set(KEYS)
        assert leak["canary"] == rep["canaries"][leak["owner"]]
        assert len(leak["fragment"]) >= 12 and leak["fragment"] in leak["canary"]
        # only prompts longer than the prefill pool read other tenants' pages
        assert pool < leak["reader_prompt_tokens"] <= engine.config.advertised_context
        probe = probes[leak["probe"]]
        assert probe["tenant"] == leak["reader"] and probe["status"] == 200
        assert probe["prompt_tokens"] == leak["reader_prompt_tokens"]
        assert probe["request_id"] == leak["request_id"]
    assert rep["smallest_leaking_prompt_tokens"] > pool
    first = rep["leaks"][0]
    assert (
        f"{first['owner']}'s canary {first['canary']} in {first['reader']}'s answer to a "
        f"{first['reader_prompt_tokens']}-token prompt"
    ) in ran.stdout
    # every pair that can leak in one round did: owners and readers span the tenants
    assert {x["owner"] for x in rep["leaks"]} == set(KEYS)
    assert_no_keys(ran, KEYS)


def test_hardened_passes_at_the_engines_real_limit_with_clean_rejections(
    tmp_path: Path,
) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}
    with refengine("hardened", keys) as (url, engine):
        ran = kvwatch_verify(url, keys, "--budget", "40", "--no-upload", tmp_path=tmp_path)
    assert ran.code == 0, ran.stdout + ran.stderr
    rep = ran.report
    assert rep is not None and rep["result"] == "pass" and rep["passed"] is True
    limit = real_limit(engine)
    assert limit < engine.config.advertised_context  # the pool binds, not the advertisement
    assert rep["verified_safe_context"] == limit
    assert rep["largest_accepted_tokens"] == limit and rep["rejection_point"] == limit + 1
    assert rep["bisection_complete"] is True and rep["cross_tenant_checked"] is True
    assert rep["findings"] == [] and rep["leaks"] == []
    assert f"verified safe context  {limit} prompt tokens" in ran.stdout
    probes = rep["probes"]
    over = [p for p in probes if p["prompt_tokens"] > limit]
    assert over and {p["phase"] for p in over} == {"sweep", "read"}
    for p in over:  # every refusal clean: OpenAI's 400, no completion
        assert (p["outcome"], p["status"], p["error_code"]) == (
            "rejected",
            400,
            "context_length_exceeded",
        )
        assert p["completion_chars"] == 0
    for p in probes:
        if p["prompt_tokens"] <= limit:
            assert p["outcome"] == "accepted"
    # both tenants read near the limit while the other planted
    reads = {(p["tenant"], p["prompt_tokens"]) for p in probes if p["phase"] == "read"}
    assert {("acme", limit), ("globex", limit)} <= reads
    assert rep["requests"] == len(probes) <= 40
    assert_no_keys(ran, keys)


# -- could not run ----------------------------------------------------------------------------


def test_endpoint_down_exits_2_and_still_writes_the_report(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    ran = kvwatch_verify(url, KEYS, "--no-upload", tmp_path=tmp_path)
    assert ran.code == 2
    assert "COULD NOT RUN" in ran.stdout and "cannot reach" in ran.stdout
    assert ran.report is not None and ran.report["result"] == "error"
    assert ran.report["requests"] == 1 and ran.report["verified_safe_context"] is None


def test_wrong_key_exits_2_naming_the_tenant_not_the_key(tmp_path: Path) -> None:
    served = {k: KEYS[k] for k in ("acme", "globex")}
    given = {"acme": KEYS["acme"], "globex": "sk-wrong-9999"}
    with refengine("hardened", served) as (url, _):
        ran = kvwatch_verify(url, given, "--no-upload", tmp_path=tmp_path)
    assert ran.code == 2
    assert "refused tenant 'globex'" in ran.stdout and "401" in ran.stdout
    assert ran.report is not None and ran.report["result"] == "error"
    assert_no_keys(ran, given)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant-key", "acme=sk-1"], "at least two --tenant-key"),
        (["--tenant-key", "acme=sk-1", "--tenant-key", "globex=sk-1"], "share one key"),
        (["--tenant-key", "acme"], "NAME=KEY"),
        (["--tenant-key", "a=sk-1", "--tenant-key", "b=sk-2", "--budget", "5"], "--budget"),
        (
            ["--tenant-key", "a=sk-1", "--tenant-key", "b=sk-2", "--canary-min-fragment", "4"],
            "--canary-min-fragment",
        ),
        (["--tenant-key", "a=sk-1", "--tenant-key", "b=sk-2", "--deployment", "bad id"], "id"),
        (["--tenant-key", "a=sk-1", "--tenant-key", "b=sk-2", "--max-context", "10"], "64"),
    ],
)
def test_bad_arguments_exit_2_before_anything_is_sent(
    args: list[str], message: str, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: sending would also fail
    ran = kvwatch_verify(url, {}, *args, "--no-upload", tmp_path=tmp_path)
    assert ran.code == 2 and message in ran.stderr
    assert ran.report is None and "synthetic" not in ran.stderr


# -- a fake upstream that misbehaves ----------------------------------------------------------

Answer = tuple[int, dict[str, Any] | str, float]  # status, body, delay before answering


class FakeUpstream:
    """A tiny OpenAI-shaped chat endpoint whose answer depends on the prompt's byte length
    (its "tokens": one per byte of the message content)."""

    def __init__(self, answer: Callable[[int, int], Answer]) -> None:
        self.answer = answer  # (prompt bytes, max_tokens) -> Answer
        self.calls = 0
        self._lock = threading.Lock()

    def handle(self, raw: bytes) -> Answer:
        with self._lock:
            self.calls += 1
        body = json.loads(raw)
        return self.answer(len(body["messages"][0]["content"].encode()), body["max_tokens"])


def ok(n: int) -> Answer:
    return (
        200,
        {
            "id": f"fake-{n}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
        },
        0.0,
    )


def refusal(n: int) -> Answer:
    err = {"message": f"too long: {n}", "type": "invalid_request_error", "param": None}
    return 400, {"error": err | {"code": "context_length_exceeded"}}, 0.0


@contextmanager
def fake_upstream(answer: Callable[[int, int], Answer]) -> Iterator[tuple[str, FakeUpstream]]:
    fake = FakeUpstream(answer)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = -1  # headers and body in one send (no Nagle / delayed-ACK stall)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status, payload, delay = fake.handle(body)
            if delay:
                time.sleep(delay)
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            # an upstream that echoes the caller's credentials back
            data = data.replace(ECHO_AUTH.encode(), self.headers.get("Authorization", "").encode())
            kind = "text/plain" if isinstance(payload, str) else "application/json"
            try:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with serve_handler(Handler) as url:
        yield f"{url}/v1", fake


@contextmanager
def serve_handler(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def fake_collector(status: int = 201, answer: str = '{"id": "v-1"}') -> Iterator[tuple[str, list]]:
    """A collector that records every verification POSTed and answers ``status`` with
    ``answer``; a run's announcement gets run 1, its end 200."""
    received: list[Any] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = -1

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code, data = status, answer.encode()
            if self.path.startswith("/v1/verification-runs"):
                code, data = (200, b"{}") if self.path.endswith("/end") else (201, b'{"id": 1}')
            else:
                received.append(json.loads(raw))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with serve_handler(Handler) as url:
        yield url, received


LIMIT = 300  # the fake's prompt limit in bytes (= its tokens)
#: The fake upstream replaces this in its answers with the request's Authorization header.
ECHO_AUTH = "<echo-authorization>"


def server_error(n: int, max_tokens: int) -> Answer:
    if n <= 200:
        return ok(n)
    return (500, "Internal Server Error", 0.0) if n <= LIMIT else refusal(n)


def slow(n: int, max_tokens: int) -> Answer:
    return ok(n) if n <= 200 else (*refusal(n)[:2], 2.0)


def partial_text(n: int, max_tokens: int) -> Answer:
    if n <= LIMIT:
        return ok(n)
    status, body, _ = refusal(n)
    assert isinstance(body, dict)
    return status, body | {"choices": [{"index": 0, "text": "partial"}]}, 0.0


def bare_refusal(n: int, max_tokens: int) -> Answer:
    return ok(n) if n <= LIMIT else (413, "<html>Request Entity Too Large</html>", 0.0)


def inconsistent(n: int, max_tokens: int) -> Answer:
    """Refuses long prompts while the sweep measures (one token asked for), answers them
    when more tokens are asked for: the limit it showed is not the one it enforces."""
    return ok(n) if n <= LIMIT or max_tokens > 1 else refusal(n)


@pytest.mark.parametrize(
    ("answer", "kind", "extra"),
    [
        (server_error, "server_error", []),
        (slow, "timeout", ["--timeout", "0.4"]),
        (partial_text, "unclean_rejection", []),
        (bare_refusal, "unclean_rejection", []),
        (inconsistent, "accepted_above_rejection", []),
    ],
)
def test_upstream_failures_are_findings_not_crashes(
    answer: Callable[[int, int], Answer], kind: str, extra: list[str], tmp_path: Path
) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}
    with fake_upstream(answer) as (url, fake):
        ran = kvwatch_verify(url, keys, "--budget", "40", "--no-upload", *extra, tmp_path=tmp_path)
    assert ran.code == 1, ran.stdout + ran.stderr
    rep = ran.report
    assert rep is not None and rep["result"] == "fail" and rep["verified_safe_context"] is None
    found = [f for f in rep["findings"] if f["kind"] == kind]
    assert found, rep["findings"]
    assert all(f["prompt_bytes"] > 200 for f in found)
    assert "FINDING" in ran.stdout and kind in ran.stdout
    assert rep["leaks"] == [] and rep["requests"] == fake.calls <= 40


def test_sweep_bisects_without_a_hint_and_respects_max_context(tmp_path: Path) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}

    def plain(n: int, max_tokens: int) -> Answer:  # refusal message states no limit
        return ok(n) if n <= LIMIT else refusal(n)

    with fake_upstream(plain) as (url, _):
        ran = kvwatch_verify(url, keys, "--budget", "50", "--no-upload", tmp_path=tmp_path)
        capped = kvwatch_verify(
            url, keys, "--budget", "50", "--max-context", "150", "--no-upload", tmp_path=tmp_path
        )
    assert ran.code == 0, ran.stdout
    assert ran.report is not None and ran.report["verified_safe_context"] == LIMIT
    assert ran.report["rejection_point"] == LIMIT + 1
    assert capped.code == 0, capped.stdout
    rep = capped.report
    assert rep is not None and rep["verified_safe_context"] == 150
    assert rep["rejection_point"] is None and rep["sweep_stopped_by"] == "max_context"
    assert max(p["prompt_tokens"] for p in rep["probes"]) == 150


def test_rate_limits_are_retried_within_the_budget_and_are_no_finding(tmp_path: Path) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}
    calls = iter(range(1, 10_000))

    def throttled(n: int, max_tokens: int) -> Answer:
        call = next(calls)
        if call in (4, 5):  # twice in a row, mid-sweep
            body = {"error": {"message": "slow down", "type": "rate_limit", "code": None}}
            return 429, body, 0.0
        return ok(n) if n <= LIMIT else refusal(n)

    with fake_upstream(throttled) as (url, fake):
        ran = kvwatch_verify(url, keys, "--budget", "50", "--no-upload", tmp_path=tmp_path)
    assert ran.code == 0, ran.stdout + ran.stderr
    rep = ran.report
    assert rep is not None and rep["verified_safe_context"] == LIMIT and rep["findings"] == []
    assert [p["outcome"] for p in rep["probes"]].count("throttled") == 2
    assert rep["requests"] == fake.calls <= 50


def echoing(n: int, max_tokens: int) -> Answer:
    """Echoes the caller's key in a clean 400 just over the limit and in a plain-text 400
    further up (an unclean refusal: a finding, so the run is uploaded)."""
    if n <= LIMIT:
        return ok(n)
    if n <= 400:
        err = {"message": f"too long for {ECHO_AUTH}", "type": "invalid_request_error"}
        return 400, {"error": err | {"code": "context_length_exceeded"}}, 0.0
    return 400, f"bad request from {ECHO_AUTH}", 0.0


def test_keys_echoed_by_the_endpoint_reach_no_output_and_no_upload(tmp_path: Path) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}
    env = {"KVWATCH_INGEST_TOKEN": "kvw_x"}
    with fake_collector() as (collector_url, uploads):
        env["KVWATCH_COLLECTOR_URL"] = collector_url
        with fake_upstream(echoing) as (url, _):
            ran = kvwatch_verify(url, keys, "--budget", "40", tmp_path=tmp_path, env=env)
        refused = (401, {"error": {"message": f"bad key {ECHO_AUTH}", "type": "auth"}}, 0.0)
        with fake_upstream(lambda n, m: refused) as (url, _):
            denied = kvwatch_verify(url, keys, "--budget", "40", tmp_path=tmp_path, env=env)
    assert ran.code == 1, ran.stdout + ran.stderr
    rep = ran.report
    assert rep is not None and rep["rejection_point"] == LIMIT + 1
    assert rep["rejection"]["error_message"] == "too long for Bearer ***"
    (unclean,) = {f["detail"] for f in rep["findings"] if f["kind"] == "unclean_rejection"}
    assert "text/plain" in unclean and "bad request" not in unclean  # no body snippet
    assert_no_keys(ran, keys)
    (uploaded,) = uploads
    assert "error_message" not in json.dumps(uploaded)
    assert denied.code == 2 and "refused tenant 'acme'" in denied.stdout
    assert "Bearer ***" in denied.stdout
    assert_no_keys(denied, keys)
    for key in keys.values():
        assert key not in json.dumps(uploads)


def test_an_endpoint_without_usage_cannot_pass(tmp_path: Path) -> None:
    """Without ``usage.prompt_tokens`` byte counts would stand in for tokens."""
    keys = {k: KEYS[k] for k in ("acme", "globex")}

    def no_usage(n: int, max_tokens: int) -> Answer:
        if n > LIMIT:
            return refusal(n)
        status, body, delay = ok(n)
        assert isinstance(body, dict)
        return status, {k: v for k, v in body.items() if k != "usage"}, delay

    with fake_collector() as (collector_url, uploads), fake_upstream(no_usage) as (url, _):
        env = {"KVWATCH_COLLECTOR_URL": collector_url, "KVWATCH_INGEST_TOKEN": "kvw_x"}
        ran = kvwatch_verify(url, keys, "--budget", "40", tmp_path=tmp_path, env=env)
    assert ran.code == 2, ran.stdout + ran.stderr
    assert "COULD NOT RUN" in ran.stdout and "usage.prompt_tokens" in ran.stdout
    assert f"largest accepted       {LIMIT} bytes (tokens unknown)" in ran.stdout
    rep = ran.report
    assert rep is not None and rep["result"] == "error" and rep["passed"] is False
    assert rep["verified_safe_context"] is None and "usage.prompt_tokens" in rep["error"]
    assert uploads == []


@pytest.mark.parametrize("answer", ["created", "[1, 2]", '"v-1"'])
def test_a_201_that_is_not_a_json_object_is_an_upload_failure(answer: str, tmp_path: Path) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}

    def plain(n: int, max_tokens: int) -> Answer:
        return ok(n) if n <= LIMIT else refusal(n)

    with fake_collector(201, answer) as (collector_url, uploads), fake_upstream(plain) as (url, _):
        env = {"KVWATCH_COLLECTOR_URL": collector_url, "KVWATCH_INGEST_TOKEN": "kvw_x"}
        ran = kvwatch_verify(url, keys, "--budget", "40", tmp_path=tmp_path, env=env)
    assert ran.code == 2, ran.stdout + ran.stderr
    assert "PASS" in ran.stdout and "upload failed" in ran.stderr and "201" in ran.stderr
    assert len(uploads) == 1
    assert ran.report is not None and ran.report["upload"]["ok"] is False
    assert ran.report["upload"]["verification_id"] is None


# -- the collector ----------------------------------------------------------------------------


def test_upload_reaches_the_collector_tied_to_the_engine_config(
    collector: Collector, tmp_path: Path
) -> None:
    deployment = "verify-lab"
    keys = {k: KEYS[k] for k in ("acme", "globex")}
    token = collector.token("ingest", deployment_id=deployment)
    probe = Probe(
        ProbeSettings(
            collector_url=collector.url,
            ingest_token=token,
            deployment_id=deployment,
            probe_flush_interval_s=0.05,
        )
    )
    try:
        with refengine("hardened", keys) as (url, engine):
            attach(engine, probe)  # the engine reports its config, as a deployed probe does
            assert probe.force_flush(20)
            ran = kvwatch_verify(
                url,
                keys,
                "--budget",
                "40",
                "--deployment",
                deployment,
                tmp_path=tmp_path,
                env={"KVWATCH_COLLECTOR_URL": collector.url, "KVWATCH_INGEST_TOKEN": token},
            )
    finally:
        probe.shutdown(5)
    assert ran.code == 0, ran.stdout + ran.stderr
    assert "uploaded: verification" in ran.stderr
    with collector.client(collector.admin) as http:
        r = http.get("/v1/verifications", params={"deployment_id": deployment})
    assert r.status_code == 200, r.text
    (record,) = r.json()
    limit = real_limit(engine)
    assert record["passed"] is True and record["model_id"] == MODEL
    assert record["verified_safe_context"] == limit
    # the collector tied it to the engine's reported settings
    assert record["pool_capacity_tokens"] == engine.config.prefill_pool_tokens
    assert record["engine_version"] == engine.info()["engine_version"]
    with collector.client(collector.admin) as http:
        ev = http.get(record["links"]["self"]).json()["evidence"]
    assert ev["tool"] == "kvwatch verify" and ev["rejection_point"] == limit + 1
    assert ev["leaks"] == 0 and ev["findings"] == 0 and ev["tenants"] == list(keys)
    assert ran.report is not None
    assert ran.report["upload"]["ok"] is True
    assert ran.report["upload"]["verification_id"] == record["id"]
    assert token not in json.dumps(record) + ran.stdout + ran.stderr
    # it announced itself before its first prompt, with its tenants, and the record ended it
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            (run,) = conn.execute(select(m.VerificationRun)).all()
    finally:
        db.dispose()
    assert run.deployment_id == deployment and json.loads(run.tenants) == sorted(keys)
    assert run.verification_id == record["id"] and run.finished_at is not None
    assert "could not announce" not in ran.stderr


def test_a_failed_upload_after_a_pass_exits_2_with_the_result_printed(tmp_path: Path) -> None:
    keys = {k: KEYS[k] for k in ("acme", "globex")}
    down = f"http://127.0.0.1:{free_port()}"
    with refengine("hardened", keys) as (url, _):
        ran = kvwatch_verify(
            url,
            keys,
            "--budget",
            "40",
            tmp_path=tmp_path,
            env={"KVWATCH_COLLECTOR_URL": down, "KVWATCH_INGEST_TOKEN": "kvw_x"},
            keys_in_env=True,  # KVWATCH_VERIFY_TENANT_KEYS, space-separated
        )
    assert ran.code == 2
    assert "PASS" in ran.stdout and "upload failed" in ran.stderr
    assert ran.report is not None and ran.report["upload"]["ok"] is False
    assert ran.report["tenants"] == list(keys)


# -- the parts --------------------------------------------------------------------------------


def test_classify_tells_clean_refusals_from_unclean_ones() -> None:
    h = httpx.Headers({"x-request-id": "r1"})
    clean = json.dumps(
        {"error": {"message": "too long", "type": "invalid_request_error", "code": None}}
    )
    assert classify(400, h, clean.encode(), 0).outcome is Outcome.REJECTED
    flat = json.dumps({"object": "error", "message": "too long", "code": 400})
    assert classify(400, h, flat.encode(), 0).outcome is Outcome.UNCLEAN_REJECTION
    with_text = json.loads(clean) | {"choices": [{"text": "partial"}]}
    r = classify(400, h, json.dumps(with_text).encode(), 0)
    assert r.outcome is Outcome.UNCLEAN_REJECTION and "completion" in (r.detail or "")
    assert classify(401, h, clean.encode(), 0).outcome is Outcome.AUTH_REFUSED
    assert classify(429, h, clean.encode(), 0).outcome is Outcome.THROTTLED
    assert classify(502, h, b"bad gateway", 0).outcome is Outcome.SERVER_ERROR
    assert classify(200, h, b"<html>", 0).outcome is Outcome.MALFORMED
    done = classify(200, h, json.dumps(ok(5)[1]).encode(), 0)
    assert done.outcome is Outcome.ACCEPTED and done.text == "fine" and done.prompt_tokens == 5


def test_leak_matcher_finds_fragments_of_other_tenants_only() -> None:
    canaries = new_canaries(["a", "b", "c"], 12)
    assert len(set(canaries.values())) == 3
    m = LeakMatcher(canaries, 12)
    text_a = TenantText(canaries["a"]).text(200)
    assert m.find("a", text_a) == []  # one's own text is no leak
    (hit,) = m.find("b", "xx" + text_a[3:40] + "yy")
    assert hit.owner == "a" and hit.canary == canaries["a"] and len(hit.fragment) >= 12
    assert m.find("b", canaries["a"][:11]) == []  # shorter than the fragment length


def test_redact_url_drops_credentials() -> None:
    url = "https://user:secret@api.example.com:8443/v1?api-key=sk-1&api-version=2024"
    assert redact_url(url) == ("https://api.example.com:8443/v1?api-key=REDACTED&api-version=2024")


@pytest.mark.parametrize(
    ("body", "clean"),
    [
        ({"error": {"message": "too long", "type": "invalid_request_error", "code": "x"}}, True),
        # vLLM's and SGLang's older flat error object
        ({"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}, True),
        ({"detail": "too long"}, False),
        ({"message": "too long"}, False),
    ],
)
def test_error_shapes_that_count_as_a_clean_refusal(body: dict[str, Any], clean: bool) -> None:
    reply = classify(400, httpx.Headers(), json.dumps(body).encode(), 0.01)
    assert (reply.outcome == Outcome.REJECTED) is clean, reply
