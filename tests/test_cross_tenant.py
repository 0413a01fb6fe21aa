"""One definition of cross-tenant (``engine_probe.events.crosses_tenants``): for each case the
value stored in ``page_events`` (and served by ``/v1/page-events``) equals the
``cross_tenant`` label of the alert the same event raised, on both databases."""

from __future__ import annotations

from typing import Any

import pytest

from engine_probe import events as ev
from tests import factories as f
from tests.conftest import Collector

# (node, the event's fields, cross-tenant?)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("n-other", {"previous_tenant": "acme"}, True),
    ("n-zeroized", {"previous_tenant": "acme", "zeroized": True}, False),
    ("n-never-written", {"previous_tenant": None, "previous_request_id": None}, False),
    ("n-own", {"previous_tenant": "globex"}, False),
]
CANARIES: list[tuple[str, str | None, bool]] = [
    ("c-unknown", None, True),
    ("c-own", "globex", False),
    ("c-other", "acme", True),
]


def _canary(seq: int, node: str, owner: str | None) -> ev.Event:
    return ev.CanaryHit(
        **f.base(seq),
        node=node,
        detector="paint",
        reader_request_id=f"r-{node}",
        reader_tenant="globex",
        canary_tenant=owner,
        page_ids=[1, 2],
    )


@pytest.mark.parametrize(
    ("node", "fields", "crossed"),
    [*CASES, *[(n, {"canary_tenant": o}, c) for n, o, c in CANARIES]],
)
def test_the_contract_says_what_crosses(node: str, fields: dict[str, Any], crossed: bool) -> None:
    if node.startswith("c-"):
        e = _canary(1, node, fields["canary_tenant"])
    else:
        e = f.stale_read(1, node=node, **fields)
    assert e.cross_tenant is crossed  # type: ignore[attr-defined]


def test_stored_value_and_alert_label_agree_for_every_case(collector: Collector) -> None:
    events = [f.stale_read(i, node=node, **fields) for i, (node, fields, _) in enumerate(CASES, 1)]
    events += [
        _canary(len(CASES) + i, node, owner) for i, (node, owner, _) in enumerate(CANARIES, 1)
    ]
    expected = {node: crossed for node, _, crossed in CASES} | {
        node: crossed for node, _, crossed in CANARIES
    }
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text
    with collector.client(collector.admin) as admin:
        stored: dict[str, bool] = {}
        for kind in ("page.stale_read", "canary.hit"):
            items = admin.get("/v1/page-events", params={"kind": kind}).json()["items"]
            stored |= {e["node"]: e["cross_tenant"] for e in items}
        labels = {
            a["labels"]["node"]: a["labels"]["cross_tenant"] == "true"
            for a in admin.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
        }
    assert stored == expected
    assert labels == expected
