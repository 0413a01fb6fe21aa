"""Two collector replicas on one PostgreSQL: concurrent batches about the same alert raise one
alert and one incident, and count every occurrence.

(Batches of one deployment already serialise on its row in the store; the alerting side adds
per-fingerprint locks and retries a batch whose alert insert lost a race. This checks the
outcome, whichever of them does the work.)"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from collector import migrate
from collector import models as m
from collector.app import create_app
from collector.db import Database
from collector.settings import Settings
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token

pytestmark = pytest.mark.postgres
BATCHES = 20


def test_replicas_neither_lose_nor_double_alerts(pg_url: str) -> None:
    migrate.upgrade(pg_url)
    settings = Settings(database_url=pg_url, auto_migrate=False, notify_enabled=False)
    tokens = [make_token(pg_url, "ingest") for _ in range(8)]
    with serve_in_thread(create_app(settings)) as a, serve_in_thread(create_app(settings)) as b:
        barrier = threading.Barrier(len(tokens))
        errors: list[Any] = []

        def probe(i: int) -> None:
            url = (a, b)[i % 2]
            events = [
                f.as_json(f.stale_read(seq, probe=f"probe-{i}", page_ids=[i, seq]))
                for seq in range(1, BATCHES + 1)
            ]
            with httpx.Client(base_url=url, timeout=60) as c:
                barrier.wait()
                for e in events:  # five batches each, racing the other replica's
                    r = c.post(
                        "/v1/events", json=[e], headers={"Authorization": f"Bearer {tokens[i]}"}
                    )
                    if r.status_code != 200:
                        errors.append(r.text)

        threads = [threading.Thread(target=probe, args=(i,)) for i in range(len(tokens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert errors == []
    db = Database(pg_url)
    try:
        with db.read() as conn:
            alerts = conn.execute(
                select(m.Alert.rule, m.Alert.occurrences).where(m.Alert.rule == "stale_page_read")
            ).all()
            incidents = conn.execute(select(func.count()).select_from(m.Incident)).scalar_one()
            firing = conn.execute(
                select(func.count())
                .select_from(m.AlertTransition)
                .where(m.AlertTransition.to_state == "firing")
            ).scalar_one()
    finally:
        db.dispose()
    assert alerts == [("stale_page_read", len(tokens) * BATCHES)]
    assert incidents == 1
    assert firing == 1
