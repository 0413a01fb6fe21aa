"""LIVE: a vLLM server stopped with SIGTERM while requests are in flight, then SIGKILL once the
grace period has run out, as a supervisor does (here at once: given time, vLLM finishes or
aborts its requests itself, each with its finish record). The kill ends the engine core,
where the probe runs, without the probe's shutdown: no ``probe.stopped`` comes, and the
requests it had admitted would stay ``admitted`` forever. The collector closes
them as ``lost`` once the probe is silent past ``KVWATCH_PROBE_LOST_AFTER_S`` (its periodic
pass, time passed in here).

A server of its own (with its own collector), started once for this module: the session's
shared server (``tests/engine_servers.py``) serves other tests and is never stopped here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from collector.db import Database
from collector.lost import LostRequests
from tests.engine_servers import (
    SERVER_TEST_TIMEOUT,
    VllmServer,
    _need_venv,
    _start_collector,
    _start_server,
    _stop,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]
LOST_AFTER_S = 300.0  # KVWATCH_PROBE_LOST_AFTER_S's default
CLIENTS = 10  # more than --max-num-seqs 8: some always queued
# before SIGKILL (Kubernetes waits 30 s). Within any grace vLLM finishes rows itself: fresh-
# clone CI runs here saw the tiny model drain ten 1,900-token answers within 5 s, and, with
# a 1 s grace, its shutdown abort every request in flight, each with its finish record. A
# grace that has already run out (SIGKILL right behind SIGTERM, as a supervisor whose grace
# was shorter than the shutdown) is the case where rows stay open, the one this test is for.
GRACE_S = 0.0


@pytest.fixture(scope="module")
def doomed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A second vLLM server, for this module alone: it is stopped mid-request."""
    _need_venv()
    workdir: Path = tmp_path_factory.mktemp("vllm-doomed")
    stack: list[Any] = []
    server = None
    try:
        server = _start_server(workdir, _start_collector(workdir, stack))
        yield server
    finally:
        if server is not None:
            _stop(server.process)
        while stack:
            stack.pop().__exit__(None, None, None)


def _rows(server: VllmServer, *, tries: int = 4) -> list[dict[str, Any]]:
    # The collector runs in a thread of this process, beside an engine that keeps both
    # cores of a 2-core machine busy (and more with other work): a read may wait past the
    # client's 30 s. Asking again is what a person would do; correctness is not timing.
    for attempt in range(tries):
        try:
            with server.collector.client() as c:
                r = c.get(
                    "/v1/requests", params={"deployment_id": server.deployment_id, "limit": 100}
                )
                r.raise_for_status()
                return list(r.json()["items"])
        except httpx.TimeoutException:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def test_sigterm_mid_request_leaves_rows_that_are_closed_as_lost(doomed: VllmServer) -> None:
    # Clients that keep long answers (ignore_eos) coming, more than the server runs at once
    # (--max-num-seqs 8): requests are generating and queued whenever the stop comes.
    prompt = list(range(10, 60))
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):  # the server went away mid-answer
                doomed.complete(prompt, tenant="acme", max_tokens=1900, timeout_s=60)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 180
    while not any(r["status"] == "admitted" for r in _rows(doomed)):
        assert time.monotonic() < deadline, (
            [(r["status"], r["completion_tokens"]) for r in _rows(doomed)],
            doomed.log_tail(),
        )
        # not faster: each read is work for the collector that the probe's batches wait on
        time.sleep(0.5)
    # What `kill`, systemd or Kubernetes does: SIGTERM to the server's main process (vLLM
    # stops its engine core itself), then, after a grace period, SIGKILL to what is left.
    doomed.process.send_signal(signal.SIGTERM)
    try:
        doomed.process.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait(timeout=30)
    stop.set()
    for t in clients:
        t.join(timeout=60)
    time.sleep(1.0)  # anything the probe still sent has arrived
    rows = _rows(doomed)
    seen = [(r["status"], r["completion_tokens"], r["lost_reason"]) for r in rows]
    open_ids = {r["request_id"] for r in rows if r["status"] == "admitted"}
    assert open_ids, seen  # no finish came for the requests in flight: they stay open
    probe_ids = {r["probe_id"] for r in rows if r["request_id"] in open_ids}
    assert len(probe_ids) == 1 and None not in probe_ids, rows
    (probe_id,) = probe_ids
    db = Database(doomed.collector.db_url)
    try:
        with db.read() as conn:
            stopped = conn.exec_driver_sql(
                "SELECT stopped_at FROM probes WHERE probe_id = ?", (probe_id,)
            ).scalar_one()
        # vLLM's shutdown ends the engine core before its probe can say so
        assert stopped is None, "the probe sent probe.stopped: docs/vllm.md says it cannot"
        sweep = LostRequests(db, LOST_AFTER_S)
        now = datetime.now(UTC)
        assert sweep.close_silent(now + timedelta(seconds=LOST_AFTER_S / 2)).lost == 0
        assert sweep.close_silent(now + timedelta(seconds=LOST_AFTER_S + 1)).lost == len(open_ids)
    finally:
        db.dispose()
    after = {r["request_id"]: r for r in _rows(doomed)}
    assert {(after[i]["status"], after[i]["lost_reason"]) for i in open_ids} == {
        ("lost", "probe_silent")
    }
    # each row names the node of its admission: the server's, by the node id rule
    port = urlsplit(doomed.base_url).port
    assert {after[i]["node"] for i in open_ids} == {f"{socket.gethostname()}:{port}"}
    with doomed.collector.client() as c:
        (dep,) = [
            d
            for d in c.get("/v1/fleet").json()["deployments"]
            if d["deployment_id"] == doomed.deployment_id
        ]
    assert dep["lost_requests"]["count"] == len(open_ids)
    assert dep["lost_requests"]["by_reason"] == {"probe_silent": len(open_ids)}
