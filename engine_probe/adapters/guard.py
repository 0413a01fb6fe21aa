"""The one rule of every engine hook: the probe's own failure never reaches the engine.

An adapter runs inside somebody else's inference server; an exception of its own raised
into a scheduler step would take the server down for an observability tool. So whatever an
adapter does in a hook runs under a :class:`HookGuard`: an exception is logged with its
traceback, counted in the adapter's ``counters``, and the engine goes on as if the hook had
done nothing (the engine's own call is never skipped nor its result changed: that is the
hook's part, around the guard).

Imports nothing of the probe's runtime (no torch)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["HookGuard"]

_T = TypeVar("_T")


class HookGuard:
    """Catches, counts and logs the exceptions of one adapter's hooks.

    Invariant: each exception caught adds exactly one to ``counters[counter]`` (created at
    the first, where the adapter does not list it from the start) and logs one ERROR line,
    with its traceback, on ``log``: ``message % where``. Only :class:`Exception` is caught:
    a ``KeyboardInterrupt`` or ``SystemExit`` is the engine's to see.
    """

    __slots__ = ("_counter", "_counters", "_log", "_message")

    def __init__(
        self, counters: dict[str, int], counter: str, log: logging.Logger, message: str
    ) -> None:
        self._counters = counters
        self._counter = counter
        self._log = log
        self._message = message

    def call(self, fn: Callable[..., _T], *args: Any) -> _T | None:
        """``fn(*args)``, or None when it raised (counted under ``fn``'s name)."""
        try:
            return fn(*args)
        except Exception:
            self.failed(fn.__name__)
            return None

    def at(self, where: str) -> _Guarded:
        """A context manager that swallows (counts and logs) an exception of its body."""
        return _Guarded(self, where)

    def failed(self, where: str, exc: BaseException | None = None) -> None:
        """Count and log an exception of ``where``: ``exc``, else the one being handled
        (call it from an ``except`` block)."""
        counters = self._counters
        counters[self._counter] = counters.get(self._counter, 0) + 1
        self._log.error(self._message, where, exc_info=exc if exc is not None else True)


class _Guarded:
    """:meth:`HookGuard.at`'s context manager: a plain object, cheaper per hook call than a
    generator-based one."""

    __slots__ = ("_guard", "_where")

    def __init__(self, guard: HookGuard, where: str) -> None:
        self._guard = guard
        self._where = where

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self._guard.failed(self._where, exc)
        return True
