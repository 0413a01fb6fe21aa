"""A webhook URL with credentials in it (``user:pass@host``): the CLI never shows the
password, and deliveries still carry it. Real CLI, real databases, a real receiver on
127.0.0.1."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from collector.db import Database
from collector.notify.dispatcher import Dispatcher
from collector.notify.outbox import enqueue
from collector.settings import Settings
from kvwatch.cli import app
from tests.notify_helpers import alert_doc

PASSWORD = "s3cr%40t-hunter2"  # percent-encoded '@', as a password with one must be written


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[str | None]]]:
    """A receiver on 127.0.0.1 that records each POST's Authorization header."""
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(self.headers.get("Authorization"))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_webhooks_list_hides_the_password_and_delivery_still_uses_it(
    db_url: str, receiver: tuple[str, list[str | None]]
) -> None:
    hostport, seen = receiver
    url = f"http://alice:{PASSWORD}@{hostport}/hooks/kv?team=sre"
    runner = CliRunner()
    added = runner.invoke(app, ["webhooks", "add", "secops", url, "--database-url", db_url])
    assert added.exit_code == 0, added.output
    plain = runner.invoke(
        app,
        [
            *("webhooks", "add", "plain", f"http://{hostport}/hooks/plain"),
            *("--min-severity", "critical", "--database-url", db_url),
        ],
    )
    assert plain.exit_code == 0, plain.output

    listed = runner.invoke(app, ["webhooks", "list", "--json", "--database-url", db_url])
    assert listed.exit_code == 0, listed.output
    rows = {doc["name"]: doc for doc in map(json.loads, listed.stdout.splitlines())}
    assert rows["secops"]["url"] == f"http://alice:***@{hostport}/hooks/kv?team=sre"
    assert rows["plain"]["url"] == f"http://{hostport}/hooks/plain"  # nothing to hide: as stored
    table = runner.invoke(app, ["webhooks", "list", "--database-url", db_url])
    assert table.exit_code == 0 and f"alice:***@{hostport}" in table.stdout, table.output
    for result in (added, listed):
        assert PASSWORD not in result.output and "hunter2" not in result.output
    assert f"http://alice:***@{hostport}/hooks/kv?team=sre" in added.stderr

    # The stored URL keeps its password: the receiver gets it as HTTP Basic credentials.
    db = Database(db_url)
    settings = Settings(database_url=db_url, notify_timeout_s=5.0)
    with db.write() as conn:
        assert enqueue(conn, alert_doc(1), severity="warning", now_us=int(time.time() * 1e6))
    dispatcher = Dispatcher(db, settings)
    try:
        assert dispatcher.run_once() == 1
    finally:
        dispatcher.shutdown()
        db.dispose()
    expected = base64.b64encode(b"alice:s3cr@t-hunter2").decode()
    assert seen == [f"Basic {expected}"]
