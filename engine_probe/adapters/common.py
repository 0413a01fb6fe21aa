"""What every engine adapter (refengine, vLLM, SGLang) does the same way when it turns engine
objects into wire events: ids that always pass the wire's id check, and page-id lists cut to
the wire's per-event limit."""

from __future__ import annotations

import hashlib

from engine_probe.events import MAX_PAGE_IDS, is_valid_id

__all__ = ["chunks", "safe_id"]


def safe_id(value: str, prefix: str) -> str:
    """``value`` if it is a valid wire id, else a stable hashed stand-in (never dropped: an
    engine's request or tenant name may hold characters the wire refuses)."""
    if is_valid_id(value):
        return value
    return f"{prefix}-{hashlib.sha256(value.encode()).hexdigest()[:24]}"


def chunks(pages: list[int]) -> list[list[int]]:
    """``pages`` in runs of at most ``MAX_PAGE_IDS`` (at least one run, maybe empty)."""
    return [pages[i : i + MAX_PAGE_IDS] for i in range(0, len(pages), MAX_PAGE_IDS)] or [[]]
