"""The vLLM adapter's bookkeeping: requests, tenants, block tables → page ledger → events,
from plain values (:mod:`~engine_probe.adapters.vllm.hooks` reads them out of vLLM's
objects; nothing here imports vLLM or reads its objects, except through :class:`EngineView`).

The ledger model
----------------
One :class:`~engine_probe.ledger.PageLedger` page per vLLM block (``page_size`` = block
size), for the first KV cache group (full attention; a model with several groups gets the
events without the ledger). A block allocated fresh to request R (``allocate_slots``: the
blocks past R's prefix-cache hits) is ``alloc``-ed to R: R is its *computing* request.
Every scheduled step writes R's positions ``[computed, computed + scheduled)`` and reads
``[0, computed + scheduled)`` of R's block table (attention); the adapter applies both when
the step's output reaches ``update_from_output``, writes first. The writes are gathered
(:class:`~engine_probe.adapters.ledger_ops.PendingLedgerOps`) and the ledger checks only
the reads it cannot already vouch for: a step that only appends to R's own blocks from
within the prefix R is known to hold valid keeps every read in that prefix (see
:class:`BlockTracker`'s invariant 4, and what cuts the prefix: a block handed out again
or written by another request while R holds it, a table that shrank).

A request finished from outside while a step that schedules it runs was still run by that
step. vLLM 0.32's ``EngineCore.step`` runs the model, then ``_process_aborts_queue`` (the
aborts that came meanwhile: ``finish_requests(ids, FINISHED_ABORTED)``, which frees the
request's blocks, still cached by hash), then ``update_from_output``; with a batch queue
(async scheduling, pipeline parallelism) ``step_with_batch_queue`` does the same, and the
busy loop's input queue may abort a request between any two steps while one or two steps
scheduling it are in flight. So the adapter keeps the steps ``schedule()`` handed out until
``update_from_output`` gets them; a request finished while one of them schedules it keeps
its record and its block table (as at its finish) until the last such step comes, and that
step's writes and reads are applied like any other's (blocks vLLM has handed out fresh
since are left to their new holder). Forgetting the request at the abort would leave that
step's KV unwritten in the ledger, and a later prefix-cache hit on those blocks would be a
false stale read; the reads of the step, and a failed load it reports, are checked as
usual: an abort hides no real stale read.

A block R holds legitimately without having written it:

* a prefix-cache hit: vLLM matched the block by the hash of its tokens (and R's salt). R's
  read of it is checked *as its computing request's* read: valid iff that request wrote it
  in its current generation. Freed blocks keep their ledger state until vLLM hands them out
  again (vLLM's free queue keeps them matchable), so a hit on a freed block is checked
  against what its computing request wrote. A block whose computing request the adapter
  never saw (attached while it ran) is not checked.
* a KV-connector load: the connector's claimed tokens count as written by R once the load
  succeeded: for a synchronous load, when the step's output reports none of R's blocks in
  ``invalid_block_ids``; for an asynchronous one, when R is in ``finished_recving`` and not
  in ``failed_recving``. Blocks reported invalid are never written by the load: the scheduler
  is expected to recompute them (``kv_load_failure_policy="recompute"``) or fail the request
  (``"fail"``); the step that loaded them is not checked (the scheduler discards its output).
  If the scheduler instead keeps such a block as computed, the next step that reads it is a
  stale read naming whoever wrote the block before.

A prefix-cache hit on a block whose load failed inherits that: the hit is checked against
the block's computing request, which never wrote it.

Not modelled: copy-on-write block copies and KV cache zeroing (``new_block_ids_to_zero``,
which vLLM 0.32 uses only for models that need it), speculative-decoding rollbacks, and
models whose KV cache is not one full-attention group (sliding-window hybrids, Mamba): they
get every event but no stale-read checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch

from engine_probe.adapters.common import StaleReadEmitter, safe_id
from engine_probe.adapters.ledger_ops import PendingLedgerOps, longs
from engine_probe.adapters.registry import Bounded, RequestRegistry
from engine_probe.adapters.reporting import Reporter, Reporting
from engine_probe.events import PoolSample
from engine_probe.ledger import PageLedger
from engine_probe.probe import BaseProbe

__all__ = ["Block", "BlockTracker", "EngineView"]

#: more steps in flight than any vLLM batch queue holds: the oldest never came back
_MAX_IN_FLIGHT: Final = 16
#: vLLM's ids of a parallel-sampling (n > 1) request's children: f"{index}_{parent id}"
#: (vllm/v1/engine/parallel_sampling.py), the parent id ending in a random suffix
_CHILD: Final = re.compile(r"(0|[1-9][0-9]*)_(.+)", re.DOTALL)
#: first children remembered for their siblings (added right after them, in order)
_RECENT_FIRST_CHILDREN: Final = 4096


class Block(Protocol):
    """An entry of a block table as the engine keeps it."""

    @property
    def block_id(self) -> int: ...


class EngineView(Protocol):
    """What the bookkeeping reads of the engine, as plain values (``hooks.SchedulerView``).

    ``tables``: request id → its block table, the engine's own lists (read, never copied
    whole, on the per-step fast path), or None where the engine keeps none to read."""

    @property
    def tables(self) -> Mapping[str, Sequence[Block]] | None: ...

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a new list)."""
        ...

    def free_blocks(self) -> int:
        """The block pool's free blocks now."""
        ...


