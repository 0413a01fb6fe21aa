"""A real collector seeded for the dashboard tests: two deployments with traffic spread over
the last 12 hours (inside every page's default 24-hour window), a verification each, a
cross-tenant stale read that opens an incident, and the rollups brought up to date.

Both dashboard test modules use it; the figures the tests check are the constants here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from engine_probe import events as ev
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token

RED = "glm-prod"
GREEN = "llama-staging"
RED_MODEL = "glm-5.3"
GREEN_MODEL = "llama-3.1-70b"
RED_SAFE = 600_000  # verified safe context of glm-5.3 on glm-prod
GREEN_SAFE = 131_072
NEAR_REQUEST = "r-near"  # 540,000 tokens: 90% of RED_SAFE, the top of the near-threshold list
NEAR_PROMPT = 540_000
# GREEN_MODEL's traffic: 12 prompts of 2,000 + 3,000 i tokens (g-0 .. g-11), and two more
# requests sharing g-0's prompt: 14 requests, 12 prompts
GREEN_SHARING = ("g-0-1", "g-0-2")
GREEN_PROMPT_TOKENS = sum(2_000 + 3_000 * i for i in range(12))
TENANT = "globex"  # the tenant-scoped token's tenant: the stale read's reader
OTHERS = ("acme", "initech")  # tenants a globex token must never see


@dataclass
class Seeded:
    url: str
    db_url: str
    admin: str
    read: str
    tenant: str
    incident_id: int


# Per probe: how long before now its newest event lies, and the spacing of its events. The
# stale read and the rejected prompt fall within the last hour; most traffic lies further back.
_SPREAD = {
    "probe-red": (timedelta(minutes=20), timedelta(seconds=380)),
    "probe-green": (timedelta(minutes=25), timedelta(seconds=900)),
}


def _events(now: datetime) -> list[dict[str, Any]]:
    """Two probes' batches, each spread evenly over the ~10 hours before ``now``."""
    t = now
    out: list[ev.Event] = []
    seq = 0

    def nxt() -> tuple[int, datetime]:
        nonlocal seq
        seq += 1
        return seq, t  # the time is set by _spread

    red = {"probe": "probe-red", "dep": RED}
    s, ts = nxt()
    out.append(f.config(s, ts=ts, **red))
    s, ts = nxt()
    out.append(f.config(s, ts=ts, role="decode", node="decode-0", pool_tokens=2_000_000, **red))
    prompts = [1_200, 8_000, 32_000, 64_000, 120_000, 250_000, 410_000, 505_000]
    tenants = ["acme", "globex", "initech"]
    routes = ["/v1/chat/completions", "/v1/completions"]
    for i in range(24):
        s, ts = nxt()
        used = 40_000 + (i * 37_000) % 600_000
        out.append(f.pool(s, used=used, node="prefill-0", role="prefill", ts=ts, **red))
        s, ts = nxt()
        out.append(
            f.pool(s, used=used // 2, cap=2_000_000, node="decode-0", role="decode", ts=ts, **red)
        )
        rid = f"r-{i}"
        tenant = tenants[i % 3]
        route = routes[i % 2]
        s, ts = nxt()
        out.append(
            f.admitted(s, rid, tenant=tenant, prompt=prompts[i % 8], route=route, ts=ts, **red)
        )
        s, ts = nxt()
        out.append(f.finished(s, rid, tenant=tenant, route=route, ts=ts, **red))
    s, ts = nxt()
    out.append(f.admitted(s, NEAR_REQUEST, tenant="acme", prompt=NEAR_PROMPT, ts=ts, **red))
    s, ts = nxt()
    out.append(f.finished(s, NEAR_REQUEST, tenant="acme", ts=ts, **red))
    s, ts = nxt()
    out.append(f.admitted(s, "r-exposed", tenant="acme", prompt=5_000, ts=ts, **red))
    s, ts = nxt()
    out.append(f.finished(s, "r-exposed", tenant="acme", ts=ts, **red))
    s, ts = nxt()
    out.append(f.rejected(s, "r-victim", tenant=TENANT, ts=ts, **red))
    s, ts = nxt()
    out.append(
        ev.KvTransfer(
            **f.base(s, probe="probe-red", dep=RED, ts=ts),
            request_id="r-victim",
            tenant=TENANT,
            from_node="prefill-0",
            to_node="decode-0",
            pages=3,
            prefill_rejected=True,
        )
    )
    for _ in range(3):
        s, ts = nxt()
        out.append(
            ev.PageReuse(
                **f.base(s, probe="probe-red", dep=RED, ts=ts),
                node="decode-0",
                role="decode",
                step=s,
                reused_pages=12,
                cross_tenant_pages=4,
            )
        )
    s, ts = nxt()
    out.append(f.stale_read(s, ts=ts, **red))  # globex read acme's pages

    green = {"probe": "probe-green", "dep": GREEN}
    seq = 0
    s, ts = nxt()
    out.append(
        f.config(
            s,
            ts=ts,
            engine="vllm",
            engine_version="0.6.3",
            model_id=GREEN_MODEL,
            advertised_context=GREEN_SAFE,
            pool_tokens=262_144,
            role="both",
            node="node-0",
            disaggregated=False,
            **green,
        )
    )
    for i in range(12):
        s, ts = nxt()
        out.append(f.pool(s, used=20_000 + i * 9_000, cap=262_144, node="node-0", ts=ts, **green))
        s, ts = nxt()
        out.append(
            f.admitted(
                s,
                f"g-{i}",
                tenant="initech",
                prompt=2_000 + i * 3_000,
                model_id=GREEN_MODEL,
                ts=ts,
                **green,
            )
        )
        s, ts = nxt()
        out.append(f.finished(s, f"g-{i}", tenant="initech", model_id=GREEN_MODEL, ts=ts, **green))
    # g-0 was sampled n=3 (vLLM's parallel sampling): two more requests share its prompt
    for rid in GREEN_SHARING:
        s, ts = nxt()
        out.append(
            f.admitted(
                s,
                rid,
                tenant="initech",
                prompt=2_000,
                model_id=GREEN_MODEL,
                prompt_shared_with="g-0",
                ts=ts,
                **green,
            )
        )
    return _spread([f.as_json(e) for e in out], now)


def _spread(events: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    for probe, (newest, step) in _SPREAD.items():
        mine = sorted((e for e in events if e["probe_id"] == probe), key=lambda e: e["seq"])
        for i, e in enumerate(mine):
            e["ts"] = (now - newest - (len(mine) - 1 - i) * step).isoformat()
    return events


def _send(c: httpx.Client, events: list[dict[str, Any]], headers: dict[str, str]) -> None:
    """One batch per probe: the collector takes each batch from a single probe."""
    for probe in sorted({e["probe_id"] for e in events}):
        batch = [e for e in events if e["probe_id"] == probe]
        r = c.post("/v1/events", json=batch, headers=headers)
        assert r.status_code == 200, r.text


def seed(url: str, db_url: str, now: datetime | None = None) -> Seeded:
    """Ingest the traffic, record the verifications, and wait (bounded) for the rollups."""
    now = now or datetime.now(UTC)
    admin = make_token(db_url, "admin", name="dashboard-test")
    ingest = make_token(db_url, "ingest")
    read = make_token(db_url, "read")
    tenant = make_token(db_url, "read", tenant=TENANT)
    with httpx.Client(base_url=url, timeout=30) as c:
        events = _events(now)
        verifications = [
            (RED, RED_MODEL, RED_SAFE, "0.5.21", now - timedelta(days=3)),
            (GREEN, GREEN_MODEL, GREEN_SAFE, "0.6.3", now - timedelta(days=1)),
        ]
        # Configs first, so each verification is tied to the running config (not stale).
        configs = [e for e in events if e["kind"] == "engine.config"]
        rest = [e for e in events if e["kind"] != "engine.config"]
        h = {"Authorization": f"Bearer {ingest}"}
        _send(c, configs, h)
        for dep, model, safe, version, at in verifications:
            r = c.post(
                "/v1/verifications",
                json={
                    "deployment_id": dep,
                    "model_id": model,
                    "passed": True,
                    "verified_safe_context": safe,
                    "engine_version": version,
                    "verified_at": at.isoformat(),
                    "evidence": {
                        "tool": "kvwatch verify",
                        "result": "pass",
                        "rejection_point": safe + 1,
                        "leaks": 0,
                    },
                },
                headers={"Authorization": f"Bearer {admin}"},
            )
            assert r.status_code == 201, r.text
        _send(c, rest, h)
        ah = {"Authorization": f"Bearer {admin}"}
        deadline = time.monotonic() + 30
        while True:
            incidents = c.get("/v1/incidents", headers=ah).json()
            stats = c.get("/v1/stats/prompt-tokens", headers=ah).json()
            models = {x["model_id"] for x in stats["routes"]}
            if incidents and models == {RED_MODEL, GREEN_MODEL}:
                break
            assert time.monotonic() < deadline, "the rollups or the incident never appeared"
            time.sleep(0.2)
    _timer_pass(db_url)
    return Seeded(url, db_url, admin, read, tenant, incidents[0]["id"])


def _timer_pass(db_url: str) -> None:
    """The policy timer's pass, as the collector runs one every KVWATCH_POLICY_TIMER_S: the
    state rules see the incident the seeded stale read opened (the small pool's alert is
    critical again with a leak open, whatever the verification said)."""
    from collector.alerting.service import AlertingService
    from collector.db import Database
    from policies import load_ruleset

    db = Database(db_url)
    try:
        AlertingService(db, load_ruleset()).tick(datetime.now(UTC))
    finally:
        db.dispose()


@contextmanager
def seeded_collector(tmp: Path) -> Iterator[Seeded]:
    """A real collector on SQLite (its rollups refreshed five times a second), seeded."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings

    db_url = f"sqlite:///{tmp / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    settings = Settings(
        database_url=db_url,
        auto_migrate=False,
        rollup_interval_s=0.2,
        notify_enabled=False,
        # a notice without a contact point is a draft, and a draft is not sent
        dpo_contact="Data protection officer, dpo@operator.example",
    )
    with serve_in_thread(create_app(settings)) as url:
        yield seed(url, db_url)
