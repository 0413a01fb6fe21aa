"""Exceptions raised by the probe core.

The probe raises only for caller bugs (bad settings, a wrong event type or field) and never
for runtime conditions such as a full buffer or an unreachable collector: those are counted
as drops, because an observability probe must not take the engine down with it.
"""

from __future__ import annotations


class ProbeError(Exception):
    """Base class of every error the probe raises."""


class ProbeConfigError(ProbeError, ValueError):
    """Settings that cannot work (reported at construction, never on the hot path)."""


class InvalidEventError(ProbeError, ValueError):
    """``emit`` was called with an event type or fields the wire contract does not allow.

    Raised before a sequence number is consumed, so the caller's bug leaves no seq gap.
    """


class SpoolError(ProbeError, OSError):
    """The spool directory could not be used (not writable, disk error, ...)."""


class SpoolFullError(SpoolError):
    """Writing a batch would take the spool past ``probe_max_spool_bytes``."""


class SpoolLockedError(SpoolError):
    """Another live process holds the lock of this probe's spool directory."""
