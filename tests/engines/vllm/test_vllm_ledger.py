"""The vLLM adapter's verdicts on real vLLM 0.32 scheduler sequences (runs in .venv-vllm).

Each test builds vLLM's own Scheduler (KVCacheManager, BlockPool, prefix cache, and for the
load tests vLLM's ExampleConnector on the scheduler side), attaches kvwatch's adapter with a
recording probe, and plays the model runner: ``step`` schedules, then hands the scheduler a
``ModelRunnerOutput`` (one sampled token per request whose prompt is done), optionally
reporting KV blocks whose load failed, exactly the channel vLLM's workers use.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import BLOCK

from engine_probe.adapters.vllm.adapter import VllmAdapter, attach
from engine_probe.events import (
    EngineConfig,
    PageReuse,
    PageStaleRead,
    PoolSample,
    PrefixCacheHit,
    RequestAdmitted,
    RequestFinished,
)
from engine_probe.recording import RecordingProbe

DRIVERS: list[Driver] = []


@pytest.fixture(autouse=True)
def _adapter_never_failed() -> Any:
    """The adapter logs and counts its own exceptions instead of raising into vLLM: a test
    that passed with one swallowed would prove nothing."""
    DRIVERS.clear()
    yield
    for d in DRIVERS:
        assert d.adapter.counters.get("errors", 0) == 0, "the adapter raised (see the log)"


class Driver:
    """A real scheduler plus the model runner's side of each step."""

    def __init__(
        self, scheduler: Any, probe: RecordingProbe, *, attached: bool = True, **options: Any
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.scheduler = scheduler
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.probe = probe
        self.requests: dict[str, Any] = {}
        if attached:
            self.attach(**options)

    def attach(self, **options: Any) -> None:
        """Attach the adapter now (``options`` as its keywords)."""
        self.adapter: VllmAdapter = attach(self.scheduler, self.probe, **options)
        DRIVERS.append(self)

    def add(
        self,
        rid: str,
        tokens: list[int],
        tenant: str | None,
        *,
        max_tokens: int = 1,
        salt: str | None = None,
        resumable: bool = False,
    ) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kvwatch_tenant": tenant} if tenant else None
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra, ignore_eos=True)
        req = Request(
            rid,
            tokens,
            params,
            None,
            cache_salt=salt,
            block_hasher=self.hasher,
            resumable=resumable,
        )
        # A streaming-input chunk for a live session updates vLLM's session object: that
        # one is the request the steps report on.
        if rid not in self.scheduler.requests:
            self.requests[rid] = req
        self.scheduler.add_request(req)
        return req

    def step(self, invalid_blocks: set[int] | None = None) -> Any:
        out = self.scheduler.schedule()
        self.finish_step(out, invalid_blocks)
        return out

    def finish_step(self, out: Any, invalid_blocks: set[int] | None = None) -> None:
        """Hand the scheduler the model runner's output of the step it scheduled as ``out``
        (a request finished meanwhile was still run: the worker learns of it next step)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.requests[rid]
            done = req.num_computed_tokens >= req.num_prompt_tokens  # after this step
            sampled.append([7] if done else [])
        kvo = KVConnectorOutput(invalid_block_ids=set(invalid_blocks or ()))
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kvo,
            ),
        )

    def blocks(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def run_until_done(self, limit: int = 50) -> None:
        for _ in range(limit):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def prompt(seed: int, n: int = 4 * BLOCK) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def test_engine_config_and_pool_figures_are_the_schedulers(make_scheduler: Any) -> None:
    probe = RecordingProbe()
    sched = make_scheduler(num_blocks=40)
    Driver(sched, probe)
    (cfg,) = probe.of(EngineConfig)
    assert cfg.engine == "vllm"
    assert cfg.engine_version == __import__("vllm").__version__
    assert cfg.advertised_context == sched.vllm_config.model_config.max_model_len == 1024
    assert cfg.pool_capacity_tokens == 40 * BLOCK
    assert cfg.page_size == BLOCK
    assert cfg.prefix_caching is True
    assert cfg.disaggregated is False
    assert cfg.dtype == "float32"
    (sample,) = probe.of(PoolSample)
    assert sample.capacity_tokens == 40 * BLOCK
    assert sample.used_tokens == 0
    assert sample.free_tokens == 39 * BLOCK  # vLLM's null block is never handed out


def test_clean_sequence_reuses_blocks_across_tenants_without_a_finding(
    make_scheduler: Any,
) -> None:
    probe = RecordingProbe()
    # 1 null block + 5: b's prompt must reuse blocks a's request wrote and freed
    d = Driver(make_scheduler(num_blocks=6), probe)
    d.add("a-1", prompt(1), "tenant-a", max_tokens=3)
    d.run_until_done()
    a_blocks = set(d.adapter._computed_by)
    d.add("b-1", prompt(2), "tenant-b", max_tokens=3)
    d.step()
    assert a_blocks & set(d.blocks("b-1")), "b should have been handed a's freed blocks"
    d.run_until_done()

    assert probe.of(PageStaleRead) == []
    reuse = probe.of(PageReuse)
    assert sum(e.cross_tenant_pages for e in reuse) >= 3
    admitted = {e.request_id: e for e in probe.of(RequestAdmitted)}
    assert admitted["a-1"].tenant == "tenant-a"
    assert admitted["b-1"].prompt_tokens == 4 * BLOCK
    finished = {e.request_id: e for e in probe.of(RequestFinished)}
    assert finished["a-1"].completion_tokens == 3
    assert finished["a-1"].status == "length"
    assert finished["b-1"].tenant == "tenant-b"
    assert probe.of(PrefixCacheHit) == []


def test_cross_tenant_prefix_hit_is_reported_and_is_no_stale_read(make_scheduler: Any) -> None:
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    shared = prompt(3)
    d.add("a-1", shared, "tenant-a")
    d.run_until_done()
    d.add("b-1", shared, "tenant-b", max_tokens=4)
    d.run_until_done()

    (hit,) = probe.of(PrefixCacheHit)
    assert (hit.reader_request_id, hit.reader_tenant) == ("b-1", "tenant-b")
    assert (hit.owner_request_id, hit.owner_tenant) == ("a-1", "tenant-a")
    assert hit.pages == 3  # vLLM never hits the block holding the prompt's last token
    assert hit.tokens == 3 * BLOCK
    assert hit.salted is False
    assert probe.of(PageStaleRead) == []


def test_salted_hits_name_the_salt_and_other_salts_do_not_hit(make_scheduler: Any) -> None:
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    shared = prompt(4)
    d.add("a-1", shared, "tenant-a", salt="team-salt")
    d.run_until_done()
    d.add("c-1", shared, "tenant-c", salt="other-salt")
    d.run_until_done()
    assert probe.of(PrefixCacheHit) == []
    d.add("b-1", shared, "tenant-b", salt="team-salt")
    d.run_until_done()
    (hit,) = probe.of(PrefixCacheHit)
    assert hit.salted is True
    assert (hit.owner_tenant, hit.reader_tenant) == ("tenant-a", "tenant-b")
    assert probe.of(PageStaleRead) == []


def test_same_tenant_hits_are_counted_not_sent(make_scheduler: Any) -> None:
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    shared = prompt(5)
    d.add("a-1", shared, "tenant-a")
    d.run_until_done()
    d.add("a-2", shared, "tenant-a")
    d.run_until_done()
    assert probe.of(PrefixCacheHit) == []
    assert d.adapter.counters["prefix_hits_same_tenant"] == 1
    assert probe.of(PageStaleRead) == []


def _plant_external_kv(scheduler: Any, tokens: list[int]) -> None:
    """Make vLLM's ExampleConnector find ``tokens`` in its storage (its own naming)."""
    connector = scheduler.connector
    n = (len(tokens) - 1) // BLOCK * BLOCK
    connector._generate_foldername_debug(torch.tensor(tokens)[:n], [], create_folder=True)


