"""The on-disk spool: where batches wait while the collector cannot take them.

Layout under the spool root::

    <root>/<probe dir>/.lock                       flock'ed by the live probe owning the dir
    <root>/<probe dir>/<16-digit index>.<n>.json   one batch (a JSON array of n events)
    <root>/<probe dir>/journal-<8-digit index>.seg the probe's write-ahead journal
                                                   (``engine_probe.journal``)
    <root>/rejected/<utc>-<probe dir>-<k>.json     batches the collector refused (dead letter)
    <root>/rejected/<utc>-<probe dir>-<k>.txt      why it refused them

``<probe dir>`` is the probe id percent-encoded (``/`` and ``:`` may appear in ids and must
not make paths). Batch files are written atomically (temporary file, fsync, rename, fsync
of the directory) and named so that lexical order is send order. A directory whose lock is
not held belongs to a process that died: the next probe to start adopts its batches (moves
them, oldest first, to the end of its own queue), turns the records of its journal that were
never delivered or spooled into batches of its queue (under the dead probe's id, which is
theirs), and removes it.

Not thread-safe: one spool is used by one exporter thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final
from urllib.parse import quote

from engine_probe import journal
from engine_probe.errors import SpoolError, SpoolFullError, SpoolLockedError

log = logging.getLogger("engine_probe.spool")

LOCK_NAME: Final = ".lock"
REJECTED_DIR: Final = "rejected"
_TMP_PREFIX: Final = ".tmp-"
_BATCH_RE: Final = re.compile(r"^(\d{16})\.(\d{1,12})\.json$")


def probe_dir_name(probe_id: str) -> str:
    """The directory name of a probe id: percent-encoded, never ``rejected``."""
    name = quote(probe_id, safe="")
    # "rejected" is the dead-letter directory; encoding its first letter keeps the mapping
    # reversible (unquote gives the id back) and collision-free.
    return "%72ejected" if name == REJECTED_DIR else name


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    """One batch file: ``index`` gives its place in the queue, ``events`` its size."""

    path: Path
    index: int
    events: int
    size: int


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` so that a crash leaves either nothing or the whole file."""
    tmp = path.with_name(f"{_TMP_PREFIX}{secrets.token_hex(6)}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _try_lock(path: Path, *, create: bool) -> int | None:
    """An fd holding ``flock(LOCK_EX)`` on ``path``, or None when another holder has it
    (or, without ``create``, the file is gone).

    After locking, the fd must still be the file at ``path``: a previous holder may have
    unlinked it (adopted or cleanly closed directory) between our open and our flock.
    """
    for _ in range(5):
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
            return fd
        os.close(fd)
        if not create:
            return None
    return None


class Spool:
    """A FIFO of batch files for one probe, bounded by ``max_bytes``.

    Invariants: ``entries`` lists this probe's batch files in send order; ``total_bytes`` is the
    sum of their sizes and stays <= ``max_bytes`` except for batches adopted from dead
    processes (already on disk; refusing them would lose them); while open, the directory's
    lock is held.
    """

    def __init__(self, root: Path, probe_id: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self.root = Path(root)
        self.probe_id = probe_id
        self.dir = self.root / probe_dir_name(probe_id)
        self.max_bytes = max_bytes
        self._entries: deque[SpoolEntry] = deque()
        self._bytes = 0
        self._events = 0
        self._next = 0
        self._lock_fd: int | None = None
        self._rejected_bytes: int | None = None
        self._rejected_count = 0
        #: events replayed from dead probes' journals, and damaged records skipped there
        self.journal_replayed = 0
        self.journal_torn = 0

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._lock_fd is not None

    def open(self) -> None:
        """Create and lock this probe's directory and load batches already in it (left by a
        previous process that used the same probe id). Idempotent."""
        if self._lock_fd is not None:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = _try_lock(self.dir / LOCK_NAME, create=True)
            if fd is None:
                raise SpoolLockedError(
                    f"spool directory {self.dir} is locked by another live process; "
                    "probe ids must be unique per process"
                )
            try:
                entries = self._scan(self.dir)
            except BaseException:
                os.close(fd)
                raise
        except SpoolError:
            raise
        except OSError as exc:
            raise SpoolError(f"cannot open spool directory {self.dir}: {exc}") from exc
        self._lock_fd = fd
        self._entries = deque(entries)
        self._bytes = sum(e.size for e in entries)
        self._events = sum(e.events for e in entries)
        self._next = entries[-1].index + 1 if entries else 0

    def close(self) -> None:
        """Release the lock. An empty directory is removed; one with batches or journal
        segments stays, and the next probe to start adopts it."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            if not self._entries and not journal.segment_paths(self.dir):
                # Unlink while still holding the lock: an adopter that opened the old lock
                # file sees the inode change and backs off.
                with contextlib.suppress(OSError):
                    (self.dir / LOCK_NAME).unlink()
                with contextlib.suppress(OSError):
                    self.dir.rmdir()
        finally:
            os.close(fd)

    def detach_after_fork(self) -> None:
        """In a forked child: let go of the parent's lock fd without unlocking it (flock
        locks belong to the open file description the parent still uses)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._entries.clear()
        self._bytes = self._events = 0

    # -- the queue ---------------------------------------------------------------------

    def push(self, body: bytes, events: int) -> SpoolEntry:
        """Append a batch at the end of the queue.

        Raises :class:`SpoolFullError` past ``max_bytes`` and :class:`SpoolError` when the
        directory cannot be used; the batch is then not in the spool.
        """
        self.open()
        if self._bytes + len(body) > self.max_bytes:
            raise SpoolFullError(
                f"spool {self.dir} holds {self._bytes} bytes; a {len(body)}-byte batch would "
                f"pass the {self.max_bytes}-byte limit"
            )
        entry = SpoolEntry(self._path(self._next, events), self._next, events, len(body))
        try:
            _atomic_write(entry.path, body)
        except OSError as exc:
            raise SpoolError(f"cannot write spool file {entry.path}: {exc}") from exc
        self._next += 1
        self._entries.append(entry)
        self._bytes += entry.size
        self._events += entry.events
        return entry

    def oldest(self) -> SpoolEntry | None:
        return self._entries[0] if self._entries else None

    def read(self, entry: SpoolEntry) -> bytes:
        try:
            return entry.path.read_bytes()
        except OSError as exc:
            raise SpoolError(f"cannot read spool file {entry.path}: {exc}") from exc

    def remove(self, entry: SpoolEntry) -> None:
        """Forget the head of the queue (delivered, rejected or unreadable)."""
        if not self._entries or self._entries[0] != entry:
            raise ValueError("only the oldest spool entry can be removed")
        with contextlib.suppress(FileNotFoundError):
            entry.path.unlink()
        self._entries.popleft()
        self._bytes -= entry.size
        self._events -= entry.events

    def replace_head(self, body: bytes, events: int) -> SpoolEntry:
        """Replace the head with what is left of it after a partial delivery.

        Same index, fewer events: the new file is renamed in before the old one is
        unlinked, and if a crash leaves both, ``_scan`` keeps the smaller one (the rest
        was delivered).
        """
        old = self._entries[0]
        new = SpoolEntry(self._path(old.index, events), old.index, events, len(body))
        try:
            _atomic_write(new.path, body)
        except OSError as exc:
            raise SpoolError(f"cannot rewrite spool file {old.path}: {exc}") from exc
        if new.path != old.path:
            with contextlib.suppress(FileNotFoundError):
                old.path.unlink()
        self._entries[0] = new
        self._bytes += new.size - old.size
        self._events += new.events - old.events
        return new

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def events(self) -> int:
        return self._events

    # -- adoption of dead processes' spools --------------------------------------------

    def adopt_orphans(self, batch_events: int = 2000) -> int:
        """Move the batches of every unlocked probe directory (a dead process's) to the end
        of this queue, oldest directory first, then the records of its journal not yet
        committed (as batches of at most ``batch_events``), and remove those directories.

        Returns how many batch files were adopted (journal batches included). Each orphan's
        own order is kept, which is all that matters: seq order is per probe. A journal
        record may also be in a spooled batch or already delivered: the collector counts
        it as a duplicate.
        """
        self.open()
        found: list[tuple[float, Path, int, list[SpoolEntry]]] = []
        try:
            children = sorted(self.root.iterdir())
        except OSError as exc:
            raise SpoolError(f"cannot list spool root {self.root}: {exc}") from exc
        for child in children:
            if (
                child == self.dir
                or child.name.startswith(".")
                or child.name == REJECTED_DIR
                or not child.is_dir()
            ):
                continue
            # No lock file: a live probe may be between mkdir and creating its lock.
            fd = _try_lock(child / LOCK_NAME, create=False)
            if fd is None:
                continue
            try:
                entries = self._scan(child)
                first = entries[0].path if entries else child / LOCK_NAME
                found.append((first.stat().st_mtime, child, fd, entries))
            except OSError as exc:
                os.close(fd)
                log.warning("cannot adopt orphaned spool directory %s: %s", child, exc)
        found.sort(key=lambda item: (item[0], item[1].name))
        adopted = 0
        for _, child, fd, entries in found:
            try:
                for entry in entries:
                    target = SpoolEntry(
                        self._path(self._next, entry.events), self._next, entry.events, entry.size
                    )
                    os.rename(entry.path, target.path)
                    self._next += 1
                    self._entries.append(target)
                    self._bytes += target.size
                    self._events += target.events
                    adopted += 1
                adopted += self._adopt_journal(child, batch_events)
                _fsync_dir(self.dir)
                (child / LOCK_NAME).unlink()
                child.rmdir()
                log.info("adopted %d spooled batches from %s", len(entries), child)
            except OSError as exc:
                log.warning("could not fully adopt orphaned spool directory %s: %s", child, exc)
            finally:
                os.close(fd)
        return adopted

    def _adopt_journal(self, child: Path, batch_events: int) -> int:
        """Spool the uncommitted records of ``child``'s journal, then delete its segments
        (only once the batches are durably here: a crash in between replays them again)."""
        paths = journal.segment_paths(child)
        if not paths:
            return 0
        found = journal.read_dir(child)
        written = 0
        for body, n in journal.iter_batches(found.records, max(1, batch_events)):
            entry = SpoolEntry(self._path(self._next, n), self._next, n, len(body))
            _atomic_write(entry.path, body)
            self._next += 1
            self._entries.append(entry)
            self._bytes += entry.size
            self._events += entry.events
            written += 1
        for path in paths:
            path.unlink()
        self.journal_replayed += len(found.records)
        self.journal_torn += found.torn
        log.info(
            "replayed %d journaled events of %s (%d already committed, %d damaged records "
            "skipped) as %d batches",
            len(found.records),
            child,
            found.skipped,
            found.torn,
            written,
        )
        return written

    # -- dead letter -------------------------------------------------------------------

    def write_rejected(self, body: bytes, note: str) -> Path | None:
        """Keep a batch the collector refused, with the reason, for a person to look at.

        Bounded by ``max_bytes`` as well; past it nothing is written (the events are
        counted as dropped either way). Returns the path written, or None.
        """
        directory = self.root / REJECTED_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if self._rejected_bytes is None:
                self._rejected_bytes = sum(
                    p.stat().st_size for p in directory.iterdir() if p.is_file()
                )
            note_bytes = note.encode("utf-8", "replace")
            size = len(body) + len(note_bytes)
            if self._rejected_bytes + size > self.max_bytes:
                log.error(
                    "dead-letter directory %s is full; not keeping a rejected batch", directory
                )
                return None
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
            self._rejected_count += 1
            stem = f"{stamp}-{probe_dir_name(self.probe_id)}-{self._rejected_count:06d}"
            path = directory / f"{stem}.json"
            _atomic_write(directory / f"{stem}.txt", note_bytes)
            _atomic_write(path, body)
        except OSError as exc:
            log.error("cannot write a rejected batch under %s: %s", directory, exc)
            return None
        self._rejected_bytes += size
        return path

    # -- helpers -----------------------------------------------------------------------

    def _path(self, index: int, events: int) -> Path:
        return self.dir / f"{index:016d}.{events}.json"

    @staticmethod
    def _scan(directory: Path) -> list[SpoolEntry]:
        """The batch files of ``directory`` in queue order; removes leftovers of writes
        interrupted by a crash, and of a crash inside ``replace_head``."""
        by_index: dict[int, SpoolEntry] = {}
        for path in directory.iterdir():
            name = path.name
            if name.startswith(_TMP_PREFIX):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            m = _BATCH_RE.match(name)
            if m is None:
                continue
            entry = SpoolEntry(path, int(m.group(1)), int(m.group(2)), path.stat().st_size)
            other = by_index.get(entry.index)
            if other is not None:
                keep, drop = (entry, other) if entry.events < other.events else (other, entry)
                with contextlib.suppress(OSError):
                    drop.path.unlink()
                entry = keep
            by_index[entry.index] = entry
        return [by_index[i] for i in sorted(by_index)]
