"""refengine's offload tier, live, with the probe attached: prefix pages the pool evicts go
to the tier and come back into a later request, and the probe follows each page out and in
under its writer and salt (engine_probe.tier_ledger). The positive control is the engine's
``offload_drops_salt`` fault (the tier keys pages by their tokens alone, as LMCache's SGLang
path did): another salt, or another tenant, is then served the prefix, and the probe says
so as a cross-tenant, salt-mismatched hit from the tier. The negative controls run the same
traffic on the tier as designed: the same tenant and salt hit, other salts never do."""

from __future__ import annotations

from typing import Any

import pytest

from engine_probe import events as ev
from engine_probe.adapters.refengine import attach
from engine_probe.recording import RecordingProbe
from refengine import Engine, EngineConfig, Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PS = 16
PREFIX = ("The memo on the merger says the board meets in March to vote. " * 5)[: 16 * PS]
assert len(PREFIX) == 16 * PS


def make(drops_salt: bool = False, **kw: Any) -> tuple[Engine, RecordingProbe]:
    cfg = EngineConfig(
        advertised_context=1024,
        pool_tokens=24 * PS,  # the prefix's 16 pages and little else: filler evicts them
        page_size=PS,
        prefix_cache=kw.pop("prefix_cache", "shared"),
        offload_tier_tokens=256 * PS,
        offload_drops_salt=drops_salt,
        **kw,
    )
    eng = Engine(cfg)
    probe = RecordingProbe()
    attach(eng, probe, deployment_id="lab")
    return eng, probe


def run(eng: Engine, prompt: str, tenant: str, salt: str | None = None) -> Request:
    req = eng.submit(prompt, tenant, 4, cache_salt=salt)
    while not req.finished:
        eng.step()
        eng.check_invariants()
    return req


def evict(eng: Engine) -> None:
    """Fresh prompts that need the whole pool: every idle cached page is evicted."""
    for i in range(2):
        run(eng, f"filler {i} " + "x" * (20 * PS), "filler")


def tier_hits(probe: RecordingProbe) -> list[ev.PrefixCacheHit]:
    return [h for h in probe.of(ev.PrefixCacheHit) if h.tier is not None]


@pytest.mark.parametrize("drops_salt", [False, True])
def test_the_owner_gets_its_prefix_back_from_the_tier(drops_salt: bool) -> None:
    eng, probe = make(drops_salt)
    first = run(eng, PREFIX + " Q1?", "acme", "salt-a")
    assert first.cached_tokens == 0
    evict(eng)
    assert eng.offload is not None and eng.offload.stored >= 16
    again = run(eng, PREFIX + " Q2?", "acme", "salt-a")
    assert again.cached_tokens == 16 * PS  # all 16 pages, loaded back from the tier
    (hit,) = tier_hits(probe)
    assert (hit.reader_tenant, hit.owner_tenant, hit.owner_request_id) == (
        "acme",
        "acme",
        first.request_id,
    )
    assert (hit.pages, hit.tier, hit.salt_mismatch, hit.cross_tenant) == (16, "cpu", False, False)
    # loaded pages are the reader's own write in the probe's ledger: no read of them is stale
    assert probe.of(ev.PageStaleRead) == []
    (cfg,) = {e.node: e for e in probe.of(ev.EngineConfig)}.values()
    assert cfg.kv_connector == "offload"
    assert cfg.kv_tiers[0].medium == "cpu" and cfg.kv_tiers[0].salted is True


@pytest.mark.parametrize(
    ("tenant", "salt"),
    [("globex", "salt-b"), ("acme", "salt-other")],
    ids=["other-tenant", "same-tenant-other-salt"],
)
def test_another_salt_misses_the_tier_unless_the_tier_drops_the_salt(
    tenant: str, salt: str
) -> None:
    for drops_salt in (False, True):
        eng, probe = make(drops_salt)
        run(eng, PREFIX + " Q1?", "acme", "salt-a")
        evict(eng)
        reader = run(eng, PREFIX + " Q3?", tenant, salt)
        hits = tier_hits(probe)
        if not drops_salt:  # the negative control: keyed with the salt, nothing to load
            assert reader.cached_tokens == 0 and hits == [], drops_salt
            continue
        assert reader.cached_tokens == 16 * PS
        (hit,) = hits
        assert hit.salt_mismatch and hit.salted and hit.owner_tenant == "acme"
        assert hit.cross_tenant is (tenant != "acme")
        assert eng.offload is not None and eng.offload.loaded == 16
        assert probe.of(ev.PageStaleRead) == []  # a prefix hit from the tier, not a stale read


def test_server_side_salting_by_tenant_keeps_tenants_apart_in_the_tier_too() -> None:
    """Salting by tenant: without any client salt, another tenant misses the tier; with the
    fault it is served the owner's prefix, and the probe says cross-tenant."""
    for drops_salt, hit_expected in ((False, False), (True, True)):
        eng, probe = make(drops_salt, prefix_cache="salted")
        run(eng, PREFIX + " Q1?", "acme")
        evict(eng)
        reader = run(eng, PREFIX + " Q4?", "globex")
        assert (reader.cached_tokens > 0) is hit_expected
        assert [h.cross_tenant for h in tier_hits(probe)] == ([True] if hit_expected else [])


@pytest.mark.parametrize("reader", ["globex", "acme"], ids=["other-tenant", "same-tenant"])
def test_a_tier_hit_across_salts_pages_critical_through_the_collector(
    collector: Any, reader: str
) -> None:
    """Through a running collector: the fault's load across salts pages
    prefix_cache_cross_tenant critical, the same tenant's too (its salt was dropped as
    surely), naming the tier; the row says it came from the CPU tier."""
    from tests.factories import as_json

    eng, probe = make(True)
    run(eng, PREFIX + " Q1?", "acme", "salt-a")
    evict(eng)
    run(eng, PREFIX + " Q3?", reader, "salt-b")
    events = [as_json(e) for e in probe.events]
    with collector.client(collector.ingest) as h:
        r = h.post("/v1/events", json=events)
        assert r.status_code == 200, r.text
    with collector.client(collector.admin) as h:
        alerts = h.get("/v1/alerts", params={"rule": "prefix_cache_cross_tenant"}).json()
        rows = h.get("/v1/page-events", params={"kind": "prefix_cache.hit"}).json()
    (alert,) = alerts
    assert (alert["state"], alert["severity"]) == ("firing", "critical")
    assert alert["labels"]["salt_mismatch"] == "true"
    assert alert["labels"]["reader_tenant"] == reader
    assert (
        f"tenant {reader} was served 16 block(s) tenant acme computed, loaded from the cpu "
        "tier across cache salts: a cache or offload tier dropped the salt"
    ) in alert["annotations"]["summary"]
    (row,) = [r for r in rows["items"] if r["detail"].get("salt_mismatch")]
    assert row["detail"]["tier"] == "cpu" and row["cross_tenant"] is (reader != "acme")
