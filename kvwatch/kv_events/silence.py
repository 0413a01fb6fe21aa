"""When an interval without KV events is a gap, not an idle cache.

A subscriber that receives nothing cannot tell by itself an engine with nothing to report
from one it cannot hear: vLLM's publisher binds only an endpoint with ``*`` or ``::`` in it
(or ``ipc://``) and *connects* to any other, so a vLLM given ``tcp://HOST:5557`` or
``tcp://0.0.0.0:5557`` connects out while the subscriber connects too, and both wait forever;
a subscriber on another topic than the publisher's drops every message; a stopped engine
publishes nothing. Counted as intervals, each of these is a row of zeros that says "nothing
was stored or evicted" when nobody looked.

:class:`Silence` judges each interval without a batch, from evidence the caller gathers (time
is passed in): whether the subscriber has a live connection to a publisher, whether messages
came on another topic, and, given the engine's HTTP root, whether the engine answers and how
many requests it finished and tokens it computed meanwhile. Its verdicts:

- ``"idle"``: connected, and nothing says the engine did anything: the zeros are true
  (before the first batch ever, only after ``silent_after_s``: until one comes, nothing
  shows the subscription can hear the engine at all);
- ``"hold"``: evidence of a gap, silent less than ``silent_after_s``: send nothing yet (the
  interval joins the next one sent: the next figures if the events come back, else the gap);
- :class:`Gap`: evidence of a gap for ``silent_after_s`` or more: send the gap, never zeros.

Evidence, strongest first: the engine does not answer (``engine_down``); nothing accepts the
subscriber's connection (``not_connected``); messages arrive on another topic
(``other_topic``); the engine answers and finished requests and computed at least one block's
worth of tokens (``engine_served``: a prefix-caching engine that computes a full block
stores it, and vLLM publishes every store). The last can be fooled by requests each shorter
than a block, and reads the counters of the whole server: with data parallelism, of all its
ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from engine_probe.events import GapCause

BIND_RULE: Final = (
    "vLLM binds its --kv-events-config endpoint only when it has '*' or '::' in it "
    "(tcp://*:5557) or is ipc://, and connects out to any other (tcp://HOST:5557, "
    "tcp://0.0.0.0:5557): give vLLM tcp://*:PORT and this --endpoint tcp://ENGINE-HOST:PORT"
)


@dataclass(frozen=True, slots=True)
class EngineReading:
    """The engine's own HTTP endpoint at one moment: whether it answered (``error`` says
    why not), and its cumulative counters: requests finished and tokens computed (prompt
    tokens not served from the prefix cache, plus generated ones)."""

    up: bool
    requests: float = 0.0
    computed_tokens: float = 0.0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Gap:
    """An unobservable stretch: since when (``since``, the caller's clock), why, and the
    line for a person (no prompt text: endpoints, topics, counts)."""

    cause: GapCause
    since: float
    silent_s: float
    requests: int | None
    reason: str


Verdict = Gap | Literal["idle", "hold"]


class Silence:
    """The judge of one subscription (see the module docstring), silent since ``now``.
    ``block_tokens``: the engine's block size, when known (one block's worth of computed
    tokens is needed before traffic counts as evidence; without it, one token). ``engine``:
    its reading at the start, the baseline of its traffic (else the first reading is)."""

    def __init__(
        self,
        *,
        endpoint: str,
        topic: str,
        silent_after_s: float,
        now: float,
        block_tokens: int | None = None,
        engine: EngineReading | None = None,
    ) -> None:
        if not silent_after_s > 0:
            raise ValueError(f"silent_after_s {silent_after_s!r} must be positive")
        self.endpoint = endpoint
        self.topic = topic
        self.silent_after_s = silent_after_s
        self.block_tokens = max(block_tokens or 1, 1)
        self.last_data = now
        self.heard = False
        self._baseline: EngineReading | None = None
        self.baseline(engine)

    def baseline(self, engine: EngineReading | None) -> None:
        """The engine's reading to count its traffic from (None, or down: the next)."""
        self._baseline = engine if engine is not None and engine.up else None

    def data(self, now: float, engine: EngineReading | None = None) -> None:
        """A batch came (the stream is heard): silence, if any, ends here. ``engine``: the
        engine's reading now, the baseline its traffic is counted from."""
        self.last_data = now
        self.heard = True
        self.baseline(engine)

    def judge(
        self,
        now: float,
        *,
        connected: bool,
        other_topic: str | None = None,
        engine: EngineReading | None = None,
        final: bool = False,
    ) -> Verdict:
        """An interval ending ``now`` without a batch. ``connected``: the subscriber holds a
        live connection to a publisher; ``other_topic``: a topic messages came on since the
        last batch, other than the one subscribed (None: none came). ``final``: the last
        interval (the subscriber stops): nothing can be held back any more, so evidence of a
        gap is a gap however short."""
        silent = max(now - self.last_data, 0.0)
        served = self._served(engine)
        cause: GapCause | None = None
        if engine is not None and not engine.up:
            cause = "engine_down"
        elif not connected:
            cause = "not_connected"
        elif other_topic is not None:
            cause = "other_topic"
        elif served is not None:
            cause = "engine_served"
        if cause is None:
            # Before any batch, nothing has shown that this subscription can hear the
            # engine at all (the topic, the endpoint): its first empty intervals are held
            # for the bound too, then taken for idle.
            return "idle" if self.heard or silent >= self.silent_after_s or final else "hold"
        if silent < self.silent_after_s and not final:
            return "hold"
        reason = self._reason(cause, silent, served, other_topic, engine)
        return Gap(cause, self.last_data, silent, served, reason)

    def _served(self, engine: EngineReading | None) -> int | None:
        """Requests the engine finished since the baseline, when it also computed at least a
        block's worth of tokens (None: no such evidence). The first reading of a silence is
        its baseline; counters that went down are a restarted engine: counted from there."""
        if engine is None or not engine.up:
            return None
        base = self._baseline
        if base is None or engine.requests < base.requests:
            self._baseline = engine
            return None
        requests = int(engine.requests - base.requests)
        if requests >= 1 and engine.computed_tokens - base.computed_tokens >= self.block_tokens:
            return requests
        return None

    def _reason(
        self,
        cause: GapCause,
        silent: float,
        served: int | None,
        other_topic: str | None,
        engine: EngineReading | None,
    ) -> str:
        head = f"no KV event for {silent:.0f} s"
        if cause == "engine_down":
            why = engine.error if engine is not None and engine.error else "no answer"
            text = f"{head}: the engine does not answer ({why})"
        elif cause == "not_connected":
            text = (
                f"{head}: nothing accepts connections at {self.endpoint} (vLLM binds only an "
                "endpoint with '*', '::' or ipc://; with tcp://HOST:PORT it connects instead)"
            )
        elif cause == "other_topic":
            text = (
                f"{head} on --topic {self.topic!r}; messages arrive on topic "
                f"{other_topic!r} (the publisher's): set --topic to it"
            )
        else:
            text = (
                f"{head} while the engine finished {served} request(s): check --topic "
                f"{self.topic!r} (vLLM's default is empty), prefix caching, and that "
                f"{self.endpoint} is this engine's publisher"
            )
        return text[:256]


def advice(gap: Gap) -> str:
    """What a person at the terminal should try, beyond the gap's reason."""
    if gap.cause == "not_connected":
        return BIND_RULE
    if gap.cause == "engine_down":
        return "the events come back with the engine: its new publisher numbers from 0 again"
    return "vLLM's publisher sends every batch on one topic, its kv-events-config 'topic'"
