"""The exporter: one daemon thread per probe that moves events from the buffer to the collector.

Per cycle (every ``probe_flush_interval_s``, or sooner when a full batch is waiting or a
flush is requested) it takes everything buffered, cuts it into batches of at most
``probe_batch_size`` events, encodes them with ``events.encode_batch`` and POSTs them to
``{collector_url}/v1/events``.

How it answers the collector:

* 2xx: delivered.
* 413: the batch is too large; split it in halves and send each, in order.
* 400/422: the collector refuses those events for good. Not retried: they are counted as
  dropped ("rejected_by_collector") and kept in ``<spool_dir>/rejected/``. When the
  collector (or a local decode) names the bad events, the others are sent again without them.
* connection errors, timeouts, 401 (the token, never the batch), 403 for a batch of this
  probe's own id (the token's deployment scope: a configuration error, like a 401), 429,
  502, 503, 504: the collector is unavailable to us. Retried forever (an outage or a wrong
  token must never lose data), with exponential backoff and full jitter; meanwhile batches
  go to the backlog. A refused token is logged once, as an ERROR naming the setting.
* any other answer (a 403 for an adopted batch of another probe's id, 404, 500, ...):
  retried too, but at most ``probe_max_attempts`` times per batch. Such an answer can come
  from the batch itself (a 500 on input the collector chokes on; a 403 for an adopted batch
  whose probe_id belongs to another token, which no token of ours will ever fix), and the
  backlog is replayed in order, so a batch that can never succeed would block every batch
  behind it. Past the cap it is dead-lettered and counted like a 422, and the next batch
  gets its turn. Once a batch of another (dead) probe's id was dead-lettered on a 403, later
  batches of that id are dead-lettered at their first 403, so an adopted spool of thousands
  of such batches cannot hold the probe's own events back for hours.

The backlog is the spool on disk when ``probe_spool_dir`` is set, else a bounded list in
memory. With a spool, the probe's write-ahead journal (``engine_probe.journal``, unless
``probe_journal_bytes`` is 0) lives in the spool's directory: the exporter opens it before the
first event (``open_journal``), releases what it covers whenever more seqs are handled, and
deletes it after a clean shutdown; a dead probe's journal is replayed by ``adopt_orphans``.
Once the backlog holds anything, every newer batch goes to its end, and it is replayed
oldest first before anything newer is sent, which keeps each probe's events in seq order.

Invariant: every event taken from the buffer ends delivered, in the backlog, or counted in
the drop counter (dead-lettered batches included); no code path discards a batch without
counting it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import httpx
import msgspec

from engine_probe import events as ev
from engine_probe.buffer import DropCounter, EventBuffer
from engine_probe.errors import ProbeError, SpoolError, SpoolFullError
from engine_probe.journal import Journal
from engine_probe.settings import ProbeSettings
from engine_probe.spool import Spool

log = logging.getLogger("engine_probe.exporter")

USER_AGENT: Final = "kvwatch-probe/0.1"
_NOTE_BODY_MAX: Final = 16 * 1024
_ERROR_MESSAGE_MAX: Final = 300
# Answers that say the collector (or the way to it) is unavailable, not that the batch is
# bad: retried forever. 401 is decided from the token before the body is read, so it never
# says anything about a batch; dead-lettering on it would only lose data while a person
# fixes the token. (A 403 for the probe's own batch is treated the same: see _deliver.)
_UNAVAILABLE: Final = frozenset({401, 429, 502, 503, 504})


class _Head(msgspec.Struct):
    """The few fields of an event the exporter needs when it has to account for a drop."""

    probe_id: str = ""
    kind: str = ""
    counts: dict[str, int] | None = None


_heads_decoder = msgspec.json.Decoder(list[_Head])
_raws_decoder = msgspec.json.Decoder(list[msgspec.Raw])


def _split(body: bytes) -> list[msgspec.Raw]:
    return _raws_decoder.decode(body)


def _join(raws: Sequence[msgspec.Raw | bytes]) -> bytes:
    return b"[" + b",".join(raws) + b"]"


@dataclass(frozen=True, slots=True)
class _Refusal:
    """An answer that counts against a batch's ``probe_max_attempts``."""

    status: int
    text: str


