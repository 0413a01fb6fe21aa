"""An endpoint gets at most KVWATCH_NOTIFY_MAX_PER_MINUTE alert notifications a minute, then
one digest for the rest of the minute (issue 40, finding 5): 100 batches under made-up probe
ids had sent 500 webhooks across 5 endpoints. Through a real collector and a real HTTP
receiver; nothing is dropped, and an incident is never held back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector import migrate
from collector.app import create_app
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.settings import Settings
from collector.timefmt import now_micros
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token
from tests.notify_helpers import Receiver

LIMIT = 3


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[str, Any, Receiver]]:
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    receiver = Receiver().start()
    db = Database(db_url)
    with db.write() as conn:
        add_endpoint(conn, "hook", f"{receiver.url}/hook", secret=None, now_us=now_micros())
    db.dispose()
    app = create_app(
        Settings(
            database_url=db_url,
            auto_migrate=False,
            notify_max_per_minute=LIMIT,
            notify_poll_s=0.1,
        )
    )
    try:
        with serve_in_thread(app) as url:
            yield url, app, receiver
    finally:
        receiver.stop()


def _gap(ingest: httpx.Client, probe: str) -> None:
    """A probe that skips seqs 2..4: a telemetry_gap alert of its own, notified at once."""
    now = datetime.now(UTC)
    for seq in (1, 5):
        batch = [f.as_json(f.pool(seq, probe=probe, dep="stormy", ts=now))]
        assert ingest.post("/v1/events", json=batch).status_code == 200


def test_past_the_limit_the_minute_goes_out_as_one_digest_and_incidents_still_page(
    world: tuple[str, Any, Receiver],
) -> None:
    url, app, receiver = world
    db_url = app.state.settings.database_url
    ingest = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {make_token(db_url, 'ingest')}"}
    )
    # keep the storm inside one minute, whatever the second it starts at
    if datetime.now(UTC).second > 40:
        time.sleep(61 - datetime.now(UTC).second)
    for i in range(10):
        _gap(ingest, f"storm-{i}")
    # the incident: a cross-tenant stale read, past the limit but never held
    now = datetime.now(UTC)
    events = [f.as_json(f.stale_read(1, probe="reader", dep="stormy", ts=now))]
    assert ingest.post("/v1/events", json=events).status_code == 200

    def types() -> list[str]:
        return [d.doc["type"] for d in receiver.by_path("/hook")]

    assert receiver.wait_for(lambda _: "incident.opened" in types(), 30), types()
    time.sleep(1.0)  # anything more the dispatcher would send now
    sent = types()
    alerts_sent = [t for t in sent if t.startswith("alert.")]
    assert len(alerts_sent) == LIMIT and "alert.digest" not in sent, sent

    # the minute ends: one digest, with every alert held back
    app.state.dispatcher.run_once(now=time.time() + 61)
    assert receiver.wait_for(lambda _: "alert.digest" in types(), 10), types()
    (digest,) = [d.doc for d in receiver.by_path("/hook") if d.doc["type"] == "alert.digest"]
    held = digest["digest"]
    firing = [a for a in digest["alerts"] if a["rule"] == "telemetry_gap"]
    shown = sum(len(d.doc.get("alerts") or []) for d in receiver.by_path("/hook")
                if d.doc["type"] == "alert.firing")  # fmt: skip
    assert held["limit_per_minute"] == LIMIT and held["notifications"] >= 1
    # every one of the ten gap alerts reached the receiver, directly or in the digest
    seen = {
        a["labels"]["probe_id"]
        for d in receiver.by_path("/hook")
        for a in d.doc.get("alerts") or []
        if a["rule"] == "telemetry_gap"
    }
    assert seen == {f"storm-{i}" for i in range(10)}, (seen, shown, len(firing))


def test_rotating_a_webhook_secret_keeps_the_pending_messages(tmp_path: Path) -> None:
    """Rotating meant `webhooks remove` and `add`, which dropped the undelivered messages
    (issue 40, low finding). `webhooks rotate-secret` changes it in place: what was pending
    goes out, signed with the new secret."""
    from typer.testing import CliRunner

    from kvwatch.cli import app as cli

    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    receiver = Receiver(status={"/hook": 503}).start()
    db = Database(db_url)
    with db.write() as conn:
        _, old = add_endpoint(conn, "hook", f"{receiver.url}/hook", now_us=now_micros())
    db.dispose()
    assert old is not None
    app = create_app(
        Settings(
            database_url=db_url,
            auto_migrate=False,
            notify_poll_s=0.1,
            notify_backoff_base_s=0.1,
            notify_backoff_max_s=0.2,
        )
    )
    try:
        with serve_in_thread(app) as url:
            ingest = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {make_token(db_url, 'ingest')}"}
            )
            _gap(ingest, "pending-1")
            assert receiver.wait_for(lambda d: len(d) >= 2, 30)  # refused, and retried
            done = CliRunner().invoke(
                cli, ["webhooks", "rotate-secret", "hook", "--database-url", db_url]
            )
            assert done.exit_code == 0, done.output
            new = done.stdout.strip().splitlines()[-1]
            assert new.startswith("whsec_") and new != old
            receiver.secrets["/hook"] = new
            receiver.status["/hook"] = 200
            tried = len(receiver.by_path("/hook"))
            assert receiver.wait_for(lambda d: len(d) > tried and d[-1].error is None, 30)
            last = receiver.by_path("/hook")[-1]
            assert last.doc["type"] == "alert.firing" and last.error is None
    finally:
        receiver.stop()
