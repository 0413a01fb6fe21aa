"""The probe's hot path: sequence numbers, a bounded in-memory buffer, drop counters.

Nothing here blocks on I/O. ``EventBuffer.append`` takes one uncontended lock for the
duration of building one msgspec Struct and a list append; when the buffer is full it drops
the new event and counts it, it never waits for room.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Final, NamedTuple, get_args

from engine_probe.errors import InvalidEventError
from engine_probe.events import SCHEMA_VERSION, DropReason, Event, ProbeDrops, utcnow
from engine_probe.journal import Journal

DROP_REASONS: Final[tuple[DropReason, ...]] = get_args(DropReason)


class DropCounter:
    """Events dropped, by reason, in two views.

    ``totals`` counts every drop since the probe started (for ``stats()``). ``pending``
    counts the drops not yet reported to the collector in a ``ProbeDrops`` event; the
    exporter takes it when it builds the report. Invariant: a report that is itself lost
    gives its counts back (``restore``), so every dropped seq of this probe is eventually
    explained by some delivered report, or stays counted in ``pending``.
    """

    __slots__ = ("_lock", "_pending", "_totals")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[DropReason, int] = {}
        self._totals: dict[DropReason, int] = {}

    def add(self, reason: DropReason, n: int = 1, *, report: bool = True) -> None:
        """Count ``n`` drops. ``report=False``: count in totals only (events of another
        probe's seq space, e.g. from an adopted spool, that this probe must not explain)."""
        if n <= 0:
            return
        with self._lock:
            self._totals[reason] = self._totals.get(reason, 0) + n
            if report:
                self._pending[reason] = self._pending.get(reason, 0) + n

    def restore(self, counts: Iterable[tuple[str, int]]) -> None:
        """Put a lost report's counts (``report.counts.items()``) back into ``pending``;
        totals already have them."""
        with self._lock:
            for reason, n in counts:
                for known in DROP_REASONS:
                    if reason == known and n > 0:
                        self._pending[known] = self._pending.get(known, 0) + n

    def take_pending(self) -> dict[DropReason, int]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def has_pending(self) -> bool:
        return bool(self._pending)

    def totals(self) -> dict[DropReason, int]:
        with self._lock:
            return dict(self._totals)


class Taken(NamedTuple):
    """What the exporter took from the buffer: ``events`` in seq order, and ``upto``, the
    highest seq handed out when it was taken. Every seq <= ``upto`` is in ``events`` or
    counted as dropped."""

    events: list[Event]
    upto: int


class EventBuffer:
    """Sequencer plus bounded buffer of one probe.

    Invariants: ``len(self) <= capacity``; seqs are handed out strictly increasing from 1,
    with no gap, under the same lock as the append, so the buffer holds events in seq order;
    a seq is handed out BEFORE the drop decision, so a dropped event leaves a gap the
    collector can see, and every seq handed out is in the buffer, taken by the exporter
    (which then delivers, spools or counts it), or counted in ``drops``. With a ``journal``,
    every event the buffer accepts (and every drops report ``take`` builds) is also written
    to it, in seq order, under the same lock, before ``append`` returns; a dropped event is
    not (its drop is what the collector will be told).
    """

    __slots__ = (
        "_batch_size",
        "_capacity",
        "_closed",
        "_deployment_id",
        "_drops",
        "_emitted",
        "_items",
        "_lock",
        "_on_batch",
        "_probe_id",
        "_seq",
        "journal",
    )

    def __init__(
        self,
        *,
        capacity: int,
        batch_size: int,
        probe_id: str,
        deployment_id: str,
        drops: DropCounter,
        on_batch: Callable[[], None],
    ) -> None:
        if capacity < 1 or batch_size < 1:
            raise ValueError("capacity and batch_size must be positive")
        self._capacity = capacity
        self._batch_size = batch_size
        self._probe_id = probe_id
        self._deployment_id = deployment_id
        self._drops = drops
        self._on_batch = on_batch
        self._lock = threading.Lock()
        self._items: list[Event] = []
        self._seq = 0
        self._emitted = 0
        self._closed = False
        #: set once, before the first append, by the probe that owns the buffer
        self.journal: Journal | None = None

    def append(
        self, cls: type[Event], ts: datetime, deployment_id: str, fields: dict[str, Any]
    ) -> bool:
        """Build the event with the next seq and buffer it; False when it was dropped.

        Raises :class:`InvalidEventError` for fields the event type refuses; no seq is
        consumed then, because the event never existed.
        """
        with self._lock:
            if self._closed:
                # No seq: nothing after the final report is sent, so there is no gap to
                # explain; the drop still shows in stats().
                self._drops.add("shutdown", report=False)
                return False
            seq = self._seq + 1
            try:
                event = cls(
                    schema_version=SCHEMA_VERSION,
                    probe_id=self._probe_id,
                    seq=seq,
                    ts=ts,
                    deployment_id=deployment_id,
                    **fields,
                )
            except (TypeError, ValueError) as exc:
                raise InvalidEventError(f"{cls.__name__}: {exc}") from None
            self._seq = seq
            self._emitted += 1
            items = self._items
            if len(items) >= self._capacity:
                self._drops.add("buffer_full")
                return False
            items.append(event)
            n = len(items)
            journal = self.journal
            if journal is not None:
                journal.append(event)
        if n == self._batch_size:
            self._on_batch()
        return True

    def take(self) -> Taken:
        """Everything buffered, plus a ``ProbeDrops`` report when drops are pending.

        The report gets its seq here, under the lock, after every event already buffered,
        so the stream stays in seq order; it goes out with the batch instead of through the
        bounded buffer, which is how it gets through even when the buffer is full.
        """
        with self._lock:
            items, self._items = self._items, []
            if self._drops.has_pending():
                counts = self._drops.take_pending()
                if counts:
                    self._seq += 1
                    report = ProbeDrops(
                        schema_version=SCHEMA_VERSION,
                        probe_id=self._probe_id,
                        seq=self._seq,
                        ts=utcnow(),
                        deployment_id=self._deployment_id,
                        counts=counts,
                    )
                    items.append(report)
                    if self.journal is not None:
                        self.journal.append(report)
            return Taken(items, self._seq)

    def snapshot(self) -> list[Event]:
        """A copy of the buffered events, in seq order; nothing is taken (a recording probe's
        reader, and benchmarks that look at what a probe holds)."""
        with self._lock:
            return list(self._items)

    def close(self) -> None:
        """Refuse further appends (counted as "shutdown" drops); ``take`` still works."""
        with self._lock:
            self._closed = True

    @property
    def seq(self) -> int:
        """The highest seq handed out so far (0 before the first event)."""
        return self._seq

    @property
    def emitted(self) -> int:
        return self._emitted

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)
