"""Where vLLM's KV goes past the pool, read off vLLM's own configuration classes, and the
offload tier's keys checked against vLLM's own hasher and CPU offloading manager.

vLLM's native offloading cannot run on this CPU build (``CPUOffloadingSpec.get_worker``
raises "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"; its worker
uses CUDA streams and cudaHostRegister), so no live vLLM offload runs here. What runs is
the part the isolation depends on: the scheduler side's keys. vLLM keys offloaded blocks by
the request's block hashes (``make_offload_key``), which carry ``cache_salt``; the probe's
tier ledger records each store under its writer and salt and judges each load. The positive
control is a key built without the salt (what a tier that drops it computes)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from engine_probe.kv_destinations import vllm_destinations
from engine_probe.tier_ledger import TierLedger, TierWriter, salt_digest


def _ktc(**kw: Any) -> Any:
    from vllm.config import KVTransferConfig

    return types.SimpleNamespace(kv_transfer_config=KVTransferConfig(**kw))


def test_the_native_offloading_connector_is_one_salted_cpu_tier() -> None:
    d = vllm_destinations(
        _ktc(kv_connector="OffloadingConnector", kv_role="kv_both",
             kv_connector_extra_config={"cpu_bytes_to_use": 8 << 30}),
        env={},
    )  # fmt: skip
    assert d["kv_connector"] == "OffloadingConnector" and d["disaggregated"] is False
    (tier,) = d["kv_tiers"]
    assert (tier.medium, tier.backend, tier.capacity_bytes, tier.salted) == (
        "cpu", "native", 8 << 30, True,
    )  # fmt: skip


def test_kv_offloading_size_expands_to_the_native_connector(tiny_model: Path) -> None:
    """``--kv-offloading-size`` (CacheConfig.kv_offloading_size, GiB) is what most operators
    set: vLLM itself turns it into the OffloadingConnector with cpu_bytes_to_use."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    cfg = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), tokenizer=None, skip_tokenizer_init=True,
                                 max_model_len=1024, dtype="float32", seed=0),
        cache_config=CacheConfig(block_size=16, kv_offloading_size=2.0),
    )  # fmt: skip
    d = vllm_destinations(cfg, env={})
    assert d["kv_connector"] in ("OffloadingConnector", "SimpleCPUOffloadConnector")
    assert d["kv_tiers"][0].capacity_bytes == 2 << 30


def test_lmcache_in_process_reports_its_version_and_the_tiers_its_config_turns_on(
    tmp_path: Path,
) -> None:
    conf = tmp_path / "lmcache.yaml"
    conf.write_text("local_cpu: true\nmax_local_cpu_size: 8\nlocal_disk: file:///tmp/lmc\n"
                    "max_local_disk_size: 28\n")  # fmt: skip
    d = vllm_destinations(
        _ktc(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
        env={"LMCACHE_CONFIG_FILE": str(conf), "LMCACHE_REMOTE_URL": "redis://cache:6379"},
    )
    assert d["kv_connector"] == "LMCacheConnectorV1" and d["disaggregated"] is False
    assert d["kv_connector_version"] is None  # LMCache is not installed here
    assert [(t.medium, t.backend, t.capacity_bytes, t.salted) for t in d["kv_tiers"]] == [
        ("cpu", "lmcache", 8 << 30, None),
        ("disk", "lmcache", 28 << 30, None),
        ("remote", "redis", None, None),
    ]


def test_a_transfer_connector_is_disaggregation_and_a_multi_connector_names_the_keeper() -> None:
    d = vllm_destinations(_ktc(kv_connector="NixlConnector", kv_role="kv_both"), env={})
    assert d == {"kv_connector": "NixlConnector", "disaggregated": True}
    d = vllm_destinations(
        _ktc(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
            ]}),
        env={},
    )  # fmt: skip
    assert d["kv_connector"] == "OffloadingConnector" and d["kv_tiers"][0].capacity_bytes == 1 << 30
    assert d["disaggregated"] is True  # its NIXL member moves KV between nodes
    assert vllm_destinations(types.SimpleNamespace(kv_transfer_config=None)) == {
        "disaggregated": False
    }


def _requests(salts: dict[str, str | None]) -> dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    prompt = list(range(1000, 1064))  # the same four blocks for everyone
    return {
        rid: Request(rid, prompt, SamplingParams(max_tokens=1), None, cache_salt=salt,
                     block_hasher=hasher)
        for rid, salt in salts.items()
    }  # fmt: skip


@pytest.mark.parametrize("drops_salt", [False, True], ids=["salted-keys", "salt-dropped"])
def test_the_tier_ledger_judges_loads_from_vllms_own_offload_keys(drops_salt: bool) -> None:
    """acme's blocks go to vLLM's CPU offloading manager under vLLM's own keys; globex (its
    own salt) and acme again (same salt) look them up. With vLLM's keys globex misses and
    acme hits; with keys that drop the salt (the fault) globex hits, and the probe's ledger
    says whose write it was served, across tenants and salts."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    salts = {"acme-1": "salt-a", "globex-1": "salt-g", "acme-2": "salt-a"}
    reqs = _requests(salts)
    unsalted = _requests({"any": None})["any"]

    def keys(rid: str) -> list[bytes]:
        hashes = unsalted.block_hashes if drops_salt else reqs[rid].block_hashes
        return [make_offload_key(h, 0) for h in hashes]

    tier, ledger = CPUOffloadingManager(num_chunks=16), TierLedger()
    stored = keys("acme-1")
    assert tier.prepare_store(stored, ReqContext("acme-1")) is not None
    tier.complete_store(stored, ReqContext("acme-1"))
    for key in stored:
        ledger.store(key, TierWriter("acme-1", "acme", salt_digest("salt-a")))

    def load(rid: str, tenant: str) -> list[Any]:
        found = [k for k in keys(rid) if tier.lookup(k, ReqContext(rid)) is LookupResult.HIT]
        return [ledger.load(k, tenant, salt_digest(salts[rid])) for k in found]

    same = load("acme-2", "acme")
    assert len(same) == 4 and not any(v.cross_tenant or v.salt_mismatch for v in same)
    other = load("globex-1", "globex")
    if not drops_salt:
        assert other == []  # vLLM's keys carry the salt: nothing of acme's to load
    else:
        assert len(other) == 4
        assert all(v.cross_tenant and v.salt_mismatch for v in other)
        assert {v.writer.tenant for v in other if v.writer} == {"acme"}
