"""Subscribing to a vLLM publisher: its PUB socket, sequence numbers, and its replay socket.

vLLM's ``ZmqEventPublisher`` numbers its batches from 0 per process and keeps the last
``buffer_steps`` of them (10,000 by default) for its ROUTER replay socket: a request of two
frames, empty then the first wanted seq (8 bytes, big-endian), is answered with every
buffered batch from that seq on, each ``["", topic, seq, payload]``, then
``["", "", -1, ""]``. ZMQ's PUB drops what a slow subscriber's queue cannot hold (the
publisher's ``hwm``), so a subscriber sees gaps; :class:`Stream` fills each from the replay
socket and counts, and logs, what the publisher no longer had. A seq far below the last one
(0 after hundreds) is a restarted publisher: its blocks are gone, the stream starts again.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvwatch.kv_events.errors import BadEndpoint, MalformedBatch
from kvwatch.kv_events.wire import END_SEQ, Decoded, decode_batch, decode_seq

log = logging.getLogger("kvwatch.kv_events")

_ENDPOINT: Final = re.compile(
    r"^(?:tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}|ipc://.+)$"
)


# Hosts that are "every address" for a bind, and name no peer for a connect.
_UNSPECIFIED: Final = frozenset({"0.0.0.0", "::", "[::]", "[::0]", "[0:0:0:0:0:0:0:0]"})


def check_endpoint(endpoint: str, what: str = "--endpoint") -> str:
    """A ZMQ address to connect to: ``tcp://HOST:PORT`` or ``ipc://PATH``. Refused, with
    what to give instead: the forms that only bind (``tcp://*:PORT``; the unspecified
    address ``0.0.0.0`` or ``[::]``, which in vLLM's config also makes vLLM *connect*: it
    binds only endpoints with ``*`` or ``::``, see :mod:`kvwatch.kv_events.silence`), and
    ``inproc://`` (one process's own)."""
    e = endpoint.strip()
    if "*" in e:
        raise BadEndpoint(
            f"{what} {e!r}: '*' is for binding (vLLM's side: its tcp://*:PORT binds every "
            "address); connect to the engine host's, tcp://HOST:PORT"
        )
    if e.startswith("inproc://"):
        raise BadEndpoint(
            f"{what} {e!r}: inproc:// reaches only the engine's own process; connect to its "
            "tcp://HOST:PORT or ipc://PATH"
        )
    if not _ENDPOINT.match(e) or (
        e.startswith("tcp://") and not 0 < int(e.rsplit(":")[-1]) < 65536
    ):
        raise BadEndpoint(f"{what} {e!r} is not tcp://HOST:PORT or ipc://PATH")
    if e.startswith("tcp://") and e[len("tcp://") : e.rindex(":")] in _UNSPECIFIED:
        raise BadEndpoint(
            f"{what} {e!r}: {e[len('tcp://') : e.rindex(':')]} is the any-address, for "
            "binding, not a host to connect to; and a vLLM given it in --kv-events-config "
            "connects instead of binding (it binds only an endpoint with '*', '::' or "
            "ipc://), so nothing would ever arrive: give vLLM tcp://*:PORT and this "
            "tcp://ENGINE-HOST:PORT"
        )
    return e


@dataclass
class StreamStats:
    """What the stream has seen: batches taken live and replayed, duplicates skipped,
    batches lost (neither received nor replayable), gaps, publisher restarts, malformed
    messages skipped, and messages on another topic than the one subscribed (skipped too:
    the subscription takes every topic so that a wrong ``--topic`` shows)."""

    received: int = 0
    replayed: int = 0
    duplicates: int = 0
    lost: int = 0
    gaps: int = 0
    unfilled_gaps: int = 0
    restarts: int = 0
    malformed: int = 0
    other_topic: int = 0
    first_seq: int | None = None
    last_seq: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Restarted:
    """The publisher started again (its seqs from 0): every block it reported is gone."""

    seq: int


