"""``kvwatch.kv_events`` against vLLM's own publisher: its ``ZmqEventPublisher`` (PUB
socket, ROUTER replay socket, replay buffer, sequence numbers) and its event classes, run in
.venv-vllm by ``tests/engines/vllm/kv_events_publisher.py`` on 127.0.0.1. Gaps are real: a
subscriber that stops reading while big batches go out fills the socket buffers, and ZMQ's
PUB drops what its high-water mark cannot hold, as in production."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from kvwatch.cli import app
from kvwatch.embedded import free_port
from kvwatch.kv_events import (
    AllBlocksCleared,
    BadEndpoint,
    BlockRemoved,
    BlockStored,
    Decoded,
    Mirror,
    Restarted,
    Stream,
    check_endpoint,
    decode_batch,
)

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPT = ROOT / "tests" / "engines" / "vllm" / "kv_events_publisher.py"


class Publisher:
    """vLLM's ZmqEventPublisher in a .venv-vllm process, fed commands over stdin."""

    def __init__(self, tmp: Path) -> None:
        port, replay = free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay = f"tcp://127.0.0.1:{replay}"
        # vLLM binds an endpoint with a '*' (and connects to any other): bound, as in a server
        self.proc = subprocess.Popen(
            [str(VLLM_PY), str(SCRIPT), f"tcp://*:{port}", f"tcp://*:{replay}", "10000", "2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(tmp / "publisher.log").open("wb"),
            cwd=tmp,
            text=True,
            env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
        )
        self.log = tmp / "publisher.log"
        self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the publisher exited:\n{self.log.read_text()[-3000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def publish(self, *batches: list[dict[str, Any]], pad: int = 0) -> int:
        """Publish the batches; the seq the next batch will get."""
        return int(self.send({"batches": list(batches), "pad": pad})["next_seq"])

    def restart(self, buffer_steps: int = 10_000) -> None:
        self.send({"restart": True, "buffer_steps": buffer_steps})

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def publisher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Publisher]:
    if not (ROOT / ".venv-vllm" / ".kvwatch-installed").exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-vllm is missing (make engines builds it)")
        pytest.skip(".venv-vllm is missing: `make engines` builds it")
    pub = Publisher(tmp_path_factory.mktemp("kv-publisher"))
    try:
        yield pub
    finally:
        pub.stop()


def subscribe(pub: Publisher, seen: list[Decoded] | None = None, **kw: Any) -> Stream:
    """A stream whose subscription has reached the publisher: probe batches are published
    until one arrives (ZMQ subscriptions propagate asynchronously); what it yielded meanwhile
    goes into ``seen``."""
    stream = Stream(pub.endpoint, **{"replay_endpoint": pub.replay, **kw})
    for _ in range(100):
        pub.publish([{"cleared": True}])
        got = [b for b in stream.batches(0.1) if isinstance(b, Decoded)]
        if seen is not None:
            seen.extend(got)
        if got:
            return stream
    raise AssertionError("the subscription never reached the publisher")


def drain(
    stream: Stream, until_seq: int, pub: Publisher | None = None, timeout_s: float = 30.0
) -> list[Decoded | Restarted]:
    """Everything the stream yields until it has taken ``until_seq``. With ``pub``, a small
    batch is published every round: the PUB socket may have dropped the last ones, and only
    a later batch tells a subscriber that they existed."""
    got: list[Decoded | Restarted] = []
    deadline = time.monotonic() + timeout_s
    while stream.stats.last_seq is None or stream.stats.last_seq < until_seq:
        if pub is not None:
            pub.publish([{"cleared": True}])
        got.extend(stream.batches(0.2))
        assert time.monotonic() < deadline, stream.stats
    return got


def burst(pub: Publisher, stream: Stream, first_hash: int) -> tuple[int, int, list[Decoded]]:
    """300 big batches while the stream reads nothing: (the stream's last seq before, its
    last seq after, the batches it took meanwhile)."""
    start = stream.stats.last_seq
    assert start is not None
    batches = [[{"stored": [first_hash + i], "parent": None}] for i in range(300)]
    last = pub.publish(*batches, pad=25_000) - 1
    got = [b for b in drain(stream, last, pub) if isinstance(b, Decoded)]
    end = stream.stats.last_seq
    assert end is not None
    return start, end, got


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_vllms_own_batches_decode(publisher: Publisher) -> None:
    stream = subscribe(publisher)
    try:
        nxt = publisher.publish(
            [
                {"stored": [1, 2], "parent": None, "salt": "tenant-a-salt", "session": "s-a"},
                {"stored": [3], "parent": 2, "session": "s-a"},
            ],
            [{"removed": [3]}, {"cleared": True}],
        )
        got = [b for b in drain(stream, nxt - 1) if isinstance(b, Decoded)]
    finally:
        stream.close()
    first, second = got[-2:]
    assert (first.seq + 1, second.seq) == (second.seq, nxt - 1)
    assert first.data_parallel_rank == 0 and abs(first.ts - time.time()) < 60
    a, b = first.events
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert a.block_hashes == [(1).to_bytes(32, "big"), (2).to_bytes(32, "big")]
    assert a.parent_block_hash is None and a.block_size == 32 and len(a.token_ids) == 64
    assert (a.salt_of_first_block(), a.session_id, a.medium) == ("tenant-a-salt", "s-a", "GPU")
    assert b.parent_block_hash == (2).to_bytes(32, "big") and b.salt_of_first_block() is None
    removed, cleared = second.events
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [(3).to_bytes(32, "big")]
    assert isinstance(cleared, AllBlocksCleared)
    assert first.unknown == [] and stream.stats.lost == 0


def test_the_mirror_follows_salts_down_the_chain_and_sees_sessions_meet() -> None:
    h = lambda n: n.to_bytes(32, "big")  # noqa: E731
    m = Mirror()
    m.apply([
        BlockStored(block_hashes=[h(1), h(2)], parent_block_hash=None, session_id="s1"),
        BlockStored(block_hashes=[h(3)], parent_block_hash=h(2), session_id="s1"),
        BlockStored(block_hashes=[h(10)], parent_block_hash=None, extra_keys=[["salt"]]),
        BlockStored(block_hashes=[h(11)], parent_block_hash=h(10)),
        BlockStored(block_hashes=[h(20)], parent_block_hash=h(99)),  # its parent: never seen
        # another session's request reported its hit on 1..2 (kv_cache_report_mode full) and
        # stored a block of its own after them
        BlockStored(block_hashes=[h(1), h(2), h(4)], parent_block_hash=None, session_id="s2"),
    ])  # fmt: skip
    assert (m.salting_of(h(3)), m.salting_of(h(11)), m.salting_of(h(20))) == (
        "unsalted",
        "salted",
        "unknown",
    )
    assert m.salting_of(h(4)) == "unsalted"
    i = m.take()
    assert (i.stored_blocks, i.unsalted_blocks, i.salted_blocks) == (9, 6, 2)
    assert (i.restored_blocks, i.cross_session_blocks) == (2, 2)
    m.apply([BlockRemoved(block_hashes=[h(1), h(2)]), AllBlocksCleared()])
    i = m.take()
    assert (i.stored_blocks, i.removed_blocks, i.cleared) == (0, 2, 1)
    assert len(m) == 0
    m.apply([BlockStored(block_hashes=[h(1)], parent_block_hash=None)])
    m.reset()  # a restarted engine: its cache is gone, a whole-cache reset
    assert m.salting_of(h(1)) is None and m.take().cleared == 1
    # a salt under a LoRA name: the name comes first in the extra keys, and is no salt
    lora = BlockStored(block_hashes=[h(5)], lora_name="ad", extra_keys=[["ad", ["mm", 0], "s"]])
    assert lora.salt_of_first_block() == "s"
    no_salt = BlockStored(block_hashes=[h(5)], lora_name="ad", extra_keys=[["ad"]])
    assert no_salt.salt_of_first_block() is None


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_a_gap_the_pub_socket_dropped_is_replayed(publisher: Publisher) -> None:
    stream = subscribe(publisher, rcvhwm=1, rcvbuf=65536)
    try:
        # the stream reads nothing while these go out: socket buffers fill, and the PUB
        # socket (high-water mark 2) drops the rest for this subscriber
        start, end, got = burst(publisher, stream, 1000)
    finally:
        stream.close()
    s = stream.stats
    assert s.gaps >= 1 and s.replayed >= 1, s  # the PUB did drop, and the replay filled it
    assert s.lost == 0 and s.unfilled_gaps == 0
    assert [b.seq for b in got] == list(range(start + 1, end + 1))  # each once, in order


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_what_the_publisher_no_longer_buffers_is_counted_lost(publisher: Publisher) -> None:
    publisher.restart(buffer_steps=5)
    try:
        stream = subscribe(publisher, rcvhwm=1, rcvbuf=65536)
        try:
            start, end, got = burst(publisher, stream, 2000)
        finally:
            stream.close()
    finally:
        publisher.restart()
    s = stream.stats
    assert s.lost > 0 and s.unfilled_gaps >= 1, s
    # every seq is taken once or counted lost: nothing silent
    assert len(got) + s.lost == end - start
    assert len({b.seq for b in got}) == len(got)


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_without_a_replay_endpoint_a_gap_is_lost_and_counted(publisher: Publisher) -> None:
    stream = subscribe(publisher, replay_endpoint=None, rcvhwm=1, rcvbuf=65536)
    try:
        start, end, got = burst(publisher, stream, 3000)
    finally:
        stream.close()
    s = stream.stats
    assert s.lost > 0 and s.replayed == 0
    assert len(got) + s.lost == end - start


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_a_backfill_replays_what_came_before_the_subscriber(publisher: Publisher) -> None:
    before = publisher.publish([{"stored": [5000, 5001], "parent": None, "salt": "early"}])
    got: list[Decoded] = []
    stream = subscribe(publisher, got, backfill=True)
    try:
        got += [b for b in drain(stream, before) if isinstance(b, Decoded)]
    finally:
        stream.close()
    s = stream.stats
    early = [b for b in got if b.seq == before - 1]
    assert len(early) == 1 and s.replayed >= 1 and s.lost == 0, s
    (stored,) = early[0].events
    assert isinstance(stored, BlockStored) and stored.salt_of_first_block() == "early"
    # every batch the publisher still buffered, once each, in order, then the live ones
    assert [b.seq for b in got] == list(range(got[0].seq, got[-1].seq + 1))


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_a_restarted_publisher_is_a_new_cache(publisher: Publisher) -> None:
    stream = subscribe(publisher)
    try:
        for _ in range(5):
            publisher.publish([{"cleared": True}])
        drain(stream, 5)
        publisher.restart()
        got: list[Decoded | Restarted] = []
        for _ in range(100):  # the new PUB socket: the subscription reconnects to it
            publisher.publish([{"stored": [7], "parent": None}])
            got.extend(stream.batches(0.1))
            if any(isinstance(b, Restarted) for b in got):
                break
    finally:
        stream.close()
    assert any(isinstance(b, Restarted) for b in got), stream.stats
    assert stream.stats.restarts == 1


def test_a_newer_vllms_unknown_kind_is_counted_not_guessed() -> None:
    # vLLM's batch layout (checked against its own encoder above), with a kind 0.32 lacks
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None},
               {"type": "BlockPinned", "block_hashes": [5]}], 0]
    )  # fmt: skip
    d = decode_batch(4, payload)
    assert [type(e).__name__ for e in d.events] == ["BlockStored"] and d.unknown == ["BlockPinned"]


