"""Operators and receivers: acknowledging, silencing, closing incidents, repeats and reminders,
and the signed webhooks an alert sends, through the real collector."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import select

from collector import audit
from collector import models as m
from collector.alerting.service import AlertingService
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.notify.signing import verify
from collector.timefmt import to_micros
from policies import load_ruleset
from tests import factories as f
from tests.conftest import Collector


class Receiver:
    """A webhook receiver on 127.0.0.1 that checks every signature."""

    def __init__(self, secret: str | None = None):
        self.secret = secret
        self.got: list[dict[str, Any]] = []
        self.bad: list[str] = []
        self.cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if outer.secret is not None:
                    try:
                        verify(outer.secret, dict(self.headers.items()), body)
                    except Exception as exc:
                        outer.bad.append(str(exc))
                with outer.cond:
                    outer.got.append({"id": self.headers.get("webhook-id"), **json.loads(body)})
                    outer.cond.notify_all()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, pred: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.got), timeout), self.got
            return list(self.got)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Env:
    def __init__(self, c: Collector):
        self.c = c
        self.admin = c.client(c.admin)
        self.ingest = c.client(c.ingest)
        self.db = Database(c.db_url)
        self.service = AlertingService(self.db, load_ruleset())
        self.seq = 0

    def send(self, *events: Any) -> None:
        r = self.ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text

    def stale(self, **kw: Any) -> None:
        """A stale read that happens now (``resolve_after`` counts from an occurrence's own
        time, so the factories' fixed past ``ts`` would be an old one, replayed late)."""
        self.seq += 1
        self.send(f.stale_read(self.seq, probe="probe-ops", **{"ts": datetime.now(UTC)} | kw))

    def alert(self, rule: str = "stale_page_read") -> dict[str, Any]:
        (a,) = self.admin.get("/v1/alerts", params={"rule": rule}).json()
        return dict(a)


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    e = Env(collector)
    yield e
    e.admin.close()
    e.ingest.close()
    e.db.dispose()


def test_firing_alert_and_incident_arrive_signed_at_a_webhook(env: Env) -> None:
    with env.db.write() as conn:
        add_endpoint(conn, "ops", "http://127.0.0.1:9/unused", now_us=to_micros(datetime.now(UTC)))
    # the real receiver: registered after a dead one, to show each endpoint gets its own copy
    rx = Receiver()
    with env.db.write() as conn:
        _, rx.secret = add_endpoint(conn, "sec", rx.url, now_us=to_micros(datetime.now(UTC)))
    try:
        env.stale()
        got = rx.wait(lambda g: {x["type"] for x in g} >= {"alert.firing", "incident.opened"})
        assert rx.bad == []
        firing = next(x for x in got if x["type"] == "alert.firing")
        assert firing["alerts"][0]["rule"] == "stale_page_read"
        assert firing["alerts"][0]["labels"]["cross_tenant"] == "true"
        assert firing["group_labels"] == {
            "alertname": "stale_page_read",
            "deployment_id": "glm-prod",
        }
        opened = next(x for x in got if x["type"] == "incident.opened")
        assert opened["incident"]["deadline_at"] > opened["incident"]["awareness_at"]
        assert len({x["id"] for x in got}) == len(got)  # one id per notification
    finally:
        rx.close()


def test_ack_stops_repeats_and_is_audited(env: Env) -> None:
    env.stale()
    a = env.alert()
    later = datetime.now(UTC) + timedelta(hours=5)  # past the 4h repeat interval
    with env.db.read() as conn:
        before = conn.execute(select(m.OutboxMessage.event_type)).scalars().all()
    rx_endpoint_needed = before == []  # no endpoint: outbox rows only exist with one
    with env.db.write() as conn:
        add_endpoint(conn, "ops", "http://127.0.0.1:9/x", now_us=to_micros(datetime.now(UTC)))
    result = env.service.tick(later)
    assert result is not None and result.notifications >= 1  # the repeat
    r = env.admin.post(f"/v1/alerts/{a['id']}/ack", json={"comment": "on it"})
    assert r.status_code == 200, r.text
    assert r.json()["acked"] is True and r.json()["ack_comment"] == "on it"
    again = env.service.tick(later + timedelta(hours=5))
    with env.db.read() as conn:
        docs = [json.loads(d) for d in conn.execute(select(m.OutboxMessage.data)).scalars()]
        assert audit.verify(conn).ok
        actions = conn.execute(select(m.AuditEntry.action)).scalars().all()
    assert again is not None
    # (the probe went silent meanwhile: telemetry_gap alerts come and repeat too)
    repeats = [
        d
        for d in docs
        if d["type"] == "alert.repeat" and d["alerts"][0]["rule"] == "stale_page_read"
    ]
    assert len(repeats) == 1, docs
    assert "alert.ack" in actions and "incident.opened" in actions
    assert rx_endpoint_needed
    history = env.admin.get(f"/v1/alerts/{a['id']}").json()["history"]
    assert history[-1]["actor"] and history[-1]["detail"]["ack"] is True
    # acknowledging twice changes nothing: the first acknowledgement stands, audited once
    twice = env.admin.post(f"/v1/alerts/{a['id']}/ack", json={"comment": "me too"})
    assert twice.status_code == 200 and twice.json()["ack_comment"] == "on it"
    with env.db.read() as conn:
        acks = conn.execute(select(m.AuditEntry.action)).scalars().all().count("alert.ack")
    assert acks == 1


def test_late_events_fire_and_resolve_as_their_own_time_says(env: Env) -> None:
    """A stale read replayed from a spool two days after it happened fires its alert (and
    opens its incident), and the next timer pass resolves it: no occurrence for 24h, counted
    from when it happened. A fresh one of the same alert keeps it firing."""
    now = datetime.now(UTC)
    env.stale(ts=now - timedelta(days=2))
    old = env.alert()
    assert old["state"] == "firing" and old["last_seen_at"].startswith(
        (now - timedelta(days=2)).date().isoformat()
    )
    (incident,) = env.admin.get("/v1/incidents").json()
    assert incident["state"] == "open"  # awareness is when kvwatch learned, not resolved
    env.service.tick(now + timedelta(seconds=1))
    assert env.alert()["state"] == "resolved"

    env.stale(ts=now)
    env.stale(ts=now - timedelta(days=3))  # an older one after it does not move it back
    env.service.tick(now + timedelta(hours=23))
    fresh = env.alert()
    assert fresh["state"] == "firing" and fresh["id"] == old["id"]
    env.service.tick(now + timedelta(hours=24, seconds=1))
    assert env.alert()["state"] == "resolved"


def test_silence_holds_back_notifications_but_not_the_alert(env: Env) -> None:
    with env.db.write() as conn:
        add_endpoint(conn, "ops", "http://127.0.0.1:9/x", now_us=to_micros(datetime.now(UTC)))
    r = env.admin.post(
        "/v1/silences",
        json={
            "matchers": [{"name": "alertname", "value": "stale_page_read"}],
            "duration": "2h",
            "comment": "maintenance",
        },
    )
    assert r.status_code == 201, r.text
    env.stale(previous_tenant="globex", reader_tenant="globex")  # same tenant: no incident
    assert env.alert()["state"] == "firing"
    assert env.alert()["silenced"] is True
    with env.db.read() as conn:
        assert conn.execute(select(m.OutboxMessage.event_type)).scalars().all() == []
    sid = r.json()["id"]
    assert env.admin.delete(f"/v1/silences/{sid}").json()["active"] is False
    env.stale(previous_tenant="initech", reader_tenant="initech")
    with env.db.read() as conn:
        assert conn.execute(select(m.OutboxMessage.event_type)).scalars().all() == ["alert.firing"]


def test_incident_reminders_then_a_person_closes_it(env: Env) -> None:
    env.stale()
    (inc,) = env.admin.get("/v1/incidents").json()
    deadline = datetime.fromisoformat(inc["deadline_at"])
    with env.db.write() as conn:
        add_endpoint(conn, "ops", "http://127.0.0.1:9/x", now_us=to_micros(datetime.now(UTC)))
    env.service.tick(deadline - timedelta(hours=30))  # the 48h reminder is due
    env.service.tick(deadline - timedelta(hours=30))  # and not twice
    env.service.tick(deadline - timedelta(minutes=30))  # 24h, 6h, 1h at once: one reminder
    detail = env.admin.get(f"/v1/incidents/{inc['id']}").json()
    assert detail["reminders_sent"] == [172800, 86400, 21600, 3600]
    with env.db.read() as conn:
        sent = conn.execute(select(m.OutboxMessage.data)).scalars().all()
    reminders = [json.loads(d) for d in sent if '"incident.reminder"' in d]
    assert [x["incident"]["remind_before_s"] for x in reminders] == [172800, 3600]

    bad = env.admin.post(f"/v1/incidents/{inc['id']}/close", json={"reason": ""})
    assert bad.status_code == 422
    ok = env.admin.post(f"/v1/incidents/{inc['id']}/close", json={"reason": "false positive: test"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["state"] == "closed" and ok.json()["close_reason"] == "false positive: test"
    # closing twice, like acknowledging twice, changes nothing: the first close stands
    twice = env.admin.post(f"/v1/incidents/{inc['id']}/close", json={"reason": "again"})
    assert twice.status_code == 200, twice.text
    assert twice.json()["close_reason"] == "false positive: test"
    assert twice.json()["closed_at"] == ok.json()["closed_at"]
    # new cross-tenant reads after closing open a new incident
    env.stale(reader_tenant="umbrella")
    assert [i["state"] for i in env.admin.get("/v1/incidents").json()] == ["open", "closed"]


def test_tokens_and_bad_input(env: Env) -> None:
    env.stale()
    a = env.alert()
    tenant = env.c.client(env.c.token("read", tenant="acme"))
    reader = env.c.client(env.c.token("read"))
    try:
        assert tenant.get("/v1/alerts").status_code == 403
        # incidents: only those that concern the tenant (env.stale's reader is globex, the
        # exposed acme), its own side of each; the assessment stays the operators'
        (mine,) = tenant.get("/v1/incidents").json()
        assert mine["concerns"] == "exposed"
        assert tenant.get(f"/v1/incidents/{mine['id']}/assessment").status_code == 403
        assert reader.get("/v1/alerts").status_code == 200
        assert reader.post(f"/v1/alerts/{a['id']}/ack").status_code == 403
        assert env.ingest.post(f"/v1/alerts/{a['id']}/ack").status_code == 403
        assert env.c.client(None).get("/v1/alerts").status_code == 401
    finally:
        tenant.close()
        reader.close()
    cases = [
        ("post", "/v1/alerts/999999/ack", {}, 404),
        ("post", "/v1/silences", {"matchers": [], "duration": "1h", "comment": "x"}, 422),
        ("post", "/v1/silences", {"matchers": [{"name": "a", "value": "("}], "comment": "x"}, 422),
        (
            "post",
            "/v1/silences",
            {
                "matchers": [{"name": "a", "value": "(", "regex": True}],
                "duration": "1h",
                "comment": "x",
            },
            422,
        ),
        (
            "post",
            "/v1/silences",
            {"matchers": [{"name": "a", "value": "b"}], "duration": "soon", "comment": "x"},
            422,
        ),
        (
            "post",
            "/v1/silences",
            {"matchers": [{"name": "9a", "value": "b"}], "duration": "1h", "comment": "x"},
            422,
        ),
        ("delete", "/v1/silences/424242", None, 404),
        ("post", "/v1/incidents/424242/close", {"reason": "x"}, 404),
        ("post", "/v1/verifications", {"deployment_id": "d", "model_id": "m"}, 422),
        (
            "post",
            "/v1/verifications",
            {"deployment_id": "d", "model_id": "m", "passed": True, "verified_safe_context": -1},
            422,
        ),
        ("get", "/v1/alerts?state=burning", None, 422),
    ]
    for method, path, body, want in cases:
        kw = {"json": body} if body is not None else {}
        r = env.admin.request(method.upper(), path, **kw)
        assert r.status_code == want, (path, body, r.status_code, r.text)
        assert "error" in r.json() and r.json()["error"]["message"]
    with env.db.read() as conn:
        assert conn.execute(select(m.Silence.id)).scalars().all() == []
        assert conn.execute(select(m.Verification.id)).scalars().all() == []


def test_metrics_show_firing_alerts_by_rule_and_severity(env: Env) -> None:
    env.stale()
    text = env.c.client(None).get("/metrics").text
    assert 'kvwatch_alerts_firing{rule="stale_page_read",severity="critical"} 1.0' in text
    assert "kvwatch_incidents_open 1.0" in text


def test_alertmanager_endpoints_get_firing_alerts_again_every_minute(env: Env) -> None:
    """Alertmanager drops an alert at its endsAt unless re-sent: kvwatch re-sends firing
    alerts to Alertmanager endpoints (only) long before."""
    now = datetime.now(UTC)
    with env.db.write() as conn:
        add_endpoint(conn, "hook", "http://127.0.0.1:9/x", now_us=to_micros(now))
        add_endpoint(conn, "am", "http://127.0.0.1:9", kind="alertmanager", now_us=to_micros(now))
    env.stale()
    env.service.tick(now + timedelta(seconds=61))
    env.service.tick(now + timedelta(seconds=62))  # not yet again
    env.service.tick(now + timedelta(seconds=125))
    with env.db.read() as conn:
        rows = conn.execute(
            select(m.NotifyEndpoint.name, m.OutboxMessage.event_type, m.OutboxMessage.data)
            .join(m.NotifyEndpoint, m.NotifyEndpoint.id == m.OutboxMessage.endpoint_id)
            .order_by(m.OutboxMessage.id)
        ).all()
    resent = [json.loads(d) for name, t, d in rows if name == "am" and t == "alert.repeat"]
    assert len(resent) == 2
    assert {a["rule"] for a in resent[0]["alerts"]} >= {"stale_page_read"}
    assert all(a["state"] == "firing" for a in resent[0]["alerts"])
    assert [t for name, t, _ in rows if name == "hook" and t == "alert.repeat"] == []


def test_verification_evidence_is_withheld_from_tenant_tokens_and_actors_are_named(
    collector: Collector,
) -> None:
    with collector.client(collector.admin) as h:
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": "glm-5.3",
                "passed": True,
                "verified_safe_context": 600_000,
                "evidence": {"tenants": ["acme", "globex"], "leak_pairs": []},
            },
        )
        assert r.status_code == 201, r.text
        (listed,) = h.get("/v1/verifications").json()
        assert "evidence" not in listed  # a list carries summaries
        one = h.get(listed["links"]["self"]).json()
        assert one["evidence"]["tenants"] == ["acme", "globex"]
        bad = h.get("/v1/alerts", params={"acked": "false"})
        assert bad.status_code == 422 and "acked" in bad.text
    acme = collector.token("read", tenant="acme")
    with collector.client(acme) as h:
        (v,) = h.get("/v1/verifications").json()
        assert "evidence" not in v and v["verified_safe_context"] == 600_000
        assert h.get(v["links"]["self"]).status_code == 403
    # A named token acts under its name (audit log, acknowledgements), not its prefix.
    named = collector.token("admin", name="oncall-alice")
    with collector.client(collector.ingest) as h:
        assert h.post("/v1/events", json=[f.as_json(f.stale_read(1))]).status_code == 200
    with collector.client(named) as h:
        (alert,) = h.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
        acked = h.post(f"/v1/alerts/{alert['id']}/ack", json={}).json()
    assert acked["acked_by"] == "oncall-alice"


def test_open_incidents_are_re_sent_to_alertmanager_only(env: Env) -> None:
    """Alertmanager forgets an alert after its horizon: each open incident goes to it again
    with the firing alerts, as the incident's own alert; webhooks get no such repeat."""
    now_us = to_micros(datetime.now(UTC))
    with env.db.write() as conn:
        am, _ = add_endpoint(conn, "am", "http://127.0.0.1:9", kind="alertmanager", now_us=now_us)
        hook, _ = add_endpoint(conn, "hook", "http://127.0.0.1:9/h", now_us=now_us)
    env.stale()
    (incident,) = env.admin.get("/v1/incidents").json()
    env.service.tick(datetime.now(UTC))  # a fresh service: its first pass re-sends
    with env.db.read() as conn:
        repeats = conn.execute(
            select(m.OutboxMessage.endpoint_id, m.OutboxMessage.data).where(
                m.OutboxMessage.event_type == "incident.repeat"
            )
        ).all()
    assert [e for e, _ in repeats] == [am]
    doc = json.loads(repeats[0][1])
    assert doc["incident"]["id"] == incident["id"] and hook != am
