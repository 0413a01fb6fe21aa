"""The engine thread (:class:`EngineDriver`) and what crosses from it to the event loop: one
:class:`Flight` per submitted request, which also counts the request in the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable

from refengine.engine import Engine
from refengine.metrics import ServerMetrics
from refengine.request import TokenDelta
from refengine.server.errors import APIError, EngineUnavailable, log


class EngineDriver:
    """The one thread that drives the engine, and the waiters it must not strand.

    Invariants: after ``start()`` and until ``stop()`` or a failure, exactly one thread calls
    ``engine.step()``; every registered waiter is told (``on_fail``) if that thread ends
    while the request is still registered, so no handler waits forever; once stopped or
    failed, ``register`` refuses.
    """

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed: str | None = "the engine thread has not started"
        self._waiters: dict[str, Callable[[APIError], None]] = {}
        self._aborts: deque[str] = deque()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._closed is None

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine driver was already started")
            self._closed = None
            self._thread = threading.Thread(target=self._run, name="refengine-driver", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close("the server is shutting down")

    def register(self, request_id: str, on_fail: Callable[[APIError], None]) -> None:
        with self._lock:
            if self._closed is not None:
                raise EngineUnavailable(self._closed)
            self._waiters[request_id] = on_fail

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (no-op if it already finished)."""
        self._aborts.append(request_id)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                while self._aborts:
                    engine.abort(self._aborts.popleft())
                if engine.has_work:
                    engine.step()
                else:
                    engine.wait_for_work(self.idle_wait_s)
        except BaseException as exc:
            self.failure = exc
            log.exception("the engine thread failed; refusing new requests")
            self._close("the engine failed; see the server log")

    def _close(self, why: str) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = why
            waiters = list(self._waiters.values())
            self._waiters.clear()
        for on_fail in waiters:
            on_fail(EngineUnavailable(why))


class Flight:
    """One submitted request: the engine's deltas, handed to the event loop, and counted."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        every_delta: bool,
        on_finish: Callable[[], None],
        metrics: ServerMetrics,
    ) -> None:
        self.loop = loop
        self.every_delta = every_delta
        self.on_finish = on_finish
        self.metrics = metrics
        self.queue: asyncio.Queue[TokenDelta | APIError] = asyncio.Queue()
        self.arrived = time.monotonic()
        self.first_token = False

    def _post(self, item: TokenDelta | APIError) -> None:
        # A closed loop (the server stopped) has nobody waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_delta(self, delta: TokenDelta) -> None:
        # Called in the engine thread with its lock held: post, never raise.
        req = delta.request
        if delta.token_ids:
            if not self.first_token:  # prefill's token: the prompt is processed
                self.first_token = True
                self.metrics.first_token(req.prompt_tokens, time.monotonic() - self.arrived)
            self.metrics.generated(len(delta.token_ids))
        if delta.finished:
            reason = delta.finish_reason or "abort"
            self.metrics.finished(
                reason, req.prompt_tokens, req.completion_tokens, time.monotonic() - self.arrived
            )
            # Forget the waiter here too, so nothing leaks if no handler reads to the end
            # (a client gone before its stream started).
            self.on_finish()
        if self.every_delta or delta.finished:
            self._post(delta)

    def on_fail(self, error: APIError) -> None:
        self._post(error)