@dataclass(eq=False)
class _Req:
    """What the adapter keeps per live request (host side)."""

    handle: int
    request_id: str
    tenant: str
    tenant_handle: int
    route: str | None
    model_id: str
    salted: bool
    prompt_tokens: int
    #: block id → handle of the request whose write makes this request's read of it valid
    #: (prefix-cache hits); blocks absent here are checked as this request's own
    grants: dict[int, int] = field(default_factory=dict)
    #: blocks this request holds that nobody here saw computed (not checked)
    trusted: set[int] = field(default_factory=set)
    #: token range [start, end) a KV connector claimed to load, not confirmed yet
    pending_load: tuple[int, int] | None = None
    #: output tokens of a streaming-input session's earlier chunks (vLLM drops them from
    #: the request when the next chunk comes)
    earlier_completion_tokens: int = 0
    #: the engine's own request object (a streaming-input session's, for all its chunks):
    #: opaque here, handed back to the hooks by :meth:`BlockTracker.engine_requests`
    request: Any = None
    #: TEST ONLY (fault injection): its KV writes are not recorded
    lose_writes: bool = False
    #: positions ``[0, valid_upto)`` of its block table whose reads the ledger holds valid
    #: (checked, or written by this request itself since; see ``BlockTracker``)
    valid_upto: int = 0
    #: ids of the leading blocks of its table that ``valid_upto`` covers (any part of),
    #: each registered in the tracker's ``_holders``
    covered: list[int] = field(default_factory=list)


