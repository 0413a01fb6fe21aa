"""Every verification verdict has consequences, through real HTTP: ``kvwatch verify`` against
a real refengine uploads to a real collector; the fleet, the critical alert and its webhook,
the incident, the limits card (JSON, Markdown, PDF read back) and a real gateway in front of
the engine all follow the verdict, and a later passing verification undoes what it must."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pypdf
import pytest

from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.timefmt import to_micros
from kvwatch.embedded import serve_in_thread
from kvwatch.gateway import GatewaySettings, create_app
from tests.conftest import Collector
from tests.pdf_helpers import assert_renders
from tests.test_alerts_api import Receiver
from tests.test_verify import KEYS, MODEL, kvwatch_verify, refengine

PAIR = {k: KEYS[k] for k in ("acme", "globex")}


def _verify(collector: Collector, url: str, deployment: str, tmp_path: Path) -> int:
    token = collector.token("ingest", deployment_id=deployment)
    ran = kvwatch_verify(
        url,
        PAIR,
        "--budget",
        "60",
        "--deployment",
        deployment,
        tmp_path=tmp_path,
        env={"KVWATCH_COLLECTOR_URL": collector.url, "KVWATCH_INGEST_TOKEN": token},
    )
    assert "uploaded: verification" in ran.stderr, ran.stdout + ran.stderr
    return ran.code


def _fleet_entry(http: httpx.Client, deployment: str) -> dict[str, Any]:
    r = http.get("/v1/fleet")
    assert r.status_code == 200, r.text
    (entry,) = [d for d in r.json()["deployments"] if d["deployment_id"] == deployment]
    return dict(entry)


def _alert(http: httpx.Client, deployment: str) -> dict[str, Any]:
    r = http.get("/v1/alerts", params={"rule": "verification_failed", "deployment_id": deployment})
    assert r.status_code == 200, r.text
    (a,) = r.json()
    return dict(a)


def _pdf_text(pdf: bytes) -> str:
    return "\n".join(p.extract_text() for p in pypdf.PdfReader(io.BytesIO(pdf)).pages)


@pytest.fixture
def receiver(collector: Collector) -> Iterator[Receiver]:
    rx = Receiver()
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            _, rx.secret = add_endpoint(conn, "secops", rx.url, now_us=to_micros(datetime.now(UTC)))
        yield rx
    finally:
        db.dispose()
        rx.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_leaking_verification_reaches_everything_and_a_pass_undoes_it(
    collector: Collector, receiver: Receiver, tmp_path: Path
) -> None:
    deployment = "hosted-glm"  # watched only from outside: no probe ever reports it
    http = collector.client(collector.admin)
    with refengine("legacy", PAIR) as (legacy_url, _):
        started = time.monotonic()
        assert _verify(collector, legacy_url, deployment, tmp_path) == 1
        got = receiver.wait(
            lambda g: any(
                x["type"] == "alert.firing" and x["alerts"][0]["rule"] == "verification_failed"
                for x in g
            )
        )
        delivered_s = time.monotonic() - started
        assert receiver.bad == []

        # -- the alert, its webhook and the incident --------------------------------------
        a = _alert(http, deployment)
        assert (a["state"], a["severity"]) == ("firing", "critical")
        assert a["labels"]["model_id"] == MODEL
        notes = a["annotations"]
        assert set(notes["leak_pairs"].split()) <= {"acme->globex", "globex->acme"}
        assert notes["leak_pairs"] != "none"
        smallest = int(notes["smallest_leaking_prompt_tokens"])
        # the verification's own day (read back: a sweep may end just before midnight)
        (stored,) = [
            v
            for v in http.get("/v1/verifications", params={"deployment_id": deployment}).json()
            if str(v["id"]) == notes["verification_id"]
        ]
        assert notes["summary"].endswith(
            f"UNSAFE: cross-tenant leak at ≥ {smallest:,} tokens on "
            f"{stored['verified_at'][:10]}, verification {notes['verification_id']}"
        )
        assert "kvwatch report breach" in notes["runbook"]
        assert "KVW-" not in str(a)  # never a canary's text
        firing = next(x for x in got if x["type"] == "alert.firing")
        assert firing["alerts"][0]["annotations"]["leak_pairs"] == notes["leak_pairs"]
        incidents = http.get("/v1/incidents").json()
        (incident,) = [i for i in incidents if i["deployment_id"] == deployment]
        assert incident["state"] == "open" and incident["cause_rule"] == "verification_failed"
        assert a["incident_id"] == incident["id"]

        # -- the fleet and the limits card -----------------------------------------------
        entry = _fleet_entry(http, deployment)
        assert entry["status"] == "red"
        assert any(r.startswith(f"{MODEL}: UNSAFE: cross-tenant leak") for r in entry["reasons"])
        (model,) = entry["models"]
        assert model["verdict"]["status"] == "unsafe"
        card = http.get(f"/v1/deployments/{deployment}/limits-card").json()
        (cm,) = card["models"]
        assert cm["verdict"]["text"] == notes["summary"].split(": ", 1)[1]
        assert cm["latest_verification"]["smallest_leaking_prompt_tokens"] == smallest
        md = http.get(f"/v1/deployments/{deployment}/limits-card", params={"format": "md"}).text
        assert "**UNSAFE: cross-tenant leak at ≥" in md
        r = http.get(f"/v1/deployments/{deployment}/limits-card", params={"format": "pdf"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/pdf"
        assert_renders(r.content)
        text = _pdf_text(r.content)
        assert "UNSAFE: cross-tenant leak at" in text and f"{smallest:,} tokens" in text
        assert "acme->globex" in text or "globex->acme" in text

        # -- the gateway in front of the engine refuses: nothing ever passed --------------
        settings = GatewaySettings(
            gateway_upstream=legacy_url,
            gateway_tenant_keys=PAIR,
            collector_url=collector.url,
            ingest_token=collector.token("ingest", deployment_id=deployment),
            deployment_id=deployment,
        )
        with serve_in_thread(create_app(settings)) as gw:
            r = httpx.post(
                f"{gw}/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                headers={"Authorization": f"Bearer {PAIR['acme']}"},
                timeout=30,
            )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert "latest verification found it unsafe" in r.json()["error"]["message"]
        assert r.headers["x-kvwatch-safe-context"] == "0"
        assert r.headers["x-kvwatch-safe-context-source"] == "failed-verification"
        assert "UNSAFE: cross-tenant leak at >=" in r.headers["x-kvwatch-warning"]

    # -- a passing verification of the fixed engine resolves the alert ---------------------
    with refengine("hardened", PAIR) as (hardened_url, engine):
        assert _verify(collector, hardened_url, deployment, tmp_path) == 0
        a = _alert(http, deployment)
        assert a["state"] == "resolved"
        entry = _fleet_entry(http, deployment)
        (model,) = entry["models"]
        assert model["verdict"]["status"] == "verified"
        safe = model["verified_safe_context"]
        assert safe and not any("UNSAFE" in r for r in entry["reasons"])
        card = http.get(f"/v1/deployments/{deployment}/limits-card", params={"format": "md"}).text
        assert f"**verified safe context {safe:,} tokens on" in card and "UNSAFE" not in card
        settings = GatewaySettings(
            gateway_upstream=hardened_url,
            gateway_tenant_keys=PAIR,
            gateway_tokenizer="bytes",
            collector_url=collector.url,
            ingest_token=collector.token("ingest", deployment_id=deployment),
            deployment_id=deployment,
        )
        with serve_in_thread(create_app(settings)) as gw:
            auth = {"Authorization": f"Bearer {PAIR['acme']}"}
            ok = httpx.post(
                f"{gw}/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                headers=auth,
                timeout=30,
            )
            near = httpx.post(
                f"{gw}/v1/completions",
                json={"model": MODEL, "prompt": "x" * int(safe * 0.9), "max_tokens": 4},
                headers=auth,
                timeout=30,
            )
            over = httpx.post(
                f"{gw}/v1/completions",
                json={"model": MODEL, "prompt": "x" * (safe + 1), "max_tokens": 4},
                headers=auth,
                timeout=30,
            )
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-kvwatch-safe-context"] == str(safe)
    assert ok.headers["x-kvwatch-safe-context-source"] == "verified"
    assert "x-kvwatch-warning" not in ok.headers
    assert near.status_code == 200, near.text
    assert "90% of the verified safe context" in near.headers["x-kvwatch-warning"]
    assert over.status_code == 400
    assert f"verified safe context is {safe} tokens" in over.json()["error"]["message"]
    assert engine.info()["engine_version"]
    http.close()
    print(f"leaking verification -> webhook delivery: {delivered_s:.2f} s")


@pytest.mark.parametrize("on_failed", ["refuse", "warn"])
def test_after_a_failure_the_gateway_holds_below_the_leak_or_only_warns(
    collector: Collector, on_failed: str
) -> None:
    """A pass at 800 tokens, then a leak at 600: ``refuse`` holds prompts below 600 (the
    source says why), ``warn`` keeps the verified 800 and says so on every answer. A model
    held to the configured limit is never called verified."""
    deployment = "gw-after-failure"
    admin = collector.client(collector.admin)
    for passed, extra in (
        (True, {"verified_safe_context": 800, "evidence": {"result": "pass"}}),
        (
            False,
            {
                "evidence": {
                    "result": "fail",
                    "leaks": 2,
                    "leak_pairs": ["acme->globex"],
                    "smallest_leaking_prompt_tokens": 600,
                }
            },
        ),
    ):
        r = admin.post(
            "/v1/verifications",
            json={"deployment_id": deployment, "model_id": MODEL, "passed": passed, **extra},
        )
        assert r.status_code == 201, r.text
        time.sleep(0.01)  # the second is the newer
    admin.close()
    with refengine("hardened", PAIR, advertised_context=4096, pool_tokens=2048) as (url, _):
        settings = GatewaySettings(
            gateway_upstream=url,
            gateway_tenant_keys=PAIR,
            gateway_safe_contexts={"*": 1000},
            gateway_on_failed_verification=on_failed,  # type: ignore[arg-type]
            collector_url=collector.url,
            ingest_token=collector.token("ingest", deployment_id=deployment),
            deployment_id=deployment,
        )
        auth = {"Authorization": f"Bearer {PAIR['acme']}"}
        with serve_in_thread(create_app(settings)) as gw:
            r = httpx.post(
                f"{gw}/v1/completions",
                json={"model": MODEL, "prompt": "x" * 650, "max_tokens": 4},
                headers=auth,
                timeout=30,
            )
            other = httpx.post(
                f"{gw}/v1/completions",
                json={"model": "another-model", "prompt": "x" * 10, "max_tokens": 4},
                headers=auth,
                timeout=30,
            )
    assert "UNSAFE: cross-tenant leak at >= 600 tokens" in r.headers["x-kvwatch-warning"]
    if on_failed == "refuse":
        assert r.status_code == 400, r.text
        assert r.headers["x-kvwatch-safe-context"] == "599"
        assert r.headers["x-kvwatch-safe-context-source"] == "failed-verification"
        message = r.json()["error"]["message"]
        assert "latest verification of this model failed" in message and "599 tokens" in message
    else:
        assert r.status_code == 200, r.text
        assert r.headers["x-kvwatch-safe-context"] == "800"
        assert r.headers["x-kvwatch-safe-context-source"] == "verified"
    # refengine answers 404 for a model it does not serve; the guard's headers still say
    # which limit held the request: the configured one, never called verified
    assert other.status_code == 404, other.text
    assert other.headers["x-kvwatch-safe-context"] == "1000"
    assert other.headers["x-kvwatch-safe-context-source"] == "configured"
