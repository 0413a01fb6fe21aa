"""An engine's own KV-cache events (vLLM's ``--kv-events-config``) → kvwatch's figures.

For deployments without the in-engine probe, or beside it: vLLM publishes every block its
prefix cache stores and evicts over ZMQ (``wire``: the format; ``stream``: the subscription,
its sequence numbers and the replay socket that fills gaps; ``mirror``: the cache as the
events describe it, and what each interval proves; ``silence``: when an interval without
events is a gap rather than an idle cache). ``kvwatch kv-events`` turns intervals into
``kv.turnover`` events (and unobservable ones into ``source.gap``) and, with the engine's
``/metrics`` beside, an ``engine.config`` saying prefix caching is on and unsalted once
unsalted blocks are seen.

Like :mod:`kvwatch.scrape`, it observes an engine from outside, so it lives in kvwatch/, and
stands alone there: of ours it imports only the contract and :mod:`engine_probe.errors`
(never torch, the probe's machinery or the collector), plus msgspec and pyzmq.
"""

from kvwatch.kv_events.errors import BadEndpoint, KvEventsError, MalformedBatch
from kvwatch.kv_events.mirror import Interval, Mirror, Totals, salt_digest
from kvwatch.kv_events.stream import Restarted, Stream, StreamStats, check_endpoint
from kvwatch.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Decoded,
    decode_batch,
    decode_seq,
)

__all__ = [
    "AllBlocksCleared",
    "BadEndpoint",
    "BlockRemoved",
    "BlockStored",
    "Decoded",
    "Interval",
    "KvEventsError",
    "MalformedBatch",
    "Mirror",
    "Restarted",
    "Stream",
    "StreamStats",
    "Totals",
    "check_endpoint",
    "decode_batch",
    "decode_seq",
    "salt_digest",
]
