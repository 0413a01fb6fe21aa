"""The limit in force is one decision (policies.limits) that every part reports and obeys.

The scenario that broke it: a verification passes at 8,000 tokens, then the deployment is
redeployed with a prefill pool of 4,096. Through real processes (the collector, the reference
engine, the gateway in front of it), every part must then say the same limit and source, and
the gateway must refuse a prompt one token over it. A property test then checks, over random
fact histories, that what is served and what a guard adds agree with the one function."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from collector import migrate
from collector.db import Database
from collector.rollups.refresh import RollupRefresher
from kvwatch.embedded import free_port
from policies.facts import DeploymentFacts, NodeConfig, VerificationFact
from policies.limits import (
    LIMIT_SOURCES,
    LimitInForce,
    from_json,
    limit_in_force,
    with_configured,
)
from tests.conftest import make_token

MODEL = "refengine-lab"
DEP = "lab-redeploy"
KEY = "sk-acme-redeploy"


# -- through real processes --------------------------------------------------------------------


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 90.0) -> Any:
    """``check()``'s first truthy answer (an HTTP error counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            last = check()
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def _process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvwatch.cli", *args], env=env, stdout=out, stderr=out
        )
        try:
            yield proc
        finally:
            proc.terminate()  # SIGTERM: the engine's probe flushes what it holds
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _engine(pool_tokens: int, port: int) -> list[str]:
    return [
        "engine",
        "serve",
        "--mode",
        "hardened",
        "--topology",
        "monolithic",
        "--deployment",
        DEP,
        "--advertised-context",
        "8192",
        "--pool-tokens",
        str(pool_tokens),
        "--tenant-key",
        f"acme={KEY}",
        "--port",
        str(port),
    ]