def test_endpoints_are_checked() -> None:
    assert check_endpoint(" tcp://vllm-0:5557 ") == "tcp://vllm-0:5557"
    for bad in ("tcp://*:5557", "http://x:1", "tcp://x", "tcp://x:0", "tcp://x:70000"):
        with pytest.raises(BadEndpoint):
            check_endpoint(bad)


def test_the_cli_refuses_what_cannot_run() -> None:
    runner = CliRunner()
    env = {"KVWATCH_COLLECTOR_URL": "", "KVWATCH_INGEST_TOKEN": ""}
    r = runner.invoke(app, ["kv-events", "--endpoint", "tcp://*:5557", "--dry-run"], env=env)
    assert r.exit_code == 2 and "binding" in r.output
    r = runner.invoke(app, ["kv-events", "--endpoint", "tcp://h:1", "--backfill"], env=env)
    assert r.exit_code == 2 and "--replay-endpoint" in r.output
    r = runner.invoke(app, ["kv-events", "--endpoint", "tcp://h:1", "--duration", "0"], env=env)
    assert r.exit_code == 2 and "KVWATCH_COLLECTOR_URL" in r.output


@pytest.mark.slow  # vLLM\'s publisher in a process of its own
def test_the_cli_dry_run_reads_vllms_publisher(publisher: Publisher) -> None:
    """In-process, as `kvwatch kv-events --dry-run` for a second: what it took is counted."""
    import threading

    runner = CliRunner()
    out: dict[str, Any] = {}

    def run() -> None:
        r = runner.invoke(
            app,
            ["kv-events", "--endpoint", publisher.endpoint, "--replay-endpoint",
             publisher.replay, "--dry-run", "--duration", "3", "--interval", "0.5"],
        )  # fmt: skip
        out["r"] = r

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    publisher.publish([{"stored": [4000, 4001], "parent": None, "session": "x"}])
    t.join(30)
    r = out["r"]
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["blocks"]["stored_blocks"] == 2 and summary["blocks"]["unsalted_blocks"] == 2
    # the empty intervals before the first batch are held (nothing yet showed the
    # subscription can hear the publisher) and join the batch's; the rest are sent
    assert summary["intervals"] >= 3 and summary["gaps"] == 0 and summary["config_sent"] is True
    assert summary["stream"]["lost"] == 0
