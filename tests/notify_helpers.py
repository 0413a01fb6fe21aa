"""A real webhook receiver on 127.0.0.1, a real Alertmanager, and notification documents,
for the notify tests."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector import timefmt
from collector.notify.signing import WebhookVerificationError, verify
from kvwatch.embedded import free_port


@dataclass
class Delivery:
    path: str
    msg_id: str
    timestamp: int
    body: bytes
    error: str | None  # why verification failed; None if the signature was valid
    headers: dict[str, str] = field(default_factory=dict)  # as received, names lower-cased

    @property
    def doc(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    """Records every POST (on arrival, before answering), verifies its Standard Webhooks
    signature with the public ``verify``, and answers ``status[path]`` (default 200)."""

    secrets: dict[str, str] = field(default_factory=dict)  # path -> whsec_ secret
    clock: Callable[[], float] = time.time
    port: int = field(default_factory=free_port)
    status: dict[str, int] = field(default_factory=dict)
    headers: dict[str, dict[str, str]] = field(default_factory=dict)  # path -> extra headers
    delay_s: float = 0.0
    # hold(path, msg_id) -> an event the handler waits on before answering (at most 30 s)
    hold: Callable[[str, str], threading.Event | None] = lambda _p, _m: None
    deliveries: list[Delivery] = field(default_factory=list)
    max_inflight: Counter[str] = field(default_factory=Counter)
    _inflight: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    arrived: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def by_path(self, path: str) -> list[Delivery]:
        with self._lock:
            return [d for d in self.deliveries if d.path == path]

    def wait_for(self, pred: Callable[[list[Delivery]], bool], timeout: float = 30) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: pred(list(self.deliveries)), timeout)

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                error: str | None = None
                secret = receiver.secrets.get(self.path)
                if secret is not None:
                    try:
                        verify(secret, headers, body, now=receiver.clock())
                    except WebhookVerificationError as exc:
                        error = exc.message
                delivery = Delivery(
                    self.path,
                    headers.get("webhook-id", ""),
                    int(headers.get("webhook-timestamp", 0)),
                    body,
                    error,
                    headers,
                )
                with receiver._lock:
                    receiver.deliveries.append(delivery)
                    receiver._inflight[self.path] += 1
                    receiver.max_inflight[self.path] = max(
                        receiver.max_inflight[self.path], receiver._inflight[self.path]
                    )
                with receiver.arrived:
                    receiver.arrived.notify_all()
                try:
                    if (event := receiver.hold(self.path, delivery.msg_id)) is not None:
                        event.wait(30)
                    if receiver.delay_s:
                        time.sleep(receiver.delay_s)
                finally:
                    with receiver._lock:
                        receiver._inflight[self.path] -= 1
                code = 401 if error else receiver.status.get(self.path, 200)
                try:
                    self.send_response(code)
                    for name, value in receiver.headers.get(self.path, {}).items():
                        self.send_header(name, value)
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except OSError:
                    pass  # the sender is gone (killed mid-request)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class FakeClock:
    """Unix seconds that move only when told to (starts at the real time, so signatures
    stay within a receiver's tolerance)."""

    def __init__(self, start: float | None = None):
        self.t = time.time() if start is None else start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def iso(ts: float) -> str:
    """How alert and incident documents write a time (collector.timefmt's format)."""
    return timefmt.iso(datetime.fromtimestamp(ts, UTC))


def alert_doc(
    alert_id: int,
    state: str = "firing",
    *,
    at: float | None = None,
    starts_at: float | None = None,
    alertname: str = "stale_page_read",
    deployment: str = "d1",
    severity: str = "critical",
) -> dict[str, Any]:
    """A notification document with one alert, as ``collector.notify`` specifies it."""
    at = time.time() if at is None else at
    starts = at - 60 if starts_at is None else starts_at
    labels = {
        "alertname": alertname,
        "deployment_id": deployment,
        "severity": severity,
        "alert_no": str(alert_id),
    }
    group = {"alertname": alertname, "deployment_id": deployment}
    return {
        "type": f"alert.{'resolved' if state == 'resolved' else 'firing'}",
        "created_at": iso(at),
        "group_key": f'{{alertname="{alertname}",deployment_id="{deployment}"}}',
        "group_labels": group,
        "alerts": [
            {
                "id": alert_id,
                "fingerprint": f"{alert_id:016x}",
                "rule": alertname,
                "kind": alertname,
                "severity": severity,
                "state": state,
                "labels": labels,
                "annotations": {"summary": f"alert {alert_id} is {state}"},
                "value": 1.0,
                "occurrences": 1,
                "starts_at": iso(starts),
                "ends_at": iso(at) if state == "resolved" else None,
                "acked": False,
            }
        ],
        "incident": None,
    }


def incident_doc(
    incident_id: int,
    state: str = "open",
    *,
    at: float | None = None,
    alerts: list[dict[str, Any]] | None = None,
) -> Any:
    """An incident notice; ``alerts``: its linked alerts (as the collector sends them)."""
    at = time.time() if at is None else at
    return {
        "type": "incident.closed" if state == "closed" else "incident.opened",
        "created_at": iso(at),
        "group_key": None,
        "group_labels": {},
        "alerts": alerts or [],
        "incident": {
            "id": incident_id,
            "deployment_id": "d1",
            "title": "cross-tenant KV page read",
            "state": state,
            "cause_rule": "stale_page_read",
            "opened_at": iso(at - 120),
            "awareness_at": iso(at - 120),
            "deadline_at": iso(at - 120 + 72 * 3600),
            "remind_before_s": None,
            "closed_at": iso(at) if state == "closed" else None,
            "closed_by": "oncall" if state == "closed" else None,
            "close_reason": "contained" if state == "closed" else None,
        },
    }


AM_BIN = "/usr/bin/prometheus-alertmanager"


@contextmanager
def running_alertmanager(tmp_path: Path, config: str) -> Iterator[str]:
    """Debian's Alertmanager (``.ci/run`` installs it) on a free loopback port, clustering
    off, with this configuration; yields its URL. Skipped where it is not installed, failed
    in CI."""
    if not os.path.exists(AM_BIN):
        if os.environ.get("CI"):
            pytest.fail(f"{AM_BIN} is missing: .ci/run installs prometheus-alertmanager")
        pytest.skip(f"{AM_BIN} not installed (apt-get install prometheus-alertmanager)")
    path = tmp_path / "alertmanager.yml"
    path.write_text(config)
    port = free_port()
    log_path = tmp_path / "alertmanager.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            AM_BIN,
            f"--config.file={path}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"Alertmanager did not become ready:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
