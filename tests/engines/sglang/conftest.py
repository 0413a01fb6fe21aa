"""Fixtures for tests inside the SGLang venv (.venv-sglang): real SGLang classes on CPU.

``tvstub`` (imported first) stubs ``torchvision`` for SGLang's imports; see there.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import tvstub  # noqa: F401  (before anything imports SGLang)

from engine_probe.events import Event
from engine_probe.probe import BaseProbe


class RecordingProbe(BaseProbe):
    """kvwatch's probe interface, keeping every emitted event in memory (built and
    validated as the real probe builds them)."""

    enabled = True

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(
        self,
        event_type: type[Event],
        /,
        *,
        ts: datetime | None = None,
        deployment_id: str | None = None,
        **fields: Any,
    ) -> bool:
        from engine_probe.events import utcnow

        self.events.append(
            event_type(
                schema_version=1,
                probe_id="test",
                seq=len(self.events) + 1,
                ts=ts or utcnow(),
                deployment_id=deployment_id or "test",
                **fields,
            )
        )
        return True

    def of(self, event_type: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, event_type)]

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"enabled": True, "emitted": len(self.events)}


@pytest.fixture
def probe() -> RecordingProbe:
    return RecordingProbe()


@pytest.fixture
def tp_rank0() -> Iterator[None]:
    """SGLang's Req.set_finish_with_abort asks which tensor-parallel rank logs: rank 0."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):
        yield
