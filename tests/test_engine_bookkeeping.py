"""The vLLM and SGLang adapters' bookkeeping driven with plain values, without the engines:
what each adapter's hooks would tell it (``tests/engines/`` run the same code under the real
engines' hooks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from engine_probe.adapters.sglang.bookkeeping import NewRequest, PoolTracker
from engine_probe.adapters.vllm.bookkeeping import BlockTracker
from engine_probe.events import (
    Event,
    PageStaleRead,
    PrefixCacheHit,
    RequestAdmitted,
    RequestFinished,
)
from engine_probe.probe import NoopProbe

BS = 16


class _Probe(NoopProbe):
    def __init__(self) -> None:
        self.sent: list[tuple[type[Event], dict[str, Any]]] = []

    def emit(
        self,
        event_type: type[Event],
        /,
        *,
        ts: datetime | None = None,
        deployment_id: str | None = None,
        **fields: Any,
    ) -> bool:
        self.sent.append((event_type, fields))
        return True

    def of(self, kind: type[Event]) -> list[dict[str, Any]]:
        return [f for k, f in self.sent if k is kind]


@dataclass(frozen=True)
class _Block:
    block_id: int


class _Scheduler:
    """What vLLM's hooks read for the tracker: block tables, free blocks."""

    def __init__(self) -> None:
        self.tables: dict[str, list[_Block]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def free_blocks(self) -> int:
        return 4


def _vllm(probe: _Probe) -> tuple[BlockTracker, _Scheduler]:
    sched = _Scheduler()
    tracker = BlockTracker(
        sched,
        probe,
        deployment_id=None,
        node="n",
        role="both",
        model_id="m",
        block_size=BS,
        num_blocks=8,
        null_block=0,
        ledger=True,
        pool_sample_every=1000,
        flush_every=64,
        handle_capacity=64,
        test_lose_kv_write_of_tenant=None,
    )
    return tracker, sched


def _run(
    tracker: BlockTracker,
    sched: _Scheduler,
    rid: str,
    tenant: str,
    blocks: Sequence[int],
    tokens: int,
    hits: Sequence[int] = (),
) -> None:
    """Admit ``rid``, allocate ``blocks`` (the first ``hits`` of them prefix-cache hits),
    run one step writing its prompt past the hits, finish it."""
    tracker.admit(
        rid,
        tenant=tenant,
        route=None,
        salted=False,
        prompt_tokens=tokens,
        max_tokens=1,
        request=None,
    )
    sched.tables[rid] = [_Block(b) for b in blocks]
    computed = len(hits) * BS
    tracker.allocated(rid, 0, 0, computed, list(hits), list(blocks), 0)
    step = {rid: tokens - computed}
    tracker.scheduled(step)
    tracker.landed(step)
    tracker.step(step, {rid: computed}, set(), set(), set())
    tracker.after_step(False)
    tracker.finished(rid, "completed", 1)


def test_vllm_bookkeeping_clean_requests_need_no_ledger_check() -> None:
    probe = _Probe()
    tracker, sched = _vllm(probe)
    _run(tracker, sched, "r-1", "t-a", [1, 2], 20)
    _run(tracker, sched, "r-2", "t-b", [1, 2], 30)  # r-1's blocks handed out again
    assert [f["request_id"] for f in probe.of(RequestAdmitted)] == ["r-1", "r-2"]
    assert [f["completion_tokens"] for f in probe.of(RequestFinished)] == [1, 1]
    assert probe.of(PageStaleRead) == [] and tracker.counters["read_checks"] == 0
    assert tracker.live == {}


def test_vllm_bookkeeping_catches_a_hit_on_a_block_its_owner_did_not_write_whole() -> None:
    probe = _Probe()
    tracker, sched = _vllm(probe)
    _run(tracker, sched, "r-1", "t-a", [1], 16)  # writes block 1 whole
    _run(tracker, sched, "r-3", "t-c", [1], 4)  # handed out again: 4 slots rewritten
    _run(tracker, sched, "r-2", "t-b", [1, 5], 20, hits=[1])  # a hit on it all the same
    (hit,) = probe.of(PrefixCacheHit)
    assert (hit["reader_request_id"], hit["owner_request_id"]) == ("r-2", "r-3")
    (stale,) = probe.of(PageStaleRead)
    assert (stale["reader_request_id"], stale["reader_tenant"]) == ("r-2", "t-b")
    # checked as r-3's read: r-3 wrote 4 slots, the other 12 still hold r-1's KV
    assert stale["page_ids"] == [1]
    assert (stale["previous_request_id"], stale["previous_tenant"]) == ("r-1", "t-a")


def _sglang(probe: _Probe) -> PoolTracker:
    return PoolTracker(
        probe,
        deployment_id=None,
        model_id="m",
        request_capacity=64,
        test_lose_kv_write_of_tenant=None,
    )


def test_sglang_bookkeeping_reads_of_own_writes_are_clean_and_of_a_reused_page_stale() -> None:
    probe = _Probe()
    tracker = _sglang(probe)
    pool = tracker.add_pool("n", "both", device="cpu", size=64, page_size=4)
    table = torch.zeros((2, 8), dtype=torch.long)

    def take(row: int, rid: str, tenant: str, slots: list[int]) -> int:
        handle = tracker.handle(rid, None, lambda: NewRequest(tenant, False, False))
        tracker.row_taken(pool, row, handle)
        tracker.admitted(pool, handle, len(slots), None)
        loc = torch.tensor(slots)
        tracker.handed_out(pool, loc)
        table[row, : len(slots)] = loc
        tracker.bind(pool, torch.full((len(slots),), row), torch.arange(len(slots)), loc)
        return handle

    take(0, "a-1", "t-a", [4, 5, 6, 7])
    tracker.record_write(pool, torch.tensor([4, 5, 6, 7]))
    tracker.check_batch(pool, table, torch.tensor([0]), torch.tensor([4]))
    assert probe.of(PageStaleRead) == []
    # b-1 is bound to page 1 while a-1 still owns it (a page handed out twice), writes one
    # slot and reads four: three of them still hold a-1's KV
    take(1, "b-1", "t-b", [4, 5, 6, 7])
    tracker.record_write(pool, torch.tensor([4]))
    tracker.check_batch(pool, table, torch.tensor([1]), torch.tensor([4]))
    (stale,) = probe.of(PageStaleRead)
    assert (stale["reader_request_id"], stale["page_ids"]) == ("b-1", [1])
    assert (stale["previous_request_id"], stale["previous_tenant"]) == ("a-1", "t-a")
    assert [f["request_id"] for f in probe.of(RequestAdmitted)] == ["a-1", "b-1"]