@dataclass(frozen=True, slots=True)
class _Retry:
    """What is left of a batch that could not be delivered yet (all of it, or the part
    after what a 413 split or a 422 did deliver). ``refusal`` is set when the failure
    counts against the attempt cap (None: transport error or collector unavailable)."""

    body: bytes
    events: int
    refusal: _Refusal | None = None


class _MemoryFull(ProbeError):
    """Control flow inside the exporter (the in-memory backlog is full: the batch is counted
    as dropped); it never leaves this module."""


class _Backlog(Protocol):
    def __len__(self) -> int: ...

    def push(self, body: bytes, events: int, first_seq: int) -> None: ...

    def peek(self) -> tuple[bytes, int]: ...

    def pop(self) -> None: ...

    def replace_head(self, body: bytes, events: int) -> None: ...

    def unhandled_from(self) -> int | None: ...

    @property
    def events(self) -> int: ...


class _DiskBacklog:
    """The spool as a backlog. A spooled batch counts as handled (it survives a crash)."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    def __len__(self) -> int:
        return len(self.spool)

    def push(self, body: bytes, events: int, first_seq: int) -> None:
        self.spool.push(body, events)

    def peek(self) -> tuple[bytes, int]:
        entry = self.spool.oldest()
        assert entry is not None
        return self.spool.read(entry), entry.events

    def pop(self) -> None:
        entry = self.spool.oldest()
        assert entry is not None
        self.spool.remove(entry)

    def replace_head(self, body: bytes, events: int) -> None:
        self.spool.replace_head(body, events)

    def unhandled_from(self) -> int | None:
        return None

    @property
    def events(self) -> int:
        return self.spool.events


@dataclass(slots=True)
class _Pending:
    body: bytes
    events: int
    first_seq: int


class _MemoryBacklog:
    """Batches awaiting retry when no spool is configured, at most ``max_events`` events.
    They are not "handled" until delivered: ``force_flush`` waits for them."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self._items: deque[_Pending] = deque()
        self._events = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, body: bytes, events: int, first_seq: int) -> None:
        if self._events + events > self.max_events:
            raise _MemoryFull
        self._items.append(_Pending(body, events, first_seq))
        self._events += events

    def peek(self) -> tuple[bytes, int]:
        head = self._items[0]
        return head.body, head.events

    def pop(self) -> None:
        self._events -= self._items.popleft().events

    def replace_head(self, body: bytes, events: int) -> None:
        head = self._items[0]
        self._events += events - head.events
        head.body, head.events = body, events

    def unhandled_from(self) -> int | None:
        return self._items[0].first_seq if self._items else None

    def drain_all(self) -> Iterator[_Pending]:
        while self._items:
            item = self._items.popleft()
            self._events -= item.events
            yield item

    @property
    def events(self) -> int:
        return self._events


