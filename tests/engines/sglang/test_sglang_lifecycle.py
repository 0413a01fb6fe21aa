"""The SGLang adapter's request and page lifecycle on real SGLang 0.5.23 classes (CPU):
handles never reused, radix-cache prefixes as grants, extend binding through SGLang's own
``write_cache_indices``, retraction, a draft runner's shared pool, bounded tenant names,
auto-truncation, and the CUDA-graph capture guard."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from sglang.srt.managers.utils import validate_input_length
from sglang.srt.mem_cache import allocation
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang_incident import (
    MAX_INPUT,
    PAGE,
    PREFILL_TOKENS,
    decode_step,
    finish,
    make_node,
    new_req,
    prefill,
    run_layers,
)

from engine_probe.adapters.sglang import attach
from engine_probe.events import (
    EngineConfig,
    PageStaleRead,
    PrefixCacheHit,
    RequestAdmitted,
    RequestFinished,
)


@pytest.fixture
def torch_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention backends ``write_cache_indices`` asks SGLang's process config for (not
    published outside a server): ``torch_native``, which selects its non-Triton path."""
    monkeypatch.setattr(allocation, "attention_backends", lambda: ("torch_native",) * 2)


def owners(adapter: Any, node: str, pages: list[int]) -> list[int]:
    return [int(o) for o in adapter.ledgers[node].owner_of(pages).tolist()]


def test_handles_are_never_reused_past_capacity(probe: Any, tp_rank0: None) -> None:
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe, request_capacity=2)
    try:
        pages = [prefill(n, new_req(f"r-{i}", f"t-{i}", PAGE, room=i))[1] for i in range(4)]
    finally:
        adapter.detach()
    got = [owners(adapter, "both-0", p)[0] for p in pages]
    assert len(set(got)) == 4, got  # four live requests, four handles
    assert probe.of(PageStaleRead) == []


def extend_with_prefix(n: Any, req: Any, prefix_slots: torch.Tensor, extra: int) -> int:
    """SGLang's extend of ``req`` over a radix-cache prefix: a row, new page-aligned slots,
    the row written by SGLang's own ``write_cache_indices`` (its CPU fallback here; the
    Triton kernel on CUDA), one extend forward. Returns the row."""
    prefix = prefix_slots.numel()
    (row,) = n.r2t.alloc([req])
    new = n.alloc.alloc(math.ceil(extra / PAGE) * PAGE)[:extra]
    seq = prefix + extra
    allocation.write_cache_indices(
        new,
        torch.tensor([row]),
        torch.tensor([row]),
        torch.tensor([prefix]),
        torch.tensor([prefix]),
        torch.tensor([seq]),
        torch.tensor([seq]),
        torch.tensor([extra]),
        torch.tensor([extra]),
        [prefix_slots.long()],
        n.r2t,
    )
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.zeros(extra, dtype=torch.long),
        req_pool_indices=torch.tensor([row]),
        seq_lens=torch.tensor([seq]),
        out_cache_loc=new,
        seq_lens_sum=seq,
        extend_prefix_lens=torch.tensor([prefix]),
        extend_seq_lens=torch.tensor([extra]),
    )
    run_layers(n, batch, extra)
    return row


def test_radix_prefix_hit_is_a_grant_not_a_stale_read(
    probe: Any, tp_rank0: None, torch_native: None
) -> None:
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        a = new_req("a-1", "tenant-a", 2 * PAGE, room=1)
        a_row, a_pages = prefill(n, a)
        b = new_req("b-1", "tenant-a", 3 * PAGE, room=2)
        b_row = extend_with_prefix(n, b, n.r2t.req_to_token[a_row, : 2 * PAGE].clone(), PAGE)
        decode_step(n, a_row, 2 * PAGE)  # A reads its own pages: still its own
        decode_step(n, b_row, 3 * PAGE)  # B reads A's prefix and its own pages
    finally:
        adapter.detach()
    assert probe.of(PageStaleRead) == []
    a_handle, b_handle = adapter._handles["a-1"], adapter._handles["b-1"]
    assert owners(adapter, "both-0", a_pages) == [a_handle, a_handle]
    b_page = int(n.r2t.req_to_token[b_row, 2 * PAGE]) // PAGE
    assert owners(adapter, "both-0", [b_page]) == [b_handle]


