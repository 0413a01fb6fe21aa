"""Two replicas of one vLLM deployment reporting to one collector (issue 35): the run's shared
server (``tests/engine_servers.py``: prefix caching on, vLLM's default, and no salting
setting) and, started here for this module only, a second engine of the same deployment and
model with ``--no-enable-prefix-caching``. Each engine's plugin names its node by the rule
of ``engine_probe/node.py`` (the API server's HOST:PORT): two nodes, so the second neither
replaces the first one's config nor resolves its ``prefix_cache_unsalted``, and the two
disagreeing on prefix caching is ``config_drift`` between them, naming both.

Cost: one more vLLM start (the tiny model on CPU, ``--optimization-level 0``; about as long
as the shared server's start) and its stop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import engine_servers
from tests.engine_servers import (
    SERVER_TEST_TIMEOUT,
    VllmServer,
    start_replica,
    stop_replica,
    wait_for,
)

vllm_server = engine_servers.vllm_server  # the run's one server, shared with other modules

# serial: beside the run's one vLLM server, a second engine needs the cores to itself
pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]

TENANTS = ("vrep-tenant-a", "vrep-tenant-b")


def _probes(server: VllmServer) -> dict[str, dict[str, Any]]:
    """The deployment's engine probes (not kv-events' or a scrape's), by id."""
    with server.collector.client() as c:
        found = c.get("/v1/probes").json()
    return {
        p["probe_id"]: p
        for p in found
        if p["deployment_id"] == server.deployment_id
        and not p["probe_id"].startswith(("kv-events-", "scrape-"))
    }


@pytest.fixture(scope="module")
def replica(vllm_server: VllmServer) -> Iterator[VllmServer]:
    before = set(_probes(vllm_server))
    server = start_replica(vllm_server, "--no-enable-prefix-caching")
    try:
        yield server
    finally:
        stop_replica(server)
        # vLLM's engine core exits without running its atexit hooks (a multiprocessing
        # child), so the replica's probe never says probe.stopped: other modules are told
        # which probe was the replica's
        engine_servers.REPLICA_PROBES.update(set(_probes(vllm_server)) - before)


def _alerts(server: VllmServer, rule: str) -> list[dict[str, Any]]:
    with server.collector.client() as c:
        r = c.get("/v1/alerts", params={"rule": rule})
        r.raise_for_status()
    return [a for a in r.json() if a["labels"].get("deployment_id") == server.deployment_id]


def _nodes(server: VllmServer) -> dict[str, dict[str, Any]]:
    with server.collector.client() as c:
        fleet = c.get("/v1/fleet").json()
    (dep,) = [d for d in fleet["deployments"] if d["deployment_id"] == server.deployment_id]
    return {n["node"]: n for n in dep["nodes"]}


def test_a_second_replica_is_a_node_of_its_own_and_drift_between_them_fires(
    vllm_server: VllmServer, replica: VllmServer
) -> None:
    first, second = vllm_server, replica
    assert first.deployment_id == second.deployment_id and first.node != second.node
    # two tenants on the deployment (the first engine's shared cache now matters)
    for tenant in TENANTS:
        r = first.complete(engine_servers.tokens(7, 40), tenant=tenant, max_tokens=1)
        assert r.status_code == 200, r.text

    # both engines report, each as its own node, with its own config (the fleet shows them)
    nodes = wait_for(lambda: _nodes(first), lambda n: {first.node, second.node} <= set(n), 120)
    assert nodes[first.node]["prefix_caching"] is True
    assert nodes[second.node]["prefix_caching"] is False
    assert nodes[first.node]["prefix_cache_salting"] is False
    assert nodes[first.node]["role"] == nodes[second.node]["role"] == "both"
    assert nodes[first.node]["dtype"] == nodes[second.node]["dtype"] != "auto"

    # the first engine still serves a shared, unsalted cache: its alert keeps firing (the
    # timer re-evaluates every node; the second node's config replaced nothing)
    def unsalted() -> list[dict[str, Any]]:
        return [a for a in _alerts(first, "prefix_cache_unsalted") if a["state"] == "firing"]

    firing = wait_for(unsalted, lambda a: any(x["labels"]["node"] == first.node for x in a), 60)
    assert second.node not in {a["labels"]["node"] for a in firing}

    # the two disagree on prefix caching: config_drift between the nodes, naming both
    def between() -> list[dict[str, Any]]:
        drift = _alerts(first, "config_drift")
        return [a for a in drift if "node" not in a["labels"] and a["state"] == "firing"]

    (drift,) = wait_for(between, bool, 60)
    assert drift["labels"]["model_id"] == first.model and drift["labels"]["role"] == "both"
    assert set(drift["annotations"]["nodes"].split(",")) == {first.node, second.node}
    assert "prefix_caching" in drift["annotations"]["changed"].split(",")
    summary = drift["annotations"]["summary"]
    assert f"{first.node}=True" in summary and f"{second.node}=False" in summary
