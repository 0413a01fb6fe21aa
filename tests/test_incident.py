"""The incident, end to end through the probe and the real collector (SQLite and PostgreSQL).

The workload of the write-up: disaggregated prefill/decode, an advertised context (4096)
larger than the prefill pool (512), several tenants' ordinary requests, then one prompt
longer than the pool.

* legacy: the answer carries another tenant's text; the ledger reports the stale read naming
  both tenants, the placeholder page included (one token written, read as 16 positions: the
  answer's first 15 bytes come from the other 15 slots); the collector stores it, with the
  request and its prompt token count;
* hardened: a clean ``ContextLengthExceeded`` before any KV moves, no stale read, no foreign
  text;
* canary mode with the ledger switched off: the painted pages give the incident away on
  their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

from engine_probe.adapters.refengine import RefengineAdapter, attach
from engine_probe.probe import Probe
from engine_probe.settings import ProbeSettings
from refengine import (
    Completion,
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    EngineObserver,
    KVPool,
    Request,
)
from tests.conftest import Collector

TENANTS = ("acme", "globex", "initech", "umbrella")
OVER = "y" * 1000  # longer than the 512-token prefill pool, well inside the 4096 context


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def secret(tenant: str, i: int) -> str:
    line = f"[{tenant}] memo #{i}: merger code {tenant.upper()}-{(i + 1) * 7919:06d}, ünïcødé ✓. "
    return line * 3


@dataclass
class Hole(EngineObserver):
    """Whose bytes sit in the placeholder page's hole: the request that last wrote the
    prefill page the legacy placeholder went into (slots 1..15 still hold its prompt), and
    the decode page that page was copied to."""

    last_writer: dict[int, Request] = field(default_factory=dict)
    writer: Request | None = None
    decode_page: int | None = None

    def on_alloc(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        if pool.name == "prefill" and req.prefill_rejected:
            self.writer = self.last_writer.get(int(pages[0]))

    def on_kv_write(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        if pool.name == "prefill":
            self.last_writer.update(dict.fromkeys(pages.tolist(), req))

    def on_kv_transfer(
        self,
        src_pool: KVPool,
        src_pages: torch.Tensor,
        dst_pool: KVPool,
        dst_pages: torch.Tensor,
        req: Request,
        prefill_rejected: bool,
    ) -> None:
        if prefill_rejected:
            self.decode_page = int(dst_pages[0])


@dataclass
class Run:
    engine: Engine
    adapter: RefengineAdapter
    normal: list[Completion]
    deployment: str


def replay(
    collector: Collector,
    mode: str,
    deployment: str,
    observers: Iterable[EngineObserver] = (),
    **adapter: Any,
) -> Run:
    """Start a probe on ``collector``, attach it (after ``observers``), serve the four
    tenants' ordinary requests; the caller sends the over-pool prompt and then calls
    ``finish``."""
    settings = ProbeSettings(
        collector_url=collector.url,
        ingest_token=collector.ingest,
        deployment_id=deployment,
        probe_flush_interval_s=0.05,
        probe_backoff_base_s=0.01,
        probe_backoff_max_s=0.05,
    )
    probe = Probe(settings)
    eng = Engine(
        EngineConfig(
            mode=mode,  # type: ignore[arg-type]
            topology="disaggregated",
            advertised_context=4096,
            pool_tokens=512,
            decode_pool_tokens=4096,
            max_batch=4,
        )
    )
    for obs in observers:
        eng.add_observer(obs)
    ad = attach(eng, probe, **adapter)
    reqs = [eng.submit(secret(t, i), t, max_tokens=400) for i, t in enumerate(TENANTS)]
    eng.run_until_idle()
    normal = [r.completion() for r in reqs]
    for c, r in zip(normal, reqs, strict=True):
        assert c.text == r.prompt.decode() and not c.rejected  # each tenant gets its own text
    return Run(eng, ad, normal, deployment)


def finish(run: Run) -> None:
    probe = run.adapter.probe
    assert isinstance(probe, Probe)
    try:
        run.adapter.sample_pools()
        assert probe.force_flush(20)
        assert not any(probe.stats()["dropped"].values())
    finally:
        probe.shutdown(5)


def get(http: httpx.Client, path: str, **params: Any) -> list[dict[str, Any]]:
    r = http.get(path, params={"limit": 1000, **params})
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def foreign_text(answer: str, normal: list[Completion]) -> list[Completion]:
    """The ordinary requests a 24-character piece of whose text shows up in ``answer``."""
    return [c for c in normal if any(c.text[i : i + 24] in answer for i in range(len(c.text) - 24))]


def test_legacy_incident_leaks_and_the_collector_stores_the_stale_read(
    collector: Collector,
) -> None:
    hole = Hole()
    run = replay(collector, "legacy", "incident-legacy", [hole])
    answer = run.engine.generate(OVER, "mallory", max_tokens=400, request_id="over-1")
    finish(run)

    # The incident: a "rejected" prompt answered with other tenants' text.
    assert answer.rejected and answer.prompt_tokens == 1000 and "y" not in answer.text
    victims = foreign_text(answer.text, run.normal)
    assert victims and {v.tenant for v in victims} <= set(TENANTS)
    # The placeholder page: prefill wrote one token into slot 0; slots 1..15 still held
    # another tenant's prompt, and they are the answer's first 15 bytes.
    assert hole.writer is not None and hole.writer.tenant in TENANTS
    assert answer.text[:15] == hole.writer.prompt[1:16].decode()

    with collector.client(collector.admin) as http:
        dep = {"deployment_id": run.deployment}
        stale = get(http, "/v1/page-events", kind="page.stale_read", **dep)
        assert stale and {(s["request_id"], s["tenant"]) for s in stale} == {("over-1", "mallory")}
        exposed = {s["other_tenant"]: s for s in stale if s["other_tenant"] is not None}
        # Both tenants named: the reader, and every victim whose text came out.
        assert {v.tenant for v in victims} <= set(exposed)
        for v in victims:
            row = exposed[v.tenant]
            assert row["other_request_id"] == v.request_id and row["cross_tenant"] is True
            assert row["detail"]["read_kind"] == "decode" and row["page_count"] > 0
        # ... and the tenant whose bytes were in the placeholder page's hole, on that page.
        assert hole.writer.tenant in exposed
        on_placeholder = [s for s in stale if hole.decode_page in s["detail"]["page_ids"]]
        assert [
            (s["other_tenant"], s["other_request_id"], s["cross_tenant"]) for s in on_placeholder
        ] == [(hole.writer.tenant, hole.writer.request_id, True)]
        (transfer,) = [
            t for t in get(http, "/v1/page-events", kind="kv.transfer", **dep)
            if t["request_id"] == "over-1"
        ]  # fmt: skip
        assert transfer["detail"]["prefill_rejected"] is True and transfer["page_count"] == 1

        # Which requests crossed the pool, with their prompt token counts (failure chain 4).
        over_pool = get(http, "/v1/requests", min_prompt_tokens=513, **dep)
        assert [(r["request_id"], r["tenant"], r["prompt_tokens"]) for r in over_pool] == [
            ("over-1", "mallory", 1000)
        ]
        row = over_pool[0]
        assert (row["reject_reason"], row["limit_tokens"]) == ("pool_exhausted", 512)
        assert row["completion_tokens"] == answer.completion_tokens
        assert len(get(http, "/v1/requests", **dep)) == len(TENANTS) + 1

        # The configuration that made it possible: a prefill pool under the advertised context.
        (deployment,) = [
            d for d in http.get("/v1/deployments").json() if d["deployment_id"] == run.deployment
        ]
        pools = {c["node"]: c for c in deployment["config"]}
        assert (
            pools["prefill"]["pool_capacity_tokens"] == 512 < pools["prefill"]["advertised_context"]
        )
        assert pools["prefill"]["role"] == "prefill" and pools["decode"]["role"] == "decode"
        (incident,) = http.get("/v1/incidents").json()

    # Each tenant's token sees the incident only if it concerns that tenant's data, and then
    # only its own side; to a tenant it does not concern, the incident does not exist.
    bystanders = sorted(set(TENANTS) - set(exposed))
    for tenant, side in [("mallory", "received"), *((t, "exposed") for t in exposed)]:
        with collector.client(collector.token("read", tenant=tenant)) as mine:
            (seen,) = mine.get("/v1/incidents").json()
            assert (seen["id"], seen["concerns"]) == (incident["id"], side)
            view = mine.get(f"/v1/incidents/{incident['id']}").json()
            assert view["concerns"] == side
            # the reader's own data was not disclosed: its summary says what it received
            assert view["summary"].startswith(
                "This incident concerns your data"
                if side == "exposed"
                else "This incident concerns data your requests received"
            )
            others = {"mallory", *exposed} - {tenant}
            assert not [o for o in others if o in json.dumps(view)]
    assert bystanders  # the workload has tenants whose data never crossed
    with collector.client(collector.token("read", tenant=bystanders[0])) as theirs:
        assert theirs.get("/v1/incidents").json() == []
        r = theirs.get(f"/v1/incidents/{incident['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_hardened_same_workload_is_a_clean_rejection(collector: Collector) -> None:
    run = replay(collector, "hardened", "incident-hardened")
    with pytest.raises(ContextLengthExceeded) as err:
        run.engine.submit(OVER, "mallory", max_tokens=400, request_id="over-1")
    assert (err.value.limit_tokens, err.value.prompt_tokens) == (512, 1000)
    assert all(p.used_pages == 0 for p in run.engine.pools.values())  # nothing allocated
    # The engine carries on, every tenant still answered with its own text only.
    again = [run.engine.generate(secret(t, 7), t, max_tokens=400) for t in TENANTS]
    assert [c.text for c in again] == [secret(t, 7) for t in TENANTS]
    finish(run)
    assert run.adapter.counters["stale_reads"] == 0

    with collector.client(collector.admin) as http:
        dep = {"deployment_id": run.deployment}
        assert get(http, "/v1/page-events", kind="page.stale_read", **dep) == []
        transfers = get(http, "/v1/page-events", kind="kv.transfer", **dep)
        assert len(transfers) == 2 * len(TENANTS)
        assert not any(t["detail"]["prefill_rejected"] for t in transfers)
        rows = get(http, "/v1/requests", min_prompt_tokens=513, **dep)
        assert [
            (
                r["request_id"],
                r["status"],
                r["reject_reason"],
                r["prompt_tokens"],
                r["limit_tokens"],
            )
            for r in rows
        ] == [("over-1", "rejected", "pool_exhausted", 1000, 512)]
        assert rows[0]["completion_tokens"] is None


def test_canary_alone_catches_the_incident(collector: Collector) -> None:
    run = replay(collector, "legacy", "incident-canary", ledger=False, canary=True)
    assert run.adapter.ledgers == {}
    answer = run.engine.generate(OVER, "mallory", max_tokens=400, request_id="over-1")
    finish(run)
    # Painted pages read back as the sentinel, not as the previous owners' KV.
    assert answer.rejected and foreign_text(answer.text, run.normal) == []

    with collector.client(collector.admin) as http:
        dep = {"deployment_id": run.deployment}
        assert get(http, "/v1/page-events", kind="page.stale_read", **dep) == []
        hits = get(http, "/v1/page-events", kind="canary.hit", **dep)
        assert hits and {(h["request_id"], h["tenant"]) for h in hits} == {("over-1", "mallory")}
        assert {h["other_tenant"] for h in hits} <= set(TENANTS)
        assert any(h["cross_tenant"] for h in hits)
        assert all(h["detail"]["detector"] == "paint" for h in hits)
        # Reported once per page, not once per decode step.
        pages = [p for h in hits for p in h["detail"]["page_ids"]]
        assert len(pages) == len(set(pages)) == sum(h["page_count"] for h in hits)
