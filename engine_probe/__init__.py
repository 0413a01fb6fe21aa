"""kvwatch's in-engine probe: typed events, a never-blocking buffer, an exporter with a spool.

Public API: :func:`get_probe`, :func:`configure_probe`, :func:`shutdown_probe`,
:class:`Probe`, :class:`NoopProbe`, :class:`BaseProbe`, :class:`ProbeSettings`, and for tests
and benchmarks :class:`RecordingProbe` (keeps the events in memory; ``engine_probe.recording``).

The top level is lazy (PEP 562): ``import engine_probe.events`` — the wire contract that
``policies`` and the collector share — must not load the exporter, httpx, pydantic-settings
or register the probe's ``atexit`` hook. The runtime loads on first use of a name below.
This package never imports torch (the adapters that need it live in ``adapters/``).
"""

from __future__ import annotations

#: kvwatch's version, one place: both distributions read it (pyproject.toml, probe/)
__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_probe.probe import (
        BaseProbe,
        NoopProbe,
        Probe,
        configure_probe,
        get_probe,
        shutdown_probe,
    )
    from engine_probe.recording import RecordingProbe
    from engine_probe.settings import ProbeSettings

_LAZY = {
    "BaseProbe": "engine_probe.probe",
    "NoopProbe": "engine_probe.probe",
    "Probe": "engine_probe.probe",
    "configure_probe": "engine_probe.probe",
    "get_probe": "engine_probe.probe",
    "shutdown_probe": "engine_probe.probe",
    "ProbeSettings": "engine_probe.settings",
    "RecordingProbe": "engine_probe.recording",
}

__all__ = [
    "BaseProbe",
    "NoopProbe",
    "Probe",
    "ProbeSettings",
    "RecordingProbe",
    "configure_probe",
    "get_probe",
    "shutdown_probe",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_probe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
