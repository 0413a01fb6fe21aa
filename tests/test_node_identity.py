"""The node id rule (``engine_probe.node``) and where each producer applies it: the vLLM
plugin's reading of its server's address, rank and role (``engine_probe.adapters.vllm.node``),
the scraper's default and its reading of ``kvwatch:node_info``, and ``KVWATCH_NODE_ID``.
The live half (a real vLLM server and a second replica) is tests/test_vllm_replicas.py."""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from engine_probe import events as ev
from engine_probe.adapters.vllm import node as vnode
from engine_probe.events import ID_MAX, is_valid_id
from engine_probe.node import machine_host, node_id, server_base
from engine_probe.settings import ProbeSettings, ProducerSettings
from kvwatch.scrape import make_target
from kvwatch.scrape import vllm as scrape_vllm
from kvwatch.scrape.exposition import parse

HOST = socket.gethostname()


@pytest.mark.parametrize("host", [None, "", "0.0.0.0", "::", "localhost", "127.0.0.1",
                                  "127.3.2.1", "::1", "[::1]"])  # fmt: skip
def test_a_wildcard_or_loopback_host_is_the_machine(host: str | None) -> None:
    assert machine_host(host) == HOST
    assert server_base(host, 8000) == f"{HOST}:8000"


def test_a_named_host_stays_and_the_role_names_one_side_of_a_pair() -> None:
    assert server_base("gpu-7.internal", 8000) == "gpu-7.internal:8000"
    assert server_base("10.1.2.3", 8001, "prefill") == "10.1.2.3:8001/prefill"
    assert server_base("10.1.2.3", 8002, "decode") == "10.1.2.3:8002/decode"
    assert server_base("10.1.2.3", 8000, "both") == "10.1.2.3:8000"
    assert server_base("gpu-7", None) == "gpu-7"  # no HTTP server (vLLM's LLM in a script)


def test_ranks_1_and_up_add_their_suffix_rank_0_is_the_base() -> None:
    assert node_id("gpu-7:8000") == "gpu-7:8000"
    assert node_id("gpu-7:8000", dp_rank=0) == "gpu-7:8000"
    assert node_id("gpu-7:8000", dp_rank=3) == "gpu-7:8000/dp3"
    assert node_id("gpu-7:8000", dp_rank=1, tp_rank=2) == "gpu-7:8000/dp1/tp2"
    # ids always follow the wire rule, and fit in it with their suffix
    odd = node_id("my host!" + "x" * 300, dp_rank=12)
    assert is_valid_id(odd) and odd.endswith("/dp12") and len(odd) == ID_MAX
    assert odd.startswith("my-host-")


def test_kvwatch_node_id_is_validated_like_the_other_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWATCH_NODE_ID", "replica-b")
    assert ProducerSettings().node_id == "replica-b"
    assert ProbeSettings().node_id == "replica-b"
    monkeypatch.setenv("KVWATCH_NODE_ID", "  ")
    assert ProducerSettings().node_id is None  # exported but empty: unset
    monkeypatch.setenv("KVWATCH_NODE_ID", "replica b\n")
    with pytest.raises(ValidationError, match="KVWATCH_NODE_ID='replica b\\\\n' is not a valid"):
        ProducerSettings()


@pytest.mark.parametrize(
    ("argv", "found"),
    [
        (["/v/bin/vllm", "serve", "m", "--port", "9000", "--host", "0.0.0.0"], ("0.0.0.0", 9000)),
        (["/v/bin/vllm", "serve", "m", "--port=9001"], (None, 9001)),
        (["/v/bin/vllm", "serve", "m"], (None, 8000)),  # vLLM's default port
        (
            [
                "/v/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py",
                "--model",
                "m",
                "--host",
                "gpu-3",
                "--port",
                "8100",
            ],
            ("gpu-3", 8100),
        ),
        (["/v/bin/vllm", "serve", "m", "--uds", "/run/v.sock"], (None, None)),
        (["/v/bin/vllm", "serve", "m", "--port", "eighty"], None),  # unreadable: not guessed
        (["my_script.py", "--port", "9000"], None),  # LLM in a script: its flags are its own
        (["/v/bin/vllm", "bench", "--port", "9000"], None),
        ([], None),
    ],
)
def test_the_api_servers_address_from_its_command_line(
    argv: list[str], found: tuple[str | None, int | None] | None
) -> None:
    assert vnode.server_from_argv(argv) == found


