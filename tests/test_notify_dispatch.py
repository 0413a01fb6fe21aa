"""The outbox and the dispatcher against real receivers on 127.0.0.1 and real databases."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from typer.testing import CliRunner

from collector import migrate
from collector import models as m
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.notify.dispatcher import Dispatcher
from collector.notify.outbox import (
    add_endpoint,
    enable_endpoint,
    enqueue,
    list_endpoints,
    remove_endpoint,
)
from collector.settings import Settings
from collector.timefmt import now_micros
from kvwatch.cli import app
from tests.notify_helpers import Delivery, FakeClock, Receiver, alert_doc, incident_doc

ROOT = Path(__file__).resolve().parents[1]
US = 1_000_000


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    migrate.upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


def _settings(db: Database, **kw: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": db.url.render_as_string(hide_password=False),
        "notify_backoff_base_s": 1.0,
        "notify_backoff_max_s": 8.0,
        "notify_timeout_s": 5.0,
        "notify_lease_s": 30.0,
        "notify_poll_s": 0.05,
        "public_url": "http://kvwatch.test",
    }
    return Settings(**(values | kw))


def _add(db: Database, name: str, url: str, **kw: Any) -> str | None:
    with db.write() as conn:
        return add_endpoint(conn, name, url, now_us=int(time.time() * US), **kw)[1]


def _enqueue(
    db: Database, *docs: dict[str, Any], severity: str = "critical", at: float | None = None
) -> int:
    now_us = int((time.time() if at is None else at) * US)
    with db.write() as conn:
        return sum(enqueue(conn, d, severity=severity, now_us=now_us) for d in docs)


def _outbox(db: Database, endpoint: str) -> list[Any]:
    o, e = m.OutboxMessage, m.NotifyEndpoint
    with db.read() as conn:
        return list(
            conn.execute(
                select(o.id, o.msg_id, o.status, o.attempts, o.next_attempt_at, o.last_error)
                .join(e, e.id == o.endpoint_id)
                .where(e.name == endpoint)
                .order_by(o.id)
            ).all()
        )


def _attempts(db: Database, endpoint: str | None = None) -> list[Any]:
    a, e = m.DeliveryAttempt, m.NotifyEndpoint
    q = select(a.outbox_id, a.status_code, a.error, a.duration_ms).order_by(a.id)
    if endpoint is not None:
        q = q.join(e, e.id == a.endpoint_id).where(e.name == endpoint)
    with db.read() as conn:
        return list(conn.execute(q).all())


def _endpoint(db: Database, name: str) -> Any:
    with db.read() as conn:
        return conn.execute(select(m.NotifyEndpoint).where(m.NotifyEndpoint.name == name)).one()


def _assert_in_order_once(got: list[Delivery], expected_ids: list[str]) -> None:
    ids = [d.msg_id for d in got]
    assert ids == expected_ids  # every id, exactly once, in outbox order
    assert all(d.error is None for d in got), [d.error for d in got if d.error]


# ------------------------------------------------------------------------- delivery


def test_receiver_down_then_up_every_message_arrives_once_in_order_signed(db: Database) -> None:
    clock = FakeClock()
    receiver = Receiver(clock=clock)
    receiver.secrets["/a"] = _add(db, "a", receiver.url + "/a") or ""
    receiver.secrets["/b"] = _add(db, "b", receiver.url + "/b", format="alertmanager") or ""
    docs = []
    for step in range(3):  # three alerts, each firing then resolved, interleaved
        docs += [alert_doc(10 + step, "firing"), alert_doc(10 + step, "resolved")]
    docs.append(incident_doc(7))
    assert _enqueue(db, *docs) == 2 * len(docs)
    dispatcher = Dispatcher(db, _settings(db), clock=clock, rng=random.Random(1))
    try:
        failed = 0
        for _ in range(4):  # the receiver's port is closed: every head fails, nothing moves
            clock.advance(30)
            assert dispatcher.run_once() == 2  # one try per endpoint: the head only
            failed += 2
        assert receiver.deliveries == []
        assert [r.attempts for r in _outbox(db, "a")] == [4] + [0] * (len(docs) - 1)

        receiver.start()
        clock.advance(30)
        assert dispatcher.run_once() == 2 * len(docs)
    finally:
        dispatcher.shutdown()
        receiver.stop()

    for path, name in (("/a", "a"), ("/b", "b")):
        rows = _outbox(db, name)
        assert {r.status for r in rows} == {"delivered"}
        _assert_in_order_once(receiver.by_path(path), [r.msg_id for r in rows])
    # kvwatch format: the document as enqueued, plus its version; per alert, firing first
    got = [d.doc for d in receiver.by_path("/a")]
    assert [d | {"version": 1} for d in docs] == got
    for step in range(3):
        states = [
            g["alerts"][0]["state"]
            for g in got
            if g["alerts"] and g["alerts"][0]["id"] == 10 + step
        ]
        assert states == ["firing", "resolved"]
    # Alertmanager webhook v4 format on the other endpoint
    am = [d.doc for d in receiver.by_path("/b")]
    assert {a["version"] for a in am} == {"4"}
    assert [a["status"] for a in am] == ["firing", "resolved"] * 3 + ["firing"]
    assert am[-1]["alerts"][0]["labels"]["alertname"] == "KvwatchIncident"
    # every attempt recorded: the refused connections, then one 200 per message
    attempts = _attempts(db)
    assert len(attempts) == failed + 2 * len(docs)
    refused = [a for a in attempts if a.status_code is None]
    assert len(refused) == failed and all("Connect" in a.error for a in refused)
    assert all(a.status_code == 200 and a.error is None for a in attempts if a not in refused)


def test_backoff_doubles_with_equal_jitter_up_to_the_cap(db: Database) -> None:
    clock = FakeClock()
    receiver = Receiver(clock=clock).start()
    receiver.status["/x"] = 500
    receiver.secrets["/x"] = _add(db, "x", receiver.url + "/x") or ""
    _enqueue(db, alert_doc(1), at=clock())
    dispatcher = Dispatcher(db, _settings(db), clock=clock)
    try:
        delays = []
        for n in range(1, 7):
            now_us = int(clock() * US)
            assert dispatcher.run_once() == 1
            (row,) = _outbox(db, "x")
            assert row.attempts == n and row.status == "pending"
            assert row.last_error.startswith("HTTP 500")
            delay = (row.next_attempt_at - now_us) / US
            nominal = min(8.0, 1.0 * 2 ** (n - 1))
            assert nominal * 0.5 <= delay <= nominal, (n, delay)
            delays.append(delay)
            # not due a microsecond early, due exactly on time
            assert dispatcher.run_once(now=(row.next_attempt_at - 1) / US) == 0
            clock.t = row.next_attempt_at / US
        assert delays[-1] > delays[0]

        # 503 with Retry-After: 30 waits longer than the backoff would, up to its cap (8 s)
        receiver.status["/x"] = 503
        receiver.headers["/x"] = {"retry-after": "30"}
        now_us = int(clock() * US)
        assert dispatcher.run_once() == 1
        (row,) = _outbox(db, "x")
        assert (row.next_attempt_at - now_us) / US >= 8.0 - 1e-6

        receiver.status["/x"] = 200
        clock.t = row.next_attempt_at / US
        assert dispatcher.run_once() == 1
    finally:
        dispatcher.shutdown()
        receiver.stop()
    (row,) = _outbox(db, "x")
    assert row.status == "delivered" and row.last_error is None
    attempts = _attempts(db, "x")
    assert [a.status_code for a in attempts] == [500] * 6 + [503, 200]
    assert all(a.duration_ms >= 0 for a in attempts)
    assert all(a.error.startswith(f"HTTP {a.status_code}") for a in attempts[:-1])
    assert attempts[-1].error is None
    # the same id every time, a fresh signature every time, all valid
    got = receiver.by_path("/x")
    assert len({d.msg_id for d in got}) == 1 and len(got) == 8
    assert all(d.error is None for d in got)
    assert len({d.body for d in got}) == 1  # retries are byte-identical


def test_410_disables_the_endpoint_and_stops_sending_until_enabled(db: Database) -> None:
    clock = FakeClock()
    receiver = Receiver(clock=clock).start()
    receiver.status["/gone"] = 410
    receiver.secrets["/gone"] = _add(db, "gone", receiver.url + "/gone") or ""
    receiver.secrets["/ok"] = _add(db, "ok", receiver.url + "/ok") or ""
    assert _enqueue(db, alert_doc(1), alert_doc(2), at=clock()) == 4
    registry = CollectorRegistry()
    dispatcher = Dispatcher(db, _settings(db), clock=clock, registry=registry)
    try:
        assert dispatcher.run_once() == 3  # one 410, two delivered
        ep = _endpoint(db, "gone")
        assert ep.enabled is False and "410" in ep.disabled_reason
        rows = _outbox(db, "gone")
        assert [r.status for r in rows] == ["pending", "pending"]  # never dropped
        assert [a.status_code for a in _attempts(db, "gone")] == [410]

        clock.advance(3600)
        assert dispatcher.run_once() == 0
        assert len(receiver.by_path("/gone")) == 1
        assert _enqueue(db, alert_doc(3), at=clock()) == 1  # a disabled endpoint gets nothing new
        with db.read() as conn:
            info = {e.name: e for e in list_endpoints(conn, now_micros())}
        assert info["gone"].pending == 2 and not info["gone"].enabled
        assert "410" in (info["gone"].disabled_reason or "")

        receiver.status["/gone"] = 200
        with db.write() as conn:
            enable_endpoint(conn, "gone", now_us=int(clock() * US))
        assert dispatcher.run_once() == 2 + 1  # gone's backlog, ok's third message
    finally:
        dispatcher.shutdown()
        receiver.stop()
    got = receiver.by_path("/gone")
    # the message refused with 410 goes out again under the same id, then the next
    assert [d.msg_id for d in got] == [rows[0].msg_id, rows[0].msg_id, rows[1].msg_id]
    assert all(d.error is None for d in got)
    assert _endpoint(db, "gone").disabled_reason is None
    count = registry.get_sample_value
    assert count("kvwatch_notify_deliveries_total", {"endpoint": "gone", "result": "gone"}) == 1
    assert (
        count("kvwatch_notify_deliveries_total", {"endpoint": "gone", "result": "delivered"}) == 2
    )
    assert count("kvwatch_notify_deliveries_total", {"endpoint": "ok", "result": "delivered"}) == 3


def test_a_document_that_cannot_be_rendered_is_retried_not_dropped(db: Database) -> None:
    _add(db, "am", "http://127.0.0.1:9", kind="alertmanager")
    broken = {k: v for k, v in alert_doc(1).items() if k != "created_at"}
    clock = FakeClock()
    _enqueue(db, broken, alert_doc(2), at=clock())
    dispatcher = Dispatcher(db, _settings(db), clock=clock)
    try:
        assert dispatcher.run_once() == 1
    finally:
        dispatcher.shutdown()
    head, second = _outbox(db, "am")
    assert head.status == "pending" and head.attempts == 1
    assert head.last_error.startswith("cannot render the notification: KeyError")
    assert head.next_attempt_at > clock() * US
    assert second.attempts == 0  # still behind it: order holds even for a bad message
    (attempt,) = _attempts(db, "am")
    assert attempt.status_code is None and "cannot render" in attempt.error


def test_two_dispatchers_never_send_to_one_endpoint_at_once(db: Database, db_url: str) -> None:
    """Two replicas (separate engines on one database) poll flat out while messages keep
    arriving, so their claims on the same endpoints race all along. The receiver counts
    requests in flight per endpoint: never two at once; every id once, in order."""
    receiver = Receiver(delay_s=0.01).start()
    names = ["e1", "e2", "e3"]
    for n in names:
        receiver.secrets[f"/{n}"] = _add(db, n, f"{receiver.url}/{n}") or ""
    replicas = [Database(db_url), Database(db_url)]
    registries = [CollectorRegistry(), CollectorRegistry()]
    dispatchers = [
        Dispatcher(r, _settings(r), owner=f"replica-{i}", registry=g, max_workers=3)
        for i, (r, g) in enumerate(zip(replicas, registries, strict=True))
    ]
    done = threading.Event()
    errors: list[BaseException] = []

    def work(d: Dispatcher) -> None:
        try:
            while not done.is_set():
                d.run_once()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d,)) for d in dispatchers]
    for t in threads:
        t.start()
    rounds = 10
    try:
        for i in range(rounds):
            _enqueue(db, alert_doc(i))
            time.sleep(0.03)
        assert receiver.wait_for(lambda got: len(got) >= rounds * len(names), timeout=60)
    finally:
        done.set()
        for t in threads:
            t.join(30)
        for d in dispatchers:
            d.shutdown()
        for r in replicas:
            r.dispose()
        receiver.stop()
    assert errors == []
    for n in names:
        assert receiver.max_inflight[f"/{n}"] == 1
        _assert_in_order_once(receiver.by_path(f"/{n}"), [r.msg_id for r in _outbox(db, n)])
    sent = [
        sum(
            g.get_sample_value(
                "kvwatch_notify_deliveries_total", {"endpoint": n, "result": "delivered"}
            )
            or 0
            for n in names
        )
        for g in registries
    ]
    assert sum(sent) == rounds * len(names)
    with db.read() as conn:
        leases = conn.execute(select(m.NotifyEndpoint.lease_owner)).scalars().all()
    assert leases == [None, None, None]  # every lease released once the work was done


_CHILD = """
import sys, time
from collector.db import Database
from collector.notify.dispatcher import Dispatcher
from collector.settings import Settings
url = sys.argv[1]
s = Settings(database_url=url, notify_poll_s=0.05, notify_lease_s=30, notify_timeout_s=25)
Dispatcher(Database(url), s, owner="doomed").start()
print("started", flush=True)
time.sleep(600)
"""


def test_a_dispatcher_killed_mid_delivery_loses_nothing(db: Database, db_url: str) -> None:
    """SIGKILL while the receiver holds message 3's request open: 1 and 2 are recorded as
    delivered, 3 is still pending under the dead process's lease. A new dispatcher, once
    that lease runs out, sends 3 again under the same webhook-id with the same body (the
    receiver already saw it once: Standard Webhooks' at-least-once; receivers deduplicate
    on the id), then the rest. Nothing is lost, nothing is out of order."""
    release = threading.Event()
    held: list[str] = []

    def hold(path: str, msg_id: str) -> threading.Event | None:
        if not held and len(receiver.by_path(path)) == 3:
            held.append(msg_id)
            return release
        return None

    receiver = Receiver(hold=hold).start()
    receiver.secrets["/k"] = _add(db, "k", receiver.url + "/k") or ""
    _enqueue(db, *[alert_doc(i) for i in range(6)])
    expected = [r.msg_id for r in _outbox(db, "k")]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, db.url.render_as_string(hide_password=False)],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    successor: Dispatcher | None = None
    try:
        arrived = receiver.wait_for(lambda got: len(got) >= 3, timeout=60)
        if not arrived:
            child.kill()
            pytest.fail(f"nothing arrived; the dispatcher said: {child.communicate()[1]}")
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        release.set()

        rows = _outbox(db, "k")
        assert [r.status for r in rows] == ["delivered"] * 2 + ["pending"] * 4
        ep = _endpoint(db, "k")
        assert ep.lease_owner == "doomed" and ep.lease_until > time.time() * US

        # A replica started now must wait out the dead one's lease: none of its business
        # until then. Its clock is moved past the lease instead of sleeping 30 s.
        waiting = Dispatcher(db, _settings(db))
        assert waiting.run_once() == 0
        waiting.shutdown()
        successor = Dispatcher(db, _settings(db), clock=lambda: time.time() + 31)
        assert successor.force_flush(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        release.set()
        if successor is not None:
            successor.shutdown()
        receiver.stop()
    got = receiver.by_path("/k")
    assert {r.status for r in _outbox(db, "k")} == {"delivered"}
    first_seen = list(dict.fromkeys(d.msg_id for d in got))
    assert first_seen == expected  # all of them, in order
    assert all(d.error is None for d in got)
    bodies: dict[str, set[bytes]] = {}
    for d in got:
        bodies.setdefault(d.msg_id, set()).add(d.body)
    assert all(len(b) == 1 for b in bodies.values())  # a re-send is the same message
    repeats = [i for i in bodies if [d.msg_id for d in got].count(i) > 1]
    assert repeats in ([], held)  # only the one cut off can have arrived twice


# ----------------------------------------------------------------- outbox, endpoints


def test_enqueue_respects_min_severity_and_enabled(db: Database) -> None:
    _add(db, "all", "http://127.0.0.1:9/all")
    _add(db, "warn", "http://127.0.0.1:9/warn", min_severity="warning")
    _add(db, "crit", "https://127.0.0.1:9/crit", min_severity="critical")
    assert _enqueue(db, alert_doc(1), severity="info") == 1
    assert _enqueue(db, alert_doc(1), severity="warning") == 2
    assert _enqueue(db, alert_doc(1), severity="critical") == 3
    rows = _outbox(db, "all")
    assert all(r.status == "pending" and r.attempts == 0 for r in rows)
    assert all(r.msg_id.startswith("msg_") and "." not in r.msg_id for r in rows)
    with pytest.raises(InvalidInput, match="severity"):
        _enqueue(db, alert_doc(1), severity="fatal")
    with pytest.raises(InvalidInput, match="type"):
        _enqueue(db, {**alert_doc(1), "type": "alert.exploded"})


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://example.com/hook", "scheme must be http or https, not 'ftp'"),
        ("file:///etc/passwd", "scheme must be http or https, not 'file'"),
        ("gopher://example.com:70/", "scheme must be http or https"),
        ("example.com/hook", "scheme must be http or https"),
        ("http:///hook", "must name a host"),
        ("https://", "must name a host"),
        ("http://example.com:99999/", "not a valid URL"),
    ],
)
def test_add_endpoint_refuses_urls_other_than_http_s_with_a_host(
    db: Database, url: str, reason: str
) -> None:
    with pytest.raises(InvalidInput, match="url") as info:
        _add(db, "bad", url)
    assert reason in info.value.message
    assert info.value.details == {"field": "url"}
    with db.read() as conn:
        assert list_endpoints(conn, now_micros()) == []


def test_add_endpoint_validates_its_other_fields(db: Database) -> None:
    for kw, field in [
        ({"kind": "smtp"}, "kind"),
        ({"format": "slack"}, "format"),
        ({"min_severity": "fatal"}, "min_severity"),
        ({"kind": "alertmanager", "format": "kvwatch"}, "format"),
        ({"kind": "alertmanager", "secret": "whsec_" + "A" * 44}, "secret"),
        ({"secret": "whsec_c2hvcnQ="}, "secret"),
        ({"secret": "whsec_not base64!"}, "secret"),
    ]:
        with pytest.raises(InvalidInput) as info:
            _add(db, "x", "https://hooks.example.com/x", **kw)
        assert info.value.details == {"field": field}, kw
    with pytest.raises(InvalidInput, match="name"):
        _add(db, "no spaces", "https://hooks.example.com/x")

    secret = _add(db, "w", "https://hooks.example.com/w")
    assert secret is not None and secret.startswith("whsec_")
    assert _add(db, "am2", "http://127.0.0.1:9093", kind="alertmanager") is None
    assert _endpoint(db, "am2").format == "alertmanager"
    given = "whsec_" + "B" * 44
    assert _add(db, "mine", "https://hooks.example.com/m", secret=given) == given
    with pytest.raises(Conflict):
        _add(db, "w", "https://hooks.example.com/other")


def test_removing_an_endpoint_takes_its_messages_and_attempts_with_it(db: Database) -> None:
    _add(db, "doomed", "http://127.0.0.1:9/closed-port")
    _add(db, "kept", "http://127.0.0.1:9/closed-port")
    _enqueue(db, alert_doc(1), alert_doc(2))
    dispatcher = Dispatcher(db, _settings(db))
    try:
        assert dispatcher.run_once() == 2  # both fail: nothing listens on port 9
    finally:
        dispatcher.shutdown()
    assert len(_attempts(db, "doomed")) == 1
    with db.write() as conn:
        assert remove_endpoint(conn, "doomed", now_us=int(time.time() * US)) == 2
    with db.read() as conn:
        endpoint_ids = set(conn.execute(select(m.OutboxMessage.endpoint_id)).scalars())
        attempts = conn.execute(select(m.DeliveryAttempt.endpoint_id)).scalars().all()
    kept = _endpoint(db, "kept").id
    assert endpoint_ids == {kept} and len(_outbox(db, "kept")) == 2
    assert [a for a in attempts if a != kept] == []
    with db.write() as conn, pytest.raises(NotFound):
        remove_endpoint(conn, "doomed", now_us=0)


def test_cli_add_list_enable_remove(db: Database) -> None:
    url = db.url.render_as_string(hide_password=False)
    runner = CliRunner()
    add = runner.invoke(
        app,
        [
            *("webhooks", "add", "pager", "https://hooks.example.com/k"),
            *("--min-severity", "warning", "--database-url", url),
        ],
    )
    assert add.exit_code == 0, add.output
    secret = add.stdout.strip().splitlines()[-1]
    assert secret.startswith("whsec_") and add.stdout.strip() == secret
    am = runner.invoke(
        app,
        [
            *("webhooks", "add", "am", "http://127.0.0.1:9093"),
            *("--kind", "alertmanager", "--database-url", url),
        ],
    )
    assert am.exit_code == 0 and am.stdout == ""
    bad = runner.invoke(
        app, ["webhooks", "add", "evil", "file:///etc/passwd", "--database-url", url]
    )
    assert bad.exit_code == 2 and "url" in bad.stderr
    listed = runner.invoke(app, ["webhooks", "list", "--database-url", url])
    assert listed.exit_code == 0
    assert "pager" in listed.stdout and "am" in listed.stdout
    assert secret not in listed.output
    enabled = runner.invoke(app, ["webhooks", "enable", "pager", "--database-url", url])
    assert enabled.exit_code == 0
    removed = runner.invoke(app, ["webhooks", "remove", "pager", "--database-url", url])
    assert removed.exit_code == 0
    missing = runner.invoke(app, ["webhooks", "remove", "pager", "--database-url", url])
    assert missing.exit_code == 2 and "no endpoint" in missing.stderr
    with db.read() as conn:
        assert [e.name for e in list_endpoints(conn, now_micros())] == ["am"]
