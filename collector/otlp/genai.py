"""OpenTelemetry's GenAI semantic conventions: which spans are GenAI spans, and what one
becomes in kvwatch (a ``request.admitted`` at the span's start and a ``request.finished`` at
its end, carrying counts only: no prompt or completion text is ever read from a span).

Names are read under the current conventions first and the older ones vLLM still emits:

| kvwatch | span attributes, first present wins |
| --- | --- |
| prompt tokens | ``gen_ai.usage.input_tokens``, ``gen_ai.usage.prompt_tokens`` |
| completion tokens | ``gen_ai.usage.output_tokens``, ``gen_ai.usage.completion_tokens`` |
| cached prompt tokens | ``gen_ai.usage.cache_read.input_tokens``, then ``CACHED``'s aliases |
| tokens written to a cache | ``gen_ai.usage.cache_creation.input_tokens``, ``CACHE_WRITE`` |
| model | ``gen_ai.response.model``, ``gen_ai.request.model`` (span, then resource) |
| request id | ``gen_ai.request.id`` (vLLM), ``gen_ai.response.id``, else trace and span id |
| max tokens | ``gen_ai.request.max_tokens`` |
| route | ``http.route``, ``url.path`` |
| status | the span's status (ERROR: ``error``) and ``gen_ai.response.finish_reasons`` |

The current conventions count cached tokens inside ``input_tokens``, so the prompt is
``input_tokens`` whole and ``cache_read.input_tokens`` (stored as the request's
``cached_tokens``) a part of it, as is ``cache_creation.input_tokens`` (stored as
``cache_write_tokens``): the two together past the prompt are refused.
vLLM's ``llm_request`` span names no model: a deployment that wants one sets it on the
resource (``OTEL_RESOURCE_ATTRIBUTES=gen_ai.request.model=NAME``), else the request is
stored without one and the ``telemetry_gap`` rule says so, as for any producer.

Tenant and deployment come from configured attributes (``KVWATCH_OTLP_TENANT_ATTRIBUTES``,
``KVWATCH_OTLP_DEPLOYMENT_ATTRIBUTES``), a span's own before its resource's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import msgspec

from collector.errors import InvalidInput
from collector.otlp.wire import Span
from collector.timefmt import iso
from engine_probe import events as ev

PROMPT: Final = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
COMPLETION: Final = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
# Sentry's names ("input_tokens.cached", "input_tokens.cache_write"), then OpenLLMetry's
# before its 0.5.0 ("cache_read_...", "cache_creation_..."), follow the current ones.
CACHED: Final = (
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.usage.input_tokens.cached",
    "gen_ai.usage.cache_read_input_tokens",
)
CACHE_WRITE: Final = (
    "gen_ai.usage.cache_creation.input_tokens",
    "gen_ai.usage.input_tokens.cache_write",
    "gen_ai.usage.cache_creation_input_tokens",
)
MODEL: Final = ("gen_ai.response.model", "gen_ai.request.model")
REQUEST_ID: Final = ("gen_ai.request.id", "gen_ai.response.id")
MAX_TOKENS: Final = ("gen_ai.request.max_tokens",)
ROUTE: Final = ("http.route", "url.path")
FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
# The tenant a producer that cannot tell one reports (as engine_probe's adapters do).
UNKNOWN_TENANT: Final = "unknown"
# The OpenTelemetry SDKs' service.name when none was configured: it names no deployment.
_SDK_DEFAULT_SERVICE: Final = "unknown_service"
_EARLIEST: Final = datetime(2000, 1, 1, tzinfo=UTC)
_LATEST_NS = 7_258_118_400 * 10**9  # 2200-01-01, the latest time kvwatch takes anywhere
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def is_genai(span: Span) -> bool:
    """A GenAI span carries at least one ``gen_ai.*`` attribute of its own."""
    return span.genai


def read_attributes(tenant: Sequence[str], deployment: Sequence[str]) -> frozenset[str]:
    """Every attribute the mapping reads (the decoder keeps these and no other)."""
    return frozenset(
        (*PROMPT, *COMPLETION, *CACHED, *CACHE_WRITE, *MODEL, *REQUEST_ID, *MAX_TOKENS, *ROUTE,
         FINISH_REASONS, *tenant, *deployment)
    )  # fmt: skip


class SpanRefused(InvalidInput):
    """A GenAI span kvwatch cannot store, and why (naming the attribute). Never answered on
    its own: the service counts it in OTLP's partial success (``rejected_spans``)."""


