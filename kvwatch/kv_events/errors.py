"""What the KV-events consumer raises. Like :mod:`kvwatch.scrape`'s errors, they hang under
engine_probe's :class:`ProbeError` and import nothing but :mod:`engine_probe.errors`."""

from __future__ import annotations

from engine_probe.errors import ProbeError


class KvEventsError(ProbeError):
    """Base class: the engine's KV events cannot be consumed. ``kvwatch kv-events`` exits 2."""


class BadEndpoint(KvEventsError, ValueError):
    """An endpoint that is not a ZMQ ``tcp://HOST:PORT`` (or ``ipc://``) address to connect to."""


class MalformedBatch(KvEventsError, ValueError):
    """A message that is not one of vLLM's event batches: wrong frames, bad msgpack, a field
    of the wrong type."""
