"""New names per token per hour are limited (issue 20, item 6): one unscoped ingest batch
once created 3,000 deployments. Over a limit the batch gets 429 naming the limit and its
setting, and nothing of it is stored; names already known cost nothing; each token lineage
has its own budget. Each kind (deployments, nodes, models, routes) has its own test."""

from __future__ import annotations

from typing import Any

import httpx

from tests import factories as f
from tests.conftest import Collector


def _post(c: Collector, token: str, events: list[Any]) -> httpx.Response:
    return httpx.post(
        f"{c.url}/v1/events",
        json=[f.as_json(e) for e in events],
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def _configs(probe: str, deps: range, seq0: int = 1) -> list[Any]:
    return [f.config(seq0 + i, dep=f"dep-{d}", probe=probe) for i, d in enumerate(deps)]


def test_new_deployments_per_token_per_hour_are_limited(collector: Collector) -> None:
    with collector.client(collector.admin) as admin:
        r = _post(collector, collector.ingest, _configs("p-flood", range(25)))
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "too_many_new_names" and "limit of 20" in err["message"]
        assert err["details"]["setting"] == "KVWATCH_MAX_NEW_DEPLOYMENTS_PER_HOUR"
        assert admin.get("/v1/deployments").json() == []  # nothing of the batch stored

        for k in range(4):  # 20 new ones in four batches: within the limit
            batch = _configs(f"p-{k}", range(5 * k, 5 * k + 5))
            assert _post(collector, collector.ingest, batch).status_code == 200
        assert len(admin.get("/v1/deployments").json()) == 20
        r = _post(collector, collector.ingest, _configs("p-4", range(20, 21)))
        assert r.status_code == 429 and r.json()["error"]["details"]["in_last_hour"] == 20
        # known names cost nothing: the same deployments again, more events
        again = [f.pool(10 + i, dep=f"dep-{i}", probe="p-0") for i in range(5)]
        assert _post(collector, collector.ingest, again).status_code == 200
        # another token has its own budget
        other = collector.token("ingest")
        assert _post(collector, other, _configs("p-other", range(20, 22))).status_code == 200
        assert len(admin.get("/v1/deployments").json()) == 22


def test_new_routes_are_limited_too(collector: Collector) -> None:
    events: list[Any] = [f.config(1, probe="p-r")]
    events += [f.admitted(2 + i, f"r-{i}", probe="p-r", route=f"/v1/route-{i}") for i in range(201)]
    r = _post(collector, collector.ingest, events)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["details"]["setting"] == "KVWATCH_MAX_NEW_ROUTES_PER_HOUR"
    assert _post(collector, collector.ingest, events[:150]).status_code == 200


def test_new_nodes_are_limited(collector: Collector) -> None:
    # one deployment and model, 201 nodes: over KVWATCH_MAX_NEW_NODES_PER_HOUR's 200
    events = [f.config(1 + i, probe="p-n", node=f"decode-{i}") for i in range(201)]
    r = _post(collector, collector.ingest, events)
    assert r.status_code == 429, r.text
    details = r.json()["error"]["details"]
    assert details["setting"] == "KVWATCH_MAX_NEW_NODES_PER_HOUR"
    assert (details["kind"], details["limit_per_hour"], details["in_batch"]) == ("node", 200, 201)
    with collector.client(collector.admin) as admin:
        assert admin.get("/v1/deployments").json() == []  # nothing of the batch stored
    assert _post(collector, collector.ingest, events[:200]).status_code == 200
    # the 201st node is new in the next batch: over the limit now, on its own
    r = _post(collector, collector.ingest, events[200:])
    assert r.status_code == 429 and r.json()["error"]["details"]["in_last_hour"] == 200


def test_new_models_are_limited(collector: Collector) -> None:
    # one deployment and route, 51 models: over KVWATCH_MAX_NEW_MODELS_PER_HOUR's 50
    events = [f.admitted(1 + i, f"r-{i}", probe="p-m", model_id=f"m-{i}") for i in range(51)]
    r = _post(collector, collector.ingest, events)
    assert r.status_code == 429, r.text
    details = r.json()["error"]["details"]
    assert details["setting"] == "KVWATCH_MAX_NEW_MODELS_PER_HOUR"
    assert (details["kind"], details["limit_per_hour"], details["in_batch"]) == ("model", 50, 51)
    with collector.client(collector.admin) as admin:
        assert admin.get("/v1/requests", params={"deployment_id": "glm-prod"}).json()["items"] == []
    assert _post(collector, collector.ingest, events[:50]).status_code == 200
    r = _post(collector, collector.ingest, events[50:])
    assert r.status_code == 429 and r.json()["error"]["details"]["in_last_hour"] == 50
    # another token has its own budget
    other = [f.admitted(1, "r-x", probe="p-m2", model_id="m-50")]
    assert _post(collector, collector.token("ingest"), other).status_code == 200
