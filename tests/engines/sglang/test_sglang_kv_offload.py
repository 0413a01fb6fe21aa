"""Where SGLang's KV goes past the pool, read off its server arguments: the names read are
SGLang's own (checked against its ServerArgs), the hierarchical cache's host tier and its
storage tier, and LMCache with the tiers LMCache's configuration turns on."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from engine_probe.kv_destinations import sglang_destinations

READ = ("enable_hierarchical_cache", "hicache_size", "hicache_storage_backend", "enable_lmcache",
        "lmcache_config_file")  # fmt: skip


def _args(**kw: Any) -> Any:
    base = {name: None for name in READ} | {"enable_hierarchical_cache": False,
                                            "enable_lmcache": False, "hicache_size": 0}  # fmt: skip
    return types.SimpleNamespace(**(base | kw))


def test_the_arguments_read_are_sglangs_own() -> None:
    from sglang.srt.server_args import ServerArgs

    # ServerArgs declares its fields as slots (not a dataclass in 0.5.23)
    missing = [name for name in READ if not hasattr(ServerArgs, name)]
    assert missing == []


def test_hicache_is_a_host_tier_and_its_storage_backend_a_second() -> None:
    assert sglang_destinations(_args(), env={}) == {}
    d = sglang_destinations(
        _args(enable_hierarchical_cache=True, hicache_size=64, hicache_storage_backend="file"),
        env={},
    )
    assert d["kv_connector"] == "hicache"
    assert [(t.medium, t.backend, t.capacity_bytes, t.salted) for t in d["kv_tiers"]] == [
        ("cpu", "hicache", 64 << 30, None),
        ("disk", "file", None, None),
    ]
    remote = sglang_destinations(
        _args(enable_hierarchical_cache=True, hicache_storage_backend="mooncake"), env={}
    )
    assert [t.medium for t in remote["kv_tiers"]] == ["cpu", "remote"]
    assert remote["kv_tiers"][0].capacity_bytes is None  # sized by --hicache-ratio


def test_lmcache_reports_its_tiers_from_its_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "lmc.yaml"
    conf.write_text("local_cpu: false\nlocal_disk: /nvme/lmc\nmax_local_disk_size: 100\n")
    d = sglang_destinations(_args(enable_lmcache=True, lmcache_config_file=str(conf)), env={})
    assert d["kv_connector"] == "LMCache"
    assert [(t.medium, t.capacity_bytes) for t in d["kv_tiers"]] == [("disk", 100 << 30)]


def test_an_unreadable_lmcache_config_still_reports_the_connector(tmp_path: Path) -> None:
    d = sglang_destinations(
        _args(enable_lmcache=True, lmcache_config_file=str(tmp_path / "missing.yaml")), env={}
    )
    assert d["kv_connector"] == "LMCache"
    assert [t.medium for t in d["kv_tiers"]] == ["cpu"]  # LMCache's default CPU tier
