"""The gateway's Prometheus metrics (``GET /metrics``, open as Prometheus scrapes it).

* ``kvwatch_gateway_requests_total{model,outcome}``: every recorded request, by outcome:
  ``forwarded`` (the upstream answered it: completed, cut at its length, or abandoned by the
  client mid-stream), ``refused`` (by the guard or by the upstream: a ``request.rejected``
  record) or ``error`` (the gateway or the upstream failed);
* ``kvwatch_gateway_refusals_total{model,reason}``: the refused ones by reason (the wire
  contract's reject reasons: ``context_length_exceeded``, ``invalid_request``...);
* ``kvwatch_gateway_upstream_latency_seconds{model}``: from forwarding a completion to the
  end of the upstream's answer (the last byte of a stream);
* ``kvwatch_gateway_prompt_tokens{model}``: the prompts the guard counted (those of models
  with a limit), refused ones included;
* ``kvwatch_gateway_limit_tokens{model,source}``: the limit in force per model (``source``:
  ``verified``, ``configured`` or ``failed-verification``; ``model="*"`` for the configured
  default), read at scrape time.

Counters and histograms only: nothing describes one request. ``model`` is bounded: a model
named in the configuration or by the collector's verifications, or one the upstream answered
(at most ``max_models`` of those); anything else is ``_other``, and a request that named no
model and got no answer is ``_none``. A client spraying model names cannot grow /metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_probe.events import RejectReason
from kvwatch.gateway.limits import SafeContexts

Outcome = Literal["forwarded", "refused", "error"]
OUTCOMES: Final[tuple[Outcome, ...]] = get_args(Outcome)
REASONS: Final[tuple[RejectReason, ...]] = get_args(RejectReason)
OTHER: Final = "_other"
NO_MODEL: Final = "_none"
MAX_MODELS: Final = 100

LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)  # fmt: skip
# 1-2-5 from 1 to 2M tokens: the contexts served today, as vLLM buckets its token counts.
PROMPT_BUCKETS: Final = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))


@dataclass(frozen=True, slots=True)
class _Children:
    """One model's label children, made once: the hot path only increments them."""

    requests: dict[Outcome, Counter]
    refusals: dict[RejectReason, Counter]
    latency: Histogram
    prompt: Histogram


class GatewayMetrics:
    """The metrics of one gateway app, in its own registry (built with the app)."""

    def __init__(self, limits: SafeContexts, *, max_models: int = MAX_MODELS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._limits = limits
        self._max_models = max_models
        self._requests = Counter(
            "kvwatch_gateway_requests",
            "Requests recorded, by model and outcome (forwarded, refused, error).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self._refusals = Counter(
            "kvwatch_gateway_refusals",
            "Requests refused (by the guard or the upstream), by model and reason.",
            ["model", "reason"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "kvwatch_gateway_upstream_latency_seconds",
            "Time from forwarding a completion to the end of the upstream's answer.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._prompt = Histogram(
            "kvwatch_gateway_prompt_tokens",
            "Prompt tokens the safe-context guard counted, refused prompts included.",
            ["model"],
            buckets=PROMPT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_LimitGauge(limits, max_models))
        self._lock = threading.Lock()
        self._children: dict[str, _Children] = {}
        self._learned = 0  # models added after construction, bounded by max_models
        for model in (OTHER, NO_MODEL, *sorted(m for m in limits.models() if m != "*")):
            self._children[model] = self._make(model)

    def _make(self, model: str) -> _Children:
        return _Children(
            {o: self._requests.labels(model, o) for o in OUTCOMES},
            {r: self._refusals.labels(model, r) for r in REASONS},
            self._latency.labels(model),
            self._prompt.labels(model),
        )

    def _of(self, model: str | None, answered: bool) -> _Children:
        """The children of ``model``'s label: its own when the configuration, a verdict or
        the upstream (``answered``) vouches for the name and there is room, else ``_other``."""
        if model is None:
            return self._children[NO_MODEL]
        found = self._children.get(model)
        if found is not None:
            return found
        if not answered and model not in self._limits.models():
            return self._children[OTHER]
        with self._lock:
            found = self._children.get(model)
            if found is None:
                if self._learned >= self._max_models:
                    return self._children[OTHER]
                self._learned += 1
                found = self._children[model] = self._make(model)
            return found

    def record(
        self,
        model: str | None,
        outcome: Outcome,
        *,
        reason: RejectReason | None = None,
        upstream_s: float | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """One request's outcome (called once per request, when its record is emitted)."""
        c = self._of(model, answered=outcome == "forwarded")
        c.requests[outcome].inc()
        if reason is not None:
            c.refusals[reason].inc()
        if upstream_s is not None:
            c.latency.observe(upstream_s)
        if prompt_tokens is not None:
            c.prompt.observe(prompt_tokens)


class _LimitGauge(Collector):
    """``kvwatch_gateway_limit_tokens``, read from the guard's limits at scrape time, so a
    model whose limit changed source shows the new series only."""

    def __init__(self, limits: SafeContexts, max_models: int) -> None:
        self.limits = limits
        self.max_models = max_models

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvwatch_gateway_limit_tokens",
            "The safe context in force per model, in tokens, by where it comes from "
            "(verified, configured, failed-verification); 0: every prompt is refused.",
            labels=["model", "source"],
        )
        for model, limit in list(self.limits.in_force().items())[: self.max_models]:
            g.add_metric([model, limit.source], limit.tokens)
        yield g