@dataclass(frozen=True, slots=True)
class SpanRequest:
    """A GenAI span as one request: its deployment, the span's identity (trace id + span id,
    hex; the request id when the span has none), the request id it names, and its events
    (``seq`` 1 as a placeholder; the service numbers them under the probe's lock)."""

    deployment_id: str
    span_key: str
    request_id: str
    events: tuple[ev.Event, ...]

    @property
    def tenant(self) -> str | None:
        return next((e.tenant for e in self.events if isinstance(e, ev.RequestAdmitted)), None)

    def as_sibling(self, *, shares_prompt: bool = True) -> SpanRequest:
        """This span as a request of its own, under the id it names with the span id
        appended: a later span naming a request id already stored. ``shares_prompt``: it
        shares the prompt of that request (vLLM sends one span per parallel-sampling child,
        all under the parent's id); never across tenants, where the same id is a collision
        and a link would tie one tenant's request to another's."""
        suffix = f".{self.span_key[-16:]}"
        rid = self.request_id[: ev.ID_MAX - len(suffix)] + suffix
        events = tuple(
            msgspec.structs.replace(e, request_id=rid, prompt_shared_with=self.request_id)
            if isinstance(e, ev.RequestAdmitted) and shares_prompt
            else msgspec.structs.replace(e, request_id=rid)
            for e in self.events
        )
        return SpanRequest(self.deployment_id, self.span_key, rid, events)