def test_a_cross_tenant_radix_prefix_hit_is_reported_with_owner_and_reader(
    probe: Any, tp_rank0: None, torch_native: None
) -> None:
    """Another tenant's request bound to a radix-cache prefix tenant A computed: one
    prefix_cache.hit naming both (pages and tokens of the prefix), no stale read; the same
    tenant's reuse is counted, not sent."""
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        a = new_req("a-1", "tenant-a", 2 * PAGE, room=1)
        a_row, _ = prefill(n, a)
        prefix = n.r2t.req_to_token[a_row, : 2 * PAGE].clone()
        b = new_req("b-1", "tenant-b", 3 * PAGE, room=2)
        b_row = extend_with_prefix(n, b, prefix, PAGE)
        decode_step(n, b_row, 3 * PAGE)
        c = new_req("c-1", "tenant-a", 3 * PAGE, room=3)
        extend_with_prefix(n, c, prefix, PAGE)
    finally:
        adapter.detach()
    assert probe.of(PageStaleRead) == []
    (hit,) = probe.of(PrefixCacheHit)
    assert (hit.reader_request_id, hit.reader_tenant) == ("b-1", "tenant-b")
    assert (hit.owner_request_id, hit.owner_tenant) == ("a-1", "tenant-a")
    assert (hit.pages, hit.tokens) == (2 * PAGE // PAGE, 2 * PAGE)
    assert hit.cross_tenant and not hit.salted
    assert adapter.counters["prefix_hits_same_tenant"] == 1


def test_a_cross_tenant_hit_between_requests_that_share_a_cache_salt_says_salted(
    probe: Any, tp_rank0: None, torch_native: None
) -> None:
    """SGLang keys its radix cache by ``cache_salt``: a hit across tenants whose requests
    carried one means the two tenants share a salt, and the hit says so."""
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        a = new_req("a-1", "tenant-a", 2 * PAGE, room=1)
        a.cache_salt = "one-salt"
        a_row, _ = prefill(n, a)
        prefix = n.r2t.req_to_token[a_row, : 2 * PAGE].clone()
        b = new_req("b-1", "tenant-b", 3 * PAGE, room=2)
        b.cache_salt = "one-salt"
        extend_with_prefix(n, b, prefix, PAGE)
    finally:
        adapter.detach()
    (hit,) = probe.of(PrefixCacheHit)
    assert (hit.reader_tenant, hit.owner_tenant) == ("tenant-b", "tenant-a")
    assert hit.cross_tenant and hit.salted


def test_granted_prefix_freed_and_reused_is_still_caught(
    probe: Any, tp_rank0: None, torch_native: None
) -> None:
    """A grant is checked as its owner's write at the time it was granted: if the page
    is reused by another request, the row's read of it is stale, naming that writer."""
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        a = new_req("a-1", "tenant-a", PAGE, room=1)
        a_row, a_pages = prefill(n, a)
        b = new_req("b-1", "tenant-b", 2 * PAGE, room=2)
        b_row = extend_with_prefix(n, b, n.r2t.req_to_token[a_row, :PAGE].clone(), PAGE)
        finish(n, a, a_row, PAGE)  # SGLang would keep B's locked prefix; a bug frees it
        c = new_req("c-1", "tenant-c", PAGE, room=3)
        _, c_pages = prefill(n, c)
        assert c_pages == a_pages  # the freed page went to C, who wrote it
        decode_step(n, b_row, 2 * PAGE)
    finally:
        adapter.detach()
    stale = probe.of(PageStaleRead)
    assert [(s.reader_request_id, s.previous_request_id, s.page_ids) for s in stale] == [
        ("b-1", "c-1", a_pages)
    ]


def test_retraction_is_not_a_finish(probe: Any, tp_rank0: None) -> None:
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        r = new_req("r-1", "tenant-a", PAGE, room=1)
        row, _ = prefill(n, r)
        # retract_decode → release_kv_cache: KV freed, row given back, not finished
        n.alloc.free(n.r2t.req_to_token[row, :PAGE].long())
        n.r2t.free(r)
        assert probe.of(RequestFinished) == []
        row, _ = prefill(n, r)  # back from the waiting queue
        finish(n, r, row, PAGE)
    finally:
        adapter.detach()
    assert [a.request_id for a in probe.of(RequestAdmitted)] == ["r-1"]
    assert [(f.request_id, f.status) for f in probe.of(RequestFinished)] == [("r-1", "completed")]
    assert probe.of(PageStaleRead) == []


def test_draft_runner_sharing_the_pool_is_watched_once(probe: Any, tp_rank0: None) -> None:
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe, node="t")
    try:
        # speculative decoding: the draft ModelRunner gets the target's pool and allocator
        assert adapter.watch(req_to_token_pool=n.r2t, allocator=n.alloc, node="draft") == "t"
        r = new_req("r-1", "tenant-a", PAGE, room=1)
        row, _ = prefill(n, r)
        finish(n, r, row, PAGE)
    finally:
        adapter.detach()
    assert len(probe.of(EngineConfig)) == 1
    assert len(probe.of(RequestFinished)) == 1
    assert "write" not in vars(n.r2t)  # every hook undone: none was installed twice


