"""refengine: the lab engine reads back its KV cache, batches tenants, queues on a full pool,
rejects cleanly when hardened, and reproduces the incident when legacy."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine import (
    EOS,
    PLACEHOLDER,
    ByteTokenizer,
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    EngineObserver,
    InvalidRequest,
    KVPool,
    Request,
    TokenDelta,
)
from refengine.tokenizer import IncrementalDecoder

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def secret(tenant: str, i: int, repeat: int = 3) -> str:
    """A tenant's distinctive prompt (several pages long)."""
    line = f"[{tenant}] memo #{i}: merger code {tenant.upper()}-{(i + 1) * 7919:06d}, ünïcødé ✓. "
    return line * repeat


# -- tokenizer ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.count(text) == len(ids) == len(tok.encode_bytes(text))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 259)), st.integers(1, 7))
def test_incremental_decoder_matches_decode(ids: list[int], chunk: int) -> None:
    dec = IncrementalDecoder()
    parts = [dec.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(dec.feed((), final=True))
    assert "".join(parts) == ByteTokenizer().decode(ids)


def test_tokenizer_specials_and_invalid_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.encode("<|eos|>") == list(b"<|eos|>")  # no special-token injection
    assert tok.decode([104, EOS, 105, PLACEHOLDER]) == "hi"
    assert tok.decode([104, EOS], skip_special=False) == "h<|eos|>"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut character, replaced, never raises
    assert tok.decode([0xFF, 65]) == "\ufffdA"


# -- reading back ---------------------------------------------------------------------------


def make(**kw: Any) -> Engine:
    base: dict[str, Any] = {"advertised_context": 4096, "pool_tokens": 2048, "page_size": 16}
    base.update(kw)
    return Engine(EngineConfig(**base))


@pytest.mark.parametrize("topology", ["monolithic", "disaggregated"])
def test_single_request_reads_back_its_prompt(topology: str) -> None:
    eng = make(topology=topology)
    prompt = "The quick brown fox — jumps over 13 lazy dogs. ✓ " * 2
    c = eng.generate(prompt, "acme", max_tokens=500)
    assert c.text == prompt
    assert c.finish_reason == "stop"
    assert c.prompt_tokens == len(prompt.encode())
    assert c.completion_tokens == c.prompt_tokens + 1  # the prompt's bytes, then EOS
    assert not c.rejected and not c.truncated
    eng.check_invariants()
    assert all(p.used_pages == 0 for p in eng.pools.values())


def test_max_tokens_cuts_the_read_back() -> None:
    eng = make()
    c = eng.generate("abcdefghijklmnopqrstuvwxyz" * 3, "acme", max_tokens=20)
    assert c.text == "abcdefghijklmnopqrst"
    assert (c.finish_reason, c.completion_tokens) == ("length", 20)
    one = eng.generate("xyz", "acme", max_tokens=1)  # only the token prefill computes
    assert (one.text, one.finish_reason) == ("x", "length")


@pytest.mark.parametrize("topology", ["monolithic", "disaggregated"])
def test_batch_of_tenants_each_reads_back_its_own_text(topology: str) -> None:
    eng = make(topology=topology, max_batch=8)
    streamed: dict[str, list[str]] = {}

    def collect(d: TokenDelta) -> None:
        streamed.setdefault(d.request.request_id, []).append(d.text)

    reqs = [
        eng.submit(secret(t, i, repeat=1 + i % 3), t, max_tokens=400, on_delta=collect)
        for i, t in enumerate(TENANTS * 2)
    ]
    batch_sizes = []
    while eng.has_work:
        batch_sizes.append(eng.step().decoded)
        eng.check_invariants()
    assert max(batch_sizes) > 1  # really batched
    for r in reqs:
        prompt = r.prompt.decode()
        assert r.completion().text == prompt
        assert "".join(streamed[r.request_id]) == prompt == r.text
        assert r.status == "finished" and r.done.is_set()
    assert all(p.used_pages == 0 for p in eng.pools.values())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reads_back_with_half_precision_kv_and_several_heads(dtype: str) -> None:
    eng = make(kv_dtype=dtype, heads=2, head_dim=32, topology="disaggregated")
    assert eng.pools["decode"].k.dtype == getattr(torch, dtype)
    prompt = secret("acme", 1)
    assert eng.generate(prompt, "acme", max_tokens=999).text == prompt


def test_determinism() -> None:
    def run() -> list[tuple[str, str, int]]:
        eng = make(topology="disaggregated", mode="legacy", pool_tokens=256)
        out = []
        for i, t in enumerate(TENANTS):
            eng.submit(secret(t, i), t, max_tokens=300, request_id=f"r{i}")
        eng.submit("y" * 700, "mallory", max_tokens=300, request_id="over")
        done: list[Request] = []
        while eng.has_work:
            done.extend(eng.step().finished)
        for r in done:
            out.append((r.request_id, r.text, r.completion_tokens))
        return out

    assert run() == run()


# -- pool pressure --------------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["monolithic", "disaggregated"])
def test_full_pool_queues_requests_until_pages_free(topology: str) -> None:
    # 8 pages of 16 tokens; each block table is 30 prompt + 30 fed-back tokens = 4 pages.
    eng = make(topology=topology, pool_tokens=128, max_batch=8)
    reqs = [
        eng.submit(f"request {i:02d} of tenant {TENANTS[i % 5]:>8}", TENANTS[i % 5], 31)
        for i in range(6)
    ]
    most_running = 0
    while eng.has_work:
        eng.step()
        eng.check_invariants()
        most_running = max(most_running, sum(r.status == "decoding" for r in reqs))
    assert most_running == 2  # the pool holds two block tables at a time; the rest waited
    assert [r.text for r in reqs] == [r.prompt.decode() for r in reqs]
    assert all(p.used_pages == 0 for p in eng.pools.values())


def test_waiting_requests_keep_fifo_order_and_all_complete() -> None:
    eng = make(pool_tokens=64, max_batch=4)
    reqs = [eng.submit(f"{i}" * 30, "acme", max_tokens=40) for i in range(5)]
    finished: list[str] = []
    while eng.has_work:
        finished.extend(r.request_id for r in eng.step().finished)
    assert finished == [r.request_id for r in reqs]
    assert [r.text for r in reqs] == [f"{i}" * 30 for i in range(5)]


def test_generation_is_capped_by_pool_and_context() -> None:
    eng = make(pool_tokens=64, advertised_context=60)
    c = eng.generate("z" * 50, "acme", max_tokens=1000)
    assert c.completion_tokens == 10 and c.finish_reason == "length"  # 50 + 10 = context
    eng2 = make(pool_tokens=64, advertised_context=4096)
    c2 = eng2.generate("z" * 60, "acme", max_tokens=1000)
    assert c2.completion_tokens == 5  # 60 prompt + 4 fed back = 64 slots; the 5th never fed


def test_abort_frees_pages_and_finishes() -> None:
    seen: list[TokenDelta] = []
    eng = make(topology="disaggregated")
    r = eng.submit(secret("acme", 0), "acme", max_tokens=500, on_delta=seen.append)
    queued = eng.submit("later", "globex", max_tokens=5)
    for _ in range(3):
        eng.step()
    assert eng.abort(r.request_id) and eng.abort(queued.request_id)
    assert not eng.abort(r.request_id)
    assert r.status == "aborted" and r.finish_reason == "abort" and seen[-1].finished
    assert not eng.has_work
    eng.check_invariants()
    assert all(p.used_pages == 0 for p in eng.pools.values())


def test_invalid_requests() -> None:
    eng = make()
    with pytest.raises(InvalidRequest):
        eng.submit("", "acme")
    with pytest.raises(InvalidRequest):
        eng.submit("x", "acme", max_tokens=0)
    with pytest.raises(InvalidRequest):
        eng.submit("x", "")
    eng.submit("x", "acme", request_id="dup")
    with pytest.raises(InvalidRequest):
        eng.submit("y", "acme", request_id="dup")
    with pytest.raises(ValueError):
        EngineConfig(pool_tokens=8, page_size=16)
    with pytest.raises(ValueError):
        EngineConfig(decode_pool_tokens=1024)  # monolithic has one pool


# -- observers ------------------------------------------------------------------------------


def _table_head(req: Request, n: int) -> torch.Tensor:
    assert req.block_table is not None
    return req.block_table[:n]


@dataclass
class Recorder(EngineObserver):
    """Records every hook with tensors turned into lists (fine in a test, not on a hot path),
    and keeps an oracle page ledger: which request last wrote each page since its alloc."""

    events: list[tuple[Any, ...]] = field(default_factory=list)
    owner: dict[tuple[str, int], int] = field(default_factory=dict)
    written: dict[tuple[str, int], int | None] = field(default_factory=dict)
    last_writer: dict[tuple[str, int], int] = field(default_factory=dict)
    stale: list[tuple[int, int, int | None]] = field(default_factory=list)  # reader, page, prev
    # prefix-cache grants: (pool, reader, page) -> the request whose write was granted
    grants: dict[tuple[str, int, int], int] = field(default_factory=dict)
    canary_hits: int = 0
    attached: Engine | None = None

    def on_attach(self, engine: Engine) -> None:
        self.attached = engine

    def on_request_admitted(self, req: Request) -> None:
        self.events.append(("admitted", req.request_id))

    def on_request_rejected(
        self, req: Request, reason: str, limit_tokens: int, prompt_tokens: int
    ) -> None:
        self.events.append(("rejected", req.request_id, reason, limit_tokens, prompt_tokens))

    def on_request_truncated(self, req: Request, limit_tokens: int, prompt_tokens: int) -> None:
        self.events.append(("truncated", req.request_id, limit_tokens, prompt_tokens))

    def on_request_finished(self, req: Request) -> None:
        self.events.append(("finished", req.request_id, req.status))
        for key in [k for k in self.grants if k[1] == req.handle]:
            del self.grants[key]

    def on_prefix_hit(
        self, pool: KVPool, pages: torch.Tensor, req: Request, owners: torch.Tensor
    ) -> None:
        assert pages.shape == owners.shape and torch.equal(pages, _table_head(req, pages.shape[0]))
        self.events.append(("hit", pool.name, pages.tolist(), req.request_id, owners.tolist()))
        for p, o in zip(pages.tolist(), owners.tolist(), strict=True):
            assert o != req.handle and self.written[(pool.name, p)] == o  # a hit holds its write
            self.grants[(pool.name, req.handle, p)] = o

    def on_alloc(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        assert pages.dtype == torch.int64 and pages.device == pool.device
        self.events.append(("alloc", pool.name, pages.tolist(), req.request_id))
        for p in pages.tolist():
            self.owner[(pool.name, p)] = req.handle
            self.written[(pool.name, p)] = None

    def on_free(self, pool: KVPool, pages: torch.Tensor, zeroized: bool) -> None:
        self.events.append(("free", pool.name, pages.tolist(), zeroized))
        if zeroized:
            assert bool((pool.k[pages] == 0).all()) and bool((pool.v[pages] == 0).all())
        for p in pages.tolist():
            self.owner.pop((pool.name, p))

    def on_kv_write(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        self.events.append(("write", pool.name, pages.tolist(), req.request_id))
        for p in pages.tolist():
            assert self.owner[(pool.name, p)] == req.handle
            self.written[(pool.name, p)] = req.handle
            self.last_writer[(pool.name, p)] = req.handle

    def on_kv_write_batch(
        self, pool: KVPool, pages: torch.Tensor, writers: torch.Tensor, reqs: Sequence[Request]
    ) -> None:
        assert writers.tolist() == [r.handle for r in reqs]
        self.events.append(("write_batch", pool.name, pages.tolist(), writers.tolist()))
        super().on_kv_write_batch(pool, pages, writers, reqs)

    def on_kv_transfer(
        self,
        src_pool: KVPool,
        src_pages: torch.Tensor,
        dst_pool: KVPool,
        dst_pages: torch.Tensor,
        req: Request,
        prefill_rejected: bool,
    ) -> None:
        assert src_pages.shape == dst_pages.shape
        self.events.append(
            ("transfer", src_pages.tolist(), dst_pages.tolist(), req.request_id, prefill_rejected)
        )
        for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            if self.written[(src_pool.name, s)] != req.handle:
                self.stale.append((req.handle, s, self.last_writer.get((src_pool.name, s))))
            self.written[(dst_pool.name, d)] = req.handle
            self.last_writer[(dst_pool.name, d)] = req.handle

    def on_kv_read(
        self,
        pool: KVPool,
        pages: torch.Tensor,
        readers: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        n = pages.shape[0]
        assert readers.shape == (n,) and readers.dtype == torch.int64
        assert k.shape == v.shape == (n, pool.page_size, pool.heads, pool.head_dim)
        assert valid.shape == (n, pool.page_size) and bool(valid.any(1).all())
        assert torch.equal(k, pool.k[pages])
        self.canary_hits += int((v[valid] == 7.0).all(-1).all(-1).sum())
        self.events.append(("read", pool.name, pages.tolist(), readers.tolist()))
        for p, r in zip(pages.tolist(), readers.tolist(), strict=True):
            # a granted page is read as its computing request's write
            if self.written[(pool.name, p)] != self.grants.get((pool.name, r, p), r):
                self.stale.append((r, p, self.last_writer.get((pool.name, p))))

    def on_step(self, engine: Engine) -> None:
        self.events.append(("step", engine.steps))

    def kinds(self, kind: str) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == kind]


def test_hooks_fire_with_the_right_pages_monolithic() -> None:
    eng = make(pool_tokens=256)
    rec = Recorder()
    eng.add_observer(rec)
    assert rec.attached is eng
    prompt = "0123456789" * 4  # 40 tokens: 3 pages; with 41 tokens of budget, 5 pages
    r = eng.submit(prompt, "acme", max_tokens=41)
    eng.run_until_idle()
    assert r.text == prompt
    (alloc,) = rec.kinds("alloc")
    pages = alloc[2]
    assert alloc == ("alloc", "kv", pages, r.request_id) and len(pages) == 5
    assert rec.kinds("write")[0] == ("write", "kv", pages[:3], r.request_id)
    reads = rec.kinds("read")
    assert len(reads) == 40  # one decode step per token after the first
    for i, ev in enumerate(reads):
        cache_len = 40 + i + 1
        assert ev[2] == pages[: (cache_len - 1) // 16 + 1] and set(ev[3]) == {r.handle}
    writes = rec.kinds("write_batch")
    assert [w[2] for w in writes] == [[pages[(40 + i) // 16]] for i in range(40)]
    assert rec.kinds("free") == [("free", "kv", pages, False)]
    assert rec.events[0] == ("admitted", r.request_id)
    assert rec.events[-2:] == [("finished", r.request_id, "finished"), ("step", eng.steps)]
    assert rec.stale == []


def test_hooks_fire_with_the_right_pages_disaggregated_batch() -> None:
    eng = make(topology="disaggregated", pool_tokens=1024, decode_pool_tokens=2048)
    rec = Recorder()
    eng.add_observer(rec)
    reqs = [eng.submit(secret(t, i), t, max_tokens=300) for i, t in enumerate(TENANTS)]
    eng.run_until_idle()
    for r in reqs:
        assert r.text == r.prompt.decode()
    transfers = rec.kinds("transfer")
    assert len(transfers) == len(reqs) and not any(t[4] for t in transfers)
    by_id = {r.request_id: r for r in reqs}
    for t in transfers:
        r = by_id[t[3]]
        assert len(t[1]) == len(t[2]) == -(-r.prompt_tokens // 16)
    # Every batched read step names each reader's pages, and readers are handles.
    batched = [e for e in rec.kinds("read") if len(set(e[3])) > 1]
    assert batched and {h for e in batched for h in e[3]} <= {r.handle for r in reqs}
    # Frees match allocs pool by pool, and nothing was read that its reader had not written.
    for pool in ("prefill", "decode"):
        allocd = sorted(p for e in rec.kinds("alloc") if e[1] == pool for p in e[2])
        freed = sorted(p for e in rec.kinds("free") if e[1] == pool for p in e[2])
        assert allocd == freed
    assert rec.stale == []


# -- rejection: hardened --------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["monolithic", "disaggregated"])
@pytest.mark.parametrize("mode", ["legacy", "hardened"])
def test_over_advertised_context_is_a_clean_error(mode: str, topology: str) -> None:
    eng = make(mode=mode, topology=topology, advertised_context=100, pool_tokens=512)
    rec = Recorder()
    eng.add_observer(rec)
    with pytest.raises(ContextLengthExceeded) as err:
        eng.submit("x" * 101, "acme")
    assert (err.value.limit_tokens, err.value.prompt_tokens) == (100, 101)
    assert (
        err.value.reason == "context_length_exceeded"
        and err.value.code == "context_length_exceeded"
    )
    assert "maximum context length is 100 tokens" in str(err.value)
    assert err.value.request is not None and err.value.request.status == "rejected"
    assert [e[0] for e in rec.events] == ["rejected"]
    assert not eng.has_work


@pytest.mark.parametrize("topology", ["monolithic", "disaggregated"])
def test_hardened_over_pool_prompt_is_rejected_before_any_kv_moves(topology: str) -> None:
    eng = make(
        mode="hardened",
        topology=topology,
        advertised_context=4096,
        pool_tokens=512,
        decode_pool_tokens=4096 if topology == "disaggregated" else None,
    )
    rec = Recorder()
    eng.add_observer(rec)
    for i, t in enumerate(TENANTS[:3]):
        assert eng.generate(secret(t, i), t, max_tokens=400).text == secret(t, i)
    before = len(rec.events)
    with pytest.raises(ContextLengthExceeded) as err:
        eng.submit("y" * 1000, "mallory", max_tokens=400)
    assert (err.value.limit_tokens, err.value.reason) == (512, "kv_pool_exceeded")
    assert err.value.request is not None
    assert rec.events[before:] == [
        ("rejected", err.value.request.request_id, "kv_pool_exceeded", 512, 1000)
    ]
    assert all(p.used_pages == 0 for p in eng.pools.values())
    # ... and the engine carries on, still answering each tenant with its own text only.
    for i, t in enumerate(TENANTS[3:]):
        assert eng.generate(secret(t, i), t, max_tokens=400).text == secret(t, i)
    c = eng.generate("y" * 512, "mallory", max_tokens=600)  # exactly the pool: fits
    # Monolithic: no room left to feed tokens back, so only prefill's token comes out.
    assert c.text == ("y" * 512 if topology == "disaggregated" else "y")
    assert rec.stale == []


# -- rejection: legacy (the incident) -------------------------------------------------------


def incident(
    zeroize: bool = False, mode: str = "legacy", first: EngineObserver | None = None
) -> tuple[Engine, Recorder, list[Request]]:
    """The incident's shape: disaggregated, advertised context 4096, prefill pool 512,
    decode pool 4096; four tenants' ordinary requests, then an over-pool prompt."""
    eng = make(
        mode=mode,
        topology="disaggregated",
        advertised_context=4096,
        pool_tokens=512,
        decode_pool_tokens=4096,
        zeroize_on_free=zeroize,
        max_batch=4,
    )
    if first is not None:
        eng.add_observer(first)
    rec = Recorder()
    eng.add_observer(rec)
    normal = [eng.submit(secret(t, i), t, max_tokens=400) for i, t in enumerate(TENANTS[:4])]
    eng.run_until_idle()
    for r in normal:
        assert r.text == r.prompt.decode() and not r.rejected
    return eng, rec, normal


def test_legacy_disaggregated_over_pool_prompt_leaks_another_tenants_text() -> None:
    eng, rec, normal = incident()
    over = eng.submit("y" * 1000, "mallory", max_tokens=400)
    eng.run_until_idle()
    answer = over.completion()
    # The answer is not mallory's text but fragments of earlier requests.
    assert "y" not in answer.text
    victims = [r for r in normal if r.prompt.decode()[40:80] in answer.text]
    assert victims and all(v.tenant != "mallory" for v in victims)
    assert answer.rejected and answer.finish_reason == "stop" and answer.prompt_tokens == 1000
    assert over.output_tokens[0] == PLACEHOLDER
    # What a probe sees: the prefill rejection, a 1-page transfer into a block table sized
    # for 1000 tokens, and decode reading pages nobody overwrote.
    assert ("rejected", over.request_id, "prefill_pool_exceeded", 512, 1000) in rec.events
    (tr,) = [t for t in rec.kinds("transfer") if t[3] == over.request_id]
    assert len(tr[1]) == len(tr[2]) == 1 and tr[4] is True
    (dst_alloc,) = [a for a in rec.kinds("alloc") if a[1] == "decode" and a[3] == over.request_id]
    assert len(dst_alloc[2]) > 60
    stale_prev = {prev for reader, _, prev in rec.stale if reader == over.handle}
    assert stale_prev & {v.handle for v in victims}
    assert {reader for reader, _, _ in rec.stale} == {over.handle}
    eng.check_invariants()


def test_legacy_canary_painting_sees_the_stale_read() -> None:
    class Painter(EngineObserver):
        def on_free(self, pool: KVPool, pages: torch.Tensor, zeroized: bool) -> None:
            pool.k.index_fill_(0, pages, 7.0)
            pool.v.index_fill_(0, pages, 7.0)

    eng, rec, _ = incident(first=Painter())  # paints before the recorder looks
    assert rec.canary_hits == 0  # ordinary requests never attend to a painted slot
    eng.generate("y" * 1000, "mallory", max_tokens=50)
    assert rec.canary_hits > 0


def test_zeroize_on_free_stops_the_legacy_leak() -> None:
    eng, rec, normal = incident(zeroize=True)
    answer = eng.generate("y" * 1000, "mallory", max_tokens=400)
    assert answer.rejected
    for r in normal:
        assert r.prompt.decode()[:10] not in answer.text
    assert answer.text == ""  # reading blank slots yields EOS
    assert all(e[3] for e in rec.kinds("free"))
    # The ledger still sees the unwritten pages being read: zeroizing hides the data, not
    # the bug.
    assert rec.stale


def test_hardened_incident_workload_has_no_leak() -> None:
    eng, rec, _ = incident(mode="hardened")
    with pytest.raises(ContextLengthExceeded):
        eng.submit("y" * 1000, "mallory", max_tokens=400)
    assert not [t for t in rec.kinds("transfer") if t[4]]
    assert rec.stale == []


def test_legacy_monolithic_truncates_silently() -> None:
    eng = make(mode="legacy", topology="monolithic", advertised_context=4096, pool_tokens=512)
    rec = Recorder()
    eng.add_observer(rec)
    for i, t in enumerate(TENANTS[:3]):
        eng.generate(secret(t, i), t, max_tokens=400)
    prompt = "".join(f"{i:04d}," for i in range(200))  # 1000 tokens
    c = eng.generate(prompt, "mallory", max_tokens=1000)
    assert c.truncated and not c.rejected and c.prompt_tokens == 1000
    # The pool holds the first 512 tokens and nothing more: only prefill's token comes out.
    assert (c.text, c.completion_tokens, c.finish_reason) == ("0", 1, "length")
    assert ("truncated", "req-4", 512, 1000) in rec.events
    assert rec.kinds("write")[-1][2] == rec.kinds("alloc")[-1][2]  # all 32 pages written
    assert rec.stale == []


# -- serving shape --------------------------------------------------------------------------


def test_background_engine_thread_with_submitters_and_streaming() -> None:
    """The server's shape: one thread steps the engine, others submit and wait."""
    eng = make(topology="disaggregated", max_batch=4)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if eng.step().idle:
                eng.wait_for_work(0.05)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    pieces: dict[str, list[str]] = {}
    lock = threading.Lock()

    def on_delta(d: TokenDelta) -> None:
        with lock:
            pieces.setdefault(d.request.request_id, []).append(d.text)

    def client(i: int) -> None:
        r = eng.submit(secret(TENANTS[i], i), TENANTS[i], 400, on_delta=on_delta)
        assert r.wait(timeout=120)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=120)
    with pytest.raises(ContextLengthExceeded):
        eng.submit("x" * 5000, "acme")  # raised in the submitting thread
    stop.set()
    worker.join(timeout=10)
    assert sorted("".join(p) for p in pieces.values()) == sorted(
        secret(t, i) for i, t in enumerate(TENANTS)
    )


def test_info_describes_the_deployment() -> None:
    info = make(topology="disaggregated", pool_tokens=512, decode_pool_tokens=1024).info()
    assert info["engine"] == "refengine" and info["disaggregated"] is True
    assert info["advertised_context"] == 4096
    assert info["pools"] == [
        {"name": "prefill", "role": "prefill", "num_pages": 32, "capacity_tokens": 512},
        {"name": "decode", "role": "decode", "num_pages": 64, "capacity_tokens": 1024},
    ]
