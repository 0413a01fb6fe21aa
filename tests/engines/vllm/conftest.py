"""Fixtures for tests that drive vLLM 0.32's own scheduler in-process (run in .venv-vllm).

``make_scheduler`` builds a real v1 ``Scheduler`` (with its real ``KVCacheManager`` and
``BlockPool``, and optionally vLLM's real ``ExampleConnector`` on the scheduler side) for a
tiny local Llama config; a test plays the model runner's part by handing the scheduler a
``ModelRunnerOutput`` per step, as vLLM's own scheduler tests do. The ``probe`` fixture is
``engine_probe.recording.RecordingProbe``: kvwatch's probe keeping the events in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from engine_probe.recording import RecordingProbe

BLOCK = 16


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama config directory (config only: the scheduler never loads weights)."""
    from bench.vllm_overhead import write_model_config  # one definition: the bench's

    path = tmp_path_factory.mktemp("tiny-llama")
    write_model_config(path)
    return path


@pytest.fixture
def make_scheduler(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make_scheduler(num_blocks=..., connector=False, policy="recompute",
    max_batched=1024, async_scheduling=False)`` → a real vLLM Scheduler (its
    ``AsyncScheduler`` with ``async_scheduling``: steps overlap, as with vLLM's batch queue);
    with ``connector``, vLLM's ExampleConnector (storage under tmp_path)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    def build(
        num_blocks: int = 64,
        connector: bool = False,
        policy: str = "recompute",
        max_batched: int = 1024,
        async_scheduling: bool = False,
    ) -> Any:
        model_config = ModelConfig(
            model=str(tiny_model),
            tokenizer=None,
            skip_tokenizer_init=True,
            max_model_len=1024,
            dtype="float32",
            seed=0,
        )
        kv_transfer = None
        if connector:
            kv_transfer = KVTransferConfig(
                kv_connector="ExampleConnector",
                kv_role="kv_both",
                kv_load_failure_policy=policy,  # type: ignore[arg-type]
                kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")},
            )
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=max_batched,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=kv_transfer,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32
                    ),
                )
            ],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        cls = AsyncScheduler if async_scheduling else Scheduler
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=False,
        )

    yield build


@pytest.fixture
def probe() -> RecordingProbe:
    return RecordingProbe()
