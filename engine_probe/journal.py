"""The write-ahead journal: every event the buffer accepts, copied into a file-mapped segment
in the probe's spool directory, so that a process killed (SIGKILL, OOM killer, segfault)
before its exporter sent or spooled them leaves them on disk, and the next probe on the node
replays them (``Spool.adopt_orphans``).

Why a file mapping: a store into a ``MAP_SHARED`` mapping is a store into the page cache, which
belongs to the kernel and outlives the process; no syscall per event, no fsync, nothing that
can block on the engine's thread. What it does not survive is the machine itself going down
(power loss, kernel panic) before the kernel wrote the pages back; the spool's batches, which
are fsync'ed, do. A segment's blocks are reserved (``posix_fallocate``) when it is created, so
a full disk fails there, counted, and never as a SIGBUS on a store into the mapping.

Layout, in ``<spool root>/<probe dir>/`` (the directory ``Spool`` locks)::

    journal-<8-digit index>.seg

A segment starts with a 24-byte header: ``MAGIC`` (8 bytes), ``u64 committed`` and ``u32
crc32(committed)`` (then 4 zero bytes): every seq <= ``committed`` was delivered, spooled or
counted by the exporter when it last wrote it. Records follow, each ``u32 length``, ``u32
crc32(payload)`` (little-endian), then the payload: the event's JSON exactly as the exporter
sends it. The rest of the segment is zeros (a new file), so a zero length ends it. The
payload is written before its header: a process killed in the middle of an append leaves a
zero header (the record never existed) or, at worst, a header whose length or checksum does
not match, which the reader detects and skips; it never crashes the reader.

Lifecycle: the engine's thread appends (``append``, under the buffer's lock: one writer, seq
order); when a record does not fit, the segment is sealed and a new one created, unless
``max_bytes`` worth of segments is live: then the record is not journaled and counted
(``full``), and the event still goes to the memory buffer (a journal drop is not a lost
event: it only loses its protection against a crash). The exporter thread, whenever every seq
up to some ``s`` is delivered, spooled or counted as dropped, calls ``release(s)``: sealed
segments whose every record is <= ``s`` are deleted, and ``s`` is written as the current
segment's ``committed``; a replay skips records at or below the highest intact ``committed``.
A clean shutdown deletes the rest (``close(discard=True)``). A replay may still resend a few
events the collector already has (delivered after the last ``release``), which it counts as
duplicates: it is idempotent on ``(probe_id, seq)``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import struct
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from engine_probe.events import Event

log = logging.getLogger("engine_probe.journal")

MAGIC: Final = b"KVWJRNL1"
_HEADER: Final = struct.Struct("<II")
_RECORD_MIN: Final = _HEADER.size
_COMMIT: Final = struct.Struct("<QI")
_COMMIT_AT: Final = len(MAGIC)
_DATA_AT: Final = 24
SEGMENT_MAX: Final = 4 << 20
SEGMENT_MIN: Final = 64 << 10
#: The smallest cap ``probe_journal_bytes`` may be (other than 0, off): two segments.
JOURNAL_MIN_BYTES: Final = 2 * SEGMENT_MIN
_SEGMENT_RE: Final = re.compile(r"^journal-(\d{8})\.seg$")
_fallocate = getattr(os, "posix_fallocate", None)


def segment_size(max_bytes: int) -> int:
    """The size of one segment of a journal capped at ``max_bytes``: an eighth of the cap,
    between ``SEGMENT_MIN`` and ``SEGMENT_MAX`` (a segment is reserved on disk whole)."""
    return max(SEGMENT_MIN, min(SEGMENT_MAX, max_bytes // 8))


def segment_paths(directory: Path) -> list[Path]:
    """The journal segments in ``directory``, oldest first."""
    found: list[tuple[int, Path]] = []
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            m = _SEGMENT_RE.match(path.name)
            if m is not None:
                found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


class _Seq(msgspec.Struct):
    seq: int = 0


_seq_decoder: Final = msgspec.json.Decoder(_Seq)


@dataclass(frozen=True, slots=True)
class Replayed:
    """What a dead probe's journal held: ``records`` (event JSON, in append order) with a
    seq above ``committed``; ``skipped``, the intact records at or below it (already
    delivered or spooled); ``torn``, the records found damaged (a process killed mid-append:
    at most one per segment, its tail) and skipped."""

    records: list[bytes]
    committed: int
    skipped: int
    torn: int
    segments: int


def _committed(data: bytes) -> int:
    seq, crc = _COMMIT.unpack_from(data, _COMMIT_AT)
    return seq if zlib.crc32(data[_COMMIT_AT : _COMMIT_AT + 8]) == crc else 0


def read_segment(data: bytes) -> tuple[list[bytes], int, bool]:
    """The records of one segment's bytes, its ``committed`` seq (0 when unreadable), and
    whether it ended on a damaged record. Never raises on any input."""
    if not data.startswith(MAGIC) or len(data) < _DATA_AT:
        return [], 0, bool(data.strip(b"\0"))
    committed = _committed(data)
    out: list[bytes] = []
    pos = _DATA_AT
    end = len(data)
    while pos + _RECORD_MIN <= end:
        n, crc = _HEADER.unpack_from(data, pos)
        if n == 0:
            return out, committed, crc != 0
        start = pos + _RECORD_MIN
        stop = start + n
        if stop > end:
            return out, committed, True
        payload = data[start:stop]
        if zlib.crc32(payload) != crc:
            return out, committed, True
        out.append(payload)
        pos = stop
    return out, committed, False


def read_dir(directory: Path) -> Replayed:
    """The intact records of the journal segments in ``directory`` not yet committed, oldest
    first. Unreadable segments count as torn (and are skipped); nothing raises."""
    records: list[bytes] = []
    committed = 0
    torn = 0
    paths = segment_paths(directory)
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as exc:
            log.warning("cannot read journal segment %s: %s", path, exc)
            torn += 1
            continue
        got, seg_committed, damaged = read_segment(data)
        records.extend(got)
        committed = max(committed, seg_committed)
        torn += damaged
    kept: list[bytes] = []
    for record in records:
        try:
            seq = _seq_decoder.decode(record).seq
        except msgspec.MsgspecError:
            seq = committed + 1  # intact but unparsable: the collector decides
        if seq > committed:
            kept.append(record)
    return Replayed(kept, committed, len(records) - len(kept), torn, len(paths))


class _Segment:
    __slots__ = ("max_seq", "mm", "path")

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self.mm = mm
        self.max_seq = 0


class Journal:
    """One probe's journal (see the module docstring). One writer: ``append`` is called under
    the buffer's lock; ``release`` and ``close`` by the exporter thread.

    Invariants: at most ``max_segments`` segments are live (mapped, on disk); every record of
    a sealed segment has a seq <= its ``max_seq``; a segment is deleted only once ``release``
    was given a seq >= its ``max_seq`` (or on a clean ``close``).
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes < JOURNAL_MIN_BYTES:
            raise ValueError(f"a journal needs at least {JOURNAL_MIN_BYTES} bytes")
        self.dir = Path(directory)
        self.segment_bytes = segment_size(max_bytes)
        self.max_segments = max(2, max_bytes // self.segment_bytes)
        self._encode = msgspec.json.Encoder().encode
        self._sealed: deque[_Segment] = deque()
        self._current: _Segment | None = None
        self._mm: mmap.mmap | None = None
        self._off = 0
        self._next_index = 0
        self.appends = 0
        self.full = 0  # records not journaled: every segment live, or one larger than a segment
        self.errors = 0  # records not journaled: a segment could not be created or written
        self.released_segments = 0
        self._committed = 0
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def open(self) -> None:
        """Create the first segment. Raises OSError when the directory cannot take one."""
        existing = segment_paths(self.dir)
        if existing:
            m = _SEGMENT_RE.match(existing[-1].name)
            assert m is not None
            self._next_index = int(m.group(1)) + 1
        self._current = self._new_segment()
        self._mm = self._current.mm
        self._off = _DATA_AT

    @property
    def is_open(self) -> bool:
        return self._current is not None

    def close(self, *, discard: bool) -> None:
        """Unmap every segment; ``discard``: delete them too (everything journaled is
        delivered or spooled). Without it the files stay for the next probe to adopt."""
        segments = list(self._sealed)
        if self._current is not None:
            segments.append(self._current)
        self._sealed.clear()
        self._current = None
        self._mm = None
        for seg in segments:
            with contextlib.suppress(Exception):
                seg.mm.close()
            if discard:
                with contextlib.suppress(OSError):
                    seg.path.unlink()

    def abandon_after_fork(self) -> None:
        """In a forked child: forget the parent's segments (the child's copies of the
        mappings are closed; the files stay the parent's)."""
        self.close(discard=False)

    # -- the hot path --------------------------------------------------------------------

    def append(self, event: Event) -> None:
        """Journal one event; never raises, never blocks on anything but the page cache
        (and, once per segment, creating the next one). Not journaled: counted."""
        mm = self._mm
        if mm is None:
            self.errors += 1
            return
        try:
            payload = self._encode(event)
            n = len(payload)
            off = self._off
            end = off + _RECORD_MIN + n
            if end > self.segment_bytes:
                mm = self._roll(_RECORD_MIN + n)
                if mm is None:
                    return
                off = self._off
                end = off + _RECORD_MIN + n
            # payload first, header last: a kill in between leaves a zero header
            mm[off + _RECORD_MIN : end] = payload
            _HEADER.pack_into(mm, off, n, zlib.crc32(payload))
            self._off = end
            cur = self._current
            assert cur is not None
            cur.max_seq = event.seq
            self.appends += 1
        except Exception as exc:
            self.errors += 1
            self.last_error = f"journal append failed: {exc!r}"

    def _roll(self, need: int) -> mmap.mmap | None:
        """Seal the current segment and start a new one; None (counted) when that is not
        allowed or fails."""
        if _DATA_AT + need > self.segment_bytes or len(self._sealed) + 1 >= self.max_segments:
            self.full += 1
            return None
        try:
            seg = self._new_segment()
        except OSError as exc:
            self.errors += 1
            self.last_error = f"cannot create a journal segment in {self.dir}: {exc}"
            return None
        cur = self._current
        assert cur is not None
        self._sealed.append(cur)
        self._current = seg
        self._mm = seg.mm
        self._off = _DATA_AT
        return seg.mm

    def _new_segment(self) -> _Segment:
        path = self.dir / f"journal-{self._next_index:08d}.seg"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the blocks now: a store into a mapping of a sparse file on a full disk
            # is a SIGBUS, which would kill the engine. (No posix_fallocate, as on macOS: a
            # sparse file, and that risk.)
            if _fallocate is not None:
                _fallocate(fd, 0, self.segment_bytes)
            else:
                os.ftruncate(fd, self.segment_bytes)
            mm = mmap.mmap(fd, self.segment_bytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        mm[: len(MAGIC)] = MAGIC
        # carried over: the segments that held it may be deleted before the next release
        committed = self._committed
        _COMMIT.pack_into(mm, _COMMIT_AT, committed, zlib.crc32(committed.to_bytes(8, "little")))
        self._next_index += 1
        return _Segment(path, mm)

    # -- the exporter's side -------------------------------------------------------------

    def release(self, handled_seq: int) -> int:
        """Delete the sealed segments whose records are all <= ``handled_seq`` (delivered,
        spooled or counted); returns how many."""
        released = 0
        sealed = self._sealed
        while sealed and sealed[0].max_seq <= handled_seq:
            seg = sealed.popleft()
            with contextlib.suppress(Exception):
                seg.mm.close()
            with contextlib.suppress(OSError):
                seg.path.unlink()
            released += 1
        self.released_segments += released
        cur = self._current
        if cur is not None and handled_seq > self._committed:
            # a racing roll may make this the just-sealed segment: still read on replay
            with contextlib.suppress(Exception):
                seq = handled_seq.to_bytes(8, "little")
                _COMMIT.pack_into(cur.mm, _COMMIT_AT, handled_seq, zlib.crc32(seq))
                self._committed = handled_seq
        return released

    def live_segments(self) -> int:
        return len(self._sealed) + (self._current is not None)

    def stats(self) -> dict[str, int | str | None]:
        return {
            "appends": self.appends,
            "not_journaled_full": self.full,
            "not_journaled_error": self.errors,
            "segments": self.live_segments(),
            "segment_bytes": self.segment_bytes,
            "max_segments": self.max_segments,
        }


def iter_batches(records: list[bytes], size: int) -> Iterator[tuple[bytes, int]]:
    """``records`` as JSON array bodies of at most ``size`` events each."""
    for start in range(0, len(records), size):
        chunk = records[start : start + size]
        yield b"[" + b",".join(chunk) + b"]", len(chunk)
