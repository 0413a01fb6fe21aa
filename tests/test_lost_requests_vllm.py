"""LIVE: a vLLM server stopped with SIGTERM while requests are in flight. vLLM's shutdown ends
its engine core at once, where the probe runs: no ``probe.stopped`` comes, and the requests
it had admitted would stay ``admitted`` forever. The collector closes them as ``lost`` once
the probe is silent past ``KVWATCH_PROBE_LOST_AFTER_S`` (its periodic pass, time passed in
here).

A server of its own (with its own collector), started once for this module: the session's
shared server (``tests/engine_servers.py``) serves other tests and is never stopped here.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.db import Database
from collector.lost import LostRequests
from tests.engine_servers import (
    VllmServer,
    _need_venv,
    _start_collector,
    _start_server,
    _stop,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]
LOST_AFTER_S = 300.0  # KVWATCH_PROBE_LOST_AFTER_S's default
IN_FLIGHT = 3


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


def _rows(server: VllmServer) -> list[dict[str, Any]]:
    with server.collector.client() as c:
        r = c.get("/v1/requests", params={"deployment_id": server.deployment_id, "limit": 100})
        r.raise_for_status()
        return list(r.json()["items"])


def test_sigterm_mid_request_leaves_rows_that_are_closed_as_lost(doomed: VllmServer) -> None:
    # Long answers (ignore_eos), so they are still being generated at the stop.
    prompt = list(range(10, 60))
    clients = [
        threading.Thread(
            target=lambda: _ignore_errors(
                lambda: doomed.complete(prompt, tenant="acme", max_tokens=1900)
            ),
            daemon=True,
        )
        for _ in range(IN_FLIGHT)
    ]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 60
    while sum(r["status"] == "admitted" for r in _rows(doomed)) < IN_FLIGHT:
        assert time.monotonic() < deadline, (_rows(doomed), doomed.log_tail())
        time.sleep(0.2)
    # What an operator's `kill`, systemd or Kubernetes does: SIGTERM to the server's main
    # process only (vLLM stops its engine core itself).
    doomed.process.send_signal(signal.SIGTERM)
    try:
        doomed.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vLLM did not stop on SIGTERM:\n{doomed.log_tail()}")
    for t in clients:
        t.join(timeout=30)
    time.sleep(1.0)  # anything the probe still sent has arrived
    rows = _rows(doomed)
    open_ids = {r["request_id"] for r in rows if r["status"] == "admitted"}
    assert len(open_ids) == IN_FLIGHT, rows
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
        assert sweep.close_silent(now + timedelta(seconds=LOST_AFTER_S + 1)).lost == IN_FLIGHT
    finally:
        db.dispose()
    after = {r["request_id"]: r for r in _rows(doomed)}
    assert {(after[i]["status"], after[i]["lost_reason"]) for i in open_ids} == {
        ("lost", "probe_silent")
    }
    assert all(after[i]["node"] == "node-0" for i in open_ids)
    with doomed.collector.client() as c:
        (dep,) = [
            d
            for d in c.get("/v1/fleet").json()["deployments"]
            if d["deployment_id"] == doomed.deployment_id
        ]
    assert dep["lost_requests"]["count"] == IN_FLIGHT
    assert dep["lost_requests"]["by_reason"] == {"probe_silent": IN_FLIGHT}


def _ignore_errors(call: Any) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server went away mid-answer: expected
        call()
