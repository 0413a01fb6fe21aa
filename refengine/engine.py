"""The engine: public API, and execution of the prefill, transfer and decode phases.

Topologies
----------
``monolithic``: one pool (``"kv"``, role ``both``). A request is admitted when the pool can
hold its whole block table (prompt plus generation budget); prefill writes the prompt into
it and decode continues in place.

``disaggregated``: a prefill worker with its own pool (``"prefill"``, ``pool_tokens``) and a
decode worker with its own (``"decode"``, ``decode_pool_tokens``). Prefill allocates the
prompt's pages, writes them and computes the first token; the transfer allocates the decode
block table, copies the prefill pages into it, and frees the prefill pages.

Over-length prompts
-------------------
Longer than ``advertised_context``: ``ContextLengthExceeded`` from ``submit`` in both modes,
before anything is allocated.

Within the advertised context but longer than a pool:

* ``hardened``: the same clean ``ContextLengthExceeded`` (limit = the smallest pool), from
  ``submit``, before any allocation or transfer.
* ``legacy``, disaggregated (the incident): prefill marks the request rejected, prefills a
  one-token PLACEHOLDER instead, and still transfers that page to decode; decode allocates a
  block table for the *original* prompt length and trusts it, so it reads pages nobody
  overwrote — the previous owners' KV, i.e. other tenants' text.
* ``legacy``, monolithic: the prompt is silently cut to the pool (its first tokens kept),
  as SGLang's quiet clamp of ``max_req_len`` to the pool makes an over-length prompt come
  out; ``req.truncated`` is set and ``on_request_truncated`` fires, the client is not told.
  No stale read happens on this path.

Prefix cache
------------
With ``prefix_cache`` on (monolithic only; see :mod:`refengine.prefix_cache` for the keys and
the cache's invariants), a prompt's full pages are keyed at ``submit``. At prefill the
longest run of leading full pages whose keys are cached is *granted* to the request: those
cached pages head its block table and prefill computes and writes only the rest of the
prompt (``req.cached_tokens`` says how much it skipped; at least the last prompt token is
always computed, as vLLM does, since the first token's query needs it); the first token
still attends over the whole prompt, reading the granted pages from the pool
(``on_kv_read``). Then the full pages prefill wrote join the cache, held by their request.
When a request ends its cached pages stay cached (idle, in an LRU, released tail first, so
a prefix's last pages go before its first) and only the others return to the free list; an
allocation the free list cannot satisfy evicts least recently used idle pages first
(``on_free`` fires for them then, zeroizing them when the pool zeroizes). A page a live
request holds is never evicted. Prompts that prefill does not write whole (legacy
truncation) neither use nor fill the cache, so the over-length behaviour of both modes is
unchanged.

Threading
---------
Every public method takes the engine's re-entrant lock, so calls from several threads are
serialised and observers never run concurrently. The intended server shape: one background
thread loops ``step()`` (``wait_for_work()`` when idle); request handlers call ``submit()``
(which may raise ``ContextLengthExceeded`` in the handler's thread), receive tokens through
the ``on_delta`` callback (called in the engine thread: hand them to an event loop with
``call_soon_threadsafe``) or poll ``req.text``, and ``req.wait()``; ``abort()`` on client
disconnect. ``generate()`` steps the engine itself: use it only where nothing else drives
the engine (tests, scripts). A step holds the lock for its whole duration, so ``submit``
may wait up to one step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from refengine.config import EngineConfig
from refengine.errors import ContextLengthExceeded, InvalidRequest
from refengine.hooks import EngineObserver
from refengine.model import LabModel
from refengine.offload import OffloadTier, TierEntry
from refengine.pool import KVPool, Role
from refengine.prefix_cache import PrefixCache, page_keys, root_key
from refengine.request import Completion, Request, TokenDelta
from refengine.scheduler import Scheduler
from refengine.tokenizer import PLACEHOLDER, ByteTokenizer

ENGINE_NAME = "refengine"


def _table(req: Request) -> torch.Tensor:
    """The block table of a request that must hold one (decoding)."""
    if req.block_table is None:
        raise RuntimeError(f"{req.request_id} has no block table in status {req.status}")
    return req.block_table


@dataclass
class StepResult:
    """What one ``step()`` did."""

    step: int
    prefilled: int = 0
    #: prompt tokens prefill computed (a prefix-cache hit's granted tokens are not)
    prefill_tokens: int = 0
    transferred: int = 0
    decoded: int = 0
    deltas: list[TokenDelta] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return not (self.prefilled or self.transferred or self.decoded)


@dataclass(frozen=True, slots=True)
class QueueDepths:
    """How many live requests wait for prefill, wait for a transfer (disaggregated only: they
    hold prefill pages), and decode."""

    waiting: int
    transferring: int
    running: int


class Engine:
    """A paged-KV engine over the lab model. See the module docstring for topologies,
    over-length handling and threading.

    Invariants: ``pools`` never changes after construction; every page of every pool is
    either free or in the block table of exactly one live request, or, with the prefix
    cache on, cached: idle (in no block table) or in the block tables of as many live
    requests as its reference count (``check_invariants``); ``_live`` maps the id of every
    queued/transferring/decoding request to it.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config if config is not None else EngineConfig()
        cfg = self.config
        self.device = cfg.torch_device
        self.tokenizer = ByteTokenizer()
        self.model = LabModel(
            heads=cfg.heads, head_dim=cfg.head_dim, device=self.device, dtype=cfg.torch_dtype
        )

        def pool(name: str, role: Role, tokens: int) -> KVPool:
            return KVPool(
                name=name,
                role=role,
                num_pages=tokens // cfg.page_size,
                page_size=cfg.page_size,
                heads=cfg.heads,
                head_dim=cfg.head_dim,
                dtype=cfg.torch_dtype,
                device=self.device,
                zeroize_on_free=cfg.zeroize_on_free,
            )

        self.disaggregated = cfg.topology == "disaggregated"
        if self.disaggregated:
            self.prefill_pool = pool("prefill", "prefill", cfg.prefill_pool_tokens)
            self.decode_pool = pool("decode", "decode", cfg.decode_pool_capacity_tokens)
            self.pools: dict[str, KVPool] = {
                "prefill": self.prefill_pool,
                "decode": self.decode_pool,
            }
        else:
            self.prefill_pool = self.decode_pool = pool("kv", "both", cfg.prefill_pool_tokens)
            self.pools = {"kv": self.prefill_pool}

        self.prefix_cache: PrefixCache | None = (
            PrefixCache(self.prefill_pool.num_pages, self.prefill_pool)
            if cfg.prefix_caching
            else None
        )
        # prefix-cache hits found while picking this step's prefills (handle -> pages)
        self._hits: dict[int, list[int]] = {}
        self.offload: OffloadTier | None = (
            OffloadTier(cfg.offload_tier_tokens // cfg.page_size)
            if cfg.offload_tier_tokens
            else None
        )
        # offload-tier hits found while picking (handle -> entries), and per cached page its
        # tier key and its computing request's tenant handle (what an eviction stores)
        self._tier_hits: dict[int, list[TierEntry]] = {}
        self._tier_meta: dict[int, tuple[bytes, int]] = {}
        self._sched = Scheduler(max_batch=cfg.max_batch, max_prefill_tokens=cfg.max_prefill_tokens)
        self._observers: list[EngineObserver] = []
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._live: dict[str, Request] = {}
        self._tenants: dict[str, int] = {}
        self._tenant_names: dict[int, str] = {}
        self._next_handle = 1
        self.steps = 0
        # Slot offsets within a page, reused by every decode step.
        self._offsets = torch.arange(cfg.page_size, device=self.device)

    # -- observers and identities ---------------------------------------------------------

    def add_observer(self, obs: EngineObserver) -> None:
        with self._lock:
            self._observers.append(obs)
            obs.on_attach(self)

    def remove_observer(self, obs: EngineObserver) -> None:
        with self._lock:
            self._observers.remove(obs)

    def request_handle(self, req: Request) -> int:
        return req.handle

    def tenant_handle(self, tenant: str) -> int:
        """The stable int handle of ``tenant`` (assigned on first sight, from 1)."""
        with self._lock:
            h = self._tenants.get(tenant)
            if h is None:
                h = len(self._tenants) + 1
                self._tenants[tenant] = h
                self._tenant_names[h] = tenant
            return h

    def tenant_name(self, handle: int) -> str | None:
        return self._tenant_names.get(handle)

    def get_request(self, request_id: str) -> Request | None:
        """A live (queued, transferring or decoding) request. Finished ones are forgotten:
        an observer that needs them later keeps its own map from ``on_request_admitted``."""
        return self._live.get(request_id)

    def info(self) -> dict[str, object]:
        """Static description for an ``engine.config`` event or ``/v1/models``."""
        from refengine import __version__

        cfg = self.config
        return {
            "engine": ENGINE_NAME,
            "engine_version": __version__,
            "model_id": cfg.model_id,
            "mode": cfg.mode,
            "topology": cfg.topology,
            "disaggregated": self.disaggregated,
            "advertised_context": cfg.advertised_context,
            "page_size": cfg.page_size,
            "dtype": cfg.kv_dtype,
            "tp_size": 1,
            "cuda_graphs": False,
            "prefix_cache": cfg.prefix_caching,
            "prefix_cache_mode": cfg.prefix_cache,
            "prefix_cache_salting": cfg.prefix_cache_isolates_tenants,
            # the tier's key is the salted chain by design (the drop-salt fault is a defect,
            # not a setting: no configuration would say it)
            "offload_tier_pages": 0 if self.offload is None else self.offload.capacity_pages,
            "offload_tier_bytes": 0
            if self.offload is None
            else self.offload.capacity_pages
            * (self.prefill_pool.kv_bytes // self.prefill_pool.num_pages),
            "zeroize_on_free": cfg.zeroize_on_free,
            "device": str(self.device),
            "max_batch": cfg.max_batch,
            "pools": [
                {
                    "name": p.name,
                    "role": p.role,
                    "num_pages": p.num_pages,
                    "capacity_tokens": p.capacity_tokens,
                }
                for p in self.pools.values()
            ],
        }

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    # -- submission -----------------------------------------------------------------------

    def submit(
        self,
        prompt: str,
        tenant: str,
        max_tokens: int = 16,
        request_id: str | None = None,
        *,
        route: str | None = None,
        on_delta: Callable[[TokenDelta], None] | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request; returns it (status ``queued``).

        ``cache_salt`` (vLLM's request field): with ``prefix_cache="salted"``, part of the
        keys of the prompt's pages, so the request shares cached pages only with requests
        that send the same salt (and, salting by tenant, come from the same tenant); ignored
        otherwise.

        Raises ``InvalidRequest`` (empty prompt or tenant, ``max_tokens < 1``, an id already
        live, a ``cache_salt`` that is not a non-empty string) or ``ContextLengthExceeded``
        — both before anything is allocated. A clean rejection still gets a handle and fires
        ``on_request_rejected`` first, so a probe counts it.
        """
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string")
        if not tenant:
            raise InvalidRequest("tenant must be a non-empty string")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, not {max_tokens!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequest("cache_salt must be a non-empty string")
        data = self.tokenizer.encode_bytes(prompt)
        if not data:
            raise InvalidRequest("prompt must not be empty")
        cfg = self.config
        keys: list[bytes] = []
        tier_keys: list[bytes] = []
        if self.prefix_cache is not None and len(data) <= min(
            cfg.advertised_context, self.prefill_pool.capacity_tokens
        ):
            # Outside the lock: hashing a long prompt must not hold up a step.
            # shared: the client's salt only (vLLM's keys); salted: the tenant's too
            tenant_part = tenant if cfg.prefix_cache == "salted" else None
            root = root_key(salt=cache_salt, tenant=tenant_part)
            keys = page_keys(data, cfg.page_size, root)
            tier_keys = keys
            if cfg.offload_drops_salt:
                tier_keys = page_keys(data, cfg.page_size, root_key())
        with self._lock:
            if request_id is not None and request_id in self._live:
                raise InvalidRequest(f"request id {request_id!r} is already in flight")
            handle = self._next_handle
            self._next_handle += 1
            req = Request(
                request_id=request_id if request_id is not None else f"req-{handle}",
                tenant=tenant,
                handle=handle,
                tenant_handle=self.tenant_handle(tenant),
                prompt=data,
                max_tokens=max_tokens,
                max_new_tokens=max_tokens,
                model=cfg.model_id,
                route=route,
                on_delta=on_delta,
                cache_salt=cache_salt,
                page_keys=keys,
                tier_keys=tier_keys if self.offload is not None else [],
            )
            p = len(data)
            if p > cfg.advertised_context:
                self._reject(req, "context_length_exceeded", cfg.advertised_context)
            pool_limit = min(self.prefill_pool.capacity_tokens, self.decode_pool.capacity_tokens)
            if cfg.mode == "hardened" and p > pool_limit:
                self._reject(req, "kv_pool_exceeded", pool_limit)
            self._plan(req)
            self._sched.waiting.append(req)
            self._live[req.request_id] = req
            for obs in self._observers:
                obs.on_request_admitted(req)
            self._work.notify_all()
            return req

    def _reject(self, req: Request, reason: str, limit: int) -> NoReturn:
        req._close("rejected", None)
        for obs in self._observers:
            obs.on_request_rejected(req, reason, limit, req.prompt_tokens)
        req.done.set()
        raise ContextLengthExceeded(
            prompt_tokens=req.prompt_tokens, limit_tokens=limit, reason=reason, request=req
        )

    def _plan(self, req: Request) -> None:
        """Decide what prefill writes, what decode will trust, and the block-table size.

        Generation is capped so the decode block table fits its pool and prompt plus
        completion fit the advertised context (at least one token is always allowed: the one
        prefill computes, which needs no slot).
        """
        cfg = self.config
        p = req.prompt_tokens
        pcap = self.prefill_pool.capacity_tokens
        dcap = self.decode_pool.capacity_tokens
        if p <= pcap:
            req.cached_prompt_tokens = p
        elif self.disaggregated:  # legacy only: hardened rejected it in submit
            req.cached_prompt_tokens = 1  # the placeholder
        else:
            req.cached_prompt_tokens = pcap  # legacy monolithic: silent truncation
        # Decode trusts the client's length (clamped to its own pool): correct whenever
        # prefill wrote the prompt, and exactly the incident's bug when it did not.
        assumed = min(p, dcap) if self.disaggregated else req.cached_prompt_tokens
        req.assumed_prompt_tokens = assumed
        req.max_new_tokens = max(
            1, min(req.max_tokens, cfg.advertised_context - p, dcap - assumed + 1)
        )
        req.reserve_tokens = assumed + req.max_new_tokens - 1

    # -- driving --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self._sched.has_work

    def queue_depths(self) -> QueueDepths:
        """The queues' lengths, read without the engine's lock: a metrics scrape must not
        wait out a long step. Each length is exact; the three may straddle a step."""
        s = self._sched
        return QueueDepths(len(s.waiting), len(s.transferring), len(s.running))

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until something is queued (or ``timeout``); for an idle server loop."""
        with self._work:
            if not self._sched.has_work:
                self._work.wait(timeout)
            return self._sched.has_work

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until nothing is queued or running; returns the number of steps."""
        n = 0
        while self.has_work and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        return n

    def generate(
        self,
        prompt: str,
        tenant: str,
        max_tokens: int = 16,
        request_id: str | None = None,
        *,
        route: str | None = None,
        cache_salt: str | None = None,
    ) -> Completion:
        """Submit and step until this request finishes (other queued requests progress too).
        Raises like ``submit``."""
        with self._lock:
            req = self.submit(
                prompt, tenant, max_tokens, request_id, route=route, cache_salt=cache_salt
            )
            while not req.finished:
                self.step()
            return req.completion()

    def abort(self, request_id: str) -> bool:
        """Stop a live request now and free its pages; False if it is not live."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None:
                return False
            self._sched.remove(req)
            if req.block_table is not None:
                self._free(self.pools[req.pool_name or ""], req)
            piece = req._close("aborted", "abort")
            self._retire(req)
            delta = TokenDelta(req, (), piece, True, req.finish_reason)
            if req.on_delta is not None:
                req.on_delta(delta)
            return True

    def step(self) -> StepResult:
        """One scheduler iteration: prefills, transfers, one batched decode step, finishes.

        Requests prefilled or transferred in this step join the decode batch in the next one.
        """
        with self._lock:
            self.steps += 1
            result = StepResult(step=self.steps)
            decode_batch = list(self._sched.running)
            self._prefill_phase(result)
            if self.disaggregated:
                self._transfer_phase(result)
            if decode_batch:
                self._decode_phase(decode_batch, result)
            if self._observers and not result.idle:
                for obs in self._observers:
                    obs.on_step(self)
            for delta in result.deltas:
                if delta.request.on_delta is not None:
                    delta.request.on_delta(delta)
            return result

    # -- phases ---------------------------------------------------------------------------

    def _prefill_phase(self, result: StepResult) -> None:
        pool = self.prefill_pool
        if self.disaggregated:
            slots = self.config.max_batch - len(self._sched.transferring)

            def need(r: Request) -> int:
                return pool.pages_for(r.cached_prompt_tokens)
        else:
            slots = self.config.max_batch - len(self._sched.running)

            def need(r: Request) -> int:
                return pool.pages_for(r.reserve_tokens)

        cache = self.prefix_cache
        free_pages = pool.free_pages
        pages_needed = need
        if cache is not None:
            # Idle cached pages can be evicted, so they count as free; a request's hits are
            # not allocated, but those idle now stop being evictable once it holds them.
            free_pages += cache.idle_pages
            hits = self._hits

            def pages_needed(r: Request) -> int:
                found = hits[r.handle] = self._lookup(r)
                if self.offload is not None:
                    # loaded pages are fresh ones: they change nothing of the count
                    self._tier_hits[r.handle] = self._tier_lookup(r, len(found))
                idle = sum(1 for p in found if cache.refs[p] == 0)
                return need(r) - len(found) + idle

        picked = self._sched.pick_prefills(
            free_pages=free_pages, pages_needed=pages_needed, slots=slots
        )
        if cache is not None:
            # Every picked request holds its hits before any allocation evicts: none of this
            # step's allocations can evict a page another picked request is granted.
            for req in picked:
                found = self._hits.pop(req.handle)
                cache.acquire(found)
                req.cached_pages = list(found)
                req.cached_tokens = len(found) * pool.page_size
                req.tier_entries = self._tier_hits.pop(req.handle, [])
                if req.page_keys:
                    cache.queries += req.prompt_tokens
                    cache.hits += req.cached_tokens
            self._hits.clear()
            self._tier_hits.clear()
        if not picked:
            return
        firsts = [self._prefill(pool, req, need(req)) for req in picked]
        result.prefill_tokens = sum(r.cached_prompt_tokens - r.cached_tokens for r in picked)
        # One device->host sync for all first tokens of the step.
        tokens = torch.cat(firsts).tolist()
        for req, tok in zip(picked, tokens, strict=True):
            delta = req._emit(tok)
            result.deltas.append(delta)
            if delta.finished:
                self._finish(pool, req, result)
            elif self.disaggregated:
                req.status = "transferring"
                self._sched.transferring.append(req)
            else:
                req.status = "decoding"
                req.cache_len = req.assumed_prompt_tokens
                self._sched.running.append(req)
        result.prefilled = len(picked)

    def _prefill(self, pool: KVPool, req: Request, n_pages: int) -> torch.Tensor:
        """Allocate, write the prompt's K/V, and return the first token (a [1] tensor)."""
        req.status = "prefilling"
        obs = self._observers
        if self.disaggregated and req.prompt_tokens > pool.capacity_tokens:
            req.prefill_rejected = True
            for o in obs:
                o.on_request_rejected(
                    req, "prefill_pool_exceeded", pool.capacity_tokens, req.prompt_tokens
                )
            tokens = torch.tensor([PLACEHOLDER], dtype=torch.int64, device=self.device)
        else:
            if req.assumed_prompt_tokens < req.prompt_tokens:
                # Legacy clamp to the binding pool (monolithic: this one; disaggregated: the
                # decode pool, which copies only what fits).
                req.truncated = True
                for o in obs:
                    o.on_request_truncated(req, req.assumed_prompt_tokens, req.prompt_tokens)
            # bytearray: torch.frombuffer wants a writable buffer.
            raw = bytearray(req.prompt[: req.cached_prompt_tokens])
            tokens = torch.frombuffer(raw, dtype=torch.uint8).to(self.device, torch.int64)
        ps = pool.page_size
        n_hit = req.cached_tokens // ps
        fresh = self._alloc(pool, n_pages - n_hit)
        granted: torch.Tensor | None = None
        if n_hit:
            granted = torch.tensor(req.cached_pages, dtype=torch.int64, device=self.device)
            pages = torch.cat([granted, fresh])
        else:
            pages = fresh
        req.block_table = pages
        req.pool_name = pool.name
        if granted is not None and obs:
            cache = self.prefix_cache
            assert cache is not None
            owners = torch.tensor(
                [cache.computed_by[p] for p in req.cached_pages],
                dtype=torch.int64,
                device=self.device,
            )
            for o in obs:
                o.on_prefix_hit(pool, granted, req, owners)
        for o in obs:
            o.on_alloc(pool, fresh, req)
        n_tier = len(req.tier_entries)
        if n_tier:
            self._load_from_tier(pool, req, pages, n_hit)
        n_pre = n_hit + n_tier
        n = tokens.shape[0]
        start = n_pre * ps
        # Only the positions past the granted (and loaded) prefix are computed and written:
        # the compute a prefix-cache hit saves.
        k, v = self.model.kv(tokens[start:], 0)
        pool.write(pool.slots(pages, start, n - start), k, v)
        req.cache_len = start  # what observers read: the write starts here
        for o in obs:
            o.on_kv_write(pool, pages[n_pre : pool.pages_for(n)], req)
        req.cached_tokens = start
        if n_pre:
            # The granted prefix is read back from the pool (it was not computed here).
            prefix = pages[:n_pre]
            kc, vc = pool.gather(prefix)
            if obs:
                readers = torch.full((n_pre,), req.handle, dtype=torch.int64, device=self.device)
                valid = torch.ones((n_pre, ps), dtype=torch.bool, device=self.device)
                for o in obs:
                    o.on_kv_read(pool, prefix, readers, kc, vc, valid)
            shape = (n_pre * ps, pool.heads, pool.head_dim)
            k = torch.cat([kc.reshape(shape), k])
            v = torch.cat([vc.reshape(shape), v])
        if req.page_keys:
            self._cache_written(pool, req, fresh)
        # The first token attends to the K/V just computed (in flight, not re-read from the
        # pool) and to the granted prefix, as prefill kernels do; the query aims at
        # position 0. All n slots form one "page" of the single reader.
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        first, _ = self.model.attend(
            self.model.query(tokens[-1:], 0),
            k[None],
            v[None],
            torch.arange(n, device=self.device)[None],
            zero,
            zero + n,
            zero,
        )
        return first

    def _load_from_tier(self, pool: KVPool, req: Request, pages: torch.Tensor, n_hit: int) -> None:
        """Copy ``req.tier_entries`` into the first fresh pages past its ``n_hit`` pool hits
        (the prefill writes them on the request's behalf), and tell observers whose writes
        they were (``on_tier_load``)."""
        assert self.offload is not None
        ps, entries = pool.page_size, req.tier_entries
        n_tier = len(entries)
        loaded = pages[n_hit : n_hit + n_tier]
        k = torch.stack([e.k for e in entries]).to(self.device)
        v = torch.stack([e.v for e in entries]).to(self.device)
        shape = (n_tier * ps, pool.heads, pool.head_dim)
        pool.write(pool.slots(pages, n_hit * ps, n_tier * ps), k.reshape(shape), v.reshape(shape))
        keys = req.tier_keys[n_hit : n_hit + n_tier]
        self.offload.touch(keys)
        req.cache_len = n_hit * ps
        writers = [e.writer for e in entries]
        tenants = [e.writer_tenant for e in entries]
        req.tier_entries = []  # copied into the pool: the request holds no tier memory
        for o in self._observers:
            o.on_kv_write(pool, loaded, req)
            o.on_tier_load(pool, loaded, req, keys, writers, tenants)

    def _tier_lookup(self, req: Request, n_found: int) -> list[TierEntry]:
        """What the offload tier holds of ``req``'s pages past its ``n_found`` pool hits
        (leaving at least its last prompt token to compute)."""
        if self.offload is None or not req.tier_keys:
            return []
        most = (req.cached_prompt_tokens - 1) // self.config.page_size
        return self.offload.lookup(req.tier_keys[n_found:most])

    def _lookup(self, req: Request) -> list[int]:
        """The cached pages to grant ``req``: its longest cached run of leading full pages,
        leaving at least its last prompt token to compute."""
        cache = self.prefix_cache
        if cache is None or not req.page_keys:
            return []
        most = (req.cached_prompt_tokens - 1) // self.config.page_size
        return cache.lookup(req.page_keys[:most])

    def _alloc(self, pool: KVPool, n: int) -> torch.Tensor:
        """``n`` pages from the free list, evicting least recently used idle cached pages
        into it first when it is short."""
        cache = self.prefix_cache
        if cache is not None and n > pool.free_pages:
            evicted = cache.evict(n - pool.free_pages)
            pages = torch.tensor([p for p, _ in evicted], dtype=torch.int64, device=self.device)
            if self.offload is not None:
                self._store_in_tier(pool, pages, evicted)
            zeroized = pool.free(pages)
            for o in self._observers:
                o.on_free(pool, pages, zeroized)
        return pool.alloc(n)

    def _store_in_tier(
        self, pool: KVPool, pages: torch.Tensor, evicted: list[tuple[int, int]]
    ) -> None:
        """Copy evicted cached pages into the offload tier, before the pool frees (and maybe
        zeroizes) them, under their tier keys; observers hear ``on_tier_store``."""
        assert self.offload is not None
        kc, vc = pool.gather(pages)
        kc, vc = kc.to("cpu"), vc.to("cpu")  # each entry clones its own page below
        keys, writers, tenants = [], [], []
        for i, (page, writer) in enumerate(evicted):
            key, tenant = self._tier_meta.pop(page)
            # clones: a view would keep the whole evicted batch alive past the tier's size
            self.offload.store(key, TierEntry(kc[i].clone(), vc[i].clone(), writer, tenant))
            keys.append(key)
            writers.append(writer)
            tenants.append(tenant)
        for o in self._observers:
            o.on_tier_store(pool, pages, keys, writers, tenants)

    def _cache_written(self, pool: KVPool, req: Request, fresh: torch.Tensor) -> None:
        """Cache the full prompt pages prefill just wrote (one host copy of their ids)."""
        cache = self.prefix_cache
        assert cache is not None
        n_hit = len(req.cached_pages)
        n_full = min(len(req.page_keys), req.cached_prompt_tokens // pool.page_size)
        if n_full <= n_hit:
            return
        ids = fresh[: n_full - n_hit].tolist()
        tier_keys = req.tier_keys[n_hit:n_full] if req.tier_keys else [b""] * (n_full - n_hit)
        for key, tier_key, page in zip(req.page_keys[n_hit:n_full], tier_keys, ids, strict=True):
            if cache.insert(key, page, req.handle):
                req.cached_pages.append(page)
                if self.offload is not None:
                    self._tier_meta[page] = (tier_key, req.tenant_handle)

    def _transfer_phase(self, result: StepResult) -> None:
        src_pool, dst_pool = self.prefill_pool, self.decode_pool
        picked = self._sched.pick_transfers(
            free_pages=dst_pool.free_pages,
            pages_needed=lambda r: dst_pool.pages_for(r.reserve_tokens),
        )
        hardened = self.config.mode == "hardened"
        for req in picked:
            assert req.block_table is not None
            src = req.block_table
            dst = dst_pool.alloc(dst_pool.pages_for(req.reserve_tokens))
            for o in self._observers:
                o.on_alloc(dst_pool, dst, req)
            # Only the pages prefill holds can be copied; decode's block table may be longer
            # (legacy: it was sized for the original prompt, not the placeholder).
            n_copy = min(src.shape[0], dst.shape[0], dst_pool.pages_for(req.assumed_prompt_tokens))
            if hardened and n_copy * dst_pool.page_size < req.assumed_prompt_tokens:
                # Hardened never hands decode a block table it did not fill; submit's check
                # makes this unreachable, so reaching it is an engine bug.
                raise RuntimeError(f"{req.request_id}: transfer would leave unwritten pages")
            dst_pool.copy_from(src_pool, src[:n_copy], dst[:n_copy])
            for o in self._observers:
                o.on_kv_transfer(
                    src_pool, src[:n_copy], dst_pool, dst[:n_copy], req, req.prefill_rejected
                )
            self._free(src_pool, req)
            req.block_table = dst
            req.pool_name = dst_pool.name
            req.cache_len = req.assumed_prompt_tokens
            req.status = "decoding"
            self._sched.running.append(req)
        result.transferred = len(picked)

    def _decode_phase(self, batch: list[Request], result: StepResult) -> None:
        pool = self.decode_pool
        ps = pool.page_size
        dev = self.device
        b = len(batch)
        # Host-side bookkeeping (no device sync): each request writes its last token at
        # position cache_len and reads pages 0..cache_len // ps of its block table.
        n_read = [r.cache_len // ps + 1 for r in batch]
        meta = torch.tensor(
            [
                [r.cache_len for r in batch],
                n_read,
                [len(r.output_tokens) for r in batch],
                [r.output_tokens[-1] for r in batch],
            ],
            dtype=torch.int64,
        ).to(dev)
        write_pos, counts, targets, fed = meta[0], meta[1], meta[2], meta[3]
        total = sum(n_read)
        flat_pages = torch.cat([_table(r)[:n] for r, n in zip(batch, n_read, strict=True)])
        starts = counts.cumsum(0) - counts
        owner_page = torch.repeat_interleave(torch.arange(b, device=dev), counts, output_size=total)
        page_rank = torch.arange(total, device=dev) - starts.repeat_interleave(
            counts, output_size=total
        )

        # Write the fed-back tokens' K/V first: attention includes the token itself.
        write_pages = flat_pages.index_select(0, starts + write_pos // ps)
        k_new, v_new = self.model.kv(fed, 1)
        pool.write(write_pages * ps + write_pos % ps, k_new, v_new)
        handles: torch.Tensor | None = None
        if self._observers:
            handles = torch.tensor([r.handle for r in batch], dtype=torch.int64).to(dev)
            for o in self._observers:
                o.on_kv_write_batch(pool, write_pages, handles, batch)

        # One gather for the whole batch: every request's pages, each read exactly once.
        k, v = pool.gather(flat_pages)
        next_tokens, valid = self.model.attend(
            self.model.query(fed, 1),
            k,
            v,
            page_rank[:, None] * ps + self._offsets[None, :],
            owner_page,
            write_pos + 1,
            targets,
        )
        if handles is not None:
            readers = handles.index_select(0, owner_page)
            for o in self._observers:
                o.on_kv_read(pool, flat_pages, readers, k, v, valid)

        tokens = next_tokens.tolist()  # the step's one device->host sync
        for req, tok in zip(batch, tokens, strict=True):
            req.cache_len += 1
            delta = req._emit(tok)
            result.deltas.append(delta)
            if delta.finished:
                self._sched.running.remove(req)
                self._finish(pool, req, result)
        result.decoded = b

    # -- endings --------------------------------------------------------------------------

    def _free(self, pool: KVPool, req: Request) -> None:
        """Free ``req``'s block table: its cached pages are released to the cache (idle once
        nobody holds them, the last page first so that a prefix's tail is evicted before its
        head), the others go back to the free list (``on_free``)."""
        assert req.block_table is not None
        pages = req.block_table
        req.block_table = None
        req.pool_name = None
        if req.cached_pages:
            cache = self.prefix_cache
            assert cache is not None
            held = set(req.cached_pages)
            own = [p for p in pages.tolist() if p not in held]
            cache.release(reversed(req.cached_pages))
            req.cached_pages = []
            pages = torch.tensor(own, dtype=torch.int64, device=self.device)
            if not own:
                return
        zeroized = pool.free(pages)
        for o in self._observers:
            o.on_free(pool, pages, zeroized)

    def _finish(self, pool: KVPool, req: Request, result: StepResult) -> None:
        self._free(pool, req)
        req._close("finished", None)
        self._retire(req)
        result.finished.append(req)

    def _retire(self, req: Request) -> None:
        self._live.pop(req.request_id, None)
        for o in self._observers:
            o.on_request_finished(req)
        req.done.set()

    # -- checks ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert that every page is free or owned by exactly one live request (with the
        prefix cache: or cached, idle or held by as many live requests as its reference
        count, the cache's own invariants holding), and that the queues hold exactly the
        live requests. Synchronises the device: tests only."""
        with self._lock:
            cache = self.prefix_cache
            for pool in self.pools.values():
                owned = [
                    r.block_table
                    for r in self._live.values()
                    if r.block_table is not None and r.pool_name == pool.name
                ]
                if cache is not None and pool is self.prefill_pool:
                    pool.check(owned, idle=list(cache.idle), shared=cache.refs)
                    held: dict[int, int] = {}
                    for table in owned:
                        for p in table.tolist():
                            held[p] = held.get(p, 0) + 1
                    cache.check(pool.free_page_ids().tolist(), held)
                    for r in self._live.values():
                        assert set(r.cached_pages) <= set(cache.refs), "a held page left the cache"
                else:
                    pool.check(owned)
            queued = (
                list(self._sched.waiting) + list(self._sched.transferring) + self._sched.running
            )
            assert sorted(r.handle for r in queued) == sorted(
                r.handle for r in self._live.values()
            ), "queues and live requests disagree"
