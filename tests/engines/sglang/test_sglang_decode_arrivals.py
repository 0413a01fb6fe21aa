"""A decode server whose prefill is another process: what the decode-side probe can check.

Only the decode node is watched here (as in a separate SGLang decode server), and "prefill"
is what Mooncake is to decode: raw writes into decode's KV buffers between the receiver's
``send_metadata`` and its ``poll`` turning Success. The probe's arrival marks must tell the
pages a transfer overwrote from those it did not, on real SGLang 0.5.23 classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver
from sglang_incident import (
    DECODE_TOKENS,
    PAGE,
    Node,
    decode_step,
    finish,
    make_node,
    new_req,
    prealloc,
)

from engine_probe.adapters.sglang import SGLangAdapter, attach
from engine_probe.adapters.sglang.adapter import FAKE_BOOTSTRAP_HOST
from engine_probe.canary import SENTINEL
from engine_probe.events import PageStaleRead, PoolSample, RequestFinished


@pytest.fixture
def decode_only(probe: Any, tp_rank0: None) -> Iterator[tuple[SGLangAdapter, Node]]:
    d = make_node(DECODE_TOKENS)
    adapter = attach(
        req_to_token_pool=d.r2t, allocator=d.alloc, role="decode", node="d0", probe=probe
    )
    yield adapter, d
    adapter.detach()


def receive(
    d: Node, rid: str, tenant: str, prompt: int, room: int, deliver: int | None
) -> tuple[Any, int]:
    """Decode's half of a transfer: preallocate, announce the pages, let "prefill" overwrite
    the first ``deliver`` of them (all when None) in every layer, poll until done."""
    req = new_req(rid, tenant, prompt, room)
    receiver = FakeKVReceiver(None, "fake-bootstrap:8998", room)
    receiver.init(prefill_dp_rank=0)
    row, pages = prealloc(d, req, prompt)
    receiver.send_metadata(kv_indices=pages, aux_index=0)
    for page in pages[: len(pages) if deliver is None else deliver]:
        slots = slice(page * PAGE, (page + 1) * PAGE)
        for buf in (*d.kv.k_buffer, *d.kv.v_buffer):
            buf[slots] = torch.randn_like(buf[slots])
    assert receiver.poll() == KVPoll.Success
    return req, row


def test_a_transfer_that_delivered_every_page_is_read_cleanly(decode_only: Any, probe: Any) -> None:
    adapter, d = decode_only
    req, row = receive(d, "a-1", "tenant-a", 24, room=11, deliver=None)
    for pos in range(24, 30):
        decode_step(d, row, pos)
    finish(d, req, row, 30)
    assert probe.of(PageStaleRead) == []
    assert adapter.counters["pages_not_arrived"] == 0
    # the request is named by its bootstrap room: the prefill server's probe names it so too
    (done,) = probe.of(RequestFinished)
    assert (done.request_id, done.tenant, done.prompt_tokens) == ("pd-11", "tenant-a", 24)


def test_pages_a_transfer_never_wrote_are_stale_reads_naming_their_previous_writer(
    decode_only: Any, probe: Any
) -> None:
    adapter, d = decode_only
    a, a_row = receive(d, "a-1", "tenant-a", 24, room=21, deliver=None)
    for pos in range(24, DECODE_TOKENS):  # A's KV in every decode page
        decode_step(d, a_row, pos)
    finish(d, a, a_row, DECODE_TOKENS)
    assert probe.of(PageStaleRead) == []

    # B's 36-token prompt: decode announces 9 pages, and "prefill" (rejected, the incident's
    # placeholder) writes one of them, yet the transfer reports success
    _, b_row = receive(d, "b-1", "tenant-b", 36, room=22, deliver=1)
    assert adapter.counters["pages_not_arrived"] == 8
    decode_step(d, b_row, 36)
    stale = probe.of(PageStaleRead)
    assert {(s.reader_request_id, s.reader_tenant, s.node) for s in stale} == {
        ("pd-22", "tenant-b", "d0")
    }
    exposing = [s for s in stale if s.cross_tenant]
    assert {(s.previous_request_id, s.previous_tenant) for s in exposing} == {("pd-21", "tenant-a")}
    # the eight pages that never arrived; the one that did is B's own
    assert sum(len(s.page_ids) for s in exposing) == 8
    # what decode read in an unwritten page: A's KV but for one element, the mark
    first_unsent = int(d.r2t.req_to_token[b_row, PAGE]) // PAGE
    assert float(d.kv.k_buffer[0][first_unsent * PAGE].reshape(-1)[0]) == SENTINEL


def test_a_second_receiver_of_the_same_room_failing_settles_nothing_of_the_first(
    decode_only: Any, probe: Any
) -> None:
    """SGLang fails a duplicate receiver of a room already in use at once (and all its
    health checks share room 0): its Failed poll must not settle the first one's pages."""
    adapter, d = decode_only
    req = new_req("c-1", "tenant-c", 12, room=31)
    first = FakeKVReceiver(None, "fake-bootstrap:8998", 31)
    first.init(prefill_dp_rank=0)
    row, pages = prealloc(d, req, 12)
    first.send_metadata(kv_indices=pages, aux_index=0)
    for page in pages:
        for buf in (*d.kv.k_buffer, *d.kv.v_buffer):
            buf[page * PAGE : (page + 1) * PAGE] = 1.0
    second = FakeKVReceiver(None, "fake-bootstrap:8998", 31)
    second.abort()
    assert second.poll() == KVPoll.Failed
    assert first.poll() == KVPoll.Success
    decode_step(d, row, 12)
    assert probe.of(PageStaleRead) == []
    assert adapter.counters["pages_not_arrived"] == 0