class Stream:
    """A subscription to one publisher. ``batches(timeout_s)`` yields the batches in seq
    order, each once: live ones, and before a live one after a gap, the gap's batches from
    the replay socket (as many as it still has). ``Restarted`` marks a publisher restart.

    ``backfill``: at the first batch, replay what the publisher still buffers from seq 0
    (the blocks stored before this subscriber joined).

    ``connected``: whether the subscription holds a live connection to a publisher (from
    the socket's monitor, read by :meth:`batches`): ZMQ retries a connection nobody accepts
    silently, forever. ``other_topic``: the last topic a message came on other than
    ``topic`` since :meth:`take_other_topic` (None: none)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        backfill: bool = False,
        replay_timeout_s: float = 5.0,
        rcvhwm: int = 0,
        rcvbuf: int = -1,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self.replay_endpoint = (
            check_endpoint(replay_endpoint, "--replay-endpoint") if replay_endpoint else None
        )
        self.topic = topic.encode()
        self.backfill = backfill
        self.replay_timeout_s = replay_timeout_s
        self.stats = StreamStats()
        self._expected: int | None = None
        self._last_ts = float("-inf")  # the engine's time of the newest batch taken
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        # 0: keep all that arrives (drops happen at the PUB only); -1: the OS's socket
        # buffer. Tests make both small, so that a subscriber that stops reading makes the
        # PUB socket drop, whatever the machine's TCP buffer autotuning would hold.
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.RCVBUF, rcvbuf)
        # Every topic, filtered here: a message on another topic is counted and named, where
        # a ZMQ filter would drop it unseen (a wrong --topic: silence, nothing else).
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.connected = False
        self.other_topic: str | None = None
        self._monitor = self._sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        )
        self._sub.connect(self.endpoint)

    def close(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)

    def take_other_topic(self) -> str | None:
        """The last other topic seen since the previous call (then forgotten)."""
        topic, self.other_topic = self.other_topic, None
        return topic

    def _watch_connection(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            self.connected = event == zmq.EVENT_CONNECTED

    def batches(self, timeout_s: float) -> Iterator[Decoded | Restarted]:
        """What arrives within ``timeout_s`` (at least one poll), in order."""
        ready = self._sub.poll(int(timeout_s * 1000))
        self._watch_connection()
        if not ready:
            return
        while self._sub.poll(0):
            frames = self._sub.recv_multipart()
            yield from self._take(frames, live=True)

    def _take(self, frames: list[bytes], *, live: bool) -> Iterator[Decoded | Restarted]:
        if len(frames) != 3:
            self.stats.malformed += 1
            log.warning("kv events: skipped a message of %d frames that is no batch", len(frames))
            return
        if frames[0] != self.topic:
            self.stats.other_topic += 1
            self.other_topic = frames[0][:64].decode("utf-8", "replace")
            return
        try:
            seq = decode_seq(frames[1])
        except MalformedBatch as exc:
            self.stats.malformed += 1
            log.warning("kv events: skipped a message: %s", exc)
            return
        expected = self._expected
        if expected is None and live and self.backfill and seq > 0:
            yield from self._replay(0, seq, first=True)
            expected = self._expected
        if expected is not None and seq < expected:
            # A seq taken already (a replay caught up past batches still queued live), or a
            # new publisher counting from 0 again: its batches are newer than any taken.
            try:
                newer = decode_batch(seq, frames[2]).ts > self._last_ts
            except MalformedBatch:
                newer = False
            if newer:
                self.stats.restarts += 1
                log.warning(
                    "kv events: the publisher started again (seq %d after %d): its cache is new",
                    seq,
                    expected - 1,
                )
                self._expected = None
                yield Restarted(seq)
                expected = None
            else:
                self.stats.duplicates += 1
                return
        if live and expected is not None and seq > expected:
            self.stats.gaps += 1
            yield from self._replay(expected, seq, first=False)
            if self._expected is not None and seq < self._expected:
                self.stats.duplicates += 1  # the replay brought this one too
                return
        try:
            batch = decode_batch(seq, frames[2])
        except MalformedBatch as exc:
            self.stats.malformed += 1
            log.warning("kv events: %s", exc)
        else:
            self._last_ts = max(self._last_ts, batch.ts)
            yield batch
        if live:
            self.stats.received += 1
        else:
            self.stats.replayed += 1
        if self.stats.first_seq is None:
            self.stats.first_seq = seq
        self.stats.last_seq = seq
        self._expected = seq + 1

    def _replay(self, start: int, until: int, *, first: bool) -> Iterator[Decoded | Restarted]:
        """Batches from ``start`` on from the replay socket, in order: the gap before
        ``until`` and whatever followed it (one request catches up; those arriving live
        later are duplicates). The ones before ``until`` it no longer has are counted as
        lost (a backfill's are not: they were never promised)."""
        got: list[list[bytes]] = []
        if self.replay_endpoint is not None:
            got = self._ask(start)
        self._expected = start if not first else None
        for frames in got:
            seq = decode_seq(frames[1]) if len(frames) == 3 and len(frames[1]) == 8 else None
            if seq is None:
                continue
            if self._expected is None:
                self._expected = seq  # a backfill starts where the buffer does
            if seq < self._expected:
                continue
            if seq > self._expected:
                if self._expected <= until < seq:
                    break  # it no longer has even the batch that came live: take that one
                if not first:
                    self._lose(self._expected, seq)
                    self.stats.unfilled_gaps += 1
            yield from self._take(frames, live=False)
        if self._expected is None:
            self._expected = until
        elif self._expected < until:
            if not first:
                self._lose(self._expected, until)
                self.stats.unfilled_gaps += 1
            self._expected = until

    def _lose(self, start: int, until: int) -> None:
        n = until - start
        self.stats.lost += n
        where = "no replay endpoint" if self.replay_endpoint is None else "not in its buffer"
        log.warning(
            "kv events: lost %d batch(es), seq %d..%d (%s): counts are lower bounds",
            n,
            start,
            until - 1,
            where,
        )

    def _ask(self, start: int) -> list[list[bytes]]:
        """One replay request; the batches it answers (empty on a timeout, logged)."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[list[bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(int(self.replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) == 3 and body[1] == END_SEQ.to_bytes(8, "big", signed=True):
                    return out
                out.append(body)
            log.warning(
                "kv events: the replay endpoint %s did not finish answering in %.1f s",
                self.replay_endpoint,
                self.replay_timeout_s,
            )
            return out
        finally:
            sock.close(linger=0)
