"""The refengine adapter: hooks → page ledger, canary and probe events.

Most tests record what the adapter emits with a recording probe and check it against
independent oracles kept by a plain ``EngineObserver`` beside it (Python dicts, host side).
One test sends ordinary traffic through a real Probe to the real collector (SQLite and
PostgreSQL) and reads it back over the collector's HTTP API.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine_probe import events as ev
from engine_probe.adapters.refengine import RefengineAdapter, attach
from engine_probe.canary import SENTINEL
from engine_probe.probe import Probe
from engine_probe.recording import RecordingProbe
from engine_probe.settings import ProbeSettings
from refengine import ContextLengthExceeded, Engine, EngineConfig, EngineObserver, KVPool, Request
from tests.conftest import Collector

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(**kw: Any) -> Engine:
    base: dict[str, Any] = {"advertised_context": 4096, "pool_tokens": 2048, "page_size": 16}
    base.update(kw)
    return Engine(EngineConfig(**base))


def secret(tenant: str, i: int, repeat: int = 3) -> str:
    line = f"[{tenant}] memo #{i}: merger code {tenant.upper()}-{(i + 1) * 7919:06d}, ünïcødé ✓. "
    return line * repeat


@dataclass
class Oracle(EngineObserver):
    """Host-side truth, in dicts, slot by slot, added before the adapter.

    ``valid``: per page, for each slot, the request that wrote it while owning the page in
    its current generation (None: not written so since the page was allocated, overwritten
    by another request, or freed); a transfer copies it for the transferring request.
    ``content``: per page, for each slot, the tenant whose KV it holds (None: never written;
    0: zeroized), carried by transfers, kept across frees. ``stale``: (reader, pool, page) of
    every decode read that used a slot not valid for its reader, and ``exposed`` the content
    tenants of those slots. ``writer_tenant``/``zeroized``: what an alloc finds in a page (for
    ``page.reuse``), per step."""

    page_size: int = 16
    owner: dict[tuple[str, int], int] = field(default_factory=dict)
    valid: dict[tuple[str, int], list[int | None]] = field(default_factory=dict)
    content: dict[tuple[str, int], list[int | None]] = field(default_factory=dict)
    writer_tenant: dict[tuple[str, int], int] = field(default_factory=dict)
    zeroized: set[tuple[str, int]] = field(default_factory=set)
    stale: set[tuple[int, str, int]] = field(default_factory=set)
    exposed: dict[tuple[int, str, int], set[int | None]] = field(default_factory=dict)
    reuse: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    tenant_of: dict[int, int] = field(default_factory=dict)
    transfers: dict[int, list[int]] = field(default_factory=dict)  # handle -> dst pages
    engine: Engine | None = None

    def on_attach(self, engine: Engine) -> None:
        self.engine = engine
        self.page_size = engine.config.page_size

    def _unwritten(self) -> list[int | None]:
        return [None] * self.page_size

    def on_alloc(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        assert self.engine is not None
        self.tenant_of[req.handle] = req.tenant_handle
        counts = self.reuse.setdefault((self.engine.steps, pool.name), [0, 0, 0])
        for p in pages.tolist():
            key = (pool.name, p)
            self.owner[key] = req.handle
            self.valid[key] = self._unwritten()
            if key in self.zeroized:
                counts[2] += 1
            elif key in self.writer_tenant:
                counts[0] += 1
                counts[1] += self.writer_tenant[key] != req.tenant_handle

    def on_free(self, pool: KVPool, pages: torch.Tensor, zeroized: bool) -> None:
        for p in pages.tolist():
            key = (pool.name, p)
            self.owner.pop(key, None)
            self.valid[key] = self._unwritten()
            if zeroized:
                self.zeroized.add(key)
                self.content[key] = [0] * self.page_size

    def _wrote(self, pool: str, page: int, handle: int, slot: int) -> None:
        key = (pool, page)
        self.writer_tenant[key] = self.tenant_of[handle]
        self.zeroized.discard(key)
        self.content.setdefault(key, self._unwritten())[slot] = self.tenant_of[handle]
        valid = self.valid.setdefault(key, self._unwritten())
        valid[slot] = handle if self.owner.get(key) == handle else None

    def on_kv_write(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        # prefill: positions cache_len (0) .. cached_prompt_tokens - 1 of the block table
        ps, table = pool.page_size, pages.tolist()
        for pos in range(req.cache_len, req.cached_prompt_tokens):
            page = table[pos // ps - req.cache_len // ps]
            self._wrote(pool.name, page, req.handle, pos % ps)

    def on_kv_write_batch(
        self, pool: KVPool, pages: torch.Tensor, writers: torch.Tensor, reqs: Sequence[Request]
    ) -> None:
        for p, r in zip(pages.tolist(), reqs, strict=True):
            self._wrote(pool.name, p, r.handle, r.cache_len % pool.page_size)

    def on_kv_transfer(
        self,
        src_pool: KVPool,
        src_pages: torch.Tensor,
        dst_pool: KVPool,
        dst_pages: torch.Tensor,
        req: Request,
        prefill_rejected: bool,
    ) -> None:
        self.transfers[req.handle] = dst_pages.tolist()
        h = req.handle
        for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            src, dst = (src_pool.name, s), (dst_pool.name, d)
            ours = self.owner.get(dst) == h
            self.valid[dst] = [
                h if ours and v == h else None for v in self.valid.get(src, self._unwritten())
            ]
            self.content[dst] = list(self.content.get(src, self._unwritten()))
            if src in self.writer_tenant:
                self.writer_tenant[dst] = self.writer_tenant[src]
            self.zeroized.discard(dst)
            if src in self.zeroized:
                self.zeroized.add(dst)

    def on_kv_read(
        self,
        pool: KVPool,
        pages: torch.Tensor,
        readers: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        for p, r, used in zip(pages.tolist(), readers.tolist(), valid.tolist(), strict=True):
            key = (pool.name, p)
            slots = self.valid.get(key, self._unwritten())
            content = self.content.get(key, self._unwritten())
            bad = [j for j, u in enumerate(used) if u and slots[j] != r]
            if bad:
                self.stale.add((r, pool.name, p))
                self.exposed.setdefault((r, pool.name, p), set()).update(content[j] for j in bad)

    def nonzero_reuse(self) -> dict[tuple[int, str], tuple[int, int, int]]:
        return {k: (a, b, c) for k, (a, b, c) in self.reuse.items() if a or c}


def run_waves(eng: Engine, waves: int = 2, per_wave: int = 6) -> list[Request]:
    reqs = []
    for w in range(waves):
        tenants = [TENANTS[(i + w) % 5] for i in range(per_wave)]
        batch = [  # max_tokens: room to read the whole prompt back
            eng.submit(secret(t, i, repeat=1 + (i + w) % 3), t, max_tokens=400)
            for i, t in enumerate(tenants)
        ]
        eng.run_until_idle()
        reqs += batch
    return reqs


# -- the adapter is a complete EngineObserver --------------------------------------------------


def test_adapter_implements_every_hook_with_the_same_signature() -> None:
    hooks = {n: f for n, f in vars(EngineObserver).items() if n.startswith("on_")}
    assert len(hooks) >= 12
    for name, base in hooks.items():
        mine = getattr(RefengineAdapter, name)
        want = [(p.name, p.kind) for p in inspect.signature(base).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(mine).parameters.values()]
        assert got == want, name
    assert not isinstance(RefengineAdapter(), EngineObserver)  # duck-typed, no refengine import


# -- ordinary traffic ---------------------------------------------------------------------------


@pytest.mark.parametrize("zeroize", [False, True])
@pytest.mark.parametrize("topology", ["monolithic", "disaggregated"])
def test_ordinary_traffic_no_stale_reads_exact_reuse_and_token_counts(
    topology: str, zeroize: bool
) -> None:
    eng = make(
        topology=topology,
        pool_tokens=768,
        decode_pool_tokens=1024 if topology == "disaggregated" else None,
        zeroize_on_free=zeroize,
        max_batch=4,
    )
    oracle = Oracle()
    eng.add_observer(oracle)
    probe = RecordingProbe()
    adapter = attach(eng, probe, canary=True, pool_sample_every=4)
    reqs = run_waves(eng)
    adapter.sample_pools()

    for r in reqs:
        assert r.text == r.prompt.decode()
    assert oracle.stale == set()
    assert probe.of(ev.PageStaleRead) == [] and probe.of(ev.CanaryHit) == []
    assert adapter.counters["stale_reads"] == adapter.counters["canary_hits"] == 0

    # engine.config: one per pool, with its role and capacity next to the advertised context
    configs = {c.node: c for c in probe.of(ev.EngineConfig)}
    expected = {p.name: (p.role, p.capacity_tokens) for p in eng.pools.values()}
    assert {n: (c.role, c.pool_capacity_tokens) for n, c in configs.items()} == expected
    for c in configs.values():
        assert c.advertised_context == 4096 and c.page_size == 16
        assert c.disaggregated is (topology == "disaggregated")
        assert c.engine == "refengine" and c.dtype == "float32"

    # request events: token counts, never text
    admitted = {f.request_id: f for f in probe.of(ev.RequestAdmitted)}
    finished = {f.request_id: f for f in probe.of(ev.RequestFinished)}
    assert set(admitted) == set(finished) == {r.request_id for r in reqs}
    for r in reqs:
        a, f = admitted[r.request_id], finished[r.request_id]
        assert (a.tenant, a.prompt_tokens, a.model_id) == (
            r.tenant,
            r.prompt_tokens,
            "refengine-lab",
        )
        assert (f.prompt_tokens, f.completion_tokens, f.status) == (
            r.prompt_tokens,
            r.completion_tokens,
            "completed",
        )
        assert r.completion_tokens == r.prompt_tokens + 1
    texts = {r.prompt.decode()[:20] for r in reqs}
    assert not any(t in repr(e) for e in probe.events for t in texts)

    # page.reuse: exactly the oracle's counts, step by step and pool by pool
    got = {
        (f.step, f.node): (f.reused_pages, f.cross_tenant_pages, f.zeroized_pages)
        for f in probe.of(ev.PageReuse)
    }
    assert got == oracle.nonzero_reuse()
    totals = [sum(x) for x in zip(*got.values(), strict=True)]
    if zeroize:
        assert totals[0] == 0 and totals[2] > 0
    else:
        assert totals[0] > 0 and totals[1] > 0 and totals[2] == 0

    # pool samples: per pool, consistent, the last one taken with everything freed
    samples = probe.of(ev.PoolSample)
    assert len(samples) >= 2 * len(eng.pools) + 2
    assert any(s.used_tokens > 0 for s in samples)
    for pool in eng.pools.values():
        last = [s for s in samples if s.node == pool.name][-1]
        assert (last.used_tokens, last.free_tokens) == (0, pool.capacity_tokens)
        assert last.role == pool.role
    assert probe.decoded()  # the collector would take every event
    eng.check_invariants()


def test_kv_transfers_are_reported_per_request() -> None:
    eng = make(topology="disaggregated", pool_tokens=512, decode_pool_tokens=1024)
    probe = RecordingProbe()
    attach(eng, probe)
    reqs = run_waves(eng, waves=1, per_wave=4)
    transfers = {f.request_id: f for f in probe.of(ev.KvTransfer)}
    for r in reqs:
        t = transfers[r.request_id]
        assert (t.from_node, t.to_node, t.prefill_rejected) == ("prefill", "decode", False)
        assert (t.pages, t.tokens) == (-(-r.prompt_tokens // 16), r.prompt_tokens)
        assert t.tenant == r.tenant


def test_at_most_one_device_sync_per_step() -> None:
    eng = make(pool_tokens=1024, max_batch=8)
    probe = RecordingProbe()
    adapter = attach(eng, probe, canary=True)
    run_waves(eng, waves=2, per_wave=8)
    assert 0 < adapter.counters["syncs"] <= adapter.counters["steps"] == eng.steps


# -- stale reads: partial writes decide validity ------------------------------------------------


@pytest.mark.parametrize("canary", [False, True])
def test_incident_stale_reads_match_the_oracle_page_for_page(canary: bool) -> None:
    eng = make(
        mode="legacy",
        topology="disaggregated",
        pool_tokens=512,
        decode_pool_tokens=4096,
        max_batch=4,
    )
    oracle = Oracle()
    eng.add_observer(oracle)
    probe = RecordingProbe()
    attach(eng, probe, canary=canary)
    normal = [eng.submit(secret(t, i), t, max_tokens=400) for i, t in enumerate(TENANTS[:4])]
    eng.run_until_idle()
    assert probe.of(ev.PageStaleRead) == []
    over = eng.submit("y" * 1000, "mallory", max_tokens=60)
    eng.run_until_idle()

    stale = probe.of(ev.PageStaleRead)
    reported = [(f.reader_request_id, "decode", p) for f in stale for p in f.page_ids]
    assert len(reported) == len(set(reported))  # each stale page reported once per reader
    names = {r.handle: r.request_id for r in [*normal, over]}
    assert set(reported) == {(names[r], pool, p) for r, pool, p in oracle.stale}
    assert {f.reader_tenant for f in stale} == {"mallory"}
    victims = {f.previous_tenant for f in stale} - {None}
    assert victims and victims <= set(TENANTS[:4])
    assert all(f.previous_request_id in names.values() for f in stale if f.previous_tenant)
    assert all(f.read_kind == "decode" and f.node == "decode" for f in stale)
    # Each report names a tenant whose KV sat in the slots read that the reader never wrote
    # (None: slots never written since the pool was created).
    handles = {name: h for h, name in names.items()}
    for f in stale:
        for p in f.page_ids:
            exposed = oracle.exposed[(handles[f.reader_request_id], "decode", p)]
            assert f.previous_tenant in {None if t is None else eng.tenant_name(t) for t in exposed}

    (tr,) = [f for f in probe.of(ev.KvTransfer) if f.request_id == over.request_id]
    assert (tr.prefill_rejected, tr.pages, tr.tokens) == (True, 1, 1)
    # The transferred placeholder page: one token written into slot 0, read as 16 positions,
    # slots 1..15 holding another tenant's prompt from the prefill pool. Stale, naming them.
    (placeholder,) = oracle.transfers[over.handle]
    (named,) = [f.previous_tenant for f in stale if placeholder in f.page_ids]
    assert named in TENANTS[:4]
    if canary:
        # The canary sees exactly the pages the ledger reports, the placeholder page included
        # (its tail holds paint copied from the prefill pool).
        hits = probe.of(ev.CanaryHit)
        assert {h.reader_request_id for h in hits} == {over.request_id}
        painted = {p for h in hits for p in h.page_ids}
        assert painted == {p for _, _, p in reported}
    rejected = probe.of(ev.RequestRejected)
    assert [(f.reason, f.prompt_tokens, f.limit_tokens) for f in rejected] == [
        ("pool_exhausted", 1000, 512)
    ]
    assert probe.decoded()  # the collector would take every event


def test_hole_write_keeps_a_stale_page_stale_and_the_placeholder_page_is_caught() -> None:
    """Block-table page 62 (positions 992..1007) of the over-pool request: decode's first
    write lands at slot 8, past the page's (empty) written prefix. Reported stale at the first
    read even though it was just written. Page 0, the transferred placeholder page, was
    written at slot 0 only and is read as 16 positions: stale, naming acme, whose prompt the
    prefill page held."""
    eng = make(mode="legacy", topology="disaggregated", pool_tokens=512, decode_pool_tokens=4096)
    probe = RecordingProbe()
    attach(eng, probe)
    acme = eng.generate(secret("acme", 0, repeat=6), "acme", max_tokens=2000)
    seen: list[torch.Tensor] = []

    class Table(EngineObserver):
        def on_alloc(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
            if pool.name == "decode":
                seen.append(pages.clone())

    eng.add_observer(Table())
    eng.generate("y" * 1000, "mallory", max_tokens=3)
    table = seen[0].tolist()
    stale = probe.of(ev.PageStaleRead)
    stale_pages = {p for f in stale for p in f.page_ids}
    assert table[62] in stale_pages
    (placeholder,) = [f for f in stale if table[0] in f.page_ids]
    assert (placeholder.previous_tenant, placeholder.previous_request_id) == (
        "acme",
        acme.request_id,
    )
    assert (placeholder.reader_tenant, placeholder.zeroized) == ("mallory", False)


# -- clean rejections, aborts, ids ----------------------------------------------------------


def test_clean_rejection_and_abort() -> None:
    eng = make(mode="hardened", pool_tokens=512)
    probe = RecordingProbe()
    attach(eng, probe)
    with pytest.raises(ContextLengthExceeded):
        eng.submit("x" * 5000, "acme", request_id="too-long")
    with pytest.raises(ContextLengthExceeded):
        eng.submit("x" * 600, "acme", request_id="over-pool")
    r = eng.submit("abc" * 40, "globex", max_tokens=100)
    eng.step()
    eng.step()
    assert eng.abort(r.request_id)
    got = {
        f.request_id: (f.reason, f.prompt_tokens, f.limit_tokens)
        for f in probe.of(ev.RequestRejected)
    }
    assert got == {
        "too-long": ("context_length_exceeded", 5000, 4096),
        "over-pool": ("pool_exhausted", 600, 512),
    }
    assert [f.request_id for f in probe.of(ev.RequestAdmitted)] == [r.request_id]
    (fin,) = probe.of(ev.RequestFinished)
    assert (fin.status, fin.completion_tokens) == ("aborted", r.completion_tokens)
    assert probe.decoded()  # the collector would take every event


def test_ids_that_are_not_wire_ids_are_hashed_not_dropped() -> None:
    eng = make()
    probe = RecordingProbe()
    attach(eng, probe)
    eng.generate("hello there", "Tenant With Spaces", request_id="my id\n1")
    (adm,) = probe.of(ev.RequestAdmitted)
    assert ev.is_valid_id(adm.request_id) and ev.is_valid_id(adm.tenant)
    assert adm.tenant.startswith("tenant-") and adm.request_id.startswith("req-")
    (fin,) = probe.of(ev.RequestFinished)
    assert (fin.request_id, fin.tenant) == (adm.request_id, adm.tenant)
    assert probe.decoded()  # the collector would take every event


def test_attached_mid_flight_reports_nothing_false() -> None:
    eng = make(topology="disaggregated", max_batch=4)
    early = [eng.submit(secret(t, i), t, max_tokens=400) for i, t in enumerate(TENANTS[:3])]
    for _ in range(4):
        eng.step()
    assert any(p.used_pages for p in eng.pools.values())
    probe = RecordingProbe()
    attach(eng, probe, canary=True)
    late = [eng.submit(secret(t, 9), t, max_tokens=400) for t in TENANTS[3:]]
    eng.run_until_idle()
    assert all(r.text == r.prompt.decode() for r in early + late)
    assert probe.of(ev.PageStaleRead) == [] and probe.of(ev.CanaryHit) == []
    assert {f.request_id for f in probe.of(ev.RequestFinished)} == {
        r.request_id for r in early + late
    }


# -- canary painting ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_canary_paints_freed_pages_unless_zeroized(dtype: str) -> None:
    for zeroize in (False, True):
        eng = make(kv_dtype=dtype, zeroize_on_free=zeroize)
        attach(eng, RecordingProbe(), ledger=False, canary=True)
        eng.generate(secret("acme", 1), "acme", max_tokens=3)
        pool = eng.pools["kv"]
        used = pool.free_page_ids()[: pool.pages_for(len(secret("acme", 1).encode()) + 2)]
        want = 0.0 if zeroize else SENTINEL
        assert bool((pool.k[used] == want).all()) and bool((pool.v[used] == want).all())


def test_canary_alone_catches_the_incident_and_the_engine_survives_painted_reads() -> None:
    eng = make(mode="legacy", topology="disaggregated", pool_tokens=512, decode_pool_tokens=4096)
    probe = RecordingProbe()
    adapter = attach(eng, probe, ledger=False, canary=True)
    assert adapter.ledgers == {}
    normal = [eng.generate(secret(t, i), t, max_tokens=400) for i, t in enumerate(TENANTS[:3])]
    answer = eng.generate("y" * 1000, "mallory", max_tokens=50)
    assert answer.finish_reason in ("stop", "length")  # decoded painted KV without crashing
    for c in normal:
        assert c.text[:30] not in answer.text
    hits = probe.of(ev.CanaryHit)
    assert hits and {h.reader_tenant for h in hits} == {"mallory"}
    assert {h.canary_tenant for h in hits} <= set(TENANTS[:3]) and all(
        h.detector == "paint" for h in hits
    )
    pages = [p for h in hits for p in h.page_ids]
    assert len(pages) == len(set(pages))  # once per page, not once per decode step
    assert Counter(type(e) for e in probe.events)[ev.PageStaleRead] == 0
    assert probe.decoded()  # the collector would take every event


# -- through the real collector ----------------------------------------------------------------


def test_ordinary_traffic_through_the_real_collector(collector: Collector) -> None:
    settings = ProbeSettings(
        collector_url=collector.url,
        ingest_token=collector.ingest,
        deployment_id="adapter-normal",
        probe_flush_interval_s=0.05,
        probe_backoff_base_s=0.01,
        probe_backoff_max_s=0.05,
    )
    probe = Probe(settings)
    try:
        eng = make(topology="disaggregated", pool_tokens=512, decode_pool_tokens=1024, max_batch=4)
        adapter = attach(eng, probe, canary=True, pool_sample_every=8)
        reqs = run_waves(eng, waves=2, per_wave=4)
        eng.generate("odd ids", "Tenant With Spaces", request_id="id with spaces")
        adapter.sample_pools()
        assert probe.force_flush(20)
        assert probe.stats()["dropped"] == dict.fromkeys(probe.stats()["dropped"], 0)
    finally:
        probe.shutdown(5)

    with collector.client(collector.admin) as http:
        q: dict[str, Any] = {"deployment_id": "adapter-normal", "limit": 500}
        rows = http.get("/v1/requests", params=q).json()["items"]
        by_id = {r["request_id"]: r for r in rows}
        assert len(by_id) == len(reqs) + 1
        for r in reqs:
            row = by_id[r.request_id]
            assert (row["tenant"], row["prompt_tokens"], row["completion_tokens"]) == (
                r.tenant,
                r.prompt_tokens,
                r.completion_tokens,
            )
            assert row["status"] == "completed" and row["model_id"] == "refengine-lab"
        page = http.get("/v1/page-events", params=q).json()["items"]
        kinds = Counter(p["kind"] for p in page)
        assert kinds["page.stale_read"] == kinds["canary.hit"] == 0
        assert kinds["kv.transfer"] == len(reqs) + 1 and kinds["page.reuse"] > 0
        samples = http.get("/v1/pool-samples", params={"deployment_id": "adapter-normal"})
        assert {b["node"] for b in samples.json()["items"]} == {"prefill", "decode"}
        deps = http.get("/v1/deployments").json()
        assert any(d.get("deployment_id") == "adapter-normal" for d in deps)
