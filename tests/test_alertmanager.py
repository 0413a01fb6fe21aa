"""The Alertmanager shapes, against a real Alertmanager (Debian's ``prometheus-alertmanager``,
which ``.ci/run`` installs) started on a free loopback port."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector import migrate
from collector.db import Database
from collector.notify.dispatcher import Dispatcher
from collector.notify.outbox import add_endpoint, enqueue
from collector.notify.payloads import AM_ZERO_TIME, am_fingerprint, render
from collector.settings import Settings
from tests import factories as f
from tests.conftest import Collector
from tests.notify_helpers import Receiver, alert_doc, incident_doc, iso, running_alertmanager

pytestmark = pytest.mark.slow

US = 1_000_000
V4_KEYS = {
    "version",
    "groupKey",
    "truncatedAlerts",
    "status",
    "receiver",
    "groupLabels",
    "commonLabels",
    "commonAnnotations",
    "externalURL",
    "alerts",
}
V4_ALERT_KEYS = {
    "status",
    "labels",
    "annotations",
    "startsAt",
    "endsAt",
    "generatorURL",
    "fingerprint",
}


@dataclass
class Alertmanager:
    url: str
    hook: Receiver  # where its webhook receiver sends alerts named "kv_shape"

    def alerts(self, **params: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v2/alerts", params=params, timeout=10)
        r.raise_for_status()
        return list(r.json())


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    """A real Alertmanager on 127.0.0.1, clustering off. Alerts go to a null receiver, except
    alertname="kv_shape", which it sends on as its own webhook (v4) to a local receiver."""
    hook = Receiver().start()
    config = f"""
route:
  receiver: "null"
  routes:
    - receiver: hook
      matchers: ['alertname="kv_shape"']
      group_by: [alertname, deployment_id]
      group_wait: 100ms
receivers:
  - name: "null"
  - name: hook
    webhook_configs:
      - url: {hook.url}/am
