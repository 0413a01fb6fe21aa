"""The engine_probe package's exceptions: one tree under :class:`ProbeError`.

The probe raises only for caller bugs (bad settings, a wrong event type or field) and never
for runtime conditions such as a full buffer or an unreachable collector: those are counted
as drops, because an observability probe must not take the engine down with it.

This module is plain classes and imports nothing, so the wire contract
(:mod:`engine_probe.events`) and the producers that observe an engine from outside
(:mod:`kvwatch.scrape`, :mod:`kvwatch.kv_events`) hang their errors under :class:`ProbeError`
without loading the probe's runtime.
"""

from __future__ import annotations


class ProbeError(Exception):
    """Base class of every error the engine_probe package raises on purpose.

    - here: the probe's own (:class:`ProbeConfigError`, :class:`InvalidEventError`, the
      spool's :class:`SpoolError`), raised to the code that configures or calls the probe;
    - :class:`engine_probe.events.DecodeError` and :class:`engine_probe.events.BatchTooLarge`:
      a batch the wire contract refuses; the collector's ingest route answers them as 422
      and 413;
    - outside engine_probe, :class:`kvwatch.scrape.ScrapeError` and its subclasses: a
      ``/metrics`` target that cannot be read; ``kvwatch scrape`` exits 2, the collector's
      scheduled scraper records the failure on the target; and
      :class:`kvwatch.kv_events.KvEventsError`: KV events that cannot be consumed
      (``kvwatch kv-events`` exits 2);
    - :class:`engine_probe.adapters.sglang.SGLangProbeError`: the SGLang adapter cannot
      attach to that SGLang version.

    Subclasses keep a builtin base (``ValueError``, ``OSError``, ``TypeError``) where callers
    catch that.
    """


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