@dataclass(frozen=True, slots=True)
class Mapper:
    """Turns GenAI spans into requests for one caller; built per export request.

    ``scope``: the deployment a scoped token writes (spans naming none belong to it);
    ``probe_id``: the probe id events of a deployment are stored under."""

    tenant_attributes: Sequence[str]
    deployment_attributes: Sequence[str]
    scope: str | None
    probe_id: Callable[[str], str]
    now: datetime
    max_clock_skew: timedelta
    _probe_ids: dict[str, str] = field(default_factory=dict)

    def request(self, span: Span) -> SpanRequest:
        """Raises :class:`SpanRefused`."""
        deployment = self._deployment(span)
        tenant, tenant_attr = _first(span, self.tenant_attributes, resource=True)
        model, model_attr = _first(span, MODEL, resource=True)
        rid, rid_attr = _first(span, REQUEST_ID)
        if rid is None:
            if not (span.trace_id and span.span_id):
                raise SpanRefused(
                    "no request id: the span has no gen_ai.request.id nor gen_ai.response.id, "
                    "and no trace and span id"
                )
            rid, rid_attr = f"{span.trace_id}-{span.span_id}", "traceId and spanId"
        prompt, prompt_attr = _tokens(span, PROMPT)
        completion, completion_attr = _tokens(span, COMPLETION)
        cached, cached_attr = _tokens(span, CACHED)
        if cached is not None and prompt is not None and cached > prompt:
            raise SpanRefused(
                f"{cached_attr} ({cached}) is more than {prompt_attr} ({prompt}): the prompt "
                "count includes its cached tokens"
            )
        written, written_attr = _tokens(span, CACHE_WRITE)
        if written is not None and prompt is not None and (cached or 0) + written > prompt:
            also = f" plus {cached_attr} ({cached})" if cached else ""
            raise SpanRefused(
                f"{written_attr} ({written}){also} is more than {prompt_attr} ({prompt}): the "
                "prompt count includes the tokens written to and read from a cache"
            )
        max_tokens, max_attr = _tokens(span, MAX_TOKENS)
        route, route_attr = _first(span, ROUTE)
        start = self._time(span.start_ns, "startTimeUnixNano")
        end = self._time(span.end_ns, "endTimeUnixNano") if span.end_ns else start
        if end < start:
            raise SpanRefused("endTimeUnixNano is before startTimeUnixNano")
        probe_id = self._probe_ids.get(deployment)
        if probe_id is None:
            probe_id = self._probe_ids[deployment] = self.probe_id(deployment)
        common = {
            "schema_version": ev.SCHEMA_VERSION,
            "probe_id": probe_id,
            "seq": 1,
            "deployment_id": deployment,
            "request_id": _text(rid, rid_attr),
            "tenant": UNKNOWN_TENANT if tenant is None else _text(tenant, tenant_attr),
            "route": None if route is None else _text(route, route_attr),
            "model_id": None if model is None else _text(model, model_attr),
            "prompt_tokens": prompt,
        }
        admitted = {**common, "ts": start, "max_tokens": max_tokens}
        finished = {
            **common,
            "ts": end,
            "completion_tokens": completion,
            "cached_tokens": cached,
            "cache_write_tokens": written,
            "status": _status(span),
            "latency_ms": (end - start) / timedelta(milliseconds=1),
        }
        try:
            events: tuple[ev.Event, ...] = (
                ev.convert_event(ev.RequestAdmitted, admitted),
                ev.convert_event(ev.RequestFinished, finished),
            )
        except ev.DecodeError as exc:
            # Which attribute fed each field, so a refusal names what the client sent.
            blame = {
                "deployment_id": self._deployment_source(span),
                "tenant": tenant_attr,
                "model_id": model_attr,
                "request_id": rid_attr,
                "prompt_tokens": prompt_attr,
                "completion_tokens": completion_attr,
                "max_tokens": max_attr,
                "cached_tokens": cached_attr,
                "cache_write_tokens": written_attr,
                "route": route_attr,
            }
            err = exc.errors[0]
            field = (err.field or "").split(".", 1)[0].split("[", 1)[0]
            raise SpanRefused(f"{blame.get(field) or field}: {err.message}") from None
        key = f"{span.trace_id}{span.span_id}" if span.trace_id and span.span_id else rid
        if len(key) > ev.ID_MAX:  # ids longer than OTLP's 16 and 8 bytes
            key = hashlib.sha256(key.encode()).hexdigest()
        return SpanRequest(deployment, key, str(common["request_id"]), events)

    def _deployment(self, span: Span) -> str:
        value, attr = _first(span, self.deployment_attributes, resource=True, skip=_sdk_default)
        if value is None:
            if self.scope is not None:
                return self.scope
            names = ", ".join(self.deployment_attributes)
            raise SpanRefused(
                f"no deployment: set one of {names} (OTEL_SERVICE_NAME sets service.name), "
                "or send with a deployment-scoped ingest token"
            )
        dep = _text(value, attr)
        if not ev.is_valid_id(dep):
            raise SpanRefused(
                f"{attr} {dep!r} is not a valid deployment id: ids start with a letter or "
                "digit and use only letters, digits and ._:/@+=- (at most "
                f"{ev.ID_MAX} characters)"
            )
        return dep

    def _deployment_source(self, span: Span) -> str | None:
        return _first(span, self.deployment_attributes, resource=True, skip=_sdk_default)[1]

    def _time(self, ns: int, name: str) -> datetime:
        if not 0 <= ns <= _LATEST_NS:
            # past what a datetime holds: refused as a span's bad time, never a 500 that
            # loses the export's other spans
            raise SpanRefused(f"{name} {ns} ns is not a time between 1970 and 2200")
        ts = _EPOCH + timedelta(microseconds=ns // 1000)
        if ts < _EARLIEST:
            raise SpanRefused(f"{name} {iso(ts)} ({ns} ns) is before 2000 (a span needs its times)")
        if ts > self.now + self.max_clock_skew:
            raise SpanRefused(f"{name} {iso(ts)} is in the future (now {iso(self.now)})")
        return ts


def _sdk_default(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(_SDK_DEFAULT_SERVICE)


def _first(
    span: Span,
    names: Sequence[str],
    *,
    resource: bool = False,
    skip: Callable[[Any], bool] | None = None,
) -> tuple[Any, str | None]:
    """The first of ``names`` present on the span (then on its resource), and its name."""
    sources: tuple[Mapping[str, Any], ...] = (
        (span.attrs, span.resource) if resource else (span.attrs,)
    )
    for attrs in sources:
        for name in names:
            v = attrs.get(name)
            if v is not None and v != "" and not (skip and skip(v)):
                return v, name
    return None, None


def _text(value: Any, attr: str | None) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise SpanRefused(f"{attr}: expected a string, got {type(value).__name__}")
    return str(value)


def _tokens(span: Span, names: Sequence[str]) -> tuple[int | None, str | None]:
    value, attr = _first(span, names)
    if value is None:
        return None, None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpanRefused(f"{attr}: expected a whole number of tokens, got {value!r}")
    if value < 0:
        raise SpanRefused(f"{attr}: {value} is negative")
    return value, attr


def _status(span: Span) -> str:
    if span.error:
        return "error"
    reasons = span.attrs.get(FINISH_REASONS)
    if isinstance(reasons, str):
        reasons = [reasons]
    if isinstance(reasons, list):
        if "length" in reasons:
            return "length"
        if any(r in ("abort", "aborted", "cancelled") for r in reasons):
            return "aborted"
    return "completed"