def test_tenant_names_are_bounded(probe: Any, tp_rank0: None) -> None:
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe, request_capacity=2)
    try:
        for i in range(6):  # a random prefix-cache salt per request: a new "tenant" each
            r = new_req(f"r-{i}", f"salt-{i}", PAGE, room=i)
            row, _ = prefill(n, r)
            finish(n, r, row, PAGE)
    finally:
        adapter.detach()
    assert len(adapter._registry.tenants) <= 2
    assert [(a.request_id, a.tenant) for a in probe.of(RequestAdmitted)] == [
        (f"r-{i}", f"salt-{i}") for i in range(6)
    ]


def test_auto_truncated_prompt_reports_the_length_sent(probe: Any, tp_rank0: None) -> None:
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        r = new_req("r-1", "tenant-a", MAX_INPUT + 9, room=1)
        assert validate_input_length(r, MAX_INPUT, allow_auto_truncate=True) is None
        assert len(r.origin_input_ids) == MAX_INPUT  # SGLang cut it
        row, _ = prefill(n, r)
        finish(n, r, row, MAX_INPUT)
    finally:
        adapter.detach()
    assert [a.prompt_tokens for a in probe.of(RequestAdmitted)] == [MAX_INPUT + 9]
    assert [f.prompt_tokens for f in probe.of(RequestFinished)] == [MAX_INPUT + 9]


def test_hooks_stand_aside_during_cuda_graph_capture(
    probe: Any, tp_rank0: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a CUDA graph is captured the write and read hooks must not touch the host
    (a sync invalidates the capture); CPU torch has no capture, so the capture state is
    what is patched, as CUDA torch reports it."""
    n = make_node(PREFILL_TOKENS)
    adapter = attach(req_to_token_pool=n.r2t, allocator=n.alloc, probe=probe)
    try:
        r = new_req("r-1", "tenant-a", PAGE, room=1)
        row, pages = prefill(n, r)
        checked = adapter.counters["reads_checked"]
        filled = adapter.ledgers["both-0"].filled_of(pages).tolist()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        slot = int(n.alloc.alloc(PAGE)[0])
        n.r2t.write((row, PAGE), torch.tensor(slot, dtype=torch.int32))
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=1,
            input_ids=torch.zeros(1, dtype=torch.long),
            req_pool_indices=torch.tensor([row]),
            seq_lens=torch.tensor([PAGE + 1]),
            out_cache_loc=torch.tensor([slot]),
            seq_lens_sum=PAGE + 1,
        )
        run_layers(n, batch, 1)
    finally:
        adapter.detach()
    assert adapter.counters["reads_checked"] == checked
    assert adapter.counters["capture_skipped"] == 2  # one write, one read check
    assert adapter.counters["hook_errors"] == 0
    assert adapter.ledgers["both-0"].filled_of(pages).tolist() == filled