def _external_load_scenario(
    make_scheduler: Any, *, abort_loader: bool, mid_step: bool = False
) -> tuple[RecordingProbe, Driver, list[int]]:
    """a's request writes blocks and finishes; b's request loads 3 blocks through the KV
    connector into blocks a wrote, and c sends the same prompt in the same step (a
    prefix-cache hit on b's blocks). The load of b's second block fails. With
    ``abort_loader`` b is aborted after that step's output came, or, ``mid_step``, while
    the step runs (after vLLM's schedule, before its update_from_output)."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(num_blocks=9, connector=True, policy="recompute"), probe)
    d.add("a-1", prompt(6, 7 * BLOCK), "tenant-a")
    d.run_until_done()
    loaded = prompt(7)
    _plant_external_kv(d.scheduler, loaded)
    d.add("b-1", loaded, "tenant-b", max_tokens=2)
    d.add("c-1", loaded, "tenant-c", max_tokens=2)
    first = d.scheduler.schedule()
    b_blocks = d.blocks("b-1")
    failed = b_blocks[1]
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(first.num_scheduled_tokens)
    from vllm.v1.request import RequestStatus

    if abort_loader and mid_step:
        d.scheduler.finish_requests("b-1", RequestStatus.FINISHED_ABORTED)
    d.scheduler.update_from_output(
        first,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(invalid_block_ids={failed}),
        ),
    )
    if abort_loader and not mid_step:
        d.scheduler.finish_requests("b-1", RequestStatus.FINISHED_ABORTED)
    d.run_until_done()
    return probe, d, [failed]


def test_failed_load_that_vllm_recomputes_is_no_finding(make_scheduler: Any) -> None:
    probe, _, _ = _external_load_scenario(make_scheduler, abort_loader=False)
    assert probe.of(PageStaleRead) == []
    hits = probe.of(PrefixCacheHit)
    assert [(h.reader_tenant, h.owner_tenant) for h in hits] == [("tenant-c", "tenant-b")]


@pytest.mark.parametrize("mid_step", [False, True], ids=["after-step", "mid-step"])
def test_failed_load_treated_as_computed_is_a_stale_read_naming_both_tenants(
    make_scheduler: Any, mid_step: bool
) -> None:
    """The loading request is aborted, so vLLM recomputes nothing, and the block whose
    load failed stays cached as computed. An abort is no excuse: aborted while the step
    ran (vLLM's engine core processes aborts before the step's output), the step's failed
    load is still known as failed when its output comes, and c's read is still stale."""
    probe, d, failed = _external_load_scenario(make_scheduler, abort_loader=True, mid_step=mid_step)
    (stale,) = probe.of(PageStaleRead)
    assert (stale.reader_request_id, stale.reader_tenant) == ("c-1", "tenant-c")
    assert stale.page_ids == failed
    assert (stale.previous_request_id, stale.previous_tenant) == ("a-1", "tenant-a")
    assert stale.zeroized is False
    assert d.adapter.counters["failed_loads"] == 1