def _cfg(*, dp_index: int = 0, kv_role: str | None = None, cache: str = "auto") -> Any:
    """A vLLM config's shape as far as the node rule reads it (the live test reads a real one)."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            data_parallel_index=dp_index, data_parallel_rank=0, tensor_parallel_size=1
        ),
        kv_transfer_config=None if kv_role is None else SimpleNamespace(kv_role=kv_role),
        cache_config=SimpleNamespace(cache_dtype=cache),
        model_config=SimpleNamespace(dtype="torch.bfloat16"),
    )


def test_the_engine_core_names_itself_from_what_the_api_server_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(vnode.SERVER_VAR, raising=False)
    vnode.remember_server(["/v/bin/vllm", "serve", "m", "--host", "gpu-3", "--port", "8100"])
    assert json.loads(os.environ[vnode.SERVER_VAR]) == {"host": "gpu-3", "port": 8100}
    # the engine core inherits it; a second register() (or the core's) keeps it
    vnode.remember_server(["/v/bin/vllm", "serve", "m", "--port", "1"])
    assert vnode.server_address() == ("gpu-3", 8100)
    assert vnode.node_of(_cfg()) == "gpu-3:8100"
    # a dense model's DP rank: vLLM resets data_parallel_rank, the index keeps the rank
    assert vnode.node_of(_cfg(dp_index=2)) == "gpu-3:8100/dp2"
    assert vnode.node_of(_cfg(kv_role="kv_producer")) == "gpu-3:8100/prefill"
    assert vnode.node_of(_cfg(kv_role="kv_consumer", dp_index=1)) == "gpu-3:8100/decode/dp1"
    assert vnode.node_of(_cfg(kv_role="kv_both")) == "gpu-3:8100"
    # KVWATCH_NODE_ID replaces the base; ranks still tell ranks apart
    assert vnode.node_of(_cfg(dp_index=1), "replica-b") == "replica-b/dp1"
    # no server remembered (LLM in a script): the machine
    monkeypatch.delenv(vnode.SERVER_VAR)
    assert vnode.node_of(_cfg()) == HOST


def test_the_kv_dtype_is_resolved() -> None:
    assert vnode.kv_dtype(_cfg()) == "bfloat16"  # auto: the model's
    assert vnode.kv_dtype(_cfg(cache="fp8_e4m3")) == "fp8_e4m3"


def _metrics(*, published: bool, engines: int = 1, offloading: str = "") -> str:
    lines = []
    for e in range(engines):
        lines += [
            f'vllm:cache_config_info{{block_size="32",cache_dtype="auto",enable_prefix_caching='
            f'"True",engine="{e}",{offloading}num_gpu_blocks="100"}} 1.0',
            f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} 0.25',
        ]
        if published:
            lines.append(
                f'kvwatch:node_info{{cuda_graphs="true",engine="{e}",kv_dtype="bfloat16",'
                f'node="gpu-3:8100{"" if e == 0 else f"/dp{e}"}",quantization="awq",'
                f'role="prefill",tp_size="2"}} 1.0'
            )
    return "\n".join(lines) + "\n"


_MODELS = {"data": [{"id": "m", "max_model_len": 2048}]}


def test_the_scraper_takes_the_node_and_settings_the_probe_publishes() -> None:
    exp = parse(_metrics(published=True, engines=2), "test")
    got = scrape_vllm.translate(exp, node_prefix="127.0.0.1:8100", models=_MODELS)
    assert [n.node for n in got.nodes] == ["gpu-3:8100", "gpu-3:8100/dp1"]
    (one, _) = got.nodes
    assert (one.dtype, one.role, one.quantization, one.tp_size, one.cuda_graphs) == (
        "bfloat16",
        "prefill",
        "awq",
        2,
        True,
    )
    # --node is the operator's: it wins over the published id (not over the dtype)
    given = scrape_vllm.translate(exp, node_prefix="mine", models=_MODELS, node_given=True)
    assert [n.node for n in given.nodes] == ["mine", "mine/dp1"]
    assert given.nodes[0].dtype == "bfloat16"


def test_without_the_plugin_the_scraper_derives_the_same_rule() -> None:
    target = make_target("http://127.0.0.1:8100", "vllm")
    assert (target.node, target.node_given) == (f"{HOST}:8100", False)
    assert make_target("http://gpu-3:8100/metrics", "vllm", role="decode").node == (
        "gpu-3:8100/decode"
    )
    assert make_target("https://gpu-3/", "vllm").node == "gpu-3:443"
    assert make_target("http://gpu-3:8100", "vllm", node="b").node_given is True
    exp = parse(_metrics(published=False, engines=2), "test")
    got = scrape_vllm.translate(exp, node_prefix=target.node, models=_MODELS)
    assert [n.node for n in got.nodes] == [f"{HOST}:8100", f"{HOST}:8100/dp1"]
    assert got.nodes[0].dtype == "auto"  # unresolved: the collector compares it with nothing


@pytest.mark.parametrize(
    ("labels", "connector", "tiers"),
    [
        ('kv_offloading_backend="native",kv_offloading_size="None",', None, []),
        ('kv_offloading_backend="native",kv_offloading_size="4.0",', "OffloadingConnector",
         [{"medium": "cpu", "backend": "native", "capacity_bytes": 4 << 30, "salted": True}]),
        ('kv_offloading_backend="lmcache",kv_offloading_size="4.0",', "LMCacheMPConnector", []),
    ],
)  # fmt: skip
def test_the_scraper_reads_vllms_offloading_flags(
    labels: str, connector: str | None, tiers: list[dict[str, Any]]
) -> None:
    """From outside the engine, vLLM's cache_config_info labels say --kv-offloading-size and
    --kv-offloading-backend: the node's engine.config carries the connector vLLM turns them
    into, and the native CPU tier (salted: its keys are the salted block hashes)."""
    exp = parse(_metrics(published=False, offloading=labels), "test")
    (node,) = scrape_vllm.translate(exp, node_prefix="127.0.0.1:8100", models=_MODELS).nodes
    fields = node.config_fields()
    assert fields.get("kv_connector") == connector
    assert [msgspec.to_builtins(t) for t in fields.get("kv_tiers", ())] == tiers
    stamp = {"schema_version": 1, "probe_id": "scrape-1", "seq": 1, "deployment_id": "d",
             "ts": "2026-12-04T00:00:00Z"}  # fmt: skip
    # what the scraper sends goes over the wire and decodes as it should
    sent = msgspec.json.encode({"kind": "engine.config", **stamp, **fields})
    decoded = ev.decode_event(sent)
    assert isinstance(decoded, ev.EngineConfig) and decoded.kv_connector == connector
