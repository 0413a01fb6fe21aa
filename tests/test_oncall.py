"""The on-call engineer's side of an incident, through the real collector: two installations
feeding one real Alertmanager keep their incidents apart; an endpoint gets only the
severities it asked for; notifications link to the dashboard and the runbook; an incident
is acknowledged, owned, annotated and its alerts linked and unlinked from the API and the
CLI, each step on one ordered timeline."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from collector import migrate
from collector.app import create_app
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.notify.payloads import am_fingerprint
from collector.settings import Settings
from kvwatch.cli import app as cli
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import DPO_CONTACT, Collector, make_token
from tests.notify_helpers import Receiver, running_alertmanager

DASHBOARD = "https://kvwatch.example/dash"


# The write-up's chain on deployment glm-prod: prompts past the pool, a rejected prefill that
# still transferred, then the stale read that opens the incident; stamped a minute ago, so
# the engine's configs fall in the incident's timeline.
def _incident_events() -> list[Any]:
    t0 = datetime.now(UTC) - timedelta(minutes=1)

    def at(seq: int) -> dict[str, Any]:
        return {"ts": t0 + timedelta(seconds=seq)}

    return [
        f.config(1, **at(1)),
        f.config(2, role="decode", node="decode-0", pool_tokens=2_000_000, **at(2)),
        f.admitted(4, "r-exposed", tenant="acme", prompt=5_000, **at(4)),
        f.finished(5, "r-exposed", tenant="acme", **at(5)),
        f.rejected(9, "r-victim", tenant="globex", **at(9)),
        f.stale_read(10, **at(10)),
    ]


def _until(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            assert got, f"timed out waiting for {what}"
            return got
        time.sleep(0.2)


@contextmanager
def _installation(tmp_path: Path, name: str, **extra: Any) -> Iterator[Collector]:
    """A collector over a database of its own, created here (never a copy of another's:
    its generated instance id is its own)."""
    url = f"sqlite:///{tmp_path / name}.db"
    migrate.upgrade(url)
    settings = Settings(
        database_url=url,
        auto_migrate=False,
        notify_poll_s=0.1,
        dpo_contact=DPO_CONTACT,
        public_url=f"http://{name}.test",
        **extra,
    )
    with serve_in_thread(create_app(settings)) as base:
        yield Collector(base, url, make_token(url, "admin"), make_token(url, "ingest"))


def _endpoint(c: Collector, name: str, url: str, **kw: Any) -> str | None:
    db = Database(c.db_url)
    try:
        with db.write() as conn:
            return add_endpoint(conn, name, url, now_us=0, **kw)[1]
    finally:
        db.dispose()


def _send(c: Collector, events: list[Any]) -> None:
    with c.client(c.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text


@dataclass
class Alertmanager:
    url: str
    pager: Receiver

    def alerts(self, **params: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v2/alerts", params=params, timeout=10)
        r.raise_for_status()
        return list(r.json())


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    """A real Alertmanager routing critical alerts, one group per alert, to a pager (a
    webhook receiver on 127.0.0.1), and everything else nowhere."""
    pager = Receiver().start()
    config = f"""
route:
  receiver: "null"
  routes:
    - receiver: pager
      matchers: ['severity="critical"']
      group_by: ['...']
      group_wait: 100ms
      group_interval: 1s
      repeat_interval: 1h
receivers:
  - name: "null"
  - name: pager
    webhook_configs:
      - url: {pager.url}/pager
        send_resolved: true
