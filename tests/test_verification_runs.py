"""A verification's own prompts are not the endpoint's traffic: announced before it sends them
(``POST /v1/verification-runs``), the requests and page events of its tenants alone on its
deployment are stored but never raise an alert or open an incident; anything naming another
tenant is evaluated as always; recording the verification ends the run's window."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_probe import events as ev
from engine_probe.events import utcnow
from tests import factories as f
from tests.conftest import Collector

PROBE = "probe-verify-runs"
DEP = "glm-prod"


class Env:
    def __init__(self, c: Collector) -> None:
        self.admin = c.client(c.admin)
        self.ingest = c.client(c.ingest)
        self.seq = 0

    def send(self, *events: ev.Event) -> None:
        r = self.ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text

    def next(self) -> int:
        self.seq += 1
        return self.seq

    def firing(self, rule: str) -> list[dict[str, Any]]:
        r = self.admin.get("/v1/alerts", params={"rule": rule})
        assert r.status_code == 200, r.text
        return [a for a in r.json() if a["state"] != "resolved"]

    def incidents(self) -> list[dict[str, Any]]:
        return list(self.admin.get("/v1/incidents").json())

    def over(self, tenant: str) -> ev.Event:
        """A prompt 3% over the pool (the limit in force): critical context pressure."""
        rid = f"r-{tenant}-{self.seq + 1}"
        return f.rejected(self.next(), rid, tenant=tenant, prompt=700_000, probe=PROBE,
                          ts=utcnow())  # fmt: skip

    def read(self, reader: str, previous: str) -> ev.Event:
        return f.stale_read(self.next(), probe=PROBE, ts=utcnow(), reader_tenant=reader,
                            previous_tenant=previous, reader_request_id=f"r-{self.seq}-x",
                            previous_request_id=f"r-{self.seq}-y")  # fmt: skip


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    e = Env(collector)
    e.send(f.config(e.next(), probe=PROBE, ts=utcnow()))  # pool 681,280 < 1,048,576
    yield e
    e.admin.close()
    e.ingest.close()


def _announce(env: Env, **kw: Any) -> dict[str, Any]:
    body = {"deployment_id": DEP, "tenants": ["acme", "globex"]} | kw
    r = env.ingest.post("/v1/verification-runs", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_a_runs_own_prompts_raise_nothing_and_others_still_do(env: Env) -> None:
    run = _announce(env)
    assert run["tenants"] == ["acme", "globex"] and run["finished_at"] is None
    env.send(env.over("acme"), env.read("globex", "acme"))  # the run's own: a leak it found
    assert env.firing("context_pressure") == [] and env.firing("stale_page_read") == []
    assert env.incidents() == []
    # stored all the same: the evidence keeps them
    reads = env.admin.get("/v1/page-events", params={"kind": "page.stale_read"}).json()
    assert len(reads["items"]) == 1

    env.send(env.over("initech"))  # a tenant of the fleet's own, during the run
    (pressure,) = env.firing("context_pressure")
    assert pressure["severity"] == "critical"
    env.send(env.read("globex", "hooli"))  # the run's reader read a real tenant's pages
    assert len(env.firing("stale_page_read")) == 1
    (incident,) = env.incidents()
    assert incident["deployment_id"] == DEP


def test_recording_the_verification_ends_the_run(env: Env) -> None:
    run = _announce(env)
    r = env.ingest.post(
        "/v1/verifications",
        json={"deployment_id": DEP, "model_id": "glm-5.3", "passed": False, "run_id": run["id"]},
    )
    assert r.status_code == 201, r.text
    env.send(env.over("acme"))  # after the run: acme's traffic is the endpoint's again
    assert [a["severity"] for a in env.firing("context_pressure")] == ["critical"]
    # once only: the run is finished, a second record cannot reopen or move it
    again = env.ingest.post(
        "/v1/verifications",
        json={"deployment_id": DEP, "model_id": "glm-5.3", "passed": True, "run_id": run["id"]},
    )
    assert again.status_code == 422 and "run_id" in again.text, again.text
    listed = env.admin.get("/v1/verifications", params={"deployment_id": DEP}).json()
    assert len(listed) == 1  # the refused one stored nothing


def test_an_ended_run_counts_no_longer_and_bad_announcements_are_refused(env: Env) -> None:
    run = _announce(env)
    r = env.ingest.post(f"/v1/verification-runs/{run['id']}/end")
    assert r.status_code == 200 and r.json()["finished_at"] is not None, r.text
    env.send(env.over("acme"))
    assert len(env.firing("context_pressure")) == 1
    assert env.ingest.post("/v1/verification-runs/999/end").status_code == 404
    for bad, field in (
        ({"tenants": []}, "tenants"),
        ({"max_duration_s": 7200}, "max_duration_s"),
        ({"deployment_id": "bad id"}, "deployment_id"),
    ):
        r = env.ingest.post("/v1/verification-runs", json={"deployment_id": DEP,
                            "tenants": ["acme"]} | bad)  # fmt: skip
        assert r.status_code == 422 and field in r.text, r.text
