"""One record per request, exported through the probe core.

A request the gateway (or the upstream) refused is a ``request.rejected``; one that was
answered, failed or abandoned is a ``request.finished``. Each carries the tenant, route, model
id, token counts (the upstream's ``usage``; the gateway's own count where the upstream gave
none), status, latency and how the gateway counted the prompt: never prompt or completion
text, and never a key.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

from engine_probe.events import NAME_MAX, FinishStatus, RequestFinished, RequestRejected
from engine_probe.probe import BaseProbe, get_probe
from kvwatch.gateway.counting import PromptCount
from kvwatch.gateway.errors import ContextLengthExceeded, GatewayError
from kvwatch.gateway.metrics import GatewayMetrics, Outcome

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it

_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(slots=True)
class Flight:
    """The state of one request, and of nothing else."""

    request_id: str
    tenant: str
    route: str
    model: str | None = None
    count: PromptCount | None = None
    limit_tokens: int | None = None  # the safe context the prompt was held to, if guarded
    headers: dict[str, str] = field(default_factory=dict)  # what every answer carries
    started: float = field(default_factory=time.monotonic)
    forwarded_at: float | None = None  # when the completion went upstream (monotonic)
    recorded: bool = False

    @property
    def latency_ms(self) -> float:
        return round((time.monotonic() - self.started) * 1000, 3)


def _model_label(model: str | None) -> str | None:
    """The model id as the wire contract takes it (None for one it would refuse)."""
    if model is None or not 0 < len(model) <= NAME_MAX or _CONTROL.search(model):
        return None
    return model


def _tokens(usage: Any, name: str) -> int | None:
    value = usage.get(name) if isinstance(usage, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def finish_status(finish_reason: Any) -> FinishStatus:
    return "length" if finish_reason == "length" else "completed"


class Recorder:
    """Emits each request's one record; ``probe`` None means the process's probe. The same
    moment counts the request in ``metrics``: one outcome per request, as one record."""

    def __init__(
        self, probe: BaseProbe | None = None, metrics: GatewayMetrics | None = None
    ) -> None:
        self._probe = probe
        self._metrics = metrics

    @property
    def probe(self) -> BaseProbe:
        return self._probe if self._probe is not None else get_probe()

    def _emit(
        self, flight: Flight, event_type: type[RequestRejected | RequestFinished], **fields: Any
    ) -> None:
        if flight.recorded:
            return
        flight.recorded = True
        try:
            self.probe.emit(
                event_type,
                request_id=flight.request_id,
                tenant=flight.tenant,
                route=flight.route,
                model_id=_model_label(flight.model),
                prompt_count_method=flight.count.method if flight.count else None,
                latency_ms=flight.latency_ms,
                **fields,
            )
        except Exception:  # a recording bug must not fail the client's request
            log.exception("could not record request %s", flight.request_id)
        try:
            self._count(flight, event_type, fields)
        except Exception:  # nor a counting bug; the record above still went out
            log.exception("could not count request %s", flight.request_id)

    def _count(
        self,
        flight: Flight,
        event_type: type[RequestRejected | RequestFinished],
        fields: dict[str, Any],
    ) -> None:
        if self._metrics is None:
            return
        refused = event_type is RequestRejected
        outcome: Outcome = (
            "refused" if refused else "error" if fields["status"] == "error" else "forwarded"
        )
        self._metrics.record(
            flight.model,
            outcome,
            reason=fields["reason"] if refused else None,
            upstream_s=None
            if flight.forwarded_at is None
            else time.monotonic() - flight.forwarded_at,
            prompt_tokens=flight.count.tokens if flight.count is not None else None,
        )

    def finished(
        self,
        flight: Flight,
        status: FinishStatus,
        usage: Any = None,
        *,
        completion_tokens: int | None = None,
    ) -> None:
        prompt = _tokens(usage, "prompt_tokens")
        if prompt is None and flight.count is not None:
            prompt = flight.count.tokens
        completion = _tokens(usage, "completion_tokens")
        self._emit(
            flight,
            RequestFinished,
            prompt_tokens=prompt,
            completion_tokens=completion if completion is not None else completion_tokens,
            status=status,
            limit_tokens=flight.limit_tokens or None,
        )

    def failed(self, flight: Flight, exc: GatewayError) -> None:
        """The record of a request answered with ``exc``."""
        if exc.outcome == "error":
            # Nothing was generated: the error came before the answer started.
            self.finished(flight, "error", completion_tokens=0)
            return
        limit = exc.limit_tokens if isinstance(exc, ContextLengthExceeded) else None
        prompt = exc.prompt_tokens if isinstance(exc, ContextLengthExceeded) else None
        if prompt is None and flight.count is not None:
            prompt = flight.count.tokens
        self._emit(
            flight,
            RequestRejected,
            reason=exc.reason,
            prompt_tokens=prompt,
            limit_tokens=limit,
        )