def test_sglangs_warm_up_fake_transfer_is_not_a_stale_read_nor_a_request(
    decode_only: Any, probe: Any
) -> None:
    """SGLang's start-up warm-up on a decode server (and its health checks) bootstrap from
    FAKE_BOOTSTRAP_HOST: the fake receiver says Success and nothing is written. Not a
    finding, and not anybody's request."""
    adapter, d = decode_only
    req = new_req("warmup-0", "unknown", 8, room=0)
    req.bootstrap_host = FAKE_BOOTSTRAP_HOST
    receiver = FakeKVReceiver(None, f"{FAKE_BOOTSTRAP_HOST}:8998", 0)
    receiver.init(prefill_dp_rank=0)
    row, pages = prealloc(d, req, 8)
    receiver.send_metadata(kv_indices=pages, aux_index=0)
    assert receiver.poll() == KVPoll.Success
    decode_step(d, row, 8)
    finish(d, req, row, 9)
    assert probe.of(PageStaleRead) == []
    assert probe.of(RequestFinished) == []
    # nothing was painted: the warm-up's pages hold what SGLang left there
    assert not bool((d.kv.k_buffer[0] == SENTINEL).any())
    assert adapter.counters["arrivals_unchecked"] == 0


def test_a_pool_indexed_by_page_is_not_marked(decode_only: Any, probe: Any) -> None:
    """A pool whose K buffers are indexed by page (SGLang's ``hnd`` layout) cannot take a
    mark at ``page * page_size``: its announced pages count as arrived, unchecked."""
    adapter, d = decode_only
    d.kv.kv_cache_layout = "hnd"
    before = d.kv.k_buffer[0].clone()
    _, row = receive(d, "h-1", "tenant-h", 16, room=61, deliver=1)
    assert torch.equal(d.kv.k_buffer[0][16:], before[16:])  # nothing painted beyond the sent page
    assert adapter.counters["arrivals_unchecked"] == 1
    assert adapter.counters["pages_not_arrived"] == 0
    decode_step(d, row, 16)
    assert probe.of(PageStaleRead) == []


def test_the_pool_is_sampled_as_forwards_run(decode_only: Any, probe: Any) -> None:
    """Occupancy follows the engine: a sample at watch (empty), then one every
    ``pool_sample_every`` eager forwards, each from the allocator's free count."""
    adapter, d = decode_only
    adapter.pool_sample_every = 4
    adapter.pool_sample_interval_s = 3600.0  # by count alone here
    _, row = receive(d, "e-1", "tenant-e", 16, room=41, deliver=None)
    for pos in range(16, 24):  # eight decode forwards: two more samples
        decode_step(d, row, pos)
    samples = probe.of(PoolSample)
    assert [s.node for s in samples] == ["d0"] * 3
    assert samples[0].used_tokens == 0
    used = DECODE_TOKENS - d.alloc.available_size()
    assert samples[-1].used_tokens == used > 16
    assert all(s.capacity_tokens == DECODE_TOKENS for s in samples)
