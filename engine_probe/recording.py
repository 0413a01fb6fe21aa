"""A probe that keeps its events in memory: for tests and benchmarks, never for an engine.

Hand it to an adapter where a real probe would go (``attach(engine, probe)``, the gateway's
``create_app(settings, probe=...)``), run the engine, then read what the adapter sent::

    probe = RecordingProbe()
    attach(engine, probe)
    ...
    (hit,) = probe.of(PrefixCacheHit)
    probe.decoded()  # and the collector would have taken every event

It is ``Probe`` without the export: the adapter calls the same ``emit``, so it cannot tell
the two apart, and nothing leaves the process.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any, TypeVar, overload

from engine_probe.buffer import DROP_REASONS, DropCounter, EventBuffer
from engine_probe.events import Event, ProbeStopped, decode_json_batch, encode_batch, utcnow
from engine_probe.probe import _BufferingProbe

E = TypeVar("E", bound=Event)


def _no_batches() -> None:
    """Nothing takes batches out of a recording probe's buffer."""


class RecordingProbe(_BufferingProbe):
    """An enabled probe that records every event it accepts, in memory.

    What it records: each event an ``emit`` accepted, built as ``Probe`` builds it
    (``schema_version``, this probe's ``probe_id``, ``seq`` from 1 with no gap, ``ts``
    defaulting to now, ``deployment_id`` to this probe's), in seq order, which is the order in
    which the ``emit`` calls took the buffer's lock, whatever threads they came from.
    ``shutdown`` records ``probe.stopped`` last, as ``Probe`` sends it; an ``emit`` after it
    returns False and counts a "shutdown" drop. Nothing else is ever dropped: the record is
    unbounded, sized for a test's or a benchmark's run, not an engine's lifetime.

    Checks: ``emit`` raises :class:`~engine_probe.errors.InvalidEventError` exactly where
    ``Probe.emit`` does (an event type a probe may not emit, unknown or missing fields, a
    naive ``ts``). Like ``Probe``, it does not range-check values; :meth:`decoded` does, as
    the collector would.

    Thread-safety: every method may be called from any thread; the readers (``events``,
    :meth:`of`, :meth:`one`, :meth:`decoded`) see a snapshot taken under the buffer's lock.
    """

    def __init__(self, *, probe_id: str = "test", deployment_id: str = "test") -> None:
        self.probe_id = probe_id
        self._deployment_id = deployment_id
        self._drops = DropCounter()
        self._buffer = EventBuffer(
            capacity=sys.maxsize,
            batch_size=sys.maxsize,
            probe_id=probe_id,
            deployment_id=deployment_id,
            drops=self._drops,
            on_batch=_no_batches,
        )
        self._started = True  # there is no exporter to start
        self._control = threading.Lock()
        self._shut_down = False

    # -- what it recorded ---------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """Every recorded event, in seq order (a copy)."""
        return self._buffer.snapshot()

    def of(self, event_type: type[E]) -> list[E]:
        """The recorded events of ``event_type``, in seq order (``Event``: all of them)."""
        return [e for e in self.events if isinstance(e, event_type)]

    @overload
    def one(self) -> Event: ...
    @overload
    def one(self, event_type: type[E]) -> E: ...
    def one(self, event_type: type[Event] = Event) -> Event:
        """The one recorded event (of ``event_type``); LookupError unless there is exactly
        one."""
        found = self.of(event_type)
        if len(found) != 1:
            what = "event" if event_type is Event else event_type.__name__
            kinds = Counter(type(e).__name__ for e in found)
            recorded = ", ".join(f"{n} {kind}" for kind, n in kinds.items()) or "none"
            raise LookupError(f"expected one {what}; recorded {recorded}")
        return found[0]

    def decoded(self) -> list[Event]:
        """Every recorded event as the collector decodes it: encoded as a probe sends a batch
        and decoded with the collector's decoder, which checks every value (ids, ranges,
        lengths, control characters).

        Raises :class:`~engine_probe.events.DecodeError` naming each event (its index in
        ``events``) and field the collector would refuse."""
        return decode_json_batch(encode_batch(self._buffer.snapshot()))

    # -- the probe interface ------------------------------------------------------------

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """True: every event emitted is already where it goes (in ``events``)."""
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Record ``probe.stopped`` and refuse later events; idempotent. True: nothing is
        lost to it."""
        with self._control:
            if not self._shut_down:
                self._buffer.append(ProbeStopped, utcnow(), self._deployment_id, {})
                self._buffer.close()
                self._shut_down = True
        return True

    def stats(self) -> dict[str, Any]:
        """``Probe.stats``'s own counters (no exporter's): emitted, seq, buffered (recorded:
        everything stays), dropped by reason (only "shutdown" ever counts), shut_down."""
        dropped = dict.fromkeys(DROP_REASONS, 0)
        dropped.update(self._drops.totals())
        return {
            "enabled": True,
            "probe_id": self.probe_id,
            "emitted": self._buffer.emitted,
            "seq": self._buffer.seq,
            "buffered": len(self._buffer),
            "dropped": dropped,
            "shut_down": self._shut_down,
        }
