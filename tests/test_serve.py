"""`kvwatch serve --workers 2` on one SQLite file: writers in two processes queue on the
write lock; every event of concurrent probes is stored exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from collector import migrate
from engine_probe import events as ev
from tests import factories as f
from tests.conftest import free_port, make_token

pytestmark = pytest.mark.slow


def test_two_worker_processes_share_one_sqlite_file(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'k.db'}"
    migrate.upgrade(db_url)
    token = make_token(db_url, "ingest")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch.cli", "serve", "--port", str(port), "--workers", "2"],
        env=os.environ | {"KVWATCH_DATABASE_URL": db_url},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "collector did not start"
            time.sleep(0.1)

        def send(probe: str) -> int:
            accepted = 0
            with httpx.Client(base_url=base, timeout=60) as c:
                for b in range(10):
                    batch = [
                        f.admitted(b * 100 + i + 1, f"{probe}-{b}-{i}", probe=probe)
                        for i in range(100)
                    ]
                    body = ev.encode_batch(batch)
                    r = c.post(
                        "/v1/events",
                        content=body,
                        headers={
                            "Authorization": f"Bearer {token}",
                            "Content-Type": "application/json",
                        },
                    )
                    assert r.status_code == 200, r.text
                    accepted += r.json()["accepted"]
                    # every batch is sent twice: the retry must store nothing
                    again = c.post("/v1/events", content=body, headers=r.request.headers)
                    assert again.json()["duplicates"] == 100
            return accepted

        with ThreadPoolExecutor(4) as pool:
            assert sum(pool.map(send, ["p1", "p2", "p3", "p4"])) == 4000
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0  # stopped as a service is: a graceful shutdown, exit 0
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert (
            conn.execute(text("SELECT count(DISTINCT request_id) FROM requests")).scalar() == 4000
        )
        assert conn.execute(text("SELECT count(*) FROM requests")).scalar() == 4000
    engine.dispose()