"""
    try:
        with running_alertmanager(tmp_path, config) as url:
            yield Alertmanager(url, hook)
    finally:
        hook.stop()


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    migrate.upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


def _settings(db: Database) -> Settings:
    return Settings(
        database_url=db.url.render_as_string(hide_password=False),
        notify_timeout_s=5,
        public_url="http://kvwatch.test",
    )


def _send(db: Database, *docs: dict[str, Any]) -> None:
    with db.write() as conn:
        for d in docs:
            enqueue(conn, d, severity="critical", now_us=int(time.time() * US))
    dispatcher = Dispatcher(db, _settings(db))
    try:
        assert dispatcher.run_once() == len(docs)
    finally:
        dispatcher.shutdown()


def _find(alerts: list[dict[str, Any]], **labels: str) -> list[dict[str, Any]]:
    return [a for a in alerts if labels.items() <= a["labels"].items()]


def test_alerts_pushed_to_alertmanager_fire_then_resolve(
    db: Database, alertmanager: Alertmanager
) -> None:
    with db.write() as conn:
        add_endpoint(conn, "am", alertmanager.url + "/", kind="alertmanager", now_us=0)
    firing = alert_doc(1, alertname="kv_pressure")
    # an incident notice carries its linked alerts, as the collector sends it
    stale = alert_doc(2)["alerts"][0]
    stale["labels"] |= {"reader_tenant": "globex", "previous_tenant": "acme"}
    _send(db, firing, incident_doc(9, alerts=[stale]))

    active = alertmanager.alerts(active="true")
    (alert,) = _find(active, alertname="kv_pressure")
    labels = firing["alerts"][0]["labels"]
    assert alert["labels"] == labels
    assert alert["status"]["state"] == "active"
    assert alert["annotations"] == firing["alerts"][0]["annotations"]
    assert alert["generatorURL"] == "http://kvwatch.test/v1/alerts/1"
    # our fingerprint function agrees with Alertmanager's
    assert alert["fingerprint"] == am_fingerprint(labels)
    # kept active for the horizon (an hour) past the notification, not resolved at once
    ends = alert["endsAt"].replace("Z", "+00:00")
    assert datetime.fromisoformat(ends).timestamp() > time.time() + 3000
    (inc,) = _find(active, alertname="KvwatchIncident")
    assert inc["labels"] == {
        "alertname": "KvwatchIncident",
        "deployment_id": "d1",
        "severity": "critical",
        "incident_id": "9",
    }
    assert inc["annotations"]["summary"] == "cross-tenant KV page read"
    assert inc["annotations"]["affected_tenants"] == "2"
    assert inc["annotations"]["deadline_at"]
    assert inc["fingerprint"] == am_fingerprint(inc["labels"])
    # the incident notice is the incident, not its triggering alert again
    assert _find(active, alertname="stale_page_read") == []

    _send(
        db,
        alert_doc(1, "resolved", alertname="kv_pressure"),
        incident_doc(9, "closed", alerts=[stale]),
    )
    active = alertmanager.alerts(active="true")
    assert _find(active, alertname="kv_pressure") == []
    assert _find(active, alertname="KvwatchIncident") == []


def _until(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            assert got, f"timed out waiting for {what}"
            return got
        time.sleep(0.2)


def test_an_incident_reaches_alertmanager_and_resolves_when_closed(
    collector: Collector, alertmanager: Alertmanager
) -> None:
    """End to end through the running collector: a cross-tenant stale read opens an
    incident, its dispatcher pushes KvwatchIncident to the real Alertmanager, and closing the
    incident through the API resolves it there."""
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            add_endpoint(conn, "am", alertmanager.url + "/", kind="alertmanager", now_us=0)
    finally:
        db.dispose()
    events = [
        f.config(1),
        f.config(2, role="decode", node="decode-0", pool_tokens=2_000_000),
        f.admitted(4, "r-exposed", tenant="acme", prompt=5_000),
        f.finished(5, "r-exposed", tenant="acme"),
        f.rejected(9, "r-victim", tenant="globex"),
        f.stale_read(10),
    ]
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text
    with collector.client(collector.admin) as admin:
        (incident,) = admin.get("/v1/incidents").json()
        (alert,) = _until(
            "KvwatchIncident in Alertmanager",
            lambda: _find(alertmanager.alerts(active="true"), alertname="KvwatchIncident"),
        )
        assert alert["labels"]["incident_id"] == str(incident["id"])
        assert alert["annotations"]["deadline_at"] == incident["deadline_at"]
        assert alert["annotations"]["affected_tenants"] == "2"
        r = admin.post(f"/v1/incidents/{incident['id']}/close", json={"reason": "contained"})
        assert r.status_code == 200, r.text
    _until(
        "KvwatchIncident resolved in Alertmanager",
        lambda: not _find(alertmanager.alerts(active="true"), alertname="KvwatchIncident"),
    )


def test_our_webhook_v4_body_has_alertmanagers_own_shape(
    db: Database, alertmanager: Alertmanager
) -> None:
    """Alertmanager forwards an alert we pushed as its own webhook (v4): our rendering of
    the same document has the same keys, the same labels and fingerprint."""
    with db.write() as conn:
        add_endpoint(conn, "am", alertmanager.url, kind="alertmanager", now_us=0)
    doc = alert_doc(5, alertname="kv_shape")
    _send(db, doc)
    assert alertmanager.hook.wait_for(lambda got: len(got) >= 1, timeout=30)
    theirs = alertmanager.hook.by_path("/am")[0].doc
    ours = json.loads(
        render("webhook", "alertmanager", doc, receiver_name="hook", external_url=alertmanager.url)
    )
    assert set(theirs) == set(ours) == V4_KEYS
    assert set(theirs["alerts"][0]) == set(ours["alerts"][0]) == V4_ALERT_KEYS
    assert theirs["version"] == ours["version"] == "4"
    for key in ("status", "receiver", "groupLabels", "commonLabels", "commonAnnotations"):
        assert theirs[key] == ours[key], key
    assert theirs["truncatedAlerts"] == ours["truncatedAlerts"] == 0
    assert theirs["alerts"][0]["labels"] == ours["alerts"][0]["labels"]
    # Alertmanager's own fingerprint, not kvwatch's alert hash
    assert theirs["alerts"][0]["fingerprint"] == ours["alerts"][0]["fingerprint"]
    assert ours["alerts"][0]["fingerprint"] != doc["alerts"][0]["fingerprint"]
    assert theirs["alerts"][0]["status"] == ours["alerts"][0]["status"] == "firing"
    # (endsAt differs by design: we posted the horizon, which Alertmanager passes on; our
    # own webhook rendering says "not ended" with Go's zero time, as Prometheus alerts do)
    assert ours["alerts"][0]["endsAt"] == AM_ZERO_TIME
    # An incident's alert carries Alertmanager's own fingerprint of its labels
    inc = json.loads(
        render("webhook", "alertmanager", incident_doc(3), receiver_name="r", external_url="")
    )
    assert inc["alerts"][0]["fingerprint"] == am_fingerprint(inc["alerts"][0]["labels"])


# ------------------------------------------------------------------ pure rendering


def test_v4_body_groups_common_labels_and_status() -> None:
    at = 1_800_000_000.0
    a, b = alert_doc(1, at=at), alert_doc(2, "resolved", at=at)
    doc = {**a, "alerts": a["alerts"] + b["alerts"]}
    body = render("webhook", "alertmanager", doc, receiver_name="ops", external_url="http://k/")
    v4 = json.loads(body)
    assert set(v4) == V4_KEYS
    assert v4["status"] == "firing"  # while any alert of the group fires
    assert v4["groupKey"] == doc["group_key"]
    assert v4["receiver"] == "ops" and v4["externalURL"] == "http://k/"
    assert v4["commonLabels"] == {
        "alertname": "stale_page_read",
        "deployment_id": "d1",
        "severity": "critical",
    }
    assert v4["commonAnnotations"] == {}
    first, second = v4["alerts"]
    assert set(first) == V4_ALERT_KEYS
    assert first["endsAt"] == AM_ZERO_TIME and first["status"] == "firing"
    assert second["endsAt"] == iso(at) and second["status"] == "resolved"
    assert first["fingerprint"] == am_fingerprint(a["alerts"][0]["labels"])  # Alertmanager's
    assert first["generatorURL"] == "http://k/v1/alerts/1"
    # deterministic: a retry sends the very same bytes; compact, keys sorted
    assert body == render(
        "webhook", "alertmanager", doc, receiver_name="ops", external_url="http://k/"
    )
    assert b" " not in body.replace(b"alert 1 is firing", b"").replace(b"alert 2 is resolved", b"")
    resolved = render("webhook", "alertmanager", b, receiver_name="ops", external_url="")
    assert json.loads(resolved)["status"] == "resolved"


def test_kvwatch_body_is_the_document_with_its_version() -> None:
    doc = alert_doc(1, at=1_800_000_000.0)
    body = render("webhook", "kvwatch", doc, receiver_name="x", external_url="")
    assert json.loads(body) == {**doc, "version": 1}
    assert body == json.dumps({**doc, "version": 1}, sort_keys=True, separators=(",", ":")).encode()
    inc = incident_doc(4, at=1_800_000_000.0)
    assert json.loads(render("webhook", "kvwatch", inc, receiver_name="x", external_url="")) == {
        **inc,
        "version": 1,
    }


def test_api_v2_alerts_end_a_horizon_ahead_while_firing() -> None:
    at = 1_800_000_000.0
    body = render(
        "alertmanager", "alertmanager", alert_doc(1, at=at), receiver_name="", external_url=""
    )
    (alert,) = json.loads(body)
    assert set(alert) == {"labels", "annotations", "startsAt", "endsAt"}  # no URL configured
    assert alert["endsAt"] == iso(at + 3600)
    # delivered late: still a full horizon from the send
    late = render(
        "alertmanager",
        "alertmanager",
        alert_doc(1, at=at),
        receiver_name="",
        external_url="http://k",
        now=at + 7200,
    )
    (alert,) = json.loads(late)
    assert alert["endsAt"] == iso(at + 7200 + 3600)
    assert alert["generatorURL"] == "http://k/v1/alerts/1"
    resolved = render(
        "alertmanager",
        "alertmanager",
        alert_doc(1, "resolved", at=at),
        receiver_name="",
        external_url="",
        now=at + 7200,
    )
    assert json.loads(resolved)[0]["endsAt"] == iso(at)
    (inc,) = json.loads(
        render(
            "alertmanager",
            "alertmanager",
            incident_doc(2, at=at),
            receiver_name="",
            external_url="",
        )
    )
    assert inc["labels"]["alertname"] == "KvwatchIncident" and inc["labels"]["incident_id"] == "2"
    with pytest.raises(ValueError, match="format"):
        render("webhook", "slack", alert_doc(1), receiver_name="", external_url="")
