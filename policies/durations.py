"""Durations as rule packs write them: ``90s``, ``15m``, ``4h``, ``3d`` or a number of seconds."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")


def parse_duration(value: object) -> float:
    """Seconds, from a number (seconds) or a string with a unit. Raises ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 30s, 15m or 4h, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2) or "s"]
    raise ValueError(f"expected a duration such as 30s, 15m or 4h, got {value!r}")


def format_duration(seconds: float) -> str:
    """The shortest exact form: ``72h``, ``90s``, ``1.5s``."""
    for unit in ("w", "d", "h", "m", "s"):
        n = seconds / _UNITS[unit]
        if n >= 1 and n == int(n):
            return f"{int(n)}{unit}"
    return f"{seconds:g}s"


def human_duration(seconds: float) -> str:
    """How every output (CLI, alert summaries, reports, dashboard) prints an elapsed time or
    an age: at most its two largest units, rounded down, ``45s``, ``6m 49s``, ``1h 9m``,
    ``3d 4h``; under a second ``0s``. Rule packs keep :func:`format_duration`'s exact form."""
    left = max(0, int(seconds))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, left = divmod(left, size)
        if n or parts:
            parts.append(f"{n}{unit}")
        if len(parts) == 2:
            break
    parts = [p for p in parts if not p.startswith("0")] or ["0s"]
    return " ".join(parts)