def _metric(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


@pytest.mark.slow
def test_after_a_redeploy_with_a_smaller_pool_every_part_says_and_enforces_one_limit(
    tmp_path: Path,
) -> None:
    db_url = f"sqlite:///{tmp_path / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    admin, ingest = make_token(db_url, "admin"), make_token(db_url, "ingest")
    cport, eport, gport = free_port(), free_port(), free_port()
    collector_url = f"http://127.0.0.1:{cport}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    env = base | {
        "KVWATCH_DATABASE_URL": db_url,
        "KVWATCH_COLLECTOR_URL": collector_url,
        "KVWATCH_INGEST_TOKEN": ingest,
        "KVWATCH_PROBE_FLUSH_INTERVAL_S": "0.1",
        "KVWATCH_POLICY_TIMER_S": "0.5",
        "KVWATCH_GATEWAY_VERIFICATION_REFRESH_S": "0.3",
        "PYTHONUNBUFFERED": "1",
    }
    h = httpx.Client(base_url=collector_url, headers={"Authorization": f"Bearer {admin}"})
    engine_url = f"http://127.0.0.1:{eport}"
    gateway_url = f"http://127.0.0.1:{gport}"

    def served() -> dict[str, Any] | None:
        got = h.get("/v1/limits", params={"deployment_id": DEP}).json()["limits"]
        return got[0] if got else None

    def complete(n_tokens: int) -> httpx.Response:
        # refengine's tokenizer is bytes: an n-byte prompt is n prompt tokens
        return httpx.post(
            f"{gateway_url}/v1/completions",
            json={"model": MODEL, "prompt": "x" * n_tokens, "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )

    with contextlib.ExitStack() as stack:
        stack.enter_context(_process(["serve", "--port", str(cport)], env, tmp_path / "c.log"))
        _wait("the collector", lambda: h.get("/readyz").status_code == 200)
        engine = stack.enter_context(_process(_engine(8192, eport), env, tmp_path / "e1.log"))
        _wait("the engine", lambda: httpx.get(f"{engine_url}/health").status_code == 200)
        _wait("the engine's config", lambda: (s := served()) and s["tokens"] == 8192)

        # a verification passes at 8,000 tokens on the 8,192-token pool
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": DEP,
                "model_id": MODEL,
                "passed": True,
                "verified_safe_context": 8000,
                "pool_capacity_tokens": 8192,
            },
        )
        assert r.status_code == 201, r.text
        first = _wait("the verified limit", lambda: (s := served()) and s["tokens"] == 8000 and s)
        assert (first["source"], first["stale"]) == ("verified", False)

        stack.enter_context(
            _process(
                [
                    "gateway",
                    "--upstream",
                    engine_url,
                    "--port",
                    str(gport),
                    "--deployment",
                    DEP,
                    "--tenant-key",
                    f"acme={KEY}",
                ],
                env,
                tmp_path / "g.log",
            )
        )
        _wait("the gateway", lambda: httpx.get(f"{gateway_url}/healthz").status_code == 200)
        held = _wait(
            "the gateway to hold the verified limit",
            lambda: (r := complete(10)).headers.get("x-kvwatch-safe-context") == "8000" and r,
        )
        assert held.headers["x-kvwatch-safe-context-source"] == "verified"

        # the redeploy: the same engine, its prefill pool halved
        engine.terminate()
        engine.wait(30)
        stack.enter_context(_process(_engine(4096, eport), env, tmp_path / "e2.log"))
        _wait("the new engine", lambda: httpx.get(f"{engine_url}/health").status_code == 200)
        limit = _wait("the new limit", lambda: (s := served()) and s["tokens"] == 4096 and s)
        assert limit["source"] == "pool" and limit["stale"] and not limit["verified"]
        kinds = {x["kind"] for x in limit["stale_reasons"]}
        assert kinds == {"drift", "pool_below_verified"}, limit
        assert limit["verification_id"] == r.json()["id"]
        text = limit["text"]
        assert text.startswith("4,096 tokens (not verified") and "STALE" in text

        # the gateway: what it holds, and a prompt one token over it refused before the engine
        _wait(
            "the gateway to hold the new limit",
            lambda: complete(10).headers.get("x-kvwatch-safe-context") == "4096",
        )
        over = complete(4097)
        assert over.status_code == 400, over.text
        assert over.json()["error"]["code"] == "context_length_exceeded"
        assert "4096 tokens" in over.json()["error"]["message"]
        assert over.headers["x-kvwatch-safe-context-source"] == "pool"
        near = complete(3500)  # 85% of 4,096: answered, and the rule's warning
        assert near.status_code == 200, near.text
        gw_metrics = httpx.get(f"{gateway_url}/metrics").text
        assert _metric(gw_metrics, "kvwatch_gateway_limit_tokens", model=MODEL) == [
            ({"model": MODEL, "source": "pool"}, 4096.0)
        ]

        # the rule: context_pressure measured the 3,500-token prompt against the same limit
        def pressure() -> dict[str, Any] | None:
            alerts = h.get("/v1/alerts", params={"deployment_id": DEP}).json()
            return next((a for a in alerts if a["rule"] == "context_pressure"), None)

        alert = _wait("the context_pressure alert", pressure)
        notes = alert["annotations"]
        assert (notes["safe_context_tokens"], notes["limit_source"]) == ("4096", "pool")
        assert notes["limit"] == text and alert["labels"]["verified"] == "false"

        # the limits card (JSON, Markdown) and the fleet
        card = h.get(f"/v1/deployments/{DEP}/limits-card").json()
        (mod,) = card["models"]
        same = ("tokens", "source", "stale", "stale_reasons", "verification_id", "text")
        assert {k: mod["limit_in_force"][k] for k in same} == {k: limit[k] for k in same}
        assert mod["stale"] is True and mod["verdict"]["status"] == "stale"
        md = h.get(f"/v1/deployments/{DEP}/limits-card", params={"format": "md"}).text
        assert f"Limit in force: **{text}**" in md
        (dep,) = [d for d in h.get("/v1/fleet").json()["deployments"] if d["deployment_id"] == DEP]
        assert dep["models"][0]["limit_in_force"]["text"] == text and dep["status"] == "red"

        # /metrics
        metrics = h.get("/metrics").text
        assert _metric(metrics, "kvwatch_deployment_safe_context_tokens", deployment=DEP) == [
            (
                {
                    "deployment": DEP,
                    "model": MODEL,
                    "verified": "false",
                    "source": "pool",
                    "stale": "true",
                },
                4096.0,
            )
        ]

        # the breach report of the window, the quarterly review and the dashboard's line
        now = datetime.now(UTC)
        window = {"since": (now - timedelta(hours=1)).isoformat(), "until": now.isoformat()}
        body = {"kind": "breach", "model_id": MODEL, "deployment_id": DEP} | window
        # 409: a request of the window arrived while the report was built (the probes flush
        # on their own schedule), and the collector refuses a report that no longer matches
        # the database; generating it again is what its message asks
        r = _wait(
            "a breach report of a settled window",
            lambda: (r := h.post("/v1/reports", json=body)).status_code != 409 and r,
        )
        assert r.status_code == 201, r.text
        report = h.get(f"/v1/reports/{r.json()['report_id']}").json()
        (section,) = [d for d in report["deployments"] if d["deployment_id"] == DEP]
        assert (section["safe_context"], section["safe_context_source"]) == (4096, "pool")
        assert section["limit"] == text
        review = h.get("/v1/review", params={"deployment_id": DEP}).json()
        rows = [x for x in review["rows"] if x["model_id"] == MODEL]
        assert rows and {(x["safe_context"], x["limit_source"], x["limit"]) for x in rows} == {
            (4096, "pool", text)
        }
        # the dashboard's line, once the rollups have the requests: brought up to date here by
        # the collector's own refresher, as its first pass does (its periodic pass recomputes
        # the open bucket at most once a minute: a minute of waiting that proves nothing here)
        db = Database(db_url)
        try:
            RollupRefresher(db).refresh(everything=True)
        finally:
            db.dispose()
        (line,) = _wait(
            "the dashboard's threshold line",
            lambda: h.get("/v1/stats/prompt-tokens", params=window | {"deployment_id": DEP}).json()[
                "thresholds"
            ],
        )
        assert (line["safe_context"], line["source"], line["limit"]) == (4096, "pool", text)


