"""Reading where KV goes past the pool never stops an engine: what a configuration gets
wrong (a size that is not a number, infinite, past the contract's ceiling, a MultiConnector
without its list) is left out or clamped, and the engine.config still goes out."""

from __future__ import annotations

import types
from datetime import UTC, datetime
from pathlib import Path

from engine_probe import events as ev
from engine_probe.kv_destinations import (
    lmcache_settings,
    lmcache_tiers,
    sglang_destinations,
    vllm_destinations,
)


def test_sizes_that_are_not_sizes_are_left_out_and_huge_ones_clamped(tmp_path: Path) -> None:
    conf = tmp_path / "lmc.yaml"
    conf.write_text("max_local_cpu_size: inf\nlocal_disk: /d\nmax_local_disk_size: 1e30\n")
    tiers = lmcache_tiers(lmcache_settings(str(conf), {}))
    assert [(t.medium, t.capacity_bytes) for t in tiers] == [("cpu", None), ("disk", 2**60)]
    env = {"LMCACHE_MAX_LOCAL_CPU_SIZE": "lots"}
    assert lmcache_tiers(lmcache_settings(None, env))[0].capacity_bytes is None


def test_a_broken_connector_config_still_names_the_connector() -> None:
    ktc = types.SimpleNamespace(
        kv_connector="MultiConnector", kv_role="kv_both",
        kv_connector_extra_config={"connectors": None},
    )  # fmt: skip
    d = vllm_destinations(types.SimpleNamespace(kv_transfer_config=ktc), env={})
    assert d == {"kv_connector": "MultiConnector", "disaggregated": False}
    ktc = types.SimpleNamespace(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": float("nan")},
    )  # fmt: skip
    (tier,) = vllm_destinations(types.SimpleNamespace(kv_transfer_config=ktc), env={})["kv_tiers"]
    assert tier.capacity_bytes is None


def test_what_is_read_always_decodes_as_the_contract_says() -> None:
    args = types.SimpleNamespace(
        enable_lmcache=False, enable_hierarchical_cache=True, hicache_size=10**12,
        hicache_storage_backend="mooncake", lmcache_config_file=None,
    )  # fmt: skip
    d = sglang_destinations(args, env={})
    assert d["kv_tiers"][0].capacity_bytes == 2**60  # a size past the ceiling, clamped
    cfg = ev.EngineConfig(
        schema_version=1, probe_id="p", seq=1, ts=datetime(2026, 12, 4, tzinfo=UTC),
        deployment_id="d", engine="sglang", engine_version="0.5.23", model_id="m",
        advertised_context=8, pool_capacity_tokens=8, page_size=1, dtype="auto", **d,
    )  # fmt: skip
    assert ev.decode_event(ev.encode_event(cfg)) == cfg
