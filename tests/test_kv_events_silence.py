"""When an interval without KV events is a gap (``kvwatch.kv_events.silence``), with time
passed in; the subscription's own evidence (its connection, other topics) against a real ZMQ
publisher in this process; and ``kvwatch kv-events`` refusing what cannot work and reporting
a gap, never zeros, where nothing publishes."""

from __future__ import annotations

import json
import time

import pytest
import zmq
from typer.testing import CliRunner

from kvwatch.cli import app
from kvwatch.embedded import free_port
from kvwatch.kv_events import BadEndpoint, Stream, check_endpoint
from kvwatch.kv_events.silence import EngineReading, Gap, Silence

EP = "tcp://vllm-0:5557"


def judge(**kw: object) -> Silence:
    return Silence(endpoint=EP, topic="kv", silent_after_s=60.0, now=1000.0, **kw)  # type: ignore[arg-type]


def test_connected_and_nothing_says_busy_is_idle() -> None:
    s = judge()
    # before any batch, nothing shows the subscription can hear the engine: held for the
    # bound, then idle
    assert s.judge(1010.0, connected=True) == "hold"
    assert s.judge(1060.0, connected=True) == "idle"
    s.data(1070.0)
    assert s.judge(1080.0, connected=True) == "idle"  # heard once: idle at once
    assert s.judge(5000.0, connected=True) == "idle"  # however long: zeros are true
    up = EngineReading(True, requests=7, computed_tokens=900)
    assert s.judge(5010.0, connected=True, engine=up) == "idle"  # the first reading: a baseline
    assert s.judge(5020.0, connected=True, engine=up) == "idle"  # no traffic since


def test_not_connected_is_held_then_a_gap_naming_the_bind_rule() -> None:
    s = judge()
    assert s.judge(1030.0, connected=False) == "hold"
    assert s.judge(1059.9, connected=False) == "hold"
    gap = s.judge(1060.0, connected=False)
    assert isinstance(gap, Gap) and gap.cause == "not_connected" and gap.since == 1000.0
    assert gap.silent_s == 60.0 and gap.requests is None
    assert f"nothing accepts connections at {EP}" in gap.reason and "'*'" in gap.reason
    assert len(gap.reason) <= 256
    # the last interval is never held: a short unobserved stretch is still a gap
    assert isinstance(judge().judge(1001.0, connected=False, final=True), Gap)


def test_a_batch_ends_the_silence_and_restarts_the_clock() -> None:
    s = judge()
    assert isinstance(s.judge(1070.0, connected=False), Gap)
    s.data(1075.0)
    assert s.judge(1080.0, connected=False) == "hold"
    assert isinstance(s.judge(1135.0, connected=False), Gap)


def test_the_engine_down_outranks_the_lost_connection() -> None:
    down = EngineReading(False, error="cannot reach http://vllm-0:8000/metrics: refused")
    gap = judge().judge(1100.0, connected=False, engine=down)
    assert isinstance(gap, Gap) and gap.cause == "engine_down" and "refused" in gap.reason


def test_another_topic_is_named() -> None:
    gap = judge().judge(1100.0, connected=True, other_topic="")
    assert isinstance(gap, Gap) and gap.cause == "other_topic"
    assert "--topic 'kv'" in gap.reason and "topic ''" in gap.reason


def test_traffic_counts_once_a_block_was_computed() -> None:
    s = judge(block_tokens=32)
    s.data(1000.0, EngineReading(True, requests=10, computed_tokens=5000))
    # a request served from the cache, 20 new tokens: no block filled, no evidence
    assert s.judge(1010.0, connected=True, engine=EngineReading(True, 11, 5020)) == "idle"
    assert s.heard
    assert s.judge(1020.0, connected=True, engine=EngineReading(True, 12, 5040)) == "hold"
    gap = s.judge(1061.0, connected=True, engine=EngineReading(True, 14, 5400))
    assert isinstance(gap, Gap) and gap.cause == "engine_served" and gap.requests == 4
    assert "finished 4 request(s)" in gap.reason
    # a baseline given at the start: traffic counts from the first interval
    t = judge(block_tokens=32, engine=EngineReading(True, requests=10, computed_tokens=5000))
    assert t.judge(1010.0, connected=True, engine=EngineReading(True, 12, 5040)) == "hold"
    # counters that went down: a restarted engine, counted from its new start
    assert s.judge(1070.0, connected=True, engine=EngineReading(True, 1, 40)) == "idle"
    assert isinstance(s.judge(1080.0, connected=True, engine=EngineReading(True, 3, 200)), Gap)


def test_silent_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="silent_after_s"):
        Silence(endpoint=EP, topic="", silent_after_s=0, now=0.0)


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("tcp://0.0.0.0:5557", "any-address"),
        ("tcp://[::]:5557", "any-address"),
        ("tcp://*:5557", "'*' is for binding"),
        ("inproc://kv", "inproc://"),
    ],
)
def test_endpoints_that_cannot_work_are_refused(endpoint: str, says: str) -> None:
    with pytest.raises(BadEndpoint, match="--endpoint") as caught:
        check_endpoint(endpoint)
    assert says in str(caught.value) and endpoint in str(caught.value)
    r = CliRunner().invoke(app, ["kv-events", "--endpoint", endpoint, "--dry-run"])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output
    assert check_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"


def test_the_stream_knows_its_connection_and_other_topics() -> None:
    port = free_port()
    nobody = Stream(f"tcp://127.0.0.1:{port}", topic="kv")
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        assert list(nobody.batches(0.2)) == [] and nobody.connected is False
        pub.bind(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while not nobody.connected:
            list(nobody.batches(0.05))
            assert time.monotonic() < deadline, "never connected"
        # vLLM's default topic (empty) while this one subscribed "kv": counted, named
        while nobody.stats.other_topic == 0:
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\x93\x00\x90\x00"])
            assert list(nobody.batches(0.05)) == []
            assert time.monotonic() < deadline, "nothing arrived"
        assert nobody.other_topic == "" and nobody.stats.malformed == 0
        assert nobody.take_other_topic() == "" and nobody.other_topic is None
        pub.close(linger=0)
        while nobody.connected:
            list(nobody.batches(0.05))
            assert time.monotonic() < deadline, "never saw the publisher go"
    finally:
        pub.close(linger=0)
        nobody.close()


def test_the_cli_reports_a_gap_not_zeros_where_nothing_publishes() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(
        app,
        ["kv-events", "--endpoint", endpoint, "--dry-run", "--duration", "1.5",
         "--interval", "0.2", "--silent-after", "0.5"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"nothing accepts connections at {endpoint}" in r.output
    assert "give vLLM tcp://*:PORT" in r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["intervals"] == 0 and summary["gaps"] >= 2, summary
