"""Two collector replicas on one PostgreSQL, several probes sending to both, every batch
delivered twice (the second time to the other replica, as a retry after a lost answer):
every event stored exactly once, the alert raised once, and every notification delivered to
the webhook exactly once per message id (both replicas run a dispatcher)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from collector import migrate
from collector import models as m
from collector.app import create_app
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.settings import Settings
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token
from tests.notify_helpers import Receiver

pytestmark = pytest.mark.postgres
PROBES, BATCHES, PER_BATCH = 6, 8, 25


def _batches(i: int) -> list[list[dict[str, Any]]]:
    out, seq = [], 0
    for b in range(BATCHES):
        events = []
        for k in range(PER_BATCH):
            seq += 1
            rid = f"p{i}-r{seq}"
            if k == 0 and b % 4 == 0:  # a stale read now and then: one alert, many hits
                events.append(f.stale_read(seq, probe=f"probe-{i}", page_ids=[i, seq]))
            elif k % 5 == 0:
                events.append(f.pool(seq, probe=f"probe-{i}", used=seq))
            else:
                events.append(f.admitted(seq, rid, "acme", 1000 + seq, probe=f"probe-{i}"))
        out.append([f.as_json(e) for e in events])
    return out


def test_two_replicas_store_alert_and_notify_exactly_once(pg_url: str) -> None:
    migrate.upgrade(pg_url)
    receiver = Receiver().start()
    db = Database(pg_url)
    try:
        with db.write() as conn:
            _, secret = add_endpoint(conn, "hook", f"{receiver.url}/hook", now_us=0)
        assert secret is not None
        receiver.secrets["/hook"] = secret
    finally:
        db.dispose()
    settings = Settings(
        database_url=pg_url, auto_migrate=False, notify_poll_s=0.05, rollup_interval_s=0.5
    )
    tokens = [make_token(pg_url, "ingest") for _ in range(PROBES)]
    statuses: Counter[int] = Counter()
    answers: Counter[str] = Counter()
    lock = threading.Lock()
    try:
        with (
            serve_in_thread(create_app(settings)) as a,
            serve_in_thread(create_app(settings)) as b,
        ):
            barrier = threading.Barrier(PROBES)

            def probe(i: int) -> None:
                urls = (a, b) if i % 2 else (b, a)
                auth = {"Authorization": f"Bearer {tokens[i]}"}
                with httpx.Client(timeout=60, headers=auth) as c:
                    barrier.wait()
                    for body in _batches(i):
                        first = c.post(f"{urls[0]}/v1/events", json=body)
                        again = c.post(f"{urls[1]}/v1/events", json=body)  # the retry
                        with lock:
                            statuses[first.status_code] += 1
                            statuses[again.status_code] += 1
                            if again.status_code == 200:
                                answers["dup"] += again.json()["duplicates"]
                                answers["dup_accepted"] += again.json()["accepted"]

            threads = [threading.Thread(target=probe, args=(i,)) for i in range(PROBES)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            # The dispatchers (one per replica) deliver what the alert enqueued.
            assert receiver.wait_for(lambda ds: len(ds) >= 1, timeout=60)
            outbox_ids = _outbox_ids(pg_url)
            assert receiver.wait_for(lambda ds: {d.msg_id for d in ds} >= outbox_ids, timeout=60), (
                outbox_ids,
                receiver.deliveries,
            )
    finally:
        receiver.stop()
    assert statuses == Counter({200: 2 * PROBES * BATCHES}), statuses
    assert answers["dup_accepted"] == 0
    assert answers["dup"] == PROBES * BATCHES * PER_BATCH  # every retry: all duplicates
    db = Database(pg_url)
    try:
        with db.read() as conn:
            accepted = conn.execute(select(func.sum(m.Probe.accepted))).scalar_one()
            reqs = conn.execute(select(func.count(), func.count(m.Request.request_id.distinct())))
            n_req, n_distinct = reqs.one()
            stale = conn.execute(
                select(func.count())
                .select_from(m.PageEvent)
                .where(m.PageEvent.kind == "page.stale_read")
            ).scalar_one()
            alerts = (
                conn.execute(select(m.Alert.occurrences).where(m.Alert.rule == "stale_page_read"))
                .scalars()
                .all()
            )
    finally:
        db.dispose()
    per_probe = [sum(len(x) for x in _batches(i)) for i in range(PROBES)]
    assert accepted == sum(per_probe)
    n_stale = PROBES * len(range(0, BATCHES, 4))
    n_pool = sum(1 for i in range(PROBES) for body in _batches(i) for e in body
                 if e["kind"] == "pool.sample")  # fmt: skip
    assert n_req == n_distinct == sum(per_probe) - n_stale - n_pool
    assert stale == n_stale
    assert alerts == [n_stale]  # one alert, every hit counted once
    msg_ids = [d.msg_id for d in receiver.deliveries]
    assert len(msg_ids) == len(set(msg_ids)), Counter(msg_ids).most_common(3)
    assert all(d.error is None for d in receiver.deliveries)


def _outbox_ids(pg_url: str) -> set[str]:
    db = Database(pg_url)
    try:
        with db.read() as conn:
            return set(conn.execute(select(m.OutboxMessage.msg_id)).scalars())
    finally:
        db.dispose()


def test_two_replicas_store_otlp_retries_exactly_once(pg_url: str) -> None:
    """Exporters (several threads) send every OTLP export to both replicas at once, as a
    retry after a lost answer would: each span's request is stored once, the collector's own
    numbering of them has no gap nor double, and the context-pressure alert counts each
    request once."""
    from tests.test_otlp_ingest import _body

    migrate.upgrade(pg_url)
    token = make_token(pg_url, "ingest")
    admin = make_token(pg_url, "admin")
    settings = Settings(database_url=pg_url, auto_migrate=False, notify_enabled=False)
    exports = [
        _body(*({"request_id": f"e{i}-r{k}", "prompt": 900_000} for k in range(20)))
        for i in range(12)
    ]
    with serve_in_thread(create_app(settings)) as a, serve_in_thread(create_app(settings)) as b:
        auth = {"Authorization": f"Bearer {admin}"}
        r = httpx.post(
            f"{a}/v1/verifications",
            headers=auth,
            json={"deployment_id": "glm-prod", "model_id": "glm-5.3", "passed": True,
                  "verified_safe_context": 1_000_000},
        )  # fmt: skip
        assert r.status_code == 201, r.text
        errors: list[str] = []

        def send(url: str, body: bytes) -> None:
            r = httpx.post(
                f"{url}/v1/traces",
                content=body,
                headers={"Authorization": f"Bearer {token}",
                         "Content-Type": "application/x-protobuf"},
                timeout=60,
            )  # fmt: skip
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text}")

        threads = [
            threading.Thread(target=send, args=(url, body)) for body in exports for url in (a, b)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        alerts = httpx.get(f"{a}/v1/alerts", headers=auth, params={"rule": "context_pressure"})
    db = Database(pg_url)
    try:
        with db.read() as conn:
            rows = conn.execute(
                select(m.Request.request_id, func.count()).group_by(m.Request.request_id)
            ).all()
            probe = conn.execute(select(m.Probe).where(m.Probe.probe_id.like("otlp.%"))).one()
            gaps = conn.execute(select(func.count()).select_from(m.SeqGap)).scalar()
    finally:
        db.dispose()
    assert len(rows) == 12 * 20 and all(n == 1 for _, n in rows)
    assert (probe.max_seq, probe.accepted, gaps) == (2 * 12 * 20, 2 * 12 * 20, 0)
    (alert,) = alerts.json()
    assert alert["occurrences"] == 12 * 20
