"""Fixtures for tests inside the SGLang venv (.venv-sglang): real SGLang classes on CPU.

``tvstub`` (imported first) stubs ``torchvision`` for SGLang's imports; see there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tvstub  # noqa: F401  (before anything imports SGLang)

from engine_probe.recording import RecordingProbe


@pytest.fixture
def probe() -> RecordingProbe:
    return RecordingProbe()


@pytest.fixture
def tp_rank0() -> Iterator[None]:
    """SGLang's Req.set_finish_with_abort asks which tensor-parallel rank logs: rank 0."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):
        yield
