"""Shared parts of the probe tests: a real HTTP collector stand-in and small helpers.

``FakeCollector`` is a real ``ThreadingHTTPServer`` on 127.0.0.1 that decodes batches with the
wire contract, the way the collector does, records every accepted batch (duplicates
included, so tests can assert exactly-once delivery) and can be told to answer 401/413/422/
503, to refuse chosen batches with any status (``refuse``), to hold requests, or to go away
entirely (connection refused) and come back on the same port.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine_probe import events as ev
from engine_probe.probe import Probe
from engine_probe.settings import ProbeSettings

TOKEN = "test-ingest-token"
_raw_list = msgspec.json.Decoder(list[msgspec.Raw])


class FakeCollector:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.batches: list[list[ev.Event]] = []  # accepted, in arrival order
        self.statuses: list[int] = []  # every answer given, in order
        self.headers: list[dict[str, str]] = []
        self.status_override: int | None = None  # answer this to every request
        self.max_events: int | None = None  # 413 above this many events
        # Called with every decoded batch: a status to answer instead of accepting it, or None.
        self.refuse: Callable[[list[ev.Event]], int | None] | None = None
        self.gate = threading.Event()  # requests wait here until it is set
        self.gate.set()
        self.in_flight = 0
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.start()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Listen (again, on the same port after ``stop``)."""
        assert self._server is None
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler_class())
        server.daemon_threads = False
        server.block_on_close = True  # server_close() joins handler threads: no leaks
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop listening: connections are refused until ``start``."""
        server, self._server = self._server, None
        if server is None:
            return
        self.gate.set()
        server.shutdown()
        server.server_close()
        assert self._thread is not None
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- what arrived ----------------------------------------------------------------------

    def events(self) -> list[ev.Event]:
        with self.lock:
            return [e for batch in self.batches for e in batch]

    def by_probe(self) -> dict[str, list[ev.Event]]:
        out: dict[str, list[ev.Event]] = {}
        for e in self.events():
            out.setdefault(e.probe_id, []).append(e)
        return out

    def batch_sizes(self) -> list[int]:
        with self.lock:
            return [len(b) for b in self.batches]

    # -- the handler -----------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: clean shutdowns

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with fake.lock:
                    fake.in_flight += 1
                    fake.headers.append(dict(self.headers.items()))
                try:
                    fake.gate.wait(10)
                    status, answer = fake._answer(self.path, self.headers, body)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                        fake.statuses.append(status)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def _answer(self, path: str, headers: Any, body: bytes) -> tuple[int, dict[str, Any]]:
        def error(code: str, message: str, details: Any = None) -> dict[str, Any]:
            return {"error": {"code": code, "message": message, "details": details}}

        if path != "/v1/events":
            return 404, error("not_found", path)
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 401, error("unauthorized", "bad token")
        if self.status_override is not None:
            return self.status_override, error("forced", "forced by the test")
        if self.max_events is not None and len(_raw_list.decode(body)) > self.max_events:
            return 413, error("too_large", "batch too large")
        try:
            batch = ev.decode_json_batch(body)
        except ev.DecodeError as exc:
            return 422, error("invalid_events", str(exc), [e.as_dict() for e in exc.errors])
        if self.refuse is not None and (status := self.refuse(batch)) is not None:
            return status, error("refused", "refused by the test")
        with self.lock:
            self.batches.append(batch)
        return 200, {"accepted": len(batch), "duplicates": 0}


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


def settings(collector: FakeCollector, **overrides: Any) -> ProbeSettings:
    """Settings for tests: tiny backoff, long flush interval (flushes are explicit)."""
    values: dict[str, Any] = {
        "collector_url": collector.url,
        "ingest_token": TOKEN,
        "deployment_id": "test-dep",
        "probe_buffer_size": 1000,
        "probe_batch_size": 100,
        "probe_flush_interval_s": 30.0,
        "probe_request_timeout_s": 5.0,
        "probe_backoff_base_s": 0.01,
        "probe_backoff_max_s": 0.05,
        "probe_atexit_timeout_s": 1.0,
    }
    values.update(overrides)
    return ProbeSettings(**values)


def pool(probe: Probe, used: int = 1, **kw: Any) -> bool:
    return probe.emit(ev.PoolSample, capacity_tokens=10**6, used_tokens=used, free_tokens=0, **kw)


def accounting(events: list[ev.Event]) -> tuple[list[int], int, int]:
    """For one probe's delivered events: (data seqs, seqs missing, drops reported)."""
    seqs = [e.seq for e in events]
    assert len(seqs) == len(set(seqs)), f"duplicated seqs: {seqs}"
    missing = set(range(1, max(seqs) + 1)) - set(seqs)
    reported = sum(sum(e.counts.values()) for e in events if isinstance(e, ev.ProbeDrops))
    data = [e.seq for e in events if not isinstance(e, ev.ProbeDrops)]
    return data, len(missing), reported


def assert_in_seq_order_exactly_once(events: list[ev.Event]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs), f"out of order: {seqs}"
    assert len(seqs) == len(set(seqs)), f"duplicates: {seqs}"


def exporter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvwatch-probe-exporter")]


@pytest.fixture
def fake_collector() -> Iterator[FakeCollector]:
    fake = FakeCollector()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def make_probe() -> Iterator[Callable[[ProbeSettings], Probe]]:
    """Build probes that are shut down after the test; fails the test on leaked threads."""
    probes: list[Probe] = []

    def make(s: ProbeSettings) -> Probe:
        probe = Probe(s)
        probes.append(probe)
        return probe

    yield make
    for probe in probes:
        probe.shutdown(2.0)
    wait_for(lambda: not exporter_threads(), 5.0, "exporter threads to end")


def spool_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json") if p.parent.name != "rejected")