"""
    try:
        with running_alertmanager(tmp_path, config) as url:
            yield Alertmanager(url, pager)
    finally:
        pager.stop()


def _incidents(am: Alertmanager) -> list[dict[str, Any]]:
    return [
        a
        for a in am.alerts(active="true")
        if a["labels"]["alertname"] == "KvwatchIncident" and a["status"]["state"] == "active"
    ]


def _paged(am: Alertmanager) -> list[dict[str, Any]]:
    """Every alert the pager was sent, with the status of that notification."""
    return [a for d in am.pager.by_path("/pager") for a in d.doc["alerts"]]


@pytest.mark.slow
def test_two_installations_page_separately_and_close_only_their_own(
    tmp_path: Path, alertmanager: Alertmanager
) -> None:
    """Incident #1 on deployment glm-prod at two installations: two pages, two fingerprints, and
    closing one resolves only it in Alertmanager."""
    with (
        _installation(tmp_path, "east", dashboard_url=DASHBOARD) as east,
        _installation(tmp_path, "west") as west,
    ):
        for c in (east, west):
            _endpoint(c, "am", alertmanager.url, kind="alertmanager")
            _send(c, _incident_events())
        incidents = _until(
            "both incidents in Alertmanager",
            lambda: len(_incidents(alertmanager)) == 2 and _incidents(alertmanager),
        )
        instances = {a["labels"]["kvwatch_instance"] for a in incidents}
        assert len(instances) == 2, incidents
        assert {a["labels"]["incident_id"] for a in incidents} == {"1"}
        assert {a["labels"]["deployment_id"] for a in incidents} == {"glm-prod"}
        assert len({a["fingerprint"] for a in incidents}) == 2
        # the instance is the database's generated id, the same each time it is read
        by_instance = {a["labels"]["kvwatch_instance"]: a for a in incidents}
        with east.client(east.admin) as admin:
            (east_inc,) = admin.get("/v1/incidents").json()
        east_label = next(
            i for i, a in by_instance.items() if a["generatorURL"].startswith(DASHBOARD)
        )
        west_label = (instances - {east_label}).pop()
        # links: the dashboard's page where one is configured, the API's otherwise
        assert by_instance[east_label]["generatorURL"] == f"{DASHBOARD}/incident?id=1"
        assert by_instance[east_label]["annotations"]["runbook_url"] == (
            f"{DASHBOARD}/runbook?kind=stale_page_read"
        )
        assert by_instance[west_label]["generatorURL"] == "http://west.test/v1/incidents/1"
        assert "runbook_url" not in by_instance[west_label]["annotations"]
        # each paged on its own
        _until(
            "two pages",
            lambda: (
                {
                    a["labels"].get("kvwatch_instance")
                    for a in _paged(alertmanager)
                    if a["labels"]["alertname"] == "KvwatchIncident" and a["status"] == "firing"
                }
                == instances
            ),
        )

        with east.client(east.admin) as admin:
            r = admin.post(f"/v1/incidents/{east_inc['id']}/close", json={"reason": "contained"})
            assert r.status_code == 200, r.text
        _until(
            "east's incident resolved",
            lambda: (
                [a["labels"]["kvwatch_instance"] for a in _incidents(alertmanager)] == [west_label]
            ),
        )
        resolved = _until(
            "the resolved page",
            lambda: [
                a
                for a in _paged(alertmanager)
                if a["labels"]["alertname"] == "KvwatchIncident" and a["status"] == "resolved"
            ],
        )
        assert {a["labels"]["kvwatch_instance"] for a in resolved} == {east_label}
        # west's incident is still open there, and still paging as it was
        (still,) = _incidents(alertmanager)
        assert still["fingerprint"] == am_fingerprint(still["labels"])


@pytest.mark.slow
def test_a_critical_only_endpoint_gets_no_warnings(tmp_path: Path) -> None:
    """The same firing alerts to two webhooks, one taking everything and one critical only:
    the second never sees a warning, in any document."""
    everything, critical = Receiver().start(), Receiver().start()
    try:
        with _installation(tmp_path, "one", dashboard_url=DASHBOARD) as c:
            _endpoint(c, "all", everything.url + "/all")
            _endpoint(c, "crit", critical.url + "/crit", min_severity="critical")
            _send(c, _incident_events())
            assert everything.wait_for(
                lambda got: (
                    any(a["severity"] == "warning" for d in got for a in d.doc["alerts"])
                    and any(d.doc["incident"] for d in got)
                )
            )
            assert critical.wait_for(lambda got: any(d.doc["incident"] for d in got))
            time.sleep(1)  # anything else queued with it has gone out too
            sent = critical.by_path("/crit")
            for d in sent:
                if d.doc["incident"] is None:
                    assert {a["severity"] for a in d.doc["alerts"]} == {"critical"}, d.doc
            # every alert sent is labelled with the installation, fingerprinted over that
            # label, and linked to its dashboard page
            from policies.signals import fingerprint

            for d in everything.by_path("/all"):
                assert d.doc["instance"]
                for a in d.doc["alerts"]:
                    assert a["labels"]["kvwatch_instance"] == d.doc["instance"]
                    assert a["fingerprint"] == fingerprint(a["labels"])
                    assert a["url"] == f"{DASHBOARD}/alerts?id={a['id']}"
                    assert a["runbook_url"] == f"{DASHBOARD}/runbook?kind={a['kind']}"
    finally:
        everything.stop()
        critical.stop()


def test_the_incident_workflow_round_trips_and_lands_on_the_timeline_in_order(
    collector: Collector,
) -> None:
    _send(collector, _incident_events())
    with collector.client(collector.admin) as admin:
        (inc,) = admin.get("/v1/incidents").json()
        iid = inc["id"]
        linked = {a["id"] for a in admin.get(f"/v1/incidents/{iid}").json()["alerts"]}
        alerts = {a["id"]: a for a in admin.get("/v1/alerts").json()}
        # every warning or critical alert of d1 active at the opening is linked, not only
        # the stale read that opened it
        causal = {
            i
            for i, a in alerts.items()
            if a["deployment_id"] == "glm-prod"
            and a["severity"] in ("warning", "critical")
            and a["state"] == "firing"
        }
        assert len(causal) > 1 and causal <= linked, (causal, linked)

        r = admin.post(f"/v1/incidents/{iid}/ack", json={"by": "ana"})
        assert r.status_code == 200, r.text
        assert r.json()["acked_by"] == "ana" and r.json()["acked_at"]
        # the first acknowledgement stands
        assert admin.post(f"/v1/incidents/{iid}/ack", json={"by": "bo"}).json()["acked_by"] == "ana"
        r = admin.post(f"/v1/incidents/{iid}/owner", json={"owner": "ana", "by": "lead"})
        assert r.status_code == 200 and r.json()["owner"] == "ana"
        r = admin.post(
            f"/v1/incidents/{iid}/notes", json={"text": "drained glm-prod behind the gateway"}
        )
        assert r.status_code == 200, r.text
        unlink = max(linked - {min(linked)})  # the lowest id is the stale read that opened it
        assert admin.delete(f"/v1/incidents/{iid}/links/{unlink}").status_code == 200
        assert unlink not in {a["id"] for a in admin.get(f"/v1/incidents/{iid}").json()["alerts"]}
        assert (
            admin.post(f"/v1/incidents/{iid}/links", json={"alert_id": unlink}).status_code == 200
        )

        # bad input: named, nothing stored
        r = admin.post(f"/v1/incidents/{iid}/notes", json={"text": ""})
        assert r.status_code == 422
        assert admin.post("/v1/incidents/999/ack", json={}).status_code == 404
        assert admin.post(f"/v1/incidents/{iid}/links", json={"alert_id": 10**9}).status_code == 404
        # a read token reads the timeline and changes nothing
        with collector.client(collector.token("read")) as reader:
            assert reader.post(f"/v1/incidents/{iid}/ack", json={}).status_code == 403
            assert reader.get(f"/v1/incidents/{iid}/timeline").status_code == 200
        with collector.client(collector.token("read", tenant="acme")) as tenant:
            assert tenant.get(f"/v1/incidents/{iid}/timeline").status_code == 403

    # the CLI, on the same database
    run = CliRunner().invoke(
        cli,
        [
            "incidents",
            "note",
            str(iid),
            "--text",
            "verified clean with kvwatch verify",
            "--by",
            "ana",
            "--database-url",
            collector.db_url,
        ],
    )
    assert run.exit_code == 0, run.output
    run = CliRunner().invoke(
        cli,
        ["incidents", "timeline", str(iid), "--json", "--database-url", collector.db_url],
    )
    assert run.exit_code == 0, run.output
    timeline = json.loads(run.stdout)
    kinds = [e["kind"] for e in timeline]
    workflow = ("incident.opened", "incident.ack", "incident.owner", "incident.note")
    assert [k for k in kinds if k in (*workflow, "incident.unlink")] == [
        *workflow,
        "incident.unlink",
        "incident.note",
    ]
    assert kinds.count("incident.note") == 2
    assert "alert.firing" in kinds and "config.changed" in kinds, sorted(set(kinds))
    assert [e["at"] for e in timeline] == sorted(e["at"] for e in timeline)
    notes = [e for e in timeline if e["kind"] == "incident.note"]
    assert [n["text"] for n in notes] == [
        "drained glm-prod behind the gateway",
        "verified clean with kvwatch verify",
    ]
    assert notes[1]["actor"] == "ana"
    # audited: the chain still verifies with every step in it
    run = CliRunner().invoke(cli, ["audit", "verify", "--database-url", collector.db_url])
    assert run.exit_code == 0, run.output


@pytest.mark.slow
def test_pagerduty_events_keep_each_installation_apart(tmp_path: Path) -> None:
    """PagerDuty's Events API v2 from two installations with the same deployment and
    incident number: distinct dedup keys; acknowledging and closing one sends acknowledge
    and resolve for its key alone; a critical-only service gets no warning."""
    pd = Receiver().start()
    key = "R0UT1NGKEY0123456789abcd"
    try:
        with (
            _installation(tmp_path, "east", dashboard_url=DASHBOARD) as east,
            _installation(tmp_path, "west") as west,
        ):
            for c, path in ((east, "/east"), (west, "/west")):
                _endpoint(c, "pd", pd.url + path, kind="pagerduty", secret=key)
                _endpoint(
                    c,
                    "pd-crit",
                    pd.url + path + "-crit",
                    kind="pagerduty",
                    secret=key,
                    min_severity="critical",
                )
                _send(c, _incident_events())

            def incident_events(path: str) -> list[dict[str, Any]]:
                return [
                    d.doc
                    for d in pd.by_path(path)
                    if d.doc.get("payload", {}).get("class") == "stale_page_read"
                    and d.doc["payload"]["summary"].startswith("Suspected")
                ] + [d.doc for d in pd.by_path(path) if d.doc["event_action"] != "trigger"]

            assert pd.wait_for(lambda _: incident_events("/east") and incident_events("/west"))
            (e,), (w,) = incident_events("/east"), incident_events("/west")
            assert e["routing_key"] == w["routing_key"] == key
            assert e["event_action"] == w["event_action"] == "trigger"
            assert e["dedup_key"] != w["dedup_key"]
            assert e["payload"]["source"] != w["payload"]["source"]
            assert e["payload"]["severity"] == "critical"
            assert e["links"][0]["href"] == f"{DASHBOARD}/incident?id=1"

            # every alert's key differs between the two as well
            def alert_keys(path: str) -> dict[str, str]:
                return {
                    d.doc["payload"]["class"]: d.doc["dedup_key"]
                    for d in pd.by_path(path)
                    if d.doc["event_action"] == "trigger"
                    and not d.doc["payload"]["summary"].startswith("Suspected")
                }

            shared = alert_keys("/east").keys() & alert_keys("/west").keys()
            assert shared
            assert all(alert_keys("/east")[r] != alert_keys("/west")[r] for r in shared)

            with east.client(east.admin) as admin:
                assert admin.post("/v1/incidents/1/ack", json={"by": "ana"}).status_code == 200
                assert (
                    admin.post("/v1/incidents/1/close", json={"reason": "contained"}).status_code
                    == 200
                )
            assert pd.wait_for(
                lambda _: [d.doc["event_action"] for d in pd.by_path("/east")].count("resolve") >= 1
            )
            later = [d.doc for d in pd.by_path("/east") if d.doc["event_action"] != "trigger"]
            assert [x["event_action"] for x in later] == ["acknowledge", "resolve"]
            assert {x["dedup_key"] for x in later} == {e["dedup_key"]}
            time.sleep(1)
            assert all(d.doc["event_action"] == "trigger" for d in pd.by_path("/west"))
            for path in ("/east-crit", "/west-crit"):
                sent = pd.by_path(path)
                assert sent
                assert {d.doc["payload"]["severity"] for d in sent if "payload" in d.doc} == {
                    "critical"
                }
    finally:
        pd.stop()


def test_a_pagerduty_endpoint_needs_its_routing_key_and_never_prints_it(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'pd.db'}"
    base = ["webhooks", "add", "pd", "https://events.pagerduty.com/v2/enqueue"]
    run = CliRunner().invoke(cli, [*base, "--kind", "pagerduty", "--database-url", url])
    assert run.exit_code == 2 and "routing key" in run.output, run.output
    key = "R0UT1NGKEY0123456789abcd"
    run = CliRunner().invoke(
        cli, [*base, "--kind", "pagerduty", "--secret", key, "--database-url", url]
    )
    assert run.exit_code == 0, run.output
    assert key not in run.output
    run = CliRunner().invoke(cli, ["webhooks", "list", "--database-url", url])
    assert "pagerduty" in run.output and key not in run.output


def test_the_fleet_leads_with_the_open_incident_for_as_long_as_it_is_open(
    collector: Collector,
) -> None:
    """A red deployment whose name sorts first, a green one, and the one with the incident:
    the incident's comes first, says why in its first reason, and links the incident from
    the incident itself (not from an alert that may have resolved)."""
    now = datetime.now(UTC) - timedelta(seconds=30)
    _send(collector, [f.config(1, probe="p-red", dep="aaa-red", pool_tokens=1000, ts=now)])
    _send(collector, [f.config(1, probe="p-green", dep="aaa-green", pool_tokens=2_000_000, ts=now)])
    _send(collector, _incident_events())
    with collector.client(collector.admin) as admin:
        fleet = admin.get("/v1/fleet").json()["deployments"]
        order = [d["deployment_id"] for d in fleet]
        assert order[0] == "glm-prod" and order.index("aaa-red") < order.index("aaa-green")
        lead = fleet[0]
        (inc,) = lead["incidents"]
        assert lead["status"] == "red" and lead["open_incidents"] == 1
        assert lead["reasons"][0].startswith(f"open incident #{inc['id']}: Suspected")
        assert inc["acked_by"] is None
        assert admin.post(f"/v1/incidents/{inc['id']}/ack", json={"by": "ana"}).status_code == 200
        (inc,) = admin.get("/v1/fleet").json()["deployments"][0]["incidents"]
        assert inc["acked_by"] == "ana"
        admin.post(f"/v1/incidents/{inc['id']}/close", json={"reason": "contained"})
        after = {d["deployment_id"]: d for d in admin.get("/v1/fleet").json()["deployments"]}
        assert after["glm-prod"]["incidents"] == []
        assert not after["glm-prod"]["reasons"][0].startswith("open incident")
