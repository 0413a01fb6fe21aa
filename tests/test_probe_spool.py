"""The on-disk spool: atomic batch files in send order, locking, limits, adoption of the
spools of processes that died, and the dead-letter directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_probe.errors import SpoolError, SpoolFullError, SpoolLockedError
from engine_probe.spool import LOCK_NAME, REJECTED_DIR, Spool, probe_dir_name


def body(i: int) -> bytes:
    return f'[{{"i":{i}}}]'.encode()


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (entry := spool.oldest()) is not None:
        out.append(spool.read(entry))
        spool.remove(entry)
    return out


def test_batches_come_back_in_order_and_file_names_sort_in_send_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "probe-a", max_bytes=10_000)
    for i in range(12):
        spool.push(body(i), events=1)
    assert len(spool) == 12 and spool.events == 12
    assert spool.total_bytes == sum(len(body(i)) for i in range(12))
    names = sorted(p.name for p in spool.dir.iterdir() if p.name != LOCK_NAME)
    assert [(spool.dir / n).read_bytes() for n in names] == [body(i) for i in range(12)]
    assert not [p for p in spool.dir.iterdir() if p.name.startswith(".tmp")]
    assert drain(spool) == [body(i) for i in range(12)]
    assert spool.total_bytes == 0 and spool.events == 0
    spool.close()
    assert not spool.dir.exists()  # an empty spool leaves nothing behind


def test_only_the_head_can_be_removed(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "p", max_bytes=1000)
    spool.push(body(1), 1)
    second = spool.push(body(2), 1)
    with pytest.raises(ValueError):
        spool.remove(second)
    spool.close()


def test_max_bytes_refuses_new_batches(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "p", max_bytes=2 * len(body(0)))
    spool.push(body(0), 1)
    spool.push(body(1), 1)
    with pytest.raises(SpoolFullError):
        spool.push(body(2), 1)
    assert len(spool) == 2
    spool.remove(spool.oldest())  # type: ignore[arg-type]
    spool.push(body(3), 1)  # room again
    assert drain(spool) == [body(1), body(3)]
    spool.close()


def test_a_live_probes_directory_is_locked(tmp_path: Path) -> None:
    first = Spool(tmp_path, "same-id", max_bytes=1000)
    first.open()
    second = Spool(tmp_path, "same-id", max_bytes=1000)
    with pytest.raises(SpoolLockedError):
        second.open()
    with pytest.raises(SpoolLockedError):
        second.push(body(0), 1)
    first.close()
    second.open()
    second.close()


def test_reopening_a_directory_resumes_its_queue(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "restarted", max_bytes=1000)
    spool.push(body(0), 1)
    spool.push(body(1), 2)
    spool.close()  # not empty: stays for whoever comes next
    assert spool.dir.exists()

    again = Spool(tmp_path, "restarted", max_bytes=1000)
    again.open()
    assert len(again) == 2 and again.events == 3
    again.push(body(2), 1)
    assert drain(again) == [body(0), body(1), body(2)]
    again.close()


def test_scan_cleans_up_after_crashes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "crashy", max_bytes=1000)
    spool.push(b"[1,2,3]", 3)
    spool.push(b"[4]", 1)
    spool.close()
    # A write interrupted before its rename, and a replace_head interrupted between the
    # rename of the smaller remainder and the unlink of the original.
    (spool.dir / ".tmp-abc-0000000000000009.1.json").write_bytes(b"[9")
    (spool.dir / f"{0:016d}.1.json").write_bytes(b"[3]")
    again = Spool(tmp_path, "crashy", max_bytes=1000)
    again.open()
    assert drain(again) == [b"[3]", b"[4]"]
    assert sorted(p.name for p in again.dir.iterdir()) == [LOCK_NAME]
    again.close()


def test_replace_head_keeps_the_place_in_the_queue(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "p", max_bytes=1000)
    spool.push(b"[1,2,3,4]", 4)
    spool.push(b"[5]", 1)
    spool.replace_head(b"[3,4]", 2)
    assert spool.events == 3
    assert drain(spool) == [b"[3,4]", b"[5]"]
    spool.close()


def test_orphaned_directories_are_adopted_oldest_first(tmp_path: Path) -> None:
    for name, items in (("dead-1", [b"[1]", b"[2]"]), ("dead-2", [b"[3]"])):
        s = Spool(tmp_path, name, max_bytes=1000)
        for item in items:
            s.push(item, 1)
        s.close()  # lock released, batches left: what a crash leaves, minus the crash
    os.utime(tmp_path / "dead-1" / f"{0:016d}.1.json", (1, 1))  # dead-1 is the oldest
    alive = Spool(tmp_path, "alive", max_bytes=1000)
    alive.open()
    busy = Spool(tmp_path, "busy", max_bytes=1000)  # live: must be left alone
    busy.push(b"[99]", 1)

    me = Spool(tmp_path, "me", max_bytes=1000)
    me.push(b"[0]", 1)
    assert me.adopt_orphans() == 3
    assert drain(me) == [b"[0]", b"[1]", b"[2]", b"[3]"]
    assert not (tmp_path / "dead-1").exists() and not (tmp_path / "dead-2").exists()
    assert (tmp_path / "busy").exists() and (tmp_path / "alive").exists()
    for s in (me, busy, alive):
        s.close()


def test_a_crashed_process_leaves_an_adoptable_spool(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # the child spools and dies without cleaning up
        try:
            s = Spool(tmp_path, "crashed", max_bytes=1000)
            s.push(b"[1]", 1)
            s.push(b"[2]", 1)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "crashed" / LOCK_NAME).exists()
    me = Spool(tmp_path, "survivor", max_bytes=1000)
    assert me.adopt_orphans() == 2
    assert drain(me) == [b"[1]", b"[2]"]
    me.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_probe_ids_map_to_safe_directory_names(tmp_path: Path) -> None:
    assert probe_dir_name("host-1-abc") == "host-1-abc"
    assert "/" not in probe_dir_name("a/../../etc")
    assert probe_dir_name("pod:7@ns") == "pod%3A7%40ns"
    assert probe_dir_name(REJECTED_DIR) != REJECTED_DIR
    spool = Spool(tmp_path, "a/../../x", max_bytes=100)
    spool.push(b"[1]", 1)
    assert spool.dir.parent == tmp_path
    spool.close()


def test_rejected_batches_are_kept_with_the_reason(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "p", max_bytes=200)
    path = spool.write_rejected(b'[{"bad":1}]', "HTTP 422\nbecause")
    assert path is not None and path.parent == tmp_path / REJECTED_DIR
    assert path.read_bytes() == b'[{"bad":1}]'
    assert "HTTP 422" in path.with_suffix(".txt").read_text()
    assert spool.write_rejected(b"x" * 500, "too big for the limit") is None
    assert len(list((tmp_path / REJECTED_DIR).iterdir())) == 2
    # The dead-letter directory is never mistaken for an orphaned probe directory.
    assert spool.adopt_orphans() == 0
    spool.close()


def test_unusable_spool_directory_raises_spool_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    spool = Spool(not_a_dir / "spool", "p", max_bytes=100)
    with pytest.raises(SpoolError):
        spool.push(b"[1]", 1)
    assert not spool.is_open