# -- every consumer agrees with the one function ---------------------------------------------

T0 = datetime(2026, 6, 1, tzinfo=UTC)


@st.composite
def histories(draw: st.DrawFn) -> tuple[DeploymentFacts, datetime]:
    pools = draw(st.lists(st.integers(1, 20_000), min_size=0, max_size=3))
    advertised = draw(st.integers(1, 20_000))
    configs = {
        f"n{i}": NodeConfig(
            deployment_id="d",
            node=f"n{i}",
            role=draw(st.sampled_from(["both", "prefill", "decode"])),
            engine="refengine",
            engine_version=draw(st.sampled_from(["1", "2"])),
            model_id="m",
            advertised_context=advertised,
            pool_capacity_tokens=pool,
            dtype="bfloat16",
            quantization=None,
            tp_size=1,
            cuda_graphs=False,
            disaggregated=False,
            prefix_caching=False,
            prefix_cache_salting=False,
            ts=T0,
        )
        for i, pool in enumerate(pools)
    }

    def verification(vid: int, result: str) -> VerificationFact:
        return VerificationFact(
            deployment_id="d",
            model_id="m",
            passed=result == "pass",
            verified_safe_context=draw(st.integers(1, 20_000)) if result == "pass" else None,
            engine_version=draw(st.sampled_from([None, "1", "2"])),
            pool_capacity_tokens=draw(st.sampled_from([None, *pools])) if pools else None,
            quantization=None,
            tp_size=None,
            cuda_graphs=None,
            verified_at=T0 + timedelta(days=vid),
            verification_id=vid,
            result=result,  # type: ignore[arg-type]
            leaks=1 if result == "fail" else 0,
            smallest_leaking_prompt=draw(st.none() | st.integers(1, 20_000))
            if result == "fail"
            else None,
        )

    results = draw(st.lists(st.sampled_from(["pass", "fail", "error"]), max_size=4))
    history = [verification(i + 1, r) for i, r in enumerate(results)]
    latest = {"m": history[-1]} if history else {}
    passing = [v for v in history if v.verdict == "pass"]
    decided = [v for v in history if v.verdict != "error"]
    facts = DeploymentFacts(
        deployment_id="d",
        configs=configs,
        verifications=latest,
        passing={"m": passing[-1]} if passing else {},
        decided={"m": decided[-1]} if decided else {},
        max_verification_age_s=draw(st.none() | st.sampled_from([86400.0, 30 * 86400.0])),
    )
    return facts, T0 + timedelta(days=draw(st.integers(0, 60)))


@settings(max_examples=300, deadline=None)
@given(histories(), st.none() | st.integers(1, 20_000))
def test_what_is_served_and_what_a_guard_adds_agree_with_the_one_function(
    history: tuple[DeploymentFacts, datetime], configured: int | None
) -> None:
    """The served form decodes to the same decision (the gateway's copy is the collector's),
    a guard's configured limit added to a served decision is the decision made with it, and
    the invariants of LimitInForce hold."""
    from kvwatch.gateway.limits import SafeContexts

    facts, now = history
    lim = limit_in_force(facts, "m", now)
    assert from_json(lim.as_json()) == lim
    assert lim.source in LIMIT_SOURCES
    assert (lim.tokens is None) == (lim.source == "none")
    if lim.tokens == 0:
        assert lim.source == "failed-verification"
    if lim.stale:
        assert lim.verified_safe_context is not None and not lim.verified
    passing = facts.passing.get("m")
    if lim.source == "verified" and passing is not None and not lim.stale:
        assert lim.tokens == passing.verified_safe_context
    if lim.source != "failed-verification" and passing is not None and lim.tokens is not None:
        # a verification, stale or not, never lets more through than it measured
        assert lim.tokens <= (passing.verified_safe_context or lim.tokens)

    decided = limit_in_force(facts, "m", now, configured=configured)
    joined = with_configured(from_json(lim.as_json()), configured)
    assert (joined.tokens, joined.source, joined.without_failure) == (
        decided.tokens,
        decided.source,
        decided.without_failure,
    )

    guard = SafeContexts({"m": configured} if configured else {})
    guard.set_served({"m": from_json(lim.as_json())})
    got = guard.limit("m")
    if decided.tokens is None:
        assert got is None
    else:
        assert got is not None and (got.tokens, got.source) == (decided.tokens, decided.source)


def test_a_served_limit_of_another_version_is_refused_not_guessed() -> None:
    """The gateway decodes what the collector serves strictly: a limit it cannot read is
    an error (it keeps the last one it could), never a half-read value."""
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        from_json({"deployment_id": "d", "model_id": "m", "tokens": "lots", "source": "pool"})
    with pytest.raises(msgspec.ValidationError):
        from_json({"deployment_id": "d", "model_id": "m", "tokens": 5, "source": "vibes"})
    assert isinstance(
        from_json({"deployment_id": "d", "model_id": "m", "tokens": 5, "source": "pool", "x": 1}),
        LimitInForce,
    )