def test_hits_on_blocks_computed_before_the_attach_are_no_cross_tenant_hits(
    make_scheduler: Any,
) -> None:
    """Blocks a request computed before the adapter attached have no known owner: a hit on
    them is not known to cross tenants (PrefixCacheHit.cross_tenant), so it is counted, not
    sent, and the reads of them are not checked."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe, attached=False)
    shared = prompt(13)
    d.add("a-1", shared, "tenant-a")
    d.run_until_done()
    d.attach()
    d.add("b-1", shared, "tenant-b", max_tokens=4)
    d.run_until_done()
    assert probe.of(PrefixCacheHit) == []
    assert d.adapter.counters["prefix_hits_unknown_owner"] == 1
    assert d.adapter.counters["prefix_hits_cross_tenant"] == 0
    assert probe.of(PageStaleRead) == []


def test_tenant_handles_stay_bounded_and_distinct(make_scheduler: Any) -> None:
    """Tenants are the clients' strings: the adapter keeps at most ``handle_capacity`` of
    them. A tenant back after its eviction gets a fresh handle (never another tenant's),
    so every reuse of the previous tenant's blocks still counts as cross-tenant."""
    probe = RecordingProbe()
    # 1 null block + 4: each request (3 blocks) reuses blocks the previous one wrote
    d = Driver(make_scheduler(num_blocks=5), probe, handle_capacity=2)
    tenants = ["t-0", "t-1", "t-2", "t-3", "t-0", "t-4", "t-1"]
    for i, tenant in enumerate(tenants):
        d.add(f"r-{i}", prompt(100 + i, 3 * BLOCK), tenant, max_tokens=2)
        d.run_until_done()
    assert len(d.adapter._registry.tenants) <= 2
    reuse = probe.of(PageReuse)
    assert sum(e.reused_pages for e in reuse) >= len(tenants) - 1
    assert all(e.cross_tenant_pages == e.reused_pages for e in reuse)
    assert probe.of(PageStaleRead) == []


@pytest.mark.parametrize("tenant", [None, "bad tenant name with spaces"])
def test_tenant_falls_back_or_is_made_a_valid_id(make_scheduler: Any, tenant: str | None) -> None:
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    d.add("x-1", prompt(8), tenant)
    d.run_until_done()
    (adm,) = probe.of(RequestAdmitted)
    if tenant is None:
        assert adm.tenant == "unknown"
    else:
        assert adm.tenant.startswith("tenant-") and " " not in adm.tenant


def test_shutdown_aborts_every_request_through_the_hooks(make_scheduler: Any) -> None:
    """vLLM's engine core aborts everything with ``finish_requests(None, ...)`` on shutdown."""
    from vllm.v1.request import RequestStatus

    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    d.add("a-1", prompt(9), "tenant-a", max_tokens=20)
    d.add("b-1", prompt(10), "tenant-b", max_tokens=20)
    d.step()
    d.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    finished = {e.request_id: e for e in probe.of(RequestFinished)}
    assert {k: v.status for k, v in finished.items()} == {"a-1": "aborted", "b-1": "aborted"}
    assert finished["a-1"].completion_tokens == 1
    assert not d.scheduler.has_unfinished_requests()


def test_preemption_and_resumption_raise_no_false_finding(make_scheduler: Any) -> None:
    """A pool too small for both requests' answers: vLLM preempts one (freeing its blocks,
    which the other then gets), and resumes it later from prefix-cache hits and fresh
    blocks. Every read stays legitimate."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(num_blocks=9), probe)
    d.add("a-1", prompt(11, 3 * BLOCK), "tenant-a", max_tokens=3 * BLOCK)
    d.add("b-1", prompt(12, 3 * BLOCK), "tenant-b", max_tokens=3 * BLOCK)
    preempted = 0
    for _ in range(400):
        if not d.scheduler.has_unfinished_requests():
            break
        out = d.step()
        preempted += len(out.preempted_req_ids or ())
    assert not d.scheduler.has_unfinished_requests()
    assert preempted >= 1, "the pool was meant to force a preemption"
    assert probe.of(PageStaleRead) == []
    finished = {e.request_id: e.completion_tokens for e in probe.of(RequestFinished)}
    assert finished == {"a-1": 3 * BLOCK, "b-1": 3 * BLOCK}
    assert sum(e.reused_pages for e in probe.of(PageReuse)) >= 1


@pytest.mark.parametrize("queued", [False, True], ids=["paused", "queued"])
def test_a_streaming_input_session_is_one_request(make_scheduler: Any, queued: bool) -> None:
    """vLLM 0.32's streaming input: each chunk is ``add_request`` with the session's id.
    Sent while the session waits for input, a chunk resumes it at once; sent while it still
    generates, chunks (and the end sentinel) wait in its queue. Either way one request:
    admitted once, every read its own, finished once with every chunk's tokens."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    chunks = [prompt(30, 2 * BLOCK), prompt(31, BLOCK + 3), prompt(32, 5)]
    sent = sum(len(c) for c in chunks)  # (vLLM extends the first chunk's list in place)
    d.add("s-1", chunks[0], "tenant-a", max_tokens=3, resumable=True)
    for chunk in chunks[1:]:
        if not queued:
            d.run_until_done()  # the session now waits for its next input
        d.add("s-1", chunk, "tenant-a", max_tokens=3, resumable=True)
    if not queued:
        d.run_until_done()
    d.add("s-1", [0], "tenant-a")  # the end of the input stream
    d.run_until_done()

    assert "s-1" not in d.scheduler.requests
    assert [e.request_id for e in probe.of(RequestAdmitted)] == ["s-1"]
    (fin,) = probe.of(RequestFinished)
    assert fin.prompt_tokens == sent
    assert fin.completion_tokens == 3 * len(chunks)
    # Closed while waiting for input, vLLM aborts the session: its client ended it
    # normally. A queued end sentinel ends it when its last chunk stops (here: max_tokens).
    assert fin.status == ("length" if queued else "completed")
    assert probe.of(PageStaleRead) == []
    assert d.adapter._reqs == {}


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "batch-queue"])
def test_a_request_aborted_while_its_step_runs_wrote_that_steps_kv(
    make_scheduler: Any, overlap: bool
) -> None:
    """vLLM's engine core runs a step, then processes the aborts that came meanwhile
    (``finish_requests(..., FINISHED_ABORTED)``), then hands the step's output to
    ``update_from_output``; with a batch queue (async scheduling) a request may also be
    aborted between steps while one or two steps scheduling it are still running. Those
    steps wrote its KV: a later prefix-cache hit on its blocks is no stale read."""
    from vllm.v1.request import RequestStatus

    probe = RecordingProbe()
    # chunked prefill of two blocks per step
    d = Driver(make_scheduler(max_batched=2 * BLOCK, async_scheduling=overlap), probe)
    shared = prompt(40, 5 * BLOCK)
    d.add("a-1", shared, "tenant-a", max_tokens=4)
    if overlap:
        running = [d.scheduler.schedule(), d.scheduler.schedule()]
        assert all("a-1" in o.num_scheduled_tokens for o in running)
    else:
        d.step()  # the first chunk
        running = [d.scheduler.schedule()]  # the second, which the client leaves during
    d.scheduler.finish_requests(["a-1"], RequestStatus.FINISHED_ABORTED)
    for out in running:
        d.finish_step(out)
    d.add("b-1", shared, "tenant-b", max_tokens=2)
    d.run_until_done()

    (fin,) = [e for e in probe.of(RequestFinished) if e.request_id == "a-1"]
    assert (fin.status, fin.completion_tokens) == ("aborted", 0)
    (hit,) = probe.of(PrefixCacheHit)
    assert (hit.reader_request_id, hit.owner_request_id) == ("b-1", "a-1")
    assert hit.pages == 4  # both chunks' blocks: vLLM cached them when it scheduled them
    assert probe.of(PageStaleRead) == []
    assert d.adapter._finished_in_flight == {} and d.adapter._in_flight == []


