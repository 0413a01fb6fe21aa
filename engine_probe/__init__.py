"""kvwatch's in-engine probe: typed events, a never-blocking buffer, an exporter with a spool.

Public API: :func:`get_probe`, :func:`configure_probe`, :class:`Probe`, :class:`ProbeSettings`.
This package never imports torch (adapters that need it live in their own modules).
"""

from engine_probe.probe import (
    BaseProbe,
    NoopProbe,
    Probe,
    configure_probe,
    get_probe,
    shutdown_probe,
)
from engine_probe.settings import ProbeSettings

__all__ = [
    "BaseProbe",
    "NoopProbe",
    "Probe",
    "ProbeSettings",
    "configure_probe",
    "get_probe",
    "shutdown_probe",
]
