"""The refengine adapter: refengine's observer hooks → page ledger, canary, probe events.

``attach(engine)`` (or ``engine.add_observer(RefengineAdapter(...))``) is all it takes. The
adapter is duck-typed: it implements every method of ``refengine.hooks.EngineObserver`` by
name and signature without importing refengine (``engine_probe`` never imports it).

What it emits, through the probe (``get_probe()`` unless one is given):

* ``engine.config`` at attach, one per pool (node = the pool's node id, role prefill, decode
  or both), with the advertised context next to that pool's capacity;
* ``request.admitted`` / ``request.rejected`` / ``request.finished`` with token counts, never
  text. Rejection reasons map to the wire contract: ``prefill_pool_exceeded`` (the legacy
  incident path) and ``kv_pool_exceeded`` → ``pool_exhausted``, ``context_length_exceeded``
  stays;
* ``kv.transfer`` per transfer (pages, tokens copied, from/to node, ``prefill_rejected``);
* ``page.reuse`` per pool per step, when its allocations handed out pages still holding
  somebody's KV (or zeroized ones), with the cross-tenant count;
* ``page.stale_read`` per :class:`~engine_probe.ledger.StaleRead` the ledger finds in a
  decode gather or a transfer, naming reader and previous writer (request and tenant);
* ``prefix_cache.hit`` for every prefix-cache hit, one per (reader, owner) pair: the
  request granted cached pages and the request that computed them, with their tenants,
  same tenant or not (the engine's hits are few, one per request at most, and a hit is a
  reuse across requests either way; ``PrefixCacheHit.cross_tenant`` tells them apart, and
  only cross-tenant ones raise the ``prefix_cache_cross_tenant`` rule). ``salted`` says
  the page keys carried a salt (the request's ``cache_salt``, or the tenant). Hits are
  counted too (``prefix_hits_same_tenant``, ``_cross_tenant``, ``_unknown_owner``);
* ``canary.hit`` (detector ``paint``) in canary mode;
* ``pool.sample`` per pool at attach and every ``pool_sample_every`` steps (cached pages no
  request holds count as free: the allocator evicts them on demand, and vLLM counts its
  evictable cached blocks so).

Slot ranges
-----------
The ledger tracks, per page, how many leading slots its owner has written (``filled``). A
write covers the positions from ``req.cache_len`` on (prefill: from 0 to the tokens it
actually wrote, ``cached_prompt_tokens``; a decode step: the one slot at ``cache_len``, the
position its fed-back token takes), so each page's slot range follows: the first page from
``cache_len % page_size``, the last up to the last position written. A read covers, per page,
the slots attention used (``on_kv_read``'s ``valid`` mask, passed to the ledger as is). A read
past a page's ``filled`` is stale and names the writer of the slots past it.

That is what keeps the incident's decode pages stale: decode trusts 1000 prompt positions,
so its first write lands at slot 8 of a page prefill never wrote (a hole: it validates
nothing). And it is what catches the transferred placeholder page: prefill wrote one token
into slot 0, decode reads it as 16 positions, and slots 1..15 still hold what the prefill
page held before (another tenant's prompt, named as the previous writer).

Reporting
---------
A decode step re-reads every page of each reader's block table. A stale page is reported
once per (reader, page, previous writer, zeroized), a painted page once per (reader, page,
painting tenant): without that, one leaking request would send an event per page group per
generated token. The memory of what was reported is host-side, per reader, and dropped when
the reader finishes.

Cost
----
No per-page Python loop on the common path, and at most one device-to-host sync per engine
step: allocations' reuse counts (``alloc_counts``) accumulate as device tensors; the decode
read computes "any stale page" (``any_stale``: the pages' owners against the readers, and the
``valid`` mask against the pages' written prefixes, 8 slots per int64 word) and "any valid
slot starting with the sentinel" without syncing, and one ``.tolist()`` of those flags and
the reuse counts decides whether the rare path (grouping, deduplicating and reporting, which
syncs freely and runs on every step while a leaking request decodes) runs. Steps without a
decode sync the reuse counts in ``on_step``. ``PageLedger.transfer`` syncs once per
transferred request on its own.

With the prefix cache on, a prefill that hits adds one sync for the hit's owners
(``on_prefix_hit``) and one for the read check of the granted pages its first token attends
to; the engine itself copies page ids to the host then too.

If attached while requests are in flight, the pages they already own are unknown to the
ledger: their reads are not checked (requests admitted after attach are).

Prefix-cache grants
-------------------
A cached page stays owned, in the ledger, by the request that computed it after that
request finished: the engine fires ``on_free`` for a cached page only when the cache evicts
it. ``on_prefix_hit`` hands the ledger a grant per page (:meth:`PageLedger.grant`): the
reader's reads of it are checked as its computing request's, so a granted page read while
it still holds that request's write is no stale read, and one handed out again or
overwritten meanwhile (an engine that evicted a page in use) is one, reported as the
reader's and naming the page's new writer. Grants are revoked when the reader finishes. A
hit on a page computed before the attach (unknown to the ledger) is taken on trust: the
ledger records it as written by its computing request before the grant.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch
from torch import Tensor

from engine_probe.adapters.common import UNKNOWN, StaleReadEmitter, chunks, safe_id
from engine_probe.adapters.registry import Bounded
from engine_probe.adapters.reporting import Reporter, Reporting, RequestIds
from engine_probe.canary import CanaryFinding, PoolCanary
from engine_probe.events import (
    CanaryHit,
    EngineConfig,
    KvTier,
    KvTransfer,
    PoolSample,
    PrefixCacheHit,
)
from engine_probe.ledger import PageLedger
from engine_probe.probe import BaseProbe
from engine_probe.tier_ledger import TierLedger, TierWriter, salt_digest

__all__ = ["REJECT_REASONS", "RefengineAdapter", "attach"]

#: refengine's rejection reasons → the wire contract's ``RejectReason``.
REJECT_REASONS: Final[Mapping[str, str]] = {
    "context_length_exceeded": "context_length_exceeded",
    "prefill_pool_exceeded": "pool_exhausted",
    "kv_pool_exceeded": "pool_exhausted",
}
_FINISH_STATUS: Final[Mapping[str, str]] = {"stop": "completed", "length": "length"}


# -- what the adapter reads from refengine's objects (duck-typed) ---------------------------


class _Pool(Protocol):
    name: str
    role: Any
    num_pages: int
    page_size: int
    device: torch.device
    dtype: torch.dtype
    k: Tensor
    v: Tensor

    @property
    def capacity_tokens(self) -> int: ...
    @property
    def used_tokens(self) -> int: ...
    @property
    def free_tokens(self) -> int: ...
    @property
    def held_tokens(self) -> int: ...
    @property
    def available_tokens(self) -> int: ...


class _Request(Protocol):
    request_id: str
    tenant: str
    handle: int
    tenant_handle: int
    model: str
    route: str | None
    max_tokens: int
    status: str
    finish_reason: str | None
    cache_len: int
    cached_prompt_tokens: int
    cached_tokens: int
    cache_salt: str | None

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


@dataclass(eq=False)
class _PoolState:
    name: str
    node: str
    role: str
    page_size: int
    ledger: PageLedger | None
    canary: PoolCanary | None
    #: this step's reuse counts [reused, cross_tenant, zeroized], not synced yet
    pending: Tensor | None = None
    reuse: list[int] = field(default_factory=lambda: [0, 0, 0])


class RefengineAdapter(Reporting):
    """Observer of one refengine ``Engine`` (see the module docstring).

    ``ledger``: keep a :class:`PageLedger` per pool and report reuse and stale reads.
    ``canary``: paint freed pages and report gathered KV that still holds the paint; works
    with ``ledger=False`` (an independent detector). ``nodes`` maps pool names to node ids
    (default: the pool name: ``kv`` monolithic, ``prefill``/``decode`` disaggregated).

    Invariants: ``_pools`` holds one state per pool of the attached engine, keyed by pool
    name; a state's ``ledger``/``canary`` live on its pool's device; ``pending`` is None
    outside a step's allocations-to-sync window.
    """

    def __init__(
        self,
        probe: BaseProbe | None = None,
        *,
        deployment_id: str | None = None,
        ledger: bool = True,
        canary: bool = False,
        pool_sample_every: int = 16,
        engine_name: str = "refengine",
        engine_version: str | None = None,
        nodes: Mapping[str, str] | None = None,
        request_capacity: int = 1 << 16,
    ) -> None:
        if pool_sample_every < 1:
            raise ValueError("pool_sample_every must be >= 1")
        self.use_ledger = ledger
        self.use_canary = canary
        self.pool_sample_every = pool_sample_every
        self.engine_name = engine_name
        self.engine_version = engine_version
        self._nodes = dict(nodes or {})
        self._engine: Any = None
        self._pools: dict[str, _PoolState] = {}
        self._prefill_node = self._decode_node = "node-0"
        self._model_id: str | None = None
        # handle -> (request id, tenant handle), for naming previous writers of stale pages
        self._requests: Bounded[int, tuple[str, int]] = Bounded(request_capacity)
        # handle -> digest of its cache_salt (None: it sent none), for the tier's writers
        self._salts: Bounded[int, bytes | None] = Bounded(request_capacity)
        self._tier: TierLedger | None = None
        self._tenant_ids: dict[int, str] = {}
        # canary findings reported, per reader handle: (pool, page, painting tenant)
        self._seen_canary: dict[int, set[tuple[str, int, int]]] = {}
        # attached mid-flight: reads by requests older than the first one seen are not checked
        self._pre_attach_pages = False
        self._first_handle: int | None = None
        self.counters: dict[str, int] = {
            "steps": 0,
            "syncs": 0,
            "stale_reads": 0,
            "canary_hits": 0,
            "reuse_events": 0,
            "prefix_hits_same_tenant": 0,
            "prefix_hits_cross_tenant": 0,
            "prefix_hits_unknown_owner": 0,
            "tier_stores": 0,
            "tier_loads": 0,
            "tier_loads_unknown_writer": 0,
            "tier_loads_salt_mismatch": 0,
        }
        self._reporter = Reporter(probe, deployment_id, self.counters)
        self._prefix_caching = False
        self._salt_mode = "off"
        self._stale = StaleReadEmitter(
            self._reporter.emit, self.counters, self._names, self._tenant_name
        )

    # -- public helpers ------------------------------------------------------------------

    @property
    def ledgers(self) -> dict[str, PageLedger]:
        return {n: s.ledger for n, s in self._pools.items() if s.ledger is not None}

    def node_of(self, pool_name: str) -> str:
        return self._pools[pool_name].node

    def detach(self) -> None:
        if self._engine is not None:
            self._engine.remove_observer(self)
            self._engine = None

    def sample_pools(self) -> None:
        """Emit one ``pool.sample`` per pool now (host counters: no device sync)."""
        if self._engine is None:
            return
        for pool in self._engine.pools.values():
            st = self._pools[pool.name]
            self._reporter.emit(
                PoolSample,
                node=st.node,
                role=st.role,
                capacity_tokens=pool.capacity_tokens,
                # idle prefix-cache pages count as free (evictable), as vLLM counts them
                used_tokens=pool.held_tokens,
                free_tokens=pool.available_tokens,
            )

    # -- EngineObserver: attach and requests ----------------------------------------------

    def on_attach(self, engine: Any) -> None:
        self._engine = engine
        info = engine.info()
        self._model_id = str(info["model_id"])
        self._prefix_caching = bool(info.get("prefix_cache", False))
        self._salt_mode = str(info.get("prefix_cache_mode", "off"))
        version = self.engine_version or str(info.get("engine_version", "unknown"))
        tier_pages = int(info.get("offload_tier_pages", 0))
        self._tier = TierLedger(tier_pages) if tier_pages and self.use_ledger else None
        tiers: tuple[KvTier, ...] = ()
        if tier_pages:
            # keyed by the prefix cache's salted chain (refengine.offload): salted by design
            size = int(info.get("offload_tier_bytes", 0)) or None
            tiers = (KvTier(medium="cpu", backend="native", capacity_bytes=size, salted=True),)
        self._pools = {}
        for pool in engine.pools.values():
            node = safe_id(self._nodes.get(pool.name, pool.name), "node")
            ledger = (
                PageLedger(pool.num_pages, pool.device, pool.name, page_size=pool.page_size)
                if self.use_ledger
                else None
            )
            canary = (
                PoolCanary(pool.num_pages, pool.device, pool.dtype) if self.use_canary else None
            )
            self._pools[pool.name] = _PoolState(
                name=pool.name,
                node=node,
                role=str(pool.role),
                page_size=pool.page_size,
                ledger=ledger,
                canary=canary,
            )
            if pool.used_tokens:
                self._pre_attach_pages = True
            self._reporter.emit(
                EngineConfig,
                engine=self.engine_name,
                engine_version=version,
                model_id=self._model_id,
                node=node,
                role=str(pool.role),
                advertised_context=int(info["advertised_context"]),
                pool_capacity_tokens=pool.capacity_tokens,
                page_size=pool.page_size,
                dtype=str(info["dtype"]),
                tp_size=int(info.get("tp_size", 1)),
                cuda_graphs=bool(info.get("cuda_graphs", False)),
                disaggregated=bool(info["disaggregated"]),
                prefix_caching=self._prefix_caching,
                prefix_cache_salting=bool(info.get("prefix_cache_salting", False)),
                kv_connector="offload" if tiers else None,
                kv_tiers=tiers,
            )
        self._prefill_node = self._pools[engine.prefill_pool.name].node
        self._decode_node = self._pools[engine.decode_pool.name].node
        self.sample_pools()

    def on_request_admitted(self, req: _Request) -> None:
        self._remember(req)
        self._reporter.admitted(
            self._ids(req),
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens,
            node=self._prefill_node,
        )

    def on_request_rejected(
        self, req: _Request, reason: str, limit_tokens: int, prompt_tokens: int
    ) -> None:
        self._remember(req)
        self._reporter.rejected(
            self._ids(req),
            reason=REJECT_REASONS.get(reason, "other"),
            prompt_tokens=prompt_tokens,
            limit_tokens=limit_tokens,
            node=self._prefill_node,
        )

    def on_request_truncated(self, req: _Request, limit_tokens: int, prompt_tokens: int) -> None:
        """No event kind for a silent truncation: ``request.admitted`` already carries the
        full prompt token count, which is what context-pressure rules need."""

    def on_request_finished(self, req: _Request) -> None:
        self._stale.forget(req.handle)
        self._seen_canary.pop(req.handle, None)
        for st in self._pools.values():
            if st.ledger is not None:
                st.ledger.revoke(req.handle)
        if req.status == "aborted":
            status = "aborted"
        else:
            status = _FINISH_STATUS.get(req.finish_reason or "", "error")
        self._reporter.finished(
            self._ids(req),
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.completion_tokens,
            status=status,
            node=self._decode_node,
            cached_tokens=int(req.cached_tokens) if self._prefix_caching else None,
        )

    # -- EngineObserver: pages -------------------------------------------------------------

    def on_alloc(self, pool: _Pool, pages: Tensor, req: _Request) -> None:
        st = self._pools[pool.name]
        if req.handle not in self._requests:
            self._remember(req, new=False)
        if st.ledger is not None:
            counts = st.ledger.alloc_counts(pages, req.handle, req.tenant_handle)
            st.pending = counts if st.pending is None else st.pending + counts
        if st.canary is not None:
            st.canary.on_alloc(pages, req.tenant_handle)

    def on_prefix_hit(self, pool: _Pool, pages: Tensor, req: _Request, owners: Tensor) -> None:
        st = self._pools[pool.name]
        if req.handle not in self._requests:
            self._remember(req, new=False)
        owner_list = owners.tolist()  # one sync per hit (a prefill, which syncs anyway)
        if st.ledger is not None:
            unknown = [self._unchecked(o) for o in owner_list]
            if any(unknown):  # computed before the attach: taken on trust (see above)
                sel = torch.tensor(unknown, device=pages.device)
                for o in sorted({o for o, u in zip(owner_list, unknown, strict=True) if u}):
                    mine = pages[sel & (owners == o)]
                    st.ledger.alloc_counts(mine, o, 0)
                    st.ledger.write(mine, o)
            st.ledger.grant(pages, req.handle, owners, req.tenant_handle)
        by_owner: dict[int, int] = {}
        for o in owner_list:
            by_owner[o] = by_owner.get(o, 0) + 1
        reader_tenant = self._tenant_id(req.tenant_handle, req.tenant)
        for owner, n in by_owner.items():
            known = self._requests.get(owner)
            if known is None or self._unchecked(owner):
                owner_id = owner_tenant = None
                self.counters["prefix_hits_unknown_owner"] += 1
            else:
                owner_id, owner_tenant = known[0], self._tenant_id(known[1])
                same = owner_tenant == reader_tenant
                kind = "same_tenant" if same else "cross_tenant"
                self.counters[f"prefix_hits_{kind}"] += 1
            self._emit_hit(st, req, owner_id, owner_tenant, n)

    def _emit_hit(
        self,
        st: _PoolState,
        req: _Request,
        owner_id: str | None,
        owner_tenant: str | None,
        pages: int,
        **tier: Any,
    ) -> None:
        """One ``prefix_cache.hit`` of ``req`` on ``pages`` of one owner's (``tier``: the
        offload tier's fields, for a load back from it)."""
        self._reporter.emit(
            PrefixCacheHit,
            node=st.node,
            role=st.role,
            reader_request_id=self._request_id(req.handle, req.request_id),
            reader_tenant=self._tenant_id(req.tenant_handle, req.tenant),
            owner_request_id=owner_id,
            owner_tenant=owner_tenant,
            pages=pages,
            tokens=pages * st.page_size,
            # the keys carried a salt: the server's per tenant, or the request's own
            salted=self._salt_mode == "salted" or req.cache_salt is not None,
            **tier,
        )

    def on_tier_store(
        self,
        pool: _Pool,
        pages: Tensor,
        keys: Sequence[bytes],
        writers: Sequence[int],
        tenants: Sequence[int],
    ) -> None:
        """Record whose write each page that leaves for the tier carries: the last writer
        the probe's own page ledger saw (not the engine's ``writers``), with its names and
        salt, under the tier's key. A page whose writer the probe does not know (written
        before it attached) forgets the key: a load of it then has an unknown writer."""
        self.counters["tier_stores"] += len(keys)
        st = self._pools[pool.name]
        if self._tier is None or st.ledger is None:
            return
        seen_writers, seen_tenants = st.ledger.writer_of(pages)
        for key, writer, tenant in zip(
            keys, seen_writers.tolist(), seen_tenants.tolist(), strict=True
        ):
            if writer < 0 or self._unchecked(writer) or writer not in self._requests:
                self._tier.forget(key)
                continue
            self._tier.store(
                key,
                TierWriter(
                    self._request_id(writer),
                    self._tenant_id(tenant),
                    self._salts.get(writer),
                ),
            )

    def on_tier_load(
        self,
        pool: _Pool,
        pages: Tensor,
        req: _Request,
        keys: Sequence[bytes],
        writers: Sequence[int],
        tenants: Sequence[int],
    ) -> None:
        """A load back from the tier: judged against the writer recorded at the store
        (never the engine's word), and reported as a prefix-cache hit from the tier, one
        per writer, naming whether the salts differ."""
        self.counters["tier_loads"] += len(keys)
        if self._tier is None:
            return
        st = self._pools[pool.name]
        if req.handle not in self._requests:
            self._remember(req, new=False)
        reader_tenant = self._tenant_id(req.tenant_handle, req.tenant)
        salt = salt_digest(req.cache_salt)
        by_writer: dict[TierWriter | None, tuple[int, bool]] = {}
        for key in keys:
            seen = self._tier.load(key, reader_tenant, salt)
            n, mismatch = by_writer.get(seen.writer, (0, False))
            by_writer[seen.writer] = (n + 1, mismatch or seen.salt_mismatch)
        for writer, (n, mismatch) in by_writer.items():
            if writer is None:
                self.counters["tier_loads_unknown_writer"] += n
            if mismatch:
                self.counters["tier_loads_salt_mismatch"] += n
            owner_id = None if writer is None else writer.request_id
            owner_tenant = None if writer is None else writer.tenant
            self._emit_hit(st, req, owner_id, owner_tenant, n, tier="cpu", salt_mismatch=mismatch)

    def on_free(self, pool: _Pool, pages: Tensor, zeroized: bool) -> None:
        st = self._pools[pool.name]
        if st.ledger is not None:
            st.ledger.free(pages, zeroized=zeroized)
        if st.canary is not None and not zeroized:
            st.canary.paint(pool.k, pool.v, pages)

    def on_kv_write(self, pool: _Pool, pages: Tensor, req: _Request) -> None:
        st = self._pools[pool.name]
        if st.ledger is None or pages.shape[0] == 0:
            return
        # Positions [cache_len, end) of the block table, whose pages these are: prefill
        # writes the prompt tokens it actually has (one for the legacy placeholder); any other
        # caller, one decode token.
        ps = st.page_size
        first = req.cache_len
        n = pages.shape[0]
        # prefill: up to the prompt's end, or these pages' end when they are a part of it
        # (a load from the offload tier writes whole pages ahead of the computed rest)
        end = (
            min(req.cached_prompt_tokens, (first // ps + n) * ps)
            if req.status == "prefilling"
            else first + 1
        )
        if end <= first:
            return  # nothing written: counting nothing is the safe side
        start: Tensor | int = first % ps
        stop: Tensor | int = (end - 1) % ps + 1
        if n > 1:  # the first page from its start slot, the last one up to its end slot
            dev = st.ledger.device
            if start:
                starts = torch.zeros(n, dtype=torch.long, device=dev)
                starts[0] = start
                start = starts
            if stop != ps:
                stops = torch.full((n,), ps, dtype=torch.long, device=dev)
                stops[-1] = stop
                stop = stops
        st.ledger.write(pages, req.handle, start=start, end=stop)

    def on_kv_write_batch(
        self, pool: _Pool, pages: Tensor, writers: Tensor, reqs: Sequence[_Request]
    ) -> None:
        st = self._pools[pool.name]
        if st.ledger is None:
            return
        ps = st.page_size
        # Host-side: each request writes the one slot at its cache_len (no device sync).
        slots = array("q", [r.cache_len % ps for r in reqs])
        first = slots[0] if slots else 0
        if all(s == first for s in slots):
            st.ledger.append(pages, writers, first)
        else:
            # a view of the array's buffer (the tensor keeps it alive): a few µs, where
            # torch.tensor(list) parses the list element by element (~9-17 µs for 32)
            at = torch.frombuffer(slots, dtype=torch.long).to(st.ledger.device)
            st.ledger.append(pages, writers, at)

    def on_kv_transfer(
        self,
        src_pool: _Pool,
        src_pages: Tensor,
        dst_pool: _Pool,
        dst_pages: Tensor,
        req: _Request,
        prefill_rejected: bool,
    ) -> None:
        src, dst = self._pools[src_pool.name], self._pools[dst_pool.name]
        n = src_pages.shape[0]
        self._reporter.emit(
            KvTransfer,
            request_id=self._request_id(req.handle, req.request_id),
            tenant=self._tenant_id(req.tenant_handle, req.tenant),
            from_node=src.node,
            to_node=dst.node,
            pages=n,
            tokens=min(req.cached_prompt_tokens, n * src.page_size),
            prefill_rejected=prefill_rejected,
        )
        if src.ledger is not None and dst.ledger is not None:
            if self._unchecked(req.handle):
                dst.ledger.write(dst_pages, req.handle)  # trusted: older than the attach
            else:
                reports = src.ledger.transfer(src_pages, dst.ledger, dst_pages, req.handle)
                self._stale.report(reports, node=src.node, role=src.role, dedupe=False)
        if src.canary is not None and dst.canary is not None:
            dst.canary.on_transfer(src.canary, src_pages, dst_pages)

    def on_kv_read(
        self,
        pool: _Pool,
        pages: Tensor,
        readers: Tensor,
        k: Tensor,
        v: Tensor,
        valid: Tensor,
    ) -> None:
        st = self._pools[pool.name]
        flags: list[Tensor] = []
        check_ledger = st.ledger is not None and not (
            self._pre_attach_pages and self._first_handle is None
        )
        if check_ledger:
            assert st.ledger is not None
            # `valid` marks the slots attention used: the ledger checks them, not the count
            # (exact for any mask, a sliding window's included)
            if self._pre_attach_pages:
                stale = st.ledger.stale_mask(pages, readers, valid)
                flags.append((stale & (readers >= (self._first_handle or 0))).any())
            else:
                flags.append(st.ledger.any_stale(pages, readers, valid))
        if st.canary is not None:
            flags.append(st.canary.suspect(k, valid))
        pending = [s for s in self._pools.values() if s.pending is not None]
        if not flags and not pending:
            return
        if pending:
            parts = [f.reshape(1).long() for f in flags]
            parts += [s.pending for s in pending if s.pending is not None]
            values = torch.cat(parts).tolist()  # the step's one sync
            self._absorb(pending, values[len(flags) :])
        elif len(flags) == 1:
            values = [flags[0].item()]  # the step's one sync
        else:
            values = torch.stack(flags).tolist()  # the step's one sync
        self.counters["syncs"] += 1
        if check_ledger and values[0]:
            assert st.ledger is not None
            reports = st.ledger.read(pages, readers, valid)
            if self._pre_attach_pages:
                first = self._first_handle or 0
                reports = [r for r in reports if r.reader_request >= first]
            self._stale.report(reports, node=st.node, role=st.role, dedupe=True)
        if st.canary is not None and values[len(flags) - 1]:
            self._emit_canary(st, st.canary.findings(pages, readers, k, v, valid))

    def on_step(self, engine: Any) -> None:
        self.counters["steps"] += 1
        pending = [s for s in self._pools.values() if s.pending is not None]
        if pending:
            values = torch.cat([s.pending for s in pending if s.pending is not None]).tolist()
            self.counters["syncs"] += 1
            self._absorb(pending, values)
        step = int(engine.steps)
        for st in self._pools.values():
            if self._reporter.page_reuse(node=st.node, role=st.role, step=step, counts=st.reuse):
                self.counters["reuse_events"] += 1
                st.reuse = [0, 0, 0]
        if self.counters["steps"] % self.pool_sample_every == 0:
            self.sample_pools()

    # -- internals -------------------------------------------------------------------------

    def _ids(self, req: _Request) -> RequestIds:
        """What the request events of ``req`` name."""
        return RequestIds(
            self._request_id(req.handle, req.request_id),
            self._tenant_id(req.tenant_handle, req.tenant),
            req.model,
            req.route,
        )

    def _absorb(self, states: list[_PoolState], values: list[int]) -> None:
        for j, st in enumerate(states):
            for c in range(3):
                st.reuse[c] += values[3 * j + c]
            st.pending = None

    def _remember(self, req: _Request, new: bool = True) -> None:
        """Keep the request's names; ``new``: it was submitted after the attach."""
        if new and self._first_handle is None:
            self._first_handle = req.handle
        self._requests[req.handle] = (safe_id(req.request_id, "req"), req.tenant_handle)
        self._salts[req.handle] = salt_digest(req.cache_salt)
        self._tenant_id(req.tenant_handle, req.tenant)

    def _unchecked(self, handle: int) -> bool:
        """A request already in flight when the adapter attached (its pages are unknown)."""
        return self._pre_attach_pages and (
            self._first_handle is None or handle < self._first_handle
        )

    def _request_id(self, handle: int, fallback: str | None = None) -> str:
        known = self._requests.get(handle)
        if known is not None:
            return known[0]
        return safe_id(fallback, "req") if fallback is not None else f"handle-{handle}"

    def _tenant_id(self, handle: int, name: str | None = None) -> str:
        tid = self._tenant_ids.get(handle)
        if tid is None:
            if name is None and self._engine is not None:
                name = self._engine.tenant_name(handle)
            if name is None:
                return UNKNOWN
            tid = self._tenant_ids[handle] = safe_id(name, "tenant")
        return tid

    def _names(self, reader: int) -> tuple[str, str]:
        """(request id, tenant id) of a request handle seen on a vectorised hook."""
        known = self._requests.get(reader)
        if known is not None:
            return known[0], self._tenant_id(known[1])
        return f"handle-{reader}", UNKNOWN

    def _tenant_name(self, handle: int) -> str | None:
        name = self._tenant_id(handle)
        return None if name == UNKNOWN else name

    def _emit_canary(self, st: _PoolState, findings: list[CanaryFinding]) -> None:
        for f in findings:
            seen = self._seen_canary.setdefault(f.reader, set())
            keys = [(st.name, p, f.canary_tenant) for p in f.page_ids]
            pages = [p for p, key in zip(f.page_ids, keys, strict=True) if key not in seen]
            seen.update(keys)
            if not pages:
                continue
            self.counters["canary_hits"] += 1
            reader_id, reader_tenant = self._names(f.reader)
            canary_tenant = None if f.canary_tenant < 0 else self._tenant_id(f.canary_tenant)
            for chunk in chunks(pages):
                self._reporter.emit(
                    CanaryHit,
                    node=st.node,
                    detector="paint",
                    reader_request_id=reader_id,
                    reader_tenant=reader_tenant,
                    canary_tenant=canary_tenant,
                    page_ids=chunk,
                )


def attach(engine: Any, probe: BaseProbe | None = None, **options: Any) -> RefengineAdapter:
    """Build a :class:`RefengineAdapter` (``options`` as its keywords) and add it to
    ``engine``'s observers; returns it."""
    adapter = RefengineAdapter(probe, **options)
    engine.add_observer(adapter)
    return adapter