def test_a_block_handed_out_again_while_held_is_caught_at_its_holders_next_read(
    make_scheduler: Any,
) -> None:
    """The adapter checks most steps' reads without the ledger, from the prefix each request
    is known to hold valid. A block handed out fresh while a live request holds it (a
    double allocation: vLLM's block pool made to hand out one of a's blocks to b) must cut
    that prefix: a's next read of the block, which b has overwritten, is a stale read
    naming b."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    d.add("a-1", prompt(21, 2 * BLOCK), "tenant-a", max_tokens=8)
    for _ in range(3):  # a's prefill and two decode steps: its reads are known valid now
        d.step()
    assert d.adapter.counters["read_checks"] == 0, "a clean request should need no check"
    victim_id = d.blocks("a-1")[0]
    pool = d.scheduler.kv_cache_manager.block_pool
    real = pool.get_new_blocks
    handed: list[int] = []

    def double_allocation(num_blocks: int) -> list[Any]:
        out = real(num_blocks)
        if out and not handed:
            spare = out[0]
            spare.ref_cnt -= 1
            pool.free_block_queue.append(spare)
            victim = pool.blocks[victim_id]
            pool._maybe_evict_cached_block(victim)  # as vLLM does to a block it hands out
            victim.ref_cnt += 1
            out[0] = victim
            handed.append(victim_id)
        return out

    pool.get_new_blocks = double_allocation
    d.add("b-1", prompt(22, 2 * BLOCK), "tenant-b", max_tokens=4)
    d.step()  # b's prefill writes the victim block; a decodes in the same step
    pool.get_new_blocks = real
    assert handed == [victim_id] and victim_id in d.blocks("b-1")
    d.step()
    stale = [e for e in probe.of(PageStaleRead) if e.reader_request_id == "a-1"]
    assert stale, "a's read of the block b overwrote went unchecked"
    assert {p for e in stale for p in e.page_ids} == {victim_id}
    assert {(e.previous_request_id, e.previous_tenant) for e in stale} == {("b-1", "tenant-b")}


def test_parallel_sampling_children_name_the_first_child_as_sharing_their_prompt(
    make_scheduler: Any,
) -> None:
    """vLLM fans an ``n > 1`` request out into children ``f"{i}_{parent}"`` with the same
    prompt: children 1..n-1 are admitted with ``prompt_shared_with`` naming child 0, so
    the collector counts the prompt once. An id of that shape whose ``0_`` sibling has
    another prompt or tenant names nobody."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    shared = prompt(31, 2 * BLOCK)
    parent = "cmpl-7f3a-1b2c3d4e"
    for i in range(3):
        d.add(f"{i}_{parent}", shared, "tenant-a", max_tokens=2)
    d.add("0_mine", prompt(32, BLOCK), "tenant-b", max_tokens=1)
    d.add("1_mine", prompt(33, 2 * BLOCK), "tenant-b", max_tokens=1)  # another length
    d.add("1_other", shared, "tenant-a", max_tokens=1)  # no 0_ sibling
    d.run_until_done()
    admitted = {e.request_id: e.prompt_shared_with for e in probe.of(RequestAdmitted)}
    assert admitted == {
        f"0_{parent}": None,
        f"1_{parent}": f"0_{parent}",
        f"2_{parent}": f"0_{parent}",
        "0_mine": None,
        "1_mine": None,
        "1_other": None,
    }
    tokens = {e.request_id: e.prompt_tokens for e in probe.of(RequestAdmitted)}
    assert tokens[f"1_{parent}"] == tokens[f"0_{parent}"] == len(shared)