class BlockTracker(Reporting):
    """The requests of one vLLM scheduler, their blocks and the page ledger (see the module
    docstring); the hooks tell it what the scheduler did, in plain values.

    Invariants:

    1. ``_reqs`` holds exactly the requests the scheduler has admitted and not yet finished
       since the attach.
    2. ``_computed_by`` maps every block the adapter saw allocated fresh to the handle of the
       request it was allocated to (its computing request), until vLLM hands the block out
       fresh again. It is the ledger's owner of the block once ``_ops`` is flushed.
    3. The ledger, with ``_ops`` applied, is what applying every allocation and write the
       adapter saw, in order, would make it.
    4. For every live request R, a read by R of positions ``[0, R.valid_upto)`` of its block
       table is valid in the ledger (with ``_ops`` applied), and ``R.covered`` lists the
       first ``ceil(R.valid_upto / block_size)`` blocks of its table, each with R in
       ``_holders[block]`` at its index.
    5. ``_full[b] == h`` only if, with ``_ops`` applied, a read of all of block ``b`` by
       handle ``h`` is valid in the ledger: ``h`` owns it and wrote it whole in its current
       generation.

    Invariant 4 is why most steps check no read in the ledger: a step that only writes
    R's own blocks (``_computed_by`` names R) from a position within ``[0, valid_upto]``
    extends R's valid prefix to the step's end, by the ledger's own rule (an owner writing
    from within its page's written prefix extends the prefix: ``PageLedger.write``), and its
    reads ``[0, end)`` then lie in it. Anything else is checked in the ledger: a request's
    first step after prefix-cache hits, a KV load, a block not its own, a hole, a failed
    load in the step, or a finished request's in-flight step. What could make a valid read
    stale, the ledger's only ways, keeps invariant 4: a block allocated fresh, or written by
    a request that does not own it, cuts every holder's valid prefix to before that block
    (in a correct vLLM neither happens to a block a live request holds: this is how the
    ledger catches it when it does); a block table that shrank (preemption frees it, and the
    next allocation finds it shorter) cuts its request's prefix to what is left.

    Invariant 5 extends a request's valid prefix over its prefix-cache hits (and, after a
    preemption, over its own blocks found again) without the ledger: a hit block read as
    its computing request's is valid iff ``_full`` names that request. ``_full`` learns a
    block whole when a valid prefix covers it, and forgets it when the block is handed out
    fresh or written by a request that does not own it: the ledger's only ways to spoil it.

    Not thread-safe: vLLM calls every hook on its scheduler's one thread.
    """

    def __init__(
        self,
        view: EngineView,
        probe: BaseProbe | None,
        *,
        deployment_id: str | None,
        node: str,
        role: str,
        model_id: str,
        block_size: int,
        num_blocks: int,
        null_block: int,
        ledger: bool,
        pool_sample_every: int,
        flush_every: int,
        handle_capacity: int,
        test_lose_kv_write_of_tenant: str | None,
    ) -> None:
        if pool_sample_every < 1:
            raise ValueError("pool_sample_every must be >= 1")
        if flush_every < 1:
            raise ValueError("flush_every must be >= 1")
        self.flush_every = flush_every
        self.node = safe_id(node, "node")
        self.pool_sample_every = pool_sample_every
        # request handles and names, tenant handles (the tenants are the clients' strings:
        # bounded, least recently admitted first out; a tenant back after its eviction gets
        # a fresh handle, never another tenant's). TEST ONLY (the plugin's
        # KVWATCH_TEST_FAULT_INJECTION): the first request of test_lose_kv_write_of_tenant
        # gets its KV writes left out of the ledger, a stale read to be caught
        self._registry = RequestRegistry(handle_capacity, test_lose_kv_write_of_tenant)
        self._view = view
        self._model_id = model_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.role = role
        self.ledger: PageLedger | None = (
            PageLedger(num_blocks, "cpu", "kv", page_size=block_size) if ledger else None
        )
        self._null_block = null_block
        # The first (only) KV cache group's request id -> its blocks (the engine's own
        # lists, not copies); None where the engine keeps them elsewhere, and the view's
        # block_ids serves
        self._tables = view.tables
        # allocations and writes not applied to the ledger yet (invariant 3)
        self._ops: PendingLedgerOps | None = (
            PendingLedgerOps(self.ledger) if self.ledger is not None else None
        )
        # block -> {handle: (request, index of the block in its table)} of the live requests
        # whose valid prefix covers it (invariant 4)
        self._holders: dict[int, dict[int, tuple[_Req, int]]] = {}
        # block -> the handle whose read of the whole block the ledger holds valid
        # (invariant 5): checks a prefix-cache hit on it without the ledger
        self._full: dict[int, int] = {}
        # blocks written this step by a request that does not own them (see step)
        self._foreign_this_step: set[int] = set()
        # raw request id -> (recorded id, tenant, prompt tokens) of recent admissions, to
        # find parallel-sampling siblings (vLLM's children of one n>1 request)
        self._recent: Bounded[str, tuple[str, str, int]] = Bounded(_RECENT_FIRST_CHILDREN)
        self._reqs: dict[str, _Req] = {}
        self._computed_by: dict[int, int] = {}
        # reuse counts of allocations applied to the ledger, not yet sent as page.reuse
        self._pending_reuse: torch.Tensor | None = None
        # the scheduled tokens (request id -> count) of the steps schedule() handed out and
        # update_from_output() has not had yet (one in vLLM's plain step, up to its batch
        # queue's size with async scheduling or pipeline parallelism), oldest first
        self._in_flight: list[Mapping[str, int]] = []
        # request id → (its record, its block table at its finish), for requests finished
        # (aborted) while scheduled in an in-flight step: that step still runs and writes
        # their KV, which the adapter applies when the step's output comes
        self._finished_in_flight: dict[str, tuple[_Req, list[int]]] = {}
        self._steps = 0
        self.counters: dict[str, int] = {
            "steps": 0,
            "stale_reads": 0,
            "prefix_hits_cross_tenant": 0,
            "prefix_hits_same_tenant": 0,
            "prefix_hits_unknown_owner": 0,
            "failed_loads": 0,
            "read_checks": 0,
            "ledger_flushes": 0,
        }
        self._reporter = Reporter(probe, deployment_id, self.counters)
        # vLLM knows no tenant handle's name apart from its requests: the recorded tenant
        self._stale = StaleReadEmitter(
            self._reporter.emit, self.counters, self._registry.names, lambda _handle: None
        )

    # -- public helpers ------------------------------------------------------------------

    def sample_pool(self) -> None:
        """Emit one ``pool.sample`` now (host counters only)."""
        usable = self.num_blocks - 1  # vLLM keeps one null block out of the pool
        free = min(self._view.free_blocks(), usable)
        bs = self.block_size
        self._reporter.emit(
            PoolSample,
            node=self.node,
            role=self.role,
            capacity_tokens=self.num_blocks * bs,
            used_tokens=(usable - free) * bs,
            free_tokens=free * bs,
        )

    def flush(self) -> None:
        """Apply the allocations and writes gathered since the last flush to the ledger, and
        send their reuse counts as one ``page.reuse``. The adapter flushes before every read
        check it needs the ledger for, every ``flush_every`` steps, when the scheduler runs
        out of requests and at shutdown; call it before reading the ledger yourself."""
        ops = self._ops
        if ops is None or not ops.pending:
            return
        self.counters["ledger_flushes"] += 1
        counts = ops.flush()
        if counts is not None:
            pending = self._pending_reuse
            self._pending_reuse = counts if pending is None else pending + counts

    @property
    def live(self) -> Mapping[str, _Req]:
        """Request id → record of the requests admitted and not finished (invariant 1)."""
        return self._reqs

    # -- what the scheduler did (called by the hooks) ------------------------------------

    def admit(
        self,
        raw_id: str,
        *,
        tenant: str,
        route: str | None,
        salted: bool,
        prompt_tokens: int,
        max_tokens: int | None,
        request: Any,
    ) -> None:
        """The scheduler took a new request (vLLM's id ``raw_id``; ``tenant`` and ``route``
        as the wire carries them; ``request``: the engine's object, kept opaque)."""
        rid = safe_id(str(raw_id), "req")
        handle = self._registry.add(rid, tenant)
        req = _Req(
            handle=handle,
            request_id=rid,
            tenant=tenant,
            tenant_handle=self._registry.tenant_handle(handle),
            route=route,
            model_id=self._model_id,
            salted=salted,
            prompt_tokens=prompt_tokens,
            request=request,
            lose_writes=self._registry.lost == handle,  # TEST ONLY
        )
        self._reqs[raw_id] = req
        self._reporter.admitted(
            req,
            prompt_tokens=req.prompt_tokens,
            max_tokens=max_tokens,
            node=self.node,
            prompt_shared_with=self._first_sibling(str(raw_id), rid, req),
        )

    def next_chunk(self, raw_id: str, output_tokens: int, new_prompt_tokens: int) -> None:
        """A streaming-input session takes its next chunk: vLLM drops the previous chunk's
        ``output_tokens`` from the request (keeping the computed ones as prompt), so they
        add up here, with the chunk's new prompt tokens."""
        req = self._reqs.get(raw_id)
        if req is None:
            return
        req.earlier_completion_tokens += output_tokens
        req.prompt_tokens += new_prompt_tokens

    def engine_requests(self, raw_ids: Iterable[str]) -> list[Any]:
        """The engine's request objects of the live requests among ``raw_ids``."""
        live = self._reqs
        return [r.request for r in (live.get(rid) for rid in raw_ids) if r is not None]

    def table_seen(self, req: _Req, blocks: int) -> None:
        """``req``'s table holds ``blocks`` blocks now (before an allocation): one that
        shrank (freed meanwhile: a preemption) cuts its valid prefix (invariant 4)."""
        if blocks * self.block_size < req.valid_upto:
            self._cut(req, blocks)

    def allocated(
        self,
        raw_id: str,
        held: int,
        computed: int,
        num_hit_tokens: int,
        hits: list[int],
        table: list[int],
        num_external: int,
    ) -> None:
        """``allocate_slots`` grew the request's table (``held`` blocks before, ``table``
        now, its first ``computed`` tokens computed before): ``hits`` are the prefix-cache
        hits it was handed (``num_hit_tokens``), the rest past ``held`` fresh blocks, and
        ``num_external`` tokens past the hits a KV connector will load."""
        req = self._reqs.get(raw_id)
        if req is None:
            return
        hits = [b for b in hits if b != self._null_block]
        hit_set = set(hits)
        fresh = [b for b in table[held:] if b != self._null_block and b not in hit_set]
        if hits:
            self._on_hits(req, hits, num_hit_tokens)
        if fresh and self._ops is not None:
            holders, full = self._holders, self._full
            for b in fresh:
                full.pop(b, None)
                if b in holders:  # a block a live request holds, handed out again
                    self._invalidate(b)
            self._ops.alloc(fresh, req.handle, req.tenant_handle)
        for b in fresh:
            self._computed_by[b] = req.handle
            req.grants.pop(b, None)
            req.trusted.discard(b)
        if num_external > 0:
            start = computed + num_hit_tokens
            req.pending_load = (start, start + num_external)

    def scheduled(self, step: Mapping[str, int]) -> None:
        """``schedule()`` handed out a step (its scheduled tokens per request id): in
        flight until its output comes."""
        flight = self._in_flight
        flight.append(step)
        if len(flight) > _MAX_IN_FLIGHT:  # steps that never came back (an engine error)
            del flight[0]

    def landed(self, step: Mapping[str, int]) -> None:
        """A step's output reached ``update_from_output``: no longer in flight."""
        flight = self._in_flight
        for i, o in enumerate(flight):
            if o is step:
                del flight[i]
                return

    def finishing(self, raw_ids: Iterable[str]) -> None:
        """Requests about to be finished from outside (vLLM's engine core aborts them
        after running a step and before handing its output to ``update_from_output``, and
        with a batch queue between any two steps) while a step that schedules them is in
        flight: that step runs and writes their KV all the same. Keep what applying its
        writes needs (their block table is freed with them)."""
        if not self._in_flight:
            return
        for rid in raw_ids:
            req = self._reqs.get(rid)
            if req is None:
                continue
            if any(rid in o for o in self._in_flight):
                self._finished_in_flight[rid] = (req, self._view.block_ids(rid))

    def drop_finished_in_flight(self) -> None:
        """Forget finished requests no step in flight schedules any more."""
        kept = self._finished_in_flight
        if not kept:
            return
        for rid in list(kept):
            if not any(rid in o for o in self._in_flight):
                req, _ = kept.pop(rid)
                self._cut(req, 0)
                self._stale.forget(req.handle)

    def step(
        self,
        scheduled: Mapping[str, int],
        starts: Mapping[str, int],
        invalid: set[int],
        failed: set[str],
        received: set[str],
    ) -> None:
        """Apply one step's writes, then check its reads (before vLLM's own bookkeeping,
        which frees finished requests' blocks). ``scheduled``: tokens per request id;
        ``starts``: each one's computed tokens when the step was scheduled (its first
        position written; read only with the ledger on); from the KV connector's output,
        the blocks whose load failed (``invalid``) and the requests whose asynchronous load
        failed or completed (``failed``, ``received``)."""
        self._steps += 1
        for rid in received:
            req = self._reqs.get(rid)
            if req is not None and req.pending_load is not None and rid not in failed:
                self._confirm_load(req, self._view.block_ids(rid), invalid)
        for rid in failed:
            req = self._reqs.get(rid)
            if req is not None and req.pending_load is not None:
                req.pending_load = None
                self.counters["failed_loads"] += 1
        if self.ledger is None:
            return
        block_ids = self._view.block_ids
        checks: list[tuple[_Req, list[int], int, bool]] = []
        # own appends recorded: (request id, request, start, end, the blocks written)
        appends: list[tuple[str, _Req, int, int, list[int]]] = []
        tables = self._tables
        for rid, n in scheduled.items():
            start = starts.get(rid)
            if start is None:
                continue
            end = start + int(n)
            req = self._reqs.get(rid)
            if req is None:
                kept = self._finished_in_flight.get(rid)
                if kept is None:
                    continue
                req, at_finish = kept
                blocks = self._still_held(req, at_finish)
                if req.pending_load is not None and req.pending_load[1] <= start:
                    self._confirm_load(req, blocks, invalid)
                self._write(req, blocks, start, end, invalid)
                checks.append((req, blocks, end, False))
                continue
            if req.pending_load is not None and req.pending_load[1] <= start:
                self._confirm_load(req, block_ids(rid), invalid)  # synchronous, this step
            if tables is not None and not invalid and not req.lose_writes:
                table = tables.get(rid)
                if start <= req.valid_upto or self._over_whole_blocks(req, table, start):
                    written = self._own_append(req, table, start, end)
                    if written is not None:
                        appends.append((rid, req, start, end, written))
                        continue
            blocks = block_ids(rid)
            self._write(req, blocks, start, end, invalid)
            checks.append((req, blocks, end, True))
        # Only now, with every write of the step recorded (and what they cut, cut): an
        # append whose prefix another request's write cut meanwhile, or whose blocks a
        # non-owner wrote in this step, is checked in the ledger like any other read
        foreign = self._foreign_this_step
        for rid, req, start, end, written in appends:
            if start > req.valid_upto or (foreign and not foreign.isdisjoint(written)):
                checks.append((req, block_ids(rid), end, True))
            else:  # invariant 4: every read of this step lies in the valid prefix
                self._extend(req, written, start, end)
        foreign.clear()
        if checks:
            self._check_reads(checks, invalid)

    def after_step(self, flush: bool) -> None:
        """After a step's update (or, ``flush``, at shutdown): flush the gathered ledger
        operations when due, send their reuse counts, sample the pool when due."""
        if not flush:
            self.counters["steps"] += 1
        ops = self._ops
        if (
            ops is not None
            and ops.pending
            and (
                flush
                or self.counters["steps"] % self.flush_every == 0
                or not self._reqs  # idle: nothing is left waiting for a flush that would come
            )
        ):
            self.flush()
        pending = self._pending_reuse
        if pending is not None:
            self._pending_reuse = None
            self._reporter.page_reuse(
                node=self.node, role=self.role, step=self._steps, counts=pending.tolist()
            )
        if not flush and self.counters["steps"] % self.pool_sample_every == 0:
            self.sample_pool()

    def finished(self, raw_id: str, status: str, output_tokens: int) -> None:
        """The request left the scheduler with ``status`` (the wire's) after
        ``output_tokens`` output tokens (of its last chunk, for a streaming-input session)."""
        req = self._reqs.pop(raw_id, None)
        if req is None:
            return
        self._cut(req, 0)
        self._stale.forget(req.handle)
        self._reporter.finished(
            req,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.earlier_completion_tokens + output_tokens,
            status=status,
            node=self.node,
        )

    # -- admissions ----------------------------------------------------------------------

    def _first_sibling(self, raw_id: str, rid: str, req: _Req) -> str | None:
        """For a parallel-sampling child ``i >= 1`` (vLLM's id ``f"{i}_{parent}"``), the
        recorded id of child 0, which carries the same prompt: when child 0 was admitted
        just before with the same tenant and prompt length. A client's own id of that shape
        matches only if another request of the same tenant and length was sent as
        ``0_<rest>``; vLLM's parent ids end in a random suffix."""
        m = _CHILD.fullmatch(raw_id)
        if m is None:
            return None
        recent = self._recent
        if m.group(1) == "0":
            recent[m.group(2)] = (rid, req.tenant, req.prompt_tokens)
            return None
        first = recent.get(m.group(2))
        if first is None or first[1:] != (req.tenant, req.prompt_tokens) or first[0] == rid:
            return None
        return first[0]

    def _on_hits(self, req: _Req, hits: list[int], num_hit_tokens: int) -> None:
        by_owner: dict[int | None, int] = {}
        for b in hits:
            owner = self._computed_by.get(b)
            if owner is None:
                req.trusted.add(b)  # computed before the attach: nothing to check against
            elif owner != req.handle:
                req.grants[b] = owner
            by_owner[owner] = by_owner.get(owner, 0) + 1
        for owner, pages in by_owner.items():
            if owner == req.handle:
                continue
            known = self._registry.known(owner) if owner is not None else None
            if known is None:
                # computed before the attach (or its name long forgotten): not known to be
                # another tenant's, so no cross-tenant hit (PrefixCacheHit.cross_tenant)
                self.counters["prefix_hits_unknown_owner"] += 1
                continue
            self._reporter.prefix_hit(
                node=self.node,
                role=self.role,
                reader=(req.request_id, req.tenant),
                owner=known,
                pages=pages,
                tokens=min(pages * self.block_size, num_hit_tokens),
                salted=req.salted,
            )

    # -- the ledger ----------------------------------------------------------------------

    def _over_whole_blocks(self, req: _Req, table: Sequence[Block] | None, start: int) -> bool:
        """Extend ``req``'s valid prefix to ``start`` over whole blocks whose reads
        ``_full`` vouches for (invariant 5: prefix-cache hits, checked as their computing
        request's reads; blocks trusted unchecked), if it ends at a block boundary and
        every block up to ``start`` is such a block; False, with nothing changed, if not."""
        bs = self.block_size
        valid = req.valid_upto
        if valid % bs or start % bs or table is None or start // bs > len(table):
            return False
        first, stop = valid // bs, start // bs
        full, grants, trusted, handle = self._full, req.grants, req.trusted, req.handle
        ids = [table[i].block_id for i in range(first, stop)]
        for b in ids:
            if b not in trusted and full.get(b) != grants.get(b, handle):
                return False
        req.valid_upto = start
        holders, covered = self._holders, req.covered
        for k, b in enumerate(ids):
            holders.setdefault(b, {})[handle] = (req, first + k)
            covered.append(b)
        return True

    def _own_append(
        self, req: _Req, table: Sequence[Block] | None, start: int, end: int
    ) -> list[int] | None:
        """Record ``req``'s write of ``[start, end)`` (``start <= req.valid_upto``) if every
        block written is its own: the ids of the blocks written (:meth:`_extend` extends
        the valid prefix over them once the step's other writes are recorded); None, with
        nothing recorded, if not (invariant 4's fast path)."""
        if end <= start:
            return []  # nothing written, and what it reads lies in its valid prefix
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if table is None or last >= len(table) or len(req.covered) < first:
            return None
        handle = req.handle
        computed_by = self._computed_by
        written = [table[i].block_id for i in range(first, last + 1)]
        for b in written:
            if computed_by.get(b) != handle:
                return None
        ops = self._ops
        assert ops is not None
        tenant = req.tenant_handle
        for k, b in enumerate(written):
            base = (first + k) * bs
            ops.write(b, handle, max(start - base, 0), min(end - base, bs), tenant)
        return written

    def _extend(self, req: _Req, written: list[int], start: int, end: int) -> None:
        """``req``'s own append of ``[start, end)`` over ``written`` (its blocks from
        ``start``'s on), recorded, extends its valid prefix to ``end``: blocks written up
        to their end are known whole (invariants 4 and 5)."""
        if end <= req.valid_upto:
            return
        bs = self.block_size
        first = start // bs
        handle, full = req.handle, self._full
        for k, b in enumerate(written):
            if end - (first + k) * bs >= bs:
                full[b] = handle
        req.valid_upto = end
        covered, holders = req.covered, self._holders
        for i in range(len(covered), first + len(written)):
            b = written[i - first]
            holders.setdefault(b, {})[handle] = (req, i)
            covered.append(b)

    def _still_held(self, req: _Req, blocks: list[int]) -> list[int]:
        """A finished request's block table at its finish, less the blocks vLLM has handed
        out fresh since (the null block in their place): the new holder's writes come after
        this step's on the device, and its allocation is what the ledger must keep."""
        computed_by = self._computed_by

        def held(b: int) -> bool:
            if b in req.grants:  # a hit: its computing request's, as long as vLLM keeps it
                return computed_by.get(b) == req.grants[b]
            if b in req.trusted:
                return b not in computed_by
            return computed_by.get(b) == req.handle

        return [b if held(b) else self._null_block for b in blocks]

    def _confirm_load(self, req: _Req, blocks: list[int], invalid: set[int]) -> None:
        """The connector's load for ``req`` succeeded, except in ``invalid`` blocks."""
        assert req.pending_load is not None
        start, end = req.pending_load
        req.pending_load = None
        if invalid & set(blocks):
            self.counters["failed_loads"] += 1
        self._write(req, blocks, start, end, invalid)

    def _write(self, req: _Req, blocks: list[int], start: int, end: int, skip: set[int]) -> None:
        """``req`` wrote positions ``[start, end)`` of its block table (not into ``skip``):
        recorded in ``_ops``, applied with the next flush. A block it does not own is
        another request's no more: whoever held it valid reads it anew (invariant 4)."""
        if self._ops is None or end <= start or req.lose_writes:
            return
        bs = self.block_size
        ops, computed_by, holders = self._ops, self._computed_by, self._holders
        null, grants, trusted = self._null_block, req.grants, req.trusted
        handle, tenant = req.handle, req.tenant_handle
        for i in range(start // bs, min((end - 1) // bs + 1, len(blocks))):
            b = blocks[i]
            if b in skip or b == null or b in grants or b in trusted:
                continue  # a hit block is full and immutable: vLLM never writes into one
            if computed_by.get(b) != handle:
                self._foreign_this_step.add(b)
                self._full.pop(b, None)
                if b in holders:
                    self._invalidate(b)
            ops.write(b, handle, max(start - i * bs, 0), min(end - i * bs, bs), tenant)

    def _check_reads(self, checks: list[tuple[_Req, list[int], int, bool]], skip: set[int]) -> None:
        """One batched ledger check of these requests' attention reads this step
        (``(request, block table, end, live)``): positions ``[0, end)`` of the table, less
        the blocks not checked (``skip``, the null block, blocks trusted unchecked). A live
        request's valid prefix becomes ``[0, end)``, or ends at its first block read stale
        or skipped as a failed load (invariant 4)."""
        assert self.ledger is not None
        self.flush()
        self.counters["read_checks"] += 1
        bs = self.block_size
        pages: list[int] = []
        readers: list[int] = []
        upto: list[int] = []
        owners: list[_Req] = []
        index: list[int] = []  # each page's index in its request's table
        valid: dict[int, int] = {}  # id(live request) -> the end of its valid prefix
        null = self._null_block
        for req, blocks, end, live in checks:
            n = min((end - 1) // bs + 1, len(blocks)) if end > 0 else 0
            read = blocks[:n]
            # up to its first block skipped as a failed load, and never past its table (a
            # table vLLM freed while the step ran, a preemption, vouches for nothing)
            good = min(end, len(blocks) * bs)
            if skip or req.trusted or null in read:
                for i, b in enumerate(read):
                    if b in skip or b == null or b in req.trusted:
                        if b in skip:
                            good = min(good, i * bs)
                        continue
                    pages.append(b)
                    readers.append(req.grants.get(b, req.handle))
                    upto.append(min(end - i * bs, bs))
                    owners.append(req)
                    index.append(i)
            elif n:
                # the common case: every block read is checked (as the list above would)
                pages += read
                grants = req.grants
                if grants:
                    readers += [grants.get(b, req.handle) for b in read]
                else:
                    readers += [req.handle] * n
                upto += [bs] * (n - 1)
                upto.append(min(end - (n - 1) * bs, bs))
                owners += [req] * n
                index += range(n)
            if live:
                valid[id(req)] = good
        if pages:
            p, r, u = longs(pages), longs(readers), longs(upto)
            stale = self.ledger.stale_mask(p, r, u)
            if bool(stale.any()):  # the step's one sync
                rows = stale.nonzero().squeeze(1).tolist()
                by_req: dict[int, list[int]] = {}
                for i in rows:
                    by_req.setdefault(id(owners[i]), []).append(i)
                    key = id(owners[i])
                    if key in valid:
                        valid[key] = min(valid[key], index[i] * bs)
                for found in by_req.values():
                    req = owners[found[0]]
                    sel = torch.tensor(found)
                    self._stale.report(
                        self.ledger.read(p[sel], r[sel], u[sel]),
                        node=self.node,
                        role=self.role,
                        dedupe=True,
                        reader=(req.handle, req.request_id, req.tenant),
                    )
        for req, blocks, _, live in checks:
            if live:
                self._set_valid(req, blocks, valid[id(req)])

    def _set_valid(self, req: _Req, blocks: list[int], valid: int) -> None:
        """A check found ``req``'s reads of ``[0, valid)`` of ``blocks`` (its table) valid:
        every block of it it read whole is known whole (invariant 5)."""
        bs = self.block_size
        full, grants, trusted, null = self._full, req.grants, req.trusted, self._null_block
        for b in blocks[: valid // bs]:
            if b != null and b not in trusted:
                full[b] = grants.get(b, req.handle)
        self._cut(req, valid // bs)
        if valid <= req.valid_upto:
            return
        req.valid_upto = valid
        covered, holders, handle = req.covered, self._holders, req.handle
        for i in range(len(covered), min(-(-valid // bs), len(blocks))):
            b = blocks[i]
            holders.setdefault(b, {})[handle] = (req, i)
            covered.append(b)

    def _cut(self, req: _Req, index: int) -> None:
        """``req``'s valid prefix ends before block ``index`` of its table, at the latest."""
        bs = self.block_size
        if req.valid_upto <= index * bs:
            return
        req.valid_upto = index * bs
        covered, holders, handle = req.covered, self._holders, req.handle
        for b in covered[index:]:
            held = holders.get(b)
            if held is not None:
                held.pop(handle, None)
                if not held:
                    del holders[b]
        del covered[index:]

    def _invalidate(self, block: int) -> None:
        """``block``'s ledger state changed under its holders: none of them holds it valid
        any more (invariant 4)."""
        for req, index in list(self._holders.get(block, {}).values()):
            self._cut(req, index)
