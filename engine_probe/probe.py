"""The probe: what engine adapters call.

``get_probe()`` returns the process's probe: a shared no-op probe until
``configure_probe(settings)`` installs a real one. Adapters call::

    get_probe().emit(PoolSample, capacity_tokens=..., used_tokens=..., free_tokens=...)

and may test ``probe.enabled`` to skip computing fields nobody will receive.

The hot path (``Probe.emit``) validates the event type, builds the msgspec Struct with the
next seq under one short lock, and appends it to a bounded buffer; it never does I/O, never
waits for room, and never blocks on the collector. A daemon exporter thread does the rest.

Probe ids: the configured ``probe_id`` (else the host name) is a root. Every ``Probe`` sends
as ``{root}-{pid}-{6 random hex}``, so a restarted process (same root, seq from 1 again) never
reuses the previous process's seq space, which the collector would count as duplicates.

Processes that fork: in the child, every probe gets a fresh probe id (the parent's seq space
must never be reused under one id), a seq counter from 1, an empty buffer, new locks, and an
exporter thread started lazily by the first ``emit``. The parent's buffered events stay the
parent's: the child never sends them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from abc import ABC, abstractmethod
from datetime import datetime
from typing import Any, Final

from engine_probe.buffer import DROP_REASONS, DropCounter, EventBuffer
from engine_probe.errors import InvalidEventError, ProbeConfigError
from engine_probe.events import EVENT_TYPES, Event, ProbeDrops, ProbeStopped, utcnow
from engine_probe.exporter import Exporter
from engine_probe.settings import ProbeSettings, derive_probe_id

log = logging.getLogger("engine_probe")

# ProbeDrops and ProbeStopped are the probe's own reports: an adapter sending one would
# corrupt gap accounting, or tell the collector a live probe had stopped.
_EMITTABLE: Final[frozenset[type[Event]]] = frozenset(
    t for t in EVENT_TYPES if t not in (ProbeDrops, ProbeStopped)
)


class BaseProbe(ABC):
    """What adapters program against; ``Probe`` and ``NoopProbe`` implement it."""

    enabled: bool

    @abstractmethod
    def emit(
        self,
        event_type: type[Event],
        /,
        *,
        ts: datetime | None = None,
        deployment_id: str | None = None,
        **fields: Any,
    ) -> bool:
        """Record one event; True when it was buffered, False when dropped (or a no-op)."""

    @abstractmethod
    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """True when everything emitted before the call is delivered, spooled or counted."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush and stop; idempotent. True when nothing was lost to the shutdown."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A snapshot of counters (see ``Probe.stats``)."""


class NoopProbe(BaseProbe):
    """The probe before ``configure_probe``: ``emit`` does nothing and checks nothing."""

    enabled = False
    probe_id: str | None = None

    def emit(
        self,
        event_type: type[Event],
        /,
        *,
        ts: datetime | None = None,
        deployment_id: str | None = None,
        **fields: Any,
    ) -> bool:
        return False

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"enabled": False, "probe_id": None}


class _BufferingProbe(BaseProbe):
    """The hot path ``Probe`` shares with ``engine_probe.recording.RecordingProbe``, so that
    an adapter cannot tell one from the other: ``emit`` checks the call, stamps it, and
    hands it to the probe's :class:`EventBuffer`, which builds the event with the next seq.

    A subclass sets ``_buffer`` and ``_deployment_id``, and ``_started`` (False: the first
    ``emit`` calls ``_start_exporter``).
    """

    enabled = True
    _buffer: EventBuffer
    _deployment_id: str
    _started: bool

    def _start_exporter(self) -> None:
        """Start whatever takes the events out of the buffer (nothing, here)."""
        self._started = True

    def emit(
        self,
        event_type: type[Event],
        /,
        *,
        ts: datetime | None = None,
        deployment_id: str | None = None,
        **fields: Any,
    ) -> bool:
        """Stamp and buffer one event; never blocks on I/O.

        The probe sets ``schema_version``, ``probe_id`` and ``seq``; ``ts`` defaults to now
        (UTC) and ``deployment_id`` to the configured one. Returns False when the event was
        dropped (buffer full, probe shut down), which is counted.

        Raises :class:`InvalidEventError` for caller bugs (an event type that is not one of
        ``events.EVENT_TYPES``, unknown or missing fields, a naive ``ts``), before any seq
        is consumed. Field values are not range-checked here (that would cost the hot path);
        the collector refuses bad ones and they are counted as "rejected_by_collector".
        """
        if event_type not in _EMITTABLE:
            raise InvalidEventError(f"{event_type!r} is not an event type a probe can emit")
        if not self._started:
            self._start_exporter()
        if ts is None:
            ts = utcnow()
        elif ts.tzinfo is None:
            raise InvalidEventError("ts must be timezone-aware")
        return self._buffer.append(event_type, ts, deployment_id or self._deployment_id, fields)


class Probe(_BufferingProbe):
    """A live probe exporting to ``settings.collector_url``.

    Invariants: seqs are strictly increasing from 1 per probe id and handed out before the
    buffer's drop decision; every seq handed out is delivered, spooled, or counted in the
    drops (and reported in a ``ProbeDrops`` event, itself part of the seq stream), so the
    collector can account for every gap.
    """

    def __init__(self, settings: ProbeSettings) -> None:
        if settings.collector_url is None:
            raise ProbeConfigError(
                "a Probe needs collector_url (KVWATCH_COLLECTOR_URL); "
                "configure_probe() keeps the no-op probe without one"
            )
        self.settings = settings
        # Every id this probe uses (and its forked children's) derives from this root: the
        # configured id, else the host name. Never the root itself: the seq counter starts
        # at 1 in every process, and a reused (probe_id, seq) is stored as a duplicate.
        self._id_root = settings.probe_id
        self._deployment_id = settings.deployment_id
        self._control = threading.Lock()
        self._shutdown_result: bool | None = None
        self._new_identity(derive_probe_id(self._id_root))
        _live_probes.add(self)
        self._start_exporter()

    def _new_identity(self, probe_id: str) -> None:
        """Fresh seq space: id, counters, buffer and a not-yet-started exporter."""
        s = self.settings
        self.probe_id = probe_id
        self._drops = DropCounter()
        self._buffer = EventBuffer(
            capacity=s.probe_buffer_size,
            batch_size=s.probe_batch_size,
            probe_id=probe_id,
            deployment_id=self._deployment_id,
            drops=self._drops,
            on_batch=self._on_batch,
        )
        self._exporter = Exporter(s, probe_id=probe_id, buffer=self._buffer, drops=self._drops)
        self._started = False

    def _on_batch(self) -> None:
        self._exporter.notify_batch()

    def _start_exporter(self) -> None:
        with self._control:
            if self._started:
                return
            self._started = True
            if self._shutdown_result is None:
                # Before the first event is buffered (the caller's emit comes after this):
                # the journal must hold every event the buffer accepts.
                self._buffer.journal = self._exporter.open_journal()
                self._exporter.start()

    # -- control -------------------------------------------------------------------------

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Block until every event emitted before the call is delivered, spooled or counted
        as dropped, or ``timeout_s`` passes (then False). Without a spool, events waiting
        for the collector to come back are not flushed: this waits for them."""
        target = self._buffer.seq
        if target == 0:
            return True
        return self._exporter.flush(target, timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Send ``probe.stopped`` (when the probe ever started), deliver what can be delivered
        in ``timeout_s``, spool the rest (or, without a spool, count it as "shutdown" drops),
        stop the exporter, release the spool.

        Idempotent: later calls return the first call's result. Events emitted afterwards
        are counted as "shutdown" drops.
        """
        with self._control:
            if self._shutdown_result is not None:
                return self._shutdown_result
            if self._started:
                # the last event of the seq stream: the collector stops expecting this probe
                self._buffer.append(ProbeStopped, utcnow(), self._deployment_id, {})
            self._buffer.close()
            exporter = self._exporter if self._started else None
            result = True if exporter is None else exporter.shutdown(timeout_s)
            self._shutdown_result = result
        _live_probes.discard(self)
        return result

    def stats(self) -> dict[str, Any]:
        """A snapshot: emitted (seqs handed out), buffered, sent (events acknowledged by the
        collector), accepted/duplicates (as it reported them), spooled (files, bytes and
        events in the spool now), dropped (totals by reason since start), last_error, and
        journal: appends, records not journaled (``not_journaled_full``/``_error``: those
        events were still buffered and sent; they only were not crash-safe), live segments,
        and ``replayed``: events this probe adopted from dead probes' journals."""
        dropped = dict.fromkeys(DROP_REASONS, 0)
        dropped.update(self._drops.totals())
        out: dict[str, Any] = {
            "enabled": True,
            "probe_id": self.probe_id,
            "emitted": self._buffer.emitted,
            "seq": self._buffer.seq,
            "buffered": len(self._buffer),
            "dropped": dropped,
            "shut_down": self._shutdown_result is not None,
        }
        out.update(self._exporter.stats())
        return out

    def _after_fork_in_child(self) -> None:
        self._exporter.abandon_after_fork()
        self._control = threading.Lock()
        self._new_identity(derive_probe_id(self._id_root))
        if self._shutdown_result is not None:
            self._buffer.close()


# -- the process's probe ----------------------------------------------------------------

_NOOP: Final = NoopProbe()
_current: BaseProbe = _NOOP
_config_lock = threading.Lock()
# Strong references: a probe stays reachable (for atexit and fork) until it is shut down.
_live_probes: set[Probe] = set()


def get_probe() -> BaseProbe:
    """The process's probe: the no-op probe until ``configure_probe`` installs one."""
    return _current


def configure_probe(settings: ProbeSettings | None = None) -> BaseProbe:
    """Install the process's probe from ``settings`` (default: ``KVWATCH_*`` environment).

    Without ``collector_url`` the no-op probe stays (or comes back): with nowhere to send
    events there is nothing useful to record, and nothing should pile up in memory or on
    disk. A probe installed earlier is shut down (its events flushed or spooled).
    """
    global _current
    settings = settings if settings is not None else ProbeSettings()
    new: BaseProbe = Probe(settings) if settings.collector_url is not None else _NOOP
    with _config_lock:
        old, _current = _current, new
    if old is not new:
        old.shutdown(settings.probe_atexit_timeout_s)
    return new


def shutdown_probe(timeout_s: float = 5.0) -> bool:
    """Shut the process's probe down and put the no-op probe back."""
    global _current
    with _config_lock:
        old, _current = _current, _NOOP
    return old.shutdown(timeout_s)


def _shutdown_all_at_exit() -> None:
    for probe in list(_live_probes):
        try:
            probe.shutdown(probe.settings.probe_atexit_timeout_s)
        except Exception:
            log.exception("kvwatch probe shutdown at exit failed")


def _after_fork_in_child() -> None:
    global _config_lock
    _config_lock = threading.Lock()
    for probe in list(_live_probes):
        probe._after_fork_in_child()


atexit.register(_shutdown_all_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
