"""Rotating a webhook's signing secret with a grace (``kvwatch webhooks rotate-secret
--grace``): the replaced secret keeps signing beside the new one, as Standard Webhooks'
several ``v1,`` entries allow, so the receiver can switch secrets without refusing a message
in between; once the grace ends, or with ``--grace 0``, only the new secret signs. Through
the CLI, a real collector's dispatcher and a real HTTP receiver that verifies with the
public ``verify``."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from collector import migrate
from collector.app import create_app
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.notify.signing import WebhookVerificationError, verify
from collector.settings import Settings
from collector.timefmt import now_micros
from kvwatch.cli import app as cli
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token
from tests.notify_helpers import Delivery, Receiver

HOUR = 3600.0


@dataclass
class World:
    db_url: str
    app: Any
    receiver: Receiver
    ingest: httpx.Client
    old: str

    def rotate(self, *args: str) -> Any:
        return CliRunner().invoke(
            cli, ["webhooks", "rotate-secret", "hook", *args, "--database-url", self.db_url]
        )

    def alert(self, probe: str) -> None:
        """A telemetry gap of ``probe``'s own: one alert notification queued."""
        now = datetime.now(UTC)
        for seq in (1, 5):
            batch = [f.as_json(f.pool(seq, probe=probe, dep="rotating", ts=now))]
            assert self.ingest.post("/v1/events", json=batch).status_code == 200

    def send(self, probe: str, ahead_s: float = 0.0) -> tuple[Delivery, float]:
        """Queue ``probe``'s alert and have the dispatcher send it as of ``ahead_s`` from
        now; the delivery and the time it was sent as of."""
        before = len(self.receiver.by_path("/hook"))
        self.alert(probe)
        deadline = time.monotonic() + 30
        while len(self.receiver.by_path("/hook")) == before:
            assert time.monotonic() < deadline, "nothing was sent"
            at = time.time() + ahead_s
            self.receiver.clock = lambda at=at: at  # its freshness check keeps that time
            self.app.state.dispatcher.run_once(now=at)
        return self.receiver.by_path("/hook")[-1], at


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    receiver = Receiver().start()
    db = Database(db_url)
    with db.write() as conn:
        _, old = add_endpoint(conn, "hook", f"{receiver.url}/hook", now_us=now_micros())
    db.dispose()
    assert old is not None
    receiver.secrets["/hook"] = old
    # the dispatcher's own timer stays out of the way: each test sends as of a time it sets
    app = create_app(Settings(database_url=db_url, auto_migrate=False, notify_poll_s=3600))
    try:
        with serve_in_thread(app) as url:
            token = make_token(db_url, "ingest")
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
                yield World(db_url, app, receiver, c, old)
    finally:
        receiver.stop()


def _valid(secret: str, d: Delivery, now: float) -> bool:
    try:
        verify(secret, d.headers, d.body, now=now)
    except WebhookVerificationError:
        return False
    return True


def _listed(world: World) -> dict[str, Any]:
    out = CliRunner().invoke(cli, ["webhooks", "list", "--json", "--database-url", world.db_url])
    assert out.exit_code == 0, out.output
    (doc,) = [json.loads(line) for line in out.stdout.splitlines()]
    return dict(doc)


def test_during_the_grace_both_secrets_sign_and_after_it_only_the_new_one(world: World) -> None:
    done = world.rotate("--grace", "2h")
    assert done.exit_code == 0, done.output
    new = done.stdout.strip().splitlines()[-1]
    assert new.startswith("whsec_") and new != world.old
    assert re.search(r"and with the replaced secret too until \S+Z \(in (1h 59m|2h)\)", done.stderr)
    assert "whsec_" not in done.stderr  # the secret is on stdout alone
    until = _listed(world)["previous_secret_until"]
    assert until is not None and "old secret signs" in CliRunner().invoke(
        cli, ["webhooks", "list", "--wide", "--database-url", world.db_url]
    ).stdout.replace("\n", " ")

    # an hour in: a receiver still on the old secret accepts, and one on the new does too
    d, at = world.send("during", HOUR)
    assert d.error is None  # the receiver verified with the old secret
    assert len(d.headers["webhook-signature"].split()) == 2
    assert _valid(world.old, d, at) and _valid(new, d, at)

    # three hours in, the grace is over: the new secret alone signs
    d, at = world.send("after", 3 * HOUR)
    assert d.error is not None  # the receiver still on the old secret refuses it
    assert len(d.headers["webhook-signature"].split()) == 1
    assert _valid(new, d, at) and not _valid(world.old, d, at)
    # and the replaced secret, which signs nothing any more, is no longer stored
    with Database(world.db_url).read() as conn:
        kept = conn.execute(text("SELECT previous_secret FROM notify_endpoints")).scalars()
        assert list(kept) == [None]


def test_grace_zero_stops_the_replaced_secret_at_once(world: World) -> None:
    done = world.rotate("--grace", "0")
    assert done.exit_code == 0, done.output
    new = done.stdout.strip().splitlines()[-1]
    assert "replaced secret" not in done.stderr
    d, at = world.send("leaked")
    assert _valid(new, d, at) and not _valid(world.old, d, at)
    assert _listed(world)["previous_secret_until"] is None


def test_a_second_rotation_in_the_grace_retires_the_first_secret(world: World) -> None:
    first = world.rotate("--grace", "1h").stdout.strip().splitlines()[-1]
    second = world.rotate("--grace", "1h").stdout.strip().splitlines()[-1]
    d, at = world.send("twice", 60)
    assert _valid(second, d, at) and _valid(first, d, at) and not _valid(world.old, d, at)


@pytest.mark.parametrize(
    ("grace", "says"),
    [("soon", "expected a duration such as 30s"), ("31d", "grace must be between 0 and 30 days")],
)
def test_a_bad_grace_is_refused_and_changes_nothing(world: World, grace: str, says: str) -> None:
    done = world.rotate("--grace", grace)
    assert done.exit_code == 2 and says in done.output, done.output
    assert "Traceback" not in done.output
    d, _ = world.send("unchanged")
    assert d.error is None and len(d.headers["webhook-signature"].split()) == 1


def test_a_pagerduty_routing_key_has_no_grace(world: World) -> None:
    with Database(world.db_url).write() as conn:
        add_endpoint(conn, "pd", "https://events.pagerduty.com/v2/enqueue", kind="pagerduty",
                     secret="a" * 32, now_us=now_micros())  # fmt: skip
    done = CliRunner().invoke(
        cli,
        ["webhooks", "rotate-secret", "pd", "--secret", "b" * 32, "--grace", "1h",
         "--database-url", world.db_url],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "replaced secret" not in done.stderr
    out = CliRunner().invoke(cli, ["webhooks", "list", "--json", "--database-url", world.db_url])
    docs = {d["name"]: d for d in map(json.loads, out.stdout.splitlines())}
    assert docs["pd"]["previous_secret_until"] is None
