"""The advisories kvwatch ships (policies/data/advisories.yaml): every row parses, fires on
the configs it names and stays quiet on its near misses; a row whose examples disagree with
it is refused where it stands; and through a running collector, a node whose engine.config
matches pages with the advisory's action, and a config that no longer matches resolves it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_probe import events as ev
from policies.errors import PackError
from policies.kinds.advisory import Advisory, builtin_advisories, load_advisories
from tests import factories as f
from tests.test_policy_rules import Env, env  # noqa: F401  (the fixture)

ROWS = builtin_advisories()


@pytest.mark.parametrize("row", ROWS, ids=[a.id for a in ROWS])
def test_each_shipped_row_fires_on_its_examples_and_not_on_its_near_misses(row: Advisory) -> None:
    assert row.examples.fires and row.examples.quiet, "every shipped row names both"
    assert row.action and row.references
    for overrides in row.examples.fires:
        assert row.matches(row.example(overrides)), overrides
    for overrides in row.examples.quiet:
        assert not row.matches(row.example(overrides)), overrides


def _file(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "adv.yaml"
    p.write_text("advisories:\n" + body)
    return p


def test_a_row_whose_example_does_not_fire_is_refused_with_its_line(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        "  - id: lmcache-x\n"
        "    engine: vllm\n"
        "    affected: '>=0.26'\n"
        "    connector: lmcache\n"
        "    connector_affected: '<0.5.6'\n"
        "    summary: s\n"
        "    examples:\n"
        "      fires:\n"
        "        - {engine_version: '0.26.0', kv_connector: LMCacheConnectorV1,\n"
        "           kv_connector_version: '0.5.6'}\n",
    )
    with pytest.raises(PackError) as info:
        load_advisories(path)
    e = info.value
    assert e.field == "advisories[0].examples.fires.0"
    assert "does not fire on this config" in str(e) and e.line is not None


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ("    connector_affected: '<1'\n", "connector_affected", "needs connector"),
        ("    connector: lmcache\n    connector_affected: 'soon'\n", "connector_affected",
         "not a version specifier"),
        ("    when: {tier: [disk, 3]}\n", "when.tier", "expected str or a list of them"),
        ("    when: {tier_salt: false}\n", "when.tier_salt", "unknown condition"),
        ("    examples: {quiet: [{engine_version: '1', colour: red}]}\n", "examples.quiet.0",
         "colour: not an engine.config field"),
    ],
)  # fmt: skip
def test_bad_rows_name_what_is_wrong(tmp_path: Path, body: str, field: str, says: str) -> None:
    path = _file(
        tmp_path, "  - id: x\n    engine: vllm\n    affected: '>=0'\n    summary: s\n" + body
    )
    with pytest.raises(PackError) as info:
        load_advisories(path)
    assert info.value.field == f"advisories[0].{field}", str(info.value)
    assert says in str(info.value)


def test_a_row_may_name_the_connector_as_the_engine_does(tmp_path: Path) -> None:
    """``connector: LMCacheConnectorV1`` and ``connector: lmcache`` name one family."""
    path = _file(
        tmp_path,
        "  - id: x\n    engine: vllm\n    affected: '>=0'\n    summary: s\n"
        "    connector: LMCacheConnectorV1\n"
        "    examples:\n      fires: [{engine_version: '1', kv_connector: LMCacheConnectorV1}]\n"
        "      quiet: [{engine_version: '1', kv_connector: LMCacheMPConnector}]\n",
    )
    (row,) = load_advisories(path)
    assert row.matches(row.example({"engine_version": "1", "kv_connector": "lmcache"}))


def _tiers(*tiers: dict[str, Any]) -> tuple[ev.KvTier, ...]:
    return tuple(ev.KvTier(**t) for t in tiers)


def test_a_matching_config_pages_with_the_action_and_a_fixed_one_resolves(env: Env) -> None:  # noqa: F811
    """A vLLM 0.26 node on LMCache 0.5.2's in-process connector with a disk tier: both
    LMCache rows fire, critical, naming the connector's version and what to do; moving the
    node to the multi-process connector on 0.5.6 resolves both."""
    lmc = {
        "engine": "vllm",
        "engine_version": "0.26.0",
        "role": "both",
        "node": "gpu-0",
        "disaggregated": False,
        "dtype": "bfloat16",
        "kv_connector": "LMCacheConnectorV1",
        "kv_connector_version": "0.5.2",
        "kv_tiers": _tiers(
            {"medium": "cpu", "backend": "lmcache", "capacity_bytes": 8 << 30},
            {"medium": "disk", "backend": "lmcache", "capacity_bytes": 28 << 30},
        ),
    }
    env.send(f.config(env.next(), probe=env.probe, **lmc))
    firing = {a["labels"]["advisory"]: a for a in env.alerts("engine_version_advisory", "firing")}
    assert set(firing) == {
        "vllm-lmcache-inprocess-packed-kv-layout",
        "lmcache-disk-tier-other-requests-content",
    }
    disk = firing["lmcache-disk-tier-other-requests-content"]
    assert disk["severity"] == "critical"
    assert disk["annotations"]["summary"].startswith(
        "vllm 0.26.0 with LMCacheConnectorV1 0.5.2 on node gpu-0: Long sessions"
    )
    assert "Turn off local_disk" in disk["annotations"]["action"]
    assert "LMCache/issues/4385" in disk["annotations"]["references"]
    # the fleet is red for it, naming the advisory
    with env.c.client(env.c.admin) as h:
        (dep,) = h.get("/v1/fleet").json()["deployments"]
    assert dep["status"] == "red"
    # the API serves what was stored
    with env.c.client(env.c.admin) as h:
        (stored,) = h.get("/v1/deployments/glm-prod/config-history").json()
    assert (stored["kv_connector"], stored["kv_connector_version"]) == (
        "LMCacheConnectorV1",
        "0.5.2",
    )
    assert [t["medium"] for t in stored["kv_tiers"]] == ["cpu", "disk"]
    moved = {**lmc, "kv_connector": "LMCacheMPConnector", "kv_connector_version": "0.5.6"}
    env.send(f.config(env.next(), probe=env.probe, **moved))
    assert env.alerts("engine_version_advisory", "firing") == []


def test_int8_kv_with_prefix_caching_fires_and_the_same_dtype_without_it_does_not(
    env: Env,  # noqa: F811
) -> None:
    base = {"engine": "vllm", "engine_version": "0.32.0", "role": "both", "node": "gpu-0",
            "disaggregated": False, "dtype": "int8_per_token_head"}  # fmt: skip
    env.send(f.config(env.next(), probe=env.probe, prefix_caching=False, **base))
    assert env.alerts("engine_version_advisory", "firing") == []
    env.send(f.config(env.next(), probe=env.probe, prefix_caching=True, **base))
    (a,) = env.alerts("engine_version_advisory", "firing")
    assert a["labels"]["advisory"] == "vllm-int8-per-token-head-prefix-cache"
    assert "--no-enable-prefix-caching" in a["annotations"]["action"]