def _chunks(items: list[ev.Event], size: int) -> Iterator[list[ev.Event]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Exporter:
    """Background delivery for one probe (one seq space). Start once; not restartable.

    Thread model: only the exporter thread touches the HTTP client and the backlog; other
    threads talk to it through ``_cond`` (wake-ups, flush requests, the stop request) and
    read counters for ``stats()``.
    """

    def __init__(
        self,
        settings: ProbeSettings,
        *,
        probe_id: str,
        buffer: EventBuffer,
        drops: DropCounter,
    ) -> None:
        if settings.events_url is None:
            raise ValueError("the exporter needs a collector_url")
        self._settings = settings
        self._url = settings.events_url
        self._probe_id = probe_id
        self._buffer = buffer
        self._drops = drops
        self._batch_size = settings.probe_batch_size
        self._interval = settings.probe_flush_interval_s
        self._spool: Spool | None = None
        self._journal: Journal | None = None
        self._journal_discard = False  # a clean shutdown: nothing journaled is unhandled
        self._backlog: _Backlog
        if settings.probe_spool_dir is not None:
            self._spool = Spool(settings.probe_spool_dir, probe_id, settings.probe_max_spool_bytes)
            self._backlog = _DiskBacklog(self._spool)
            if settings.probe_journal_bytes:
                self._journal = Journal(self._spool.dir, settings.probe_journal_bytes)
        else:
            self._backlog = _MemoryBacklog(settings.probe_buffer_size)
        self._client: httpx.Client | None = None

        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._ready = False  # a full batch is waiting in the buffer
        self._flush_requested = 0
        self._flush_seen = 0  # the flush requests the current cycle serves
        self._flush_acked = 0  # flush requests whose cycle has taken and routed the buffer
        self._stop_at: float | None = None  # monotonic deadline once shutdown was asked for
        self._finished = False
        self._final_clean = False
        self._taken_upto = 0
        self._handled = 0  # every seq <= this is delivered, spooled or counted as dropped

        self._attempt = 0
        self._retry_at = 0.0
        self._healthy = True
        self._refused_status: int | None = None  # the 401/403 already said, until a success
        self._max_attempts = settings.probe_max_attempts
        # Refusals counted against the backlog's head (reset whenever the head changes or
        # makes progress), and the foreign probe ids given up on after a 403.
        self._head_attempts = 0
        self._forbidden_ids: set[str] = set()

        self.sent = 0
        self.batches_sent = 0
        self.accepted = 0
        self.duplicates = 0
        self.last_error: str | None = None
        self.adopted_files = 0

    # -- control, from any thread --------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"kvwatch-probe-exporter[{self._probe_id}]", daemon=True
        )
        self._thread.start()

    def open_journal(self) -> Journal | None:
        """Lock the spool directory and open the journal, on the thread that builds the probe
        and before ``start`` (so that the first event is journaled); None without one. A
        directory that cannot take it is logged, and the probe runs without a journal."""
        journal = self._journal
        if journal is None or self._spool is None:
            return None
        if journal.is_open:
            return journal
        try:
            self._spool.open()
            journal.open()
        except Exception as exc:  # an observability probe must not stop the engine's start
            self.last_error = f"journal unavailable: {exc}"
            journal.last_error = self.last_error
            log.error("kvwatch probe journal unavailable (events are not crash-safe): %s", exc)
            return None
        return journal

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def notify_batch(self) -> None:
        """Called by the buffer when a full batch is waiting."""
        with self._cond:
            self._ready = True
            self._cond.notify_all()

    def flush(self, upto_seq: int, timeout_s: float) -> bool:
        """Run a cycle now and wait until every seq <= ``upto_seq`` is delivered, spooled or
        counted as dropped. The cycle also sends the report of drops counted so far."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._flush_requested += 1
            request = self._flush_requested
            self._cond.notify_all()
            while not self._finished and (self._flush_acked < request or self._handled < upto_seq):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._handled >= upto_seq

    def shutdown(self, timeout_s: float) -> bool:
        """Last cycle (deliver what it can until shortly before the deadline, spool the
        rest), then stop. True when the thread finished in time and nothing was lost to
        the shutdown itself."""
        thread = self._thread
        if thread is None:
            return True
        started = time.monotonic()
        timeout_s = max(0.0, timeout_s)
        # Leave the thread a margin to spool what it could not send before the caller's
        # deadline passes.
        margin = min(0.25, timeout_s * 0.2)
        with self._cond:
            if self._stop_at is None:
                self._stop_at = started + timeout_s - margin
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(max(0.0, timeout_s - (time.monotonic() - started)))
        return not thread.is_alive() and self._final_clean

    def abandon_after_fork(self) -> None:
        """In a forked child: this exporter's thread does not exist there. Let go of the
        parent's spool lock and never touch its sockets or files again."""
        if self._journal is not None:
            self._journal.abandon_after_fork()
        if self._spool is not None:
            self._spool.detach_after_fork()
        self._client = None
        self._finished = True

    def stats(self) -> dict[str, Any]:
        spool = self._spool
        return {
            "sent": self.sent,
            "batches_sent": self.batches_sent,
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "spooled": {
                "files": len(spool) if spool is not None else 0,
                "bytes": spool.total_bytes if spool is not None else 0,
                "events": spool.events if spool is not None else 0,
            },
            "retry_pending_events": 0 if spool is not None else self._backlog.events,
            "adopted_files": self.adopted_files,
            "journal": self._journal_stats(),
            "collector_healthy": self._healthy,
            "last_error": self.last_error,
            "running": self.running,
        }

    def _journal_stats(self) -> dict[str, Any]:
        spool, journal = self._spool, self._journal
        out: dict[str, Any] = {"enabled": journal is not None and journal.is_open}
        if journal is not None:
            out.update(journal.stats())
            out["last_error"] = journal.last_error
        # what this probe adopted from dead probes' journals (with or without its own)
        out["replayed"] = spool.journal_replayed if spool is not None else 0
        out["replay_torn"] = spool.journal_torn if spool is not None else 0
        return out

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._client = httpx.Client(
                headers=self._headers(),
                timeout=self._settings.probe_request_timeout_s,
                follow_redirects=False,
            )
            self._open_spool()
            # The first cycle comes after one interval, or at once when adopted batches wait.
            next_tick = time.monotonic() + self._interval
            while True:
                with self._cond:
                    while True:
                        now = time.monotonic()
                        if (
                            self._stop_at is not None
                            or self._ready
                            or self._flush_requested > self._flush_seen
                        ):
                            break
                        wake_at = next_tick
                        if len(self._backlog):
                            wake_at = min(wake_at, self._retry_at)
                        if wake_at <= now:
                            break
                        self._cond.wait(wake_at - now)
                    stop_at = self._stop_at
                    self._flush_seen = self._flush_requested
                    self._ready = False
                if stop_at is not None:
                    self._final(stop_at)
                    return
                next_tick = time.monotonic() + self._interval
                self._cycle(None)
        except BaseException as exc:  # the thread must say why it died; it never should
            self.last_error = f"exporter thread crashed: {exc!r}"
            log.exception("kvwatch probe exporter crashed")
            raise
        finally:
            self._close()

    def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if self._journal is not None:
            # before the spool: an empty directory (no journal left) is then removed
            self._journal.close(discard=self._journal_discard)
        if self._spool is not None:
            with contextlib.suppress(Exception):
                self._spool.close()
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT}
        if self._settings.ingest_token:
            headers["Authorization"] = f"Bearer {self._settings.ingest_token}"
        else:
            log.warning("KVWATCH_INGEST_TOKEN is not set; the collector will likely refuse events")
        return headers

    def _open_spool(self) -> None:
        if self._spool is None:
            return
        try:
            self._spool.open()
            self.adopted_files = self._spool.adopt_orphans(self._batch_size)
        except SpoolError as exc:
            # Not fatal: direct delivery still works; batches that need the spool are
            # counted as "spool_error" drops, and pushing retries opening it.
            self.last_error = str(exc)
            log.error("kvwatch probe spool unavailable: %s", exc)

    def _cycle(self, deadline: float | None) -> None:
        self._take_route_ack(deadline, self._flush_seen)
        self._drain(deadline)

    def _take_route_ack(self, deadline: float | None, serving: int) -> None:
        """Move everything buffered to the collector or the backlog, then tell the
        ``flush`` callers up to request ``serving`` that their events are handled."""
        self._take_and_route(deadline)
        if self._drops.has_pending():
            # Drops counted while routing (a refused event, a full spool): report them in
            # this cycle rather than one interval later.
            self._take_and_route(deadline)
        self._mark_handled()
        with self._cond:
            self._flush_acked = max(self._flush_acked, serving)
            self._cond.notify_all()

    def _take_and_route(self, deadline: float | None) -> None:
        taken = self._buffer.take()
        self._taken_upto = taken.upto
        self._route(taken.events, deadline)

    def _final(self, deadline: float) -> None:
        totals_before = self._drops.totals()
        # The buffer is closed by now: this cycle takes the last events and the last report.
        self._cycle(deadline)
        if isinstance(self._backlog, _MemoryBacklog):
            for item in self._backlog.drain_all():
                self._account_drop(item.body, item.events, "shutdown")
            self._head_attempts = 0
            self._mark_handled()
        totals_after = self._drops.totals()
        lost = sum(
            totals_after.get(r, 0) - totals_before.get(r, 0)
            for r in ("shutdown", "spool_full", "spool_error", "buffer_full")
        )
        self._final_clean = lost == 0
        # Everything journaled is delivered or spooled: the journal has nothing to protect.
        # Otherwise it stays, and the next probe replays it (duplicates are harmless).
        self._journal_discard = self._final_clean and self._handled >= self._buffer.seq

    def _mark_handled(self) -> None:
        first_unhandled = self._backlog.unhandled_from()
        handled = self._taken_upto if first_unhandled is None else first_unhandled - 1
        with self._cond:
            if handled <= self._handled:
                return
            self._handled = handled
            self._cond.notify_all()
        if self._journal is not None:
            self._journal.release(handled)

    def _stopping(self, deadline: float | None) -> bool:
        # A regular cycle yields to a shutdown request; the final one runs to its deadline.
        return deadline is None and self._stop_at is not None

    def _backing_off(self) -> bool:
        return time.monotonic() < self._retry_at

    # -- routing ---------------------------------------------------------------------------

    def _route(self, events: list[ev.Event], deadline: float | None) -> None:
        for chunk in _chunks(events, self._batch_size):
            encoded = self._encode(chunk)
            if encoded is None:
                continue
            body, n = encoded
            first_seq = chunk[0].seq
            # Backoff applies to replaying the backlog. With an empty backlog (the failed
            # batch could not be spooled) trying the next batch beats dropping it untried.
            if len(self._backlog) or self._stopping(deadline):
                self._to_backlog(body, n, first_seq)
                continue
            try:
                retry = self._deliver(body, n, deadline)
            except Exception as exc:  # a bug here must not lose the batch
                log.exception("unexpected error delivering a batch")
                self._failed(f"unexpected error: {exc!r}")
                retry = _Retry(body, n)
            if retry is not None:
                attempts = 0 if retry.refusal is None else 1
                if self._give_up(retry, attempts):
                    continue
                # The backlog was empty: this batch becomes its head, with its attempt.
                self._to_backlog(retry.body, retry.events, first_seq, attempts)

    def _encode(self, chunk: list[ev.Event]) -> tuple[bytes, int] | None:
        try:
            return ev.encode_batch(chunk), len(chunk)
        except Exception:
            pass  # find the culprits below; the rest still goes out
        parts: list[bytes] = []
        for event in chunk:
            try:
                parts.append(ev.encode_event(event))
            except Exception as exc:
                # A field value msgspec cannot encode (a tensor, a numpy scalar): the
                # collector could never accept it, so it is counted the same way.
                log.error(
                    "dropping unencodable %s seq=%d: %r", type(event).__name__, event.seq, exc
                )
                self.last_error = f"unencodable {type(event).__name__}: {exc!r}"
                self._drops.add("rejected_by_collector")
                if isinstance(event, ev.ProbeDrops):
                    self._drops.restore(event.counts.items())
        return (_join(parts), len(parts)) if parts else None

    def _to_backlog(self, body: bytes, n: int, first_seq: int, attempts: int = 0) -> None:
        was_empty = not len(self._backlog)
        try:
            self._backlog.push(body, n, first_seq)
            if was_empty:
                self._head_attempts = attempts
        except SpoolFullError as exc:
            self.last_error = str(exc)
            self._account_drop(body, n, "spool_full")
        except _MemoryFull:
            self.last_error = "retry backlog full (no spool configured)"
            self._account_drop(body, n, "buffer_full")
        except Exception as exc:
            self.last_error = str(exc)
            log.error("cannot spool a batch of %d events: %s", n, exc)
            self._account_drop(body, n, "spool_error")

    def _drain(self, deadline: float | None) -> None:
        """Replay the backlog oldest first while the collector takes it."""
        while len(self._backlog):
            if self._backing_off() or self._stopping(deadline):
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            if deadline is None and (self._ready or self._flush_requested > self._flush_seen):
                # A long replay must neither starve the buffer into dropping nor keep
                # force_flush waiting: move what is buffered to the end of the backlog
                # (seq order is kept: it is all newer).
                with self._cond:
                    self._ready = False
                    self._flush_seen = self._flush_requested
                self._take_route_ack(deadline, self._flush_seen)
            try:
                body, n = self._backlog.peek()
            except Exception as exc:
                log.error("unreadable spooled batch dropped: %s", exc)
                self.last_error = str(exc)
                self._drops.add("spool_error", self._head_events())
                self._pop_head()
                continue
            try:
                retry = self._deliver(body, n, deadline)
            except Exception as exc:
                log.exception("unexpected error replaying a batch")
                self._failed(f"unexpected error: {exc!r}")
                return
            if retry is not None:
                if retry.events < n:  # part of it was delivered (413 split) or refused (422)
                    try:
                        self._backlog.replace_head(retry.body, retry.events)
                    except Exception as exc:
                        # The old head stays: its delivered part will be sent twice, which
                        # the collector's (probe_id, seq) idempotency absorbs. Its attempt
                        # count stays too, so this cannot go round forever.
                        log.warning("cannot shrink a partly delivered spool file: %s", exc)
                    else:
                        self._head_attempts = 0  # progress: what is left starts afresh
                if retry.refusal is not None:
                    self._head_attempts += 1
                    if self._give_up(retry, self._head_attempts):
                        # What was delivered of the head is delivered; the rest is in the
                        # dead-letter directory and counted: the head is done with.
                        self._pop_head()
                        self._mark_handled()
                        continue
                return
            self._pop_head()
            self._mark_handled()

    def _pop_head(self) -> None:
        self._backlog.pop()
        self._head_attempts = 0

    def _give_up(self, retry: _Retry, attempts: int) -> bool:
        """Dead-letter ``retry`` (counted as "rejected_by_collector") when its refusals
        reached the cap; True when it did."""
        refusal = retry.refusal
        if refusal is None:
            return False
        # A 403 counts here only for another probe's id (an adopted batch: our own batches'
        # 403 is a token to fix, retried forever); that id's token is gone for good.
        probe_id = self._batch_probe_id(retry.body) if refusal.status == 403 else None
        foreign = probe_id if probe_id is not None and probe_id != self._probe_id else None
        if attempts < self._max_attempts and foreign not in self._forbidden_ids:
            return False
        why = (
            f"gave up after {attempts} refusal{'' if attempts == 1 else 's'}, "
            f"probe_max_attempts={self._max_attempts}"
        )
        if attempts < self._max_attempts:
            why += f"; an earlier batch of probe_id {foreign!r} was refused with 403 as often"
        if foreign is not None:
            self._forbidden_ids.add(foreign)
        self._dead_letter(retry.body, retry.events, refusal.status, refusal.text, why)
        return True

    @staticmethod
    def _batch_probe_id(body: bytes) -> str | None:
        try:
            heads = _heads_decoder.decode(body)
        except msgspec.MsgspecError:
            return None
        return heads[0].probe_id if heads else None

    def _head_events(self) -> int:
        spool = self._spool
        if spool is not None and (entry := spool.oldest()) is not None:
            return entry.events
        return 0

    # -- one batch on the wire -------------------------------------------------------------

    def _deliver(self, body: bytes, n: int, deadline: float | None) -> _Retry | None:
        """POST one batch. None when it is done with (delivered or refused for good), else
        what is left to retry later (backoff already scheduled)."""
        client = self._client
        assert client is not None
        timeout = self._settings.probe_request_timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return _Retry(body, n)
            timeout = min(timeout, left)
        try:
            resp = client.post(self._url, content=body, timeout=timeout)
        except httpx.HTTPError as exc:
            self._failed(f"POST {self._url} failed: {exc!r}")
            return _Retry(body, n)
        status = resp.status_code
        if 200 <= status < 300:
            self._succeeded(resp, n)
            return None
        if status == 413:
            return self._split_and_deliver(body, n, resp, deadline)
        if status in (400, 422):
            return self._reject(body, n, resp, deadline)
        said = f"collector answered {status}{_error_message(resp)}"
        token_refused = status == 401 or (status == 403 and not self._foreign(body))
        if token_refused or status == 404:
            self._token_refused(status, said)
        if token_refused or status in _UNAVAILABLE:
            if token_refused:
                scope = " and its deployment scope" if status == 403 else ""
                said += f" (check KVWATCH_INGEST_TOKEN{scope}; {self._kept_where()})"
            self._failed(said, resp)
            return _Retry(body, n)
        self._failed(f"{said} (a batch refused {self._max_attempts} times is dead-lettered)", resp)
        return _Retry(body, n, _Refusal(status, resp.text[:_NOTE_BODY_MAX]))

    def _foreign(self, body: bytes) -> bool:
        """Whether a batch carries another probe's id (an adopted spool's). A 403 for it says
        that id belongs to another token: no token of ours fixes that, so it is capped. A
        403 for our own batch says our token is wrong, which a person can fix."""
        probe_id = self._batch_probe_id(body)
        return probe_id is not None and probe_id != self._probe_id

    def _split_and_deliver(
        self, body: bytes, n: int, resp: httpx.Response, deadline: float | None
    ) -> _Retry | None:
        try:
            raws = _split(body)
        except msgspec.MsgspecError:
            self._dead_letter_resp(body, n, resp, "413 for a batch that is not a JSON array")
            return None
        if len(raws) <= 1:
            self._dead_letter_resp(body, n, resp, "one event is larger than the collector allows")
            return None
        mid = len(raws) // 2
        halves = (raws[:mid], raws[mid:])
        for i, half in enumerate(halves):
            retry = self._deliver(_join(half), len(half), deadline)
            if retry is not None:
                if i == 0:
                    rest = _split(retry.body) + halves[1]
                    return _Retry(_join(rest), len(rest), retry.refusal)
                return retry
        return None

    def _reject(
        self, body: bytes, n: int, resp: httpx.Response, deadline: float | None
    ) -> _Retry | None:
        """Refused for good. If the bad events can be named, only they are refused and the
        rest is sent again (each round strictly smaller, so this ends)."""
        try:
            raws = _split(body)
        except msgspec.MsgspecError:
            self._dead_letter_resp(body, n, resp, "batch is not a JSON array")
            return None
        bad = _bad_indices(resp, len(raws))
        if not bad:
            try:
                ev.decode_json_batch(body)
            except ev.DecodeError as exc:
                bad = {e.index for e in exc.errors if e.index is not None and e.index < len(raws)}
        if not bad or len(bad) >= len(raws):
            self._dead_letter_resp(body, len(raws), resp, "collector refused the batch")
            return None
        rejected = [raws[i] for i in sorted(bad)]
        good = [raw for i, raw in enumerate(raws) if i not in bad]
        self._dead_letter_resp(
            _join(rejected), len(rejected), resp, "collector refused these events"
        )
        return self._deliver(_join(good), len(good), deadline)

    def _dead_letter_resp(self, body: bytes, n: int, resp: httpx.Response, why: str) -> None:
        self._dead_letter(body, n, resp.status_code, resp.text, why)

    def _dead_letter(self, body: bytes, n: int, status: int, text: str, why: str) -> None:
        """Count ``n`` events as "rejected_by_collector" and keep them, with ``why``, in
        ``<spool_dir>/rejected/`` (when there is a spool)."""
        log.error("collector refused %d events (%s, HTTP %d)", n, why, status)
        self.last_error = f"collector refused {n} events: HTTP {status} ({why})"
        self._account_drop(body, n, "rejected_by_collector")
        if self._spool is not None:
            note = (
                f"{why}\nPOST {self._url}\nHTTP {status}\n"
                f"events: {n}\nresponse:\n{text[:_NOTE_BODY_MAX]}\n"
            )
            self._spool.write_rejected(body, note)
        # The collector answered: it is reachable, whatever it thought of these events.
        self._attempt = 0
        self._retry_at = 0.0

    def _account_drop(self, body: bytes, n: int, reason: ev.DropReason) -> None:
        """Count a batch as dropped. Only this probe's events go into its reports (an
        adopted spool holds other, dead, probes' events), and a drops report that is itself
        dropped gives its counts back so the next report carries them."""
        try:
            heads = _heads_decoder.decode(body)
        except msgspec.MsgspecError:
            self._drops.add(reason, n)
            return
        own = 0
        for head in heads:
            if head.probe_id != self._probe_id:
                continue
            own += 1
            if head.kind == "probe.drops" and head.counts:
                self._drops.restore(head.counts.items())
        self._drops.add(reason, own)
        self._drops.add(reason, len(heads) - own, report=False)

    def _token_refused(self, status: int, said: str) -> None:
        """A refused token (401, or 403 for our own batch) or a URL that is no collector
        (404) is a person's mistake, not an outage: said once, as an error naming the setting
        to fix, until a batch gets through again. Events wait (in the spool, if one is set)
        meanwhile; a 404 batch is capped (``probe_max_attempts``), a refused token's is not."""
        if self._refused_status == status:
            return
        self._refused_status = status
        if status == 404:
            log.error(
                "kvwatch probe: %s answered 404 (%s): it is not a kvwatch collector's "
                "/v1/events. This is a configuration error, not an outage: fix "
                "KVWATCH_COLLECTOR_URL (the collector's base URL, e.g. http://host:8700).",
                self._url,
                said,
            )
            return
        what = (
            "the ingest token is unknown, revoked or expired"
            if status == 401
            else "the ingest token may not write this probe's events (it is scoped to "
            "another deployment than KVWATCH_DEPLOYMENT_ID, or this probe_id is registered "
            "to another token)"
        )
        log.error(
            "kvwatch probe %s: the collector refused its token: %s (%s). This is a "
            "configuration error, not an outage: set KVWATCH_INGEST_TOKEN to a valid token "
            "(kvwatch tokens list / rotate). Until then: %s.",
            self._url,
            what,
            said,
            self._kept_where(),
        )

    def _kept_where(self) -> str:
        """Where undelivered events wait, said the same way everywhere: without a spool
        directory they live in memory, and a stop before delivery drops them (counted as
        ``shutdown``), so "kept" alone would promise what the stop then breaks."""
        if isinstance(self._backlog, _MemoryBacklog):
            return (
                "events are kept in memory and retried, and lost if the process stops first "
                "(KVWATCH_PROBE_SPOOL_DIR keeps them on disk)"
            )
        return "events are kept in the spool and retried"

    def _succeeded(self, resp: httpx.Response, n: int) -> None:
        self._refused_status = None
        if not self._healthy:
            log.info(
                "kvwatch collector reachable again; replaying %d spooled batches",
                len(self._backlog),
            )
        self._healthy = True
        self._attempt = 0
        self._retry_at = 0.0
        self._forbidden_ids.clear()  # whatever was refused may be allowed again
        self.sent += n
        self.batches_sent += 1
        try:
            answer = resp.json()
        except ValueError:
            return
        if isinstance(answer, dict):
            accepted, duplicates = answer.get("accepted"), answer.get("duplicates")
            if isinstance(accepted, int):
                self.accepted += accepted
            if isinstance(duplicates, int):
                self.duplicates += duplicates

    def _failed(self, message: str, resp: httpx.Response | None = None) -> None:
        """Schedule the next try: exponential backoff with full jitter."""
        self.last_error = message
        if self._healthy:
            log.warning("kvwatch collector unavailable, spilling to the backlog: %s", message)
        self._healthy = False
        self._attempt += 1
        s = self._settings
        ceiling = min(
            s.probe_backoff_max_s, s.probe_backoff_base_s * 2 ** min(self._attempt - 1, 62)
        )
        delay = random.uniform(0.0, ceiling)
        if resp is not None and resp.status_code in (429, 503):
            with contextlib.suppress(ValueError):
                delay = max(
                    delay, min(float(resp.headers.get("Retry-After", "")), s.probe_backoff_max_s)
                )
        self._retry_at = time.monotonic() + delay


def _error_message(resp: httpx.Response) -> str:
    """``": <the collector's error message>"`` from ``{"error": {"message": ...}}``, or ""."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    if not isinstance(message, str) or not message:
        return ""
    return f": {message[:_ERROR_MESSAGE_MAX]}"


def _bad_indices(resp: httpx.Response, count: int) -> set[int]:
    """Event indices the collector blamed, from ``{"error": {"details": [...]}}``; empty
    when it did not say (then the exporter decodes the batch itself to find them)."""
    try:
        details = resp.json()["error"]["details"]
    except (ValueError, KeyError, TypeError):
        return set()
    if isinstance(details, dict):
        details = details.get("errors")
    if not isinstance(details, list):
        return set()
    found: set[int] = set()
    for item in details:
        if isinstance(item, dict):
            index = item.get("index")
            if isinstance(index, int) and 0 <= index < count:
                found.add(index)
    return found
