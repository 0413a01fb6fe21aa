"""No request stays ``admitted`` forever: when the probe that admitted it is gone (it said it
stopped, a new probe announced itself on its node, or it fell silent past the bound), the
collector closes it as ``lost`` with the reason, and says so on the fleet, in the reports and
in its metrics; a finish arriving later still wins. Through the real HTTP ingest API, on
SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from collector import migrate
from collector.app import create_app
from collector.db import Database
from collector.lost import LostRequests
from collector.settings import Settings
from engine_probe import events as ev
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import Collector, make_token

QUIET_S = 2.0  # KVWATCH_PROBE_REPLACED_QUIET_S here: a restart's gap, without a long wait
OLD, NEW, SIBLING = "gpu-host-1111-aaaaaa", "gpu-host-2222-bbbbbb", "gpu-host-3333-cccccc"
START = datetime.now(UTC) - timedelta(hours=1)  # the fleet counts the last 24 hours' losses


def T(seq: int) -> datetime:
    return START + timedelta(seconds=seq)


# The factories' events, at T(seq).
def config(seq: int, **kw: Any) -> ev.Event:
    return f.config(seq, ts=T(seq), **kw)


def admitted(seq: int, rid: str, **kw: Any) -> ev.Event:
    return f.admitted(seq, rid, ts=T(seq), **kw)


def finished(seq: int, rid: str, **kw: Any) -> ev.Event:
    return f.finished(seq, rid, ts=T(seq), **kw)


def rejected(seq: int, rid: str, **kw: Any) -> ev.Event:
    return f.rejected(seq, rid, ts=T(seq), **kw)


def stopped(seq: int, probe: str) -> ev.Event:
    return ev.ProbeStopped(**f.base(seq, probe=probe, ts=T(seq)))


@pytest.fixture
def c(db_url: str) -> Iterator[Collector]:
    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, probe_replaced_quiet_s=QUIET_S)
    with serve_in_thread(create_app(settings)) as url:
        yield Collector(url, db_url, make_token(db_url, "admin"), make_token(db_url, "ingest"))


def send(c: Collector, *events: ev.Event) -> None:
    with c.client(c.ingest) as client:
        r = client.post("/v1/events", json=[f.as_json(e) for e in events])
    assert r.status_code == 200, r.text


def requests(c: Collector) -> dict[str, dict[str, Any]]:
    with c.client(c.admin) as client:
        items = client.get("/v1/requests", params={"limit": 1000}).json()["items"]
    return {r["request_id"]: r for r in items}


def status(c: Collector) -> dict[str, tuple[str, str | None]]:
    return {rid: (r["status"], r["lost_reason"]) for rid, r in requests(c).items()}


def fleet_lost(c: Collector) -> dict[str, Any]:
    with c.client(c.admin) as client:
        (dep,) = client.get("/v1/fleet").json()["deployments"]
    return dict(dep["lost_requests"])


def lost_metric(c: Collector, reason: str) -> float:
    text = httpx.get(f"{c.url}/metrics", timeout=10).text
    line = f'kvwatch_requests_lost_total{{reason="{reason}"}} '
    (value,) = [x.removeprefix(line) for x in text.splitlines() if x.startswith(line)]
    return float(value)


def test_a_stopped_probes_open_requests_are_lost_until_a_later_finish(c: Collector) -> None:
    send(
        c,
        config(1, probe=OLD, node="node-0"),
        admitted(2, "r-open", probe=OLD, node="node-0"),
        admitted(3, "r-done", probe=OLD, node="node-0"),
        finished(4, "r-done", probe=OLD),
        rejected(5, "r-refused", probe=OLD),
    )
    assert status(c)["r-open"] == ("admitted", None)
    assert requests(c)["r-open"]["probe_id"] == OLD
    assert requests(c)["r-open"]["node"] == "node-0"
    send(c, stopped(6, OLD))
    assert status(c) == {
        "r-open": ("lost", "probe_stopped"),
        "r-done": ("completed", None),
        "r-refused": ("rejected", None),
    }
    assert lost_metric(c, "probe_stopped") == 1
    with c.client(c.admin) as client:
        (probe,) = client.get("/v1/probes").json()
    assert (probe["gone_reason"], probe["lost_requests"]) == ("probe_stopped", 1)
    assert probe["gone_at"] is not None
    assert fleet_lost(c)["count"] == 1
    assert fleet_lost(c)["by_reason"] == {"probe_stopped": 1}
    # Its crash journal, replayed under its id after the stop: an admission it never
    # finished is lost as it arrives; the finish of r-open wins over lost.
    send(
        c,
        admitted(7, "r-replayed", probe=OLD, node="node-0"),
        finished(8, "r-open", probe=OLD, completion=77),
    )
    got = requests(c)
    assert (got["r-open"]["status"], got["r-open"]["lost_reason"]) == ("completed", None)
    assert got["r-open"]["completion_tokens"] == 77
    assert (got["r-replayed"]["status"], got["r-replayed"]["lost_reason"]) == (
        "lost",
        "probe_stopped",
    )
    assert fleet_lost(c) | {"latest_at": None} == {
        "window_s": 86_400,
        "count": 1,
        "by_reason": {"probe_stopped": 1},
        "latest_at": None,
    }


def test_a_new_probe_on_the_node_replaces_the_old_one_there_only(c: Collector) -> None:
    send(
        c,
        config(1, probe=OLD, node="node-0"),
        admitted(2, "r-0", probe=OLD, node="node-0"),
        config(3, probe=OLD, node="node-1"),
        admitted(4, "r-1", probe=OLD, node="node-1"),
    )
    time.sleep(QUIET_S + 0.5)  # the engine restarts
    # A replica reporting the same node id sends side by side with the new probe: it is
    # no restart, and its requests stay open.
    send(
        c,
        config(1, probe=SIBLING, node="node-0"),
        admitted(2, "r-sibling", probe=SIBLING, node="node-0"),
    )
    send(c, config(1, probe=NEW, node="node-0"), admitted(2, "r-new", probe=NEW, node="node-0"))
    assert status(c) == {
        "r-0": ("lost", "probe_replaced"),
        "r-1": ("admitted", None),  # node-1: not replaced
        "r-sibling": ("admitted", None),
        "r-new": ("admitted", None),
    }
    assert lost_metric(c, "probe_replaced") == 1
    assert fleet_lost(c)["by_reason"] == {"probe_replaced": 1}
    # The old probe's journal, replayed after the new probe's first events: the finish wins,
    # and the lost count no longer includes it.
    send(c, finished(5, "r-0", probe=OLD))
    assert status(c)["r-0"] == ("completed", None)
    assert status(c)["r-1"] == ("admitted", None)  # its node-1 was not replaced
    assert fleet_lost(c)["count"] == 0


def test_silence_past_the_bound_loses_open_requests(c: Collector) -> None:
    send(
        c,
        config(1, probe=OLD, node="node-0"),
        admitted(2, "r-open", probe=OLD, node="node-0"),
        finished(3, "r-done", probe=OLD),  # a finish alone (a gateway's): never open
    )
    db = Database(c.db_url)
    try:
        now = datetime.now(UTC)
        # A collector that has not been listening for the bound (back from an outage, its
        # probes buffering meanwhile) judges no one silent.
        fresh = LostRequests(db, 300, listening_since=now + timedelta(seconds=200))
        assert fresh.close_silent(now + timedelta(seconds=301)).lost == 0
        assert status(c)["r-open"] == ("admitted", None)
        # Listening since `now`, not since it is built: on a loaded machine the calls above
        # can take over a second, which would move the bound past now + 301 s.
        sweep = LostRequests(db, lost_after_s=300, listening_since=now)
        assert sweep.close_silent(now + timedelta(seconds=200)).lost == 0
        assert status(c)["r-open"] == ("admitted", None)
        done = sweep.close_silent(now + timedelta(seconds=301))
        assert done.lost == 1
        assert status(c) == {"r-open": ("lost", "probe_silent"), "r-done": ("completed", None)}
        assert sweep.close_silent(now + timedelta(seconds=900)).lost == 0  # closed once
        # Heard from again (a network partition healed): running, its new requests stay open
        # until it falls silent again; its old request's finish wins.
        send(c, admitted(4, "r-later", probe=OLD), finished(5, "r-open", probe=OLD))
        assert status(c)["r-later"] == ("admitted", None)
        assert status(c)["r-open"] == ("completed", None)
        assert sweep.close_silent(datetime.now(UTC) + timedelta(seconds=301)).lost == 1
        assert status(c)["r-later"] == ("lost", "probe_silent")
    finally:
        db.dispose()


def test_reports_count_lost_requests(c: Collector) -> None:
    send(
        c,
        config(1, probe=OLD, node="node-0"),
        admitted(2, "r-open", probe=OLD, node="node-0"),
        admitted(3, "r-done", probe=OLD, node="node-0"),
        finished(4, "r-done", probe=OLD),
        stopped(5, OLD),
    )
    window = {
        "since": (START - timedelta(hours=1)).isoformat(),
        "until": (START + timedelta(hours=2)).isoformat(),
    }
    with c.client(c.admin) as admin:
        review = admin.get("/v1/review", params=window).json()
        assert review["totals"]["lost_requests"] == 1
        assert [(r["requests"], r["lost_requests"]) for r in review["rows"]] == [(2, 1)]
        csv_text = admin.get("/v1/review", params={**window, "format": "csv"}).text
        head, row = csv_text.splitlines()[:2]
        assert head.split(",")[-1] == "lost_requests" and row.split(",")[-1] == "1"
        r = admin.post("/v1/reports", json={"kind": "breach", "model_id": "glm-5.3", **window})
        assert r.status_code == 201, r.text
        report = admin.get(f"/v1/reports/{r.json()['report_id']}").json()
        assert report["affected_requests"]["by_status"] == {"completed": 1, "lost": 1}
        listed = {x["request_id"]: x["status"] for x in report["affected_requests"]["items"]}
        assert listed == {"r-open": "lost", "r-done": "completed"}
        # its CSV recounts the statuses: a consistent download
        csv_r = admin.get(f"/v1/reports/{r.json()['report_id']}", params={"format": "csv"})
        assert csv_r.status_code == 200, csv_r.text