def test_a_foreign_write_in_the_same_step_is_caught_in_that_step(make_scheduler: Any) -> None:
    """A block of a's that b's block table holds without vLLM having handed it out (a's
    block written into b's table in place, as a corrupted table would): b's write into it
    is a non-owner's write, and a's read of it in the same step (a decodes; the adapter
    sees a's step first) is a stale read reported with that step's output, not a step
    later (a finishes in that step: a later check would never come)."""
    probe = RecordingProbe()
    d = Driver(make_scheduler(), probe)
    d.add("a-1", prompt(41, 2 * BLOCK), "tenant-a", max_tokens=4)
    for _ in range(3):  # a's prefill and two decode steps: a's reads are known valid
        d.step()
    victim_id = d.blocks("a-1")[0]
    d.add("b-1", prompt(42, 2 * BLOCK), "tenant-b", max_tokens=2)
    out = d.scheduler.schedule()  # a's last decode step and b's prefill
    assert next(iter(out.num_scheduled_tokens)) == "a-1"
    manager = d.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    pool = d.scheduler.kv_cache_manager.block_pool
    table = manager.req_to_blocks["b-1"]
    spare, victim = table[0], pool.blocks[victim_id]
    spare.ref_cnt -= 1
    pool.free_block_queue.append(spare)
    victim.ref_cnt += 1
    table[0] = victim
    d.finish_step(out)
    stale = [e for e in probe.of(PageStaleRead) if e.reader_request_id == "a-1"]
    assert stale, "a's read of the block b wrote into went unchecked in that step"
    assert {p for e in stale for p in e.page_ids} == {victim_id}
    assert {(e.previous_request_id, e.previous_tenant) for e in stale} == {("b-1", "tenant-b")}
    assert "a-1" in {e.request_id for e in probe.of(RequestFinished)}
