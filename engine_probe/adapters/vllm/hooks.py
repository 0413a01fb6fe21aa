"""The vLLM adapter's hooks: what patches one v1 ``Scheduler`` instance (its class is
untouched) and reads vLLM's objects into the plain values
:class:`~engine_probe.adapters.vllm.bookkeeping.BlockTracker` keeps.

Wrapped: the scheduler's ``add_request``, ``schedule``, ``finish_requests``,
``update_from_output``, ``_update_request_as_session`` (where vLLM has it) and its KV cache
manager's ``allocate_slots``. Every hook passes vLLM's arguments through untouched and calls
vLLM's method whatever the adapter does; the adapter's own work runs under a
:class:`~engine_probe.adapters.guard.HookGuard` (an exception is logged and counted in
``counters["errors"]``, never raised into vLLM). Everything runs in the engine-core process,
on the scheduler's thread, in host memory; the model runner is never touched.

What is read where: a request's tenant and route from its ``vllm_xargs``
(``SamplingParams.extra_args``, keys ``kvwatch_tenant``/``kvwatch_route``); its status and
output tokens when it leaves, turned into the wire's finish status here (vLLM ends a request
whose output matched a stop string by aborting it: the plugin's stop marks, read from the
ids ``finish_requests`` is handed, say which; a streaming-input session closed while it
waits for input is aborted by vLLM too, and reported completed); each step's scheduled
tokens, starting positions and KV-connector outcome; the block tables of the first KV cache
group (:class:`SchedulerView`); the configuration, once, at attach (:func:`read_shape`,
:func:`engine_config`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from engine_probe.adapters.common import UNKNOWN, safe_id
from engine_probe.adapters.guard import HookGuard
from engine_probe.adapters.vllm import ROUTE_KEY, TENANT_KEY, parse_stop_marks
from engine_probe.adapters.vllm.bookkeeping import BlockTracker
from engine_probe.adapters.vllm.node import kv_settings, role_of
from engine_probe.kv_destinations import vllm_destinations

__all__ = ["SchedulerHooks", "SchedulerShape", "SchedulerView", "engine_config", "read_shape"]

log = logging.getLogger("engine_probe.vllm")  # its name before the move: log filters use it

# vLLM's RequestStatus names of finished requests → the wire contract's FinishStatus.
_FINISH_STATUS: Final[Mapping[str, str]] = {
    "FINISHED_STOPPED": "completed",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_REPETITION": "completed",
    "FINISHED_ABORTED": "aborted",
    "FINISHED_ERROR": "error",
    "FINISHED_IGNORED": "error",
}


@dataclass(frozen=True, slots=True)
class SchedulerShape:
    """What the bookkeeping needs to know of a scheduler, read once at attach."""

    model_id: str
    #: the KV connector's role: ``kv_producer`` → prefill, ``kv_consumer`` → decode, else both
    role: str
    block_size: int
    num_blocks: int
    null_block: int
    kv_cache_groups: int
    #: one KV cache group, of full attention: the block tables the ledger model assumes,
    #: which only grow (sliding-window and Mamba groups rewrite theirs in place)
    single_full_attention_group: bool


def read_shape(scheduler: Any) -> SchedulerShape:
    cfg = scheduler.vllm_config
    kv_cfg = scheduler.kv_cache_config
    groups = kv_cfg.kv_cache_groups
    return SchedulerShape(
        model_id=_model_id(cfg),
        role=role_of(cfg),
        block_size=int(scheduler.block_size),
        num_blocks=int(kv_cfg.num_blocks),
        null_block=int(scheduler.kv_cache_manager.block_pool.null_block.block_id),
        kv_cache_groups=len(groups),
        single_full_attention_group=len(groups) == 1 and _full_attention(groups[0]),
    )


def engine_config(scheduler: Any) -> dict[str, Any]:
    """The ``engine.config`` fields vLLM's configuration decides (the pool's are the
    adapter's): version, advertised context (``max_model_len``), the KV cache's dtype
    (resolved: ``auto`` is the model's, as ``node.kv_dtype`` says), quantization, TP
    size, CUDA graphs, prefix caching, and where KV goes past the pool (its connector and
    offload tiers; disaggregation where the connector moves KV between nodes:
    :mod:`engine_probe.kv_destinations`)."""
    cfg = scheduler.vllm_config
    mc, cc = cfg.model_config, cfg.cache_config
    import vllm  # the engine is running: importing it costs nothing

    return {
        "engine": "vllm",
        "engine_version": str(vllm.__version__)[:64],
        "advertised_context": int(mc.max_model_len),
        **kv_settings(cfg),
        **vllm_destinations(cfg),
        "prefix_caching": bool(cc.enable_prefix_caching),
        # vLLM has no setting that makes salts mandatory: each request may carry one
        # (prefix_cache.hit says whether the hit was salted).
        "prefix_cache_salting": False,
    }


class SchedulerView:
    """The bookkeeping's :class:`~engine_probe.adapters.vllm.bookkeeping.EngineView` of one
    scheduler: block tables of the first KV cache group, and the pool's free blocks."""

    __slots__ = ("_scheduler", "tables")

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        # vLLM's own lists, not copies (KVCacheManager.get_block_ids builds new lists on
        # every call); None where this vLLM keeps them elsewhere, and get_block_ids serves
        self.tables: Mapping[str, list[Any]] | None = _block_tables(scheduler)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (group 0) as block ids (a new list)."""
        tables = self.tables
        if tables is not None:
            return [blk.block_id for blk in tables.get(request_id) or ()]
        return list(self._scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def num_blocks(self, request_id: str) -> int:
        tables = self.tables
        if tables is not None:
            return len(tables.get(request_id) or ())
        return len(self._scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def free_blocks(self) -> int:
        return int(self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


class SchedulerHooks:
    """The wrappers :meth:`install` puts on one scheduler instance, and what they read of
    vLLM's objects for ``tracker``.

    ``_closing`` and ``_stop_finishes`` live only during one vLLM call (``add_request``,
    ``finish_requests``) and tell the finishes it makes apart from plain aborts."""

    def __init__(self, scheduler: Any, tracker: BlockTracker, view: SchedulerView) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.view = view
        self._guard = HookGuard(
            tracker.counters, "errors", log, "kvwatch: the vLLM adapter failed in %s"
        )
        # the id of the streaming-input session an add_request is closing, during that call
        self._closing: str | None = None
        # during a finish_requests call: request id → completion tokens vLLM's front end
        # reported, for the requests it aborts because their output matched a stop string
        self._stop_finishes: dict[str, int] = {}

    def install(self) -> list[str]:
        """Wrap the scheduler's methods; returns what was wrapped (``Class.method``)."""
        sch = self.scheduler
        tracker, guard = self.tracker, self._guard
        mgr = sch.kv_cache_manager
        add_request = sch.add_request
        schedule = sch.schedule
        finish_requests = sch.finish_requests
        update_from_output = sch.update_from_output
        allocate_slots = mgr.allocate_slots
        # vLLM 0.32's streaming input: the next chunk's tokens join the session's prompt
        update_session = getattr(sch, "_update_request_as_session", None)

        def update_session_hook(session: Any, update: Any) -> Any:
            guard.call(self._on_next_chunk, session, update)
            assert update_session is not None  # installed only where vLLM has it
            return update_session(session, update)

        def add_request_hook(request: Any) -> None:
            # vLLM takes an id it already holds as the next chunk (or the end) of a
            # streaming-input session: the same request, not a new one.
            known = guard.call(self._session_state, request)
            self._closing = request.request_id if known == "closing" else None
            try:
                add_request(request)
            finally:
                self._closing = None
            if known is None:
                guard.call(self._on_add, request)

        # The hooks pass vLLM's arguments through untouched and call the original whatever
        # the adapter does: everything of the adapter's own runs inside the guard.
        def schedule_hook(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            guard.call(self._on_scheduled, out)
            return out

        def finish_requests_hook(request_ids: Any, *args: Any, **kwargs: Any) -> Any:
            reqs: list[Any] = []
            guard.call(self._snapshot_finishing, request_ids, reqs)
            guard.call(self._keep_in_flight, reqs)
            guard.call(self._read_stop_marks, request_ids)
            out = finish_requests(request_ids, *args, **kwargs)
            guard.call(self._on_finished, reqs)
            self._stop_finishes.clear()
            if request_ids is None:  # vLLM's shutdown: nothing gathered may stay unsent
                guard.call(tracker.after_step, True)
            return out

        def update_from_output_hook(scheduler_output: Any, model_runner_output: Any) -> Any:
            # vLLM adds every request it frees to finished_req_ids (a set schedule() starts
            # anew): if the step's update does not grow it, no request finished, and none of
            # the step's requests needs looking at; without such a set, all of them do
            finished = getattr(sch, "finished_req_ids", None)
            before = len(finished) if isinstance(finished, set) else -1
            reqs: list[Any] | None = [] if before < 0 else None
            guard.call(self._landed, scheduler_output)
            guard.call(self._on_step, scheduler_output, model_runner_output, reqs)
            guard.call(tracker.drop_finished_in_flight)
            out = update_from_output(scheduler_output, model_runner_output)
            if reqs is not None:
                guard.call(self._on_finished, reqs)
            elif len(sch.finished_req_ids) != before:
                guard.call(self._on_finished_ids, sch.finished_req_ids)
            guard.call(tracker.after_step, False)
            return out

        live, tables, num_blocks = tracker.live, self.view.tables, self.view.num_blocks

        def table_length(rid: str) -> int:
            return len(tables.get(rid) or ()) if tables is not None else num_blocks(rid)

        def allocate_slots_hook(
            request: Any,
            num_new_tokens: int,
            num_new_computed_tokens: int = 0,
            new_computed_blocks: Any = None,
            num_lookahead_tokens: int = 0,
            num_external_computed_tokens: int = 0,
            **kwargs: Any,
        ) -> Any:
            # vLLM calls this for every scheduled request of every step: the hook's own work
            # is inline, and a request that only fits its next tokens into the blocks it
            # holds costs a dict look-up and two reads of its table's length
            held = -1
            try:
                rid = request.request_id
                req = live.get(rid)
                if req is not None:
                    held = table_length(rid)
                    tracker.table_seen(req, held)
                    computed = int(request.num_computed_tokens)
            except Exception:
                held = -1
                guard.failed("allocate_slots (before)")
            out = allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                **kwargs,
            )
            if out is not None and held >= 0:
                try:
                    if (
                        new_computed_blocks is not None
                        or num_external_computed_tokens
                        or table_length(rid) != held
                    ):
                        self._on_allocated(
                            rid,
                            held,
                            computed,
                            num_new_computed_tokens,
                            new_computed_blocks,
                            num_external_computed_tokens,
                        )
                except Exception:
                    guard.failed("_on_allocated")
            return out

        sch.add_request = add_request_hook
        sch.schedule = schedule_hook
        if update_session is not None:
            sch._update_request_as_session = update_session_hook
        sch.finish_requests = finish_requests_hook
        sch.update_from_output = update_from_output_hook
        mgr.allocate_slots = allocate_slots_hook
        hooked = [
            f"{type(sch).__name__}.{name}"
            for name in ("add_request", "schedule", "finish_requests", "update_from_output")
        ]
        if update_session is not None:
            hooked.append(f"{type(sch).__name__}._update_request_as_session")
        hooked.append(f"{type(mgr).__name__}.allocate_slots")
        return hooked

    # -- what the hooks read -------------------------------------------------------------

    def _snapshot_finishing(self, request_ids: Any, out: list[Any]) -> None:
        """The request objects ``finish_requests`` is about to finish (None: all of them)."""
        requests = self.scheduler.requests
        if request_ids is None:
            out.extend(requests.values())
            return
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        out.extend(r for r in (requests.get(rid) for rid in ids) if r is not None)

    def _on_scheduled(self, scheduler_output: Any) -> None:
        self.tracker.scheduled(scheduler_output.num_scheduled_tokens)

    def _landed(self, scheduler_output: Any) -> None:
        self.tracker.landed(scheduler_output.num_scheduled_tokens)

    def _read_stop_marks(self, request_ids: Any) -> None:
        """The front end's marks of stop-string finishes among the ids to finish."""
        if isinstance(request_ids, list | tuple | set | frozenset):
            self._stop_finishes = parse_stop_marks(request_ids)

    def _keep_in_flight(self, finishing: list[Any]) -> None:
        """Requests about to be finished from outside, not finished yet (see
        :meth:`~engine_probe.adapters.vllm.bookkeeping.BlockTracker.finishing`: read only
        while a step is in flight)."""
        self.tracker.finishing(r.request_id for r in finishing if not r.is_finished())

    def _session_state(self, request: Any) -> str | None:
        """None for a new request; for the id of one the scheduler holds (the next chunk
        or the end of a streaming-input session), "closing" when ``request`` ends a session
        that waits for input (vLLM then finishes it as aborted, though its client ended it
        normally), else "continuing"."""
        session = self.scheduler.requests.get(request.request_id)
        if session is None:
            return None
        waiting = getattr(session.status, "name", "") == "WAITING_FOR_STREAMING_REQ"
        return "closing" if waiting and not getattr(request, "resumable", False) else "continuing"

    def _on_next_chunk(self, session: Any, update: Any) -> None:
        """A streaming-input session takes its next chunk: vLLM drops the previous chunk's
        outputs from the request (keeping the computed ones as prompt)."""
        self.tracker.next_chunk(
            session.request_id,
            int(session.num_output_tokens),
            len(update.prompt_token_ids or ()),
        )

    def _on_add(self, request: Any) -> None:
        params = request.sampling_params
        extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
        tenant_raw = extra.get(TENANT_KEY)
        route_raw = extra.get(ROUTE_KEY)
        self.tracker.admit(
            request.request_id,
            tenant=safe_id(str(tenant_raw), "tenant") if tenant_raw else UNKNOWN,
            route=str(route_raw)[:256] if route_raw else None,
            salted=getattr(request, "cache_salt", None) is not None,
            prompt_tokens=int(request.num_prompt_tokens),
            max_tokens=getattr(params, "max_tokens", None) if params is not None else None,
            request=request,
        )

    def _on_allocated(
        self,
        rid: str,
        held: int,
        computed: int,
        num_hit_tokens: int,
        hit_blocks: Any,
        num_external: int,
    ) -> None:
        hits: list[int] = list(hit_blocks.get_block_ids()[0]) if hit_blocks is not None else []
        table = self.view.block_ids(rid)
        self.tracker.allocated(rid, held, computed, num_hit_tokens, hits, table, num_external)

    def _on_step(
        self, scheduler_output: Any, model_runner_output: Any, reqs: list[Any] | None
    ) -> None:
        """One step's output, before vLLM's own bookkeeping (which frees finished requests'
        blocks); ``reqs``, if given, gets the step's request objects, for
        :meth:`_on_finished` after vLLM's update."""
        scheduled = scheduler_output.num_scheduled_tokens
        if reqs is not None:
            requests = self.scheduler.requests
            reqs.extend(r for r in (requests.get(rid) for rid in scheduled) if r is not None)
        kvo = getattr(model_runner_output, "kv_connector_output", None)
        invalid: set[int] = set(kvo.invalid_block_ids or ()) if kvo is not None else set()
        failed: set[str] = set(kvo.failed_recving or ()) if kvo is not None else set()
        received: set[str] = set(kvo.finished_recving or ()) if kvo is not None else set()
        # where each write starts matters only to the ledger
        starts = _computed_at_schedule(scheduler_output) if self.tracker.ledger is not None else {}
        self.tracker.step(scheduled, starts, invalid, failed, received)

    def _on_finished_ids(self, ids: Iterable[str]) -> None:
        """The requests vLLM freed whose finish the adapter has not reported yet."""
        self._on_finished(self.tracker.engine_requests(ids))

    def _on_finished(self, requests: Iterable[Any]) -> None:
        for request in requests:
            if not request.is_finished():
                continue
            rid = request.request_id
            # vLLM's front end aborts a request whose output matched a stop string, with the
            # output tokens it kept (the engine core may have generated more meanwhile)
            stopped = self._stop_finishes.get(rid)
            if rid == self._closing or stopped is not None:
                status = "completed"
            else:
                status = _FINISH_STATUS.get(
                    getattr(request.status, "name", str(request.status)), "error"
                )
            output = int(request.num_output_tokens) if stopped is None else stopped
            self.tracker.finished(rid, status, output)


def _model_id(cfg: Any) -> str:
    served = getattr(cfg.model_config, "served_model_name", None)
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    name = str(served or cfg.model_config.model)
    return name[:256]


def _full_attention(group: Any) -> bool:
    """Whether a KV cache group is full attention."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return isinstance(getattr(group, "kv_cache_spec", None), FullAttentionSpec)


def _block_tables(scheduler: Any) -> Mapping[str, list[Any]] | None:
    """vLLM's own request id -> blocks map of the first KV cache group (the single-type
    manager's ``req_to_blocks``), or None where this vLLM has no such attribute."""
    try:
        tables = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    except (AttributeError, IndexError, TypeError):
        return None
    return tables if isinstance(tables, Mapping) else None


def _computed_at_schedule(scheduler_output: Any) -> dict[str, int]:
    """Each scheduled request's computed tokens when the step was scheduled (its first
    position written this step)."""
    out = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
        out[rid] = int(n)
    return out
