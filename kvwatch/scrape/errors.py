"""What a scrape raises. Every message names the target and what was missing or wrong.

The scrape package stands alone (see :mod:`kvwatch.scrape`): of ours it imports only the
contract and :mod:`engine_probe.errors`, a module of plain classes, so its errors keep
hanging under :class:`ProbeError`, as they did in engine_probe and as the KV-events
consumer's do (whoever catches a ProbeError still catches them).
"""

from __future__ import annotations

from engine_probe.errors import ProbeError


class ScrapeError(ProbeError):
    """Base class: the target could not be turned into events. ``kvwatch scrape`` exits 2 on
    it; the collector's scheduled scraper records it as the target's last error (translated by
    :mod:`kvwatch.scheduled_scrape`)."""


class BadTarget(ScrapeError, ValueError):
    """The target itself is unusable: not an http(s) URL, an unknown engine, a bad node id."""


class TargetUnreachable(ScrapeError):
    """Nothing usable came back: connection refused, timeout, an HTTP error status."""


class NotThatEngine(ScrapeError):
    """The target answered, but not with the named engine's metrics (its marker metric is
    missing): a wrong URL, a wrong ``--engine``, or metrics turned off."""


class MalformedMetrics(ScrapeError, ValueError):
    """The exposition (or an endpoint it needs) is not what the engine writes: unparsable
    text, a missing or non-numeric figure, a value out of range."""
