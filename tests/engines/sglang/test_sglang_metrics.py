"""kvwatch's scrape translation on the exposition SGLang 0.5.23's own metric classes write
(``sglang.srt.observability.metrics_collector``, rendered by ``sglang_exposition.render``):
pool capacity, context length, page size and occupancy per data-parallel rank."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest
from sglang_exposition import render, server_info

from engine_probe import events as ev
from kvwatch.scrape import NotThatEngine, translate

# The incident's figures: a 681,280-token pool under a 1,048,576-token context.
INCIDENT: dict[str, Any] = {
    "model_name": "glm-4.6",
    "max_total_num_tokens": 681_280,
    "context_len": 1_048_576,
    "page_size": 64,
    "kv_used_tokens": 200_000,
    "kv_available_tokens": 400_000,
    "kv_evictable_tokens": 81_280,
    "prompts": [1_000, 30_000, 700_000],
}
# SGLang's own /server_info document for a server started with these arguments.
SERVER_ARGS = {
    "model_path": "glm-4.6",
    "tp_size": 8,
    "dtype": "bfloat16",
    "kv_cache_dtype": "fp8_e4m3",
    "quantization": "fp8",
}


def _stamped(fields: dict[str, Any], kind: type[ev.Event], seq: int) -> ev.Event:
    """The event as a producer would send it, through the wire contract's decoder."""
    event = kind(
        schema_version=1,
        probe_id="scrape-t",
        seq=seq,
        ts=ev.utcnow(),
        deployment_id="d",
        **fields,
    )
    return ev.decode_event(ev.encode_event(event))


def test_the_incident_pool_and_its_occupancy() -> None:
    scrape = translate(
        "sglang",
        render(INCIDENT),
        node="sglang-0",
        side={"server_info": server_info(**SERVER_ARGS)},
    )
    (node,) = scrape.nodes
    assert (node.node, node.role, node.disaggregated, node.model_id) == (
        "sglang-0",
        "both",
        False,
        "glm-4.6",
    )
    assert (node.pool_capacity_tokens, node.advertised_context, node.page_size) == (
        681_280,
        1_048_576,
        64,
    )
    # Slots holding evictable radix-cache entries are neither used nor free.
    assert (node.used_tokens, node.free_tokens) == (200_000, 400_000)
    assert (node.engine_version, node.dtype, node.quantization, node.tp_size) == (
        version("sglang"),
        "fp8_e4m3",
        "fp8",
        8,
    )
    assert node.cuda_graphs and node.prefix_caching  # SGLang's defaults: both on

    config = _stamped(node.config_fields(), ev.EngineConfig, 1)
    assert isinstance(config, ev.EngineConfig)
    assert config.pool_capacity_tokens < config.advertised_context  # what the policy flags
    pool = _stamped(node.pool_fields(), ev.PoolSample, 2)
    assert isinstance(pool, ev.PoolSample) and pool.capacity_tokens == 681_280

    (prompts,) = scrape.prompts
    assert (prompts.requests, prompts.prompt_tokens_total) == (3, 731_000)
    # SGLang's buckets around the pool are 600,000 and 800,000: the 700,000-token prompt
    # may or may not be longer than the 681,280-token pool, as far as they can tell.
    assert (prompts.over_pool_at_least, prompts.over_pool_at_most) == (0, 1)
    assert prompts.largest_prompt_at_most == 800_000


def test_each_data_parallel_rank_of_a_prefill_server_is_a_node() -> None:
    ranks = [
        {
            "max_total_num_tokens": 284_928,
            "context_len": 1_048_576,
            "page_size": 1,
            "kv_used_tokens": 1_000,
            "kv_available_tokens": 283_000,
        },
        {
            "max_total_num_tokens": 284_928,
            "context_len": 1_048_576,
            "page_size": 1,
            "kv_used_tokens": 50_000,
            "kv_available_tokens": 234_928,
        },
    ]
    text = render({"model_name": "m", "engine_type": "prefill", "dp_ranks": ranks})
    scrape = translate("sglang", text, node="p")
    assert [(n.node, n.role, n.disaggregated, n.used_tokens) for n in scrape.nodes] == [
        ("p", "prefill", True, 1_000),  # rank 0 is the node itself (engine_probe.node)
        ("p/dp1", "prefill", True, 50_000),
    ]
    assert {n.pool_capacity_tokens for n in scrape.nodes} == {284_928}
    # Without /server_info the version and dtype are unknown, not guessed.
    assert {(n.engine_version, n.dtype) for n in scrape.nodes} == {("unknown", "unknown")}


def test_a_server_that_has_run_nothing_yet_has_a_free_pool() -> None:
    figures = {k: v for k, v in INCIDENT.items() if not k.startswith("kv_")}
    (node,) = translate("sglang", render({**figures, "prompts": []}), node="n").nodes
    assert (node.used_tokens, node.free_tokens) == (0, 681_280)


def test_sglang_metrics_are_not_vllm_metrics() -> None:
    with pytest.raises(NotThatEngine, match="vllm:cache_config_info not found at m"):
        translate("vllm", render(INCIDENT), source="m")


def test_cuda_graphs_do_not_follow_the_last_batch() -> None:
    """``sglang:is_cuda_graph`` is whether the last batch ran as a CUDA graph (every prefill
    does not): without /server_info the figures, and so the config hash that decides when
    engine.config is resent, must not change with it."""
    figures = [
        {k: v for k, v in INCIDENT.items() if k != "prompts"} | {"is_cuda_graph": graph}
        for graph in (1, 0)
    ]
    decode, prefill = (translate("sglang", render(f), node="n").nodes[0] for f in figures)
    assert decode.config_fields() == prefill.config_fields()
    with_info = translate(
        "sglang", render(figures[1]), node="n", side={"server_info": server_info(**SERVER_ARGS)}
    )
    assert with_info.nodes[0].cuda_graphs is True  # what the server was started with
