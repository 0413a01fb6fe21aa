"""Real OpenTelemetry SDK spans, exported by the SDK's own OTLP/HTTP exporters (protobuf,
and the JSON one) to a kvwatch collector's /v1/traces."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from opentelemetry.exporter.otlp.json.http.trace_exporter import (
    OTLPSpanExporter as JsonExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as ProtobufExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

Encoding = Literal["protobuf", "json"]


def exporter(url: str, token: str, encoding: Encoding, *, gzip: bool = False) -> SpanExporter:
    headers = {"Authorization": f"Bearer {token}"}
    endpoint = f"{url}/v1/traces"
    if encoding == "protobuf":
        return ProtobufExporter(
            endpoint=endpoint,
            headers=headers,
            compression=Compression.Gzip if gzip else Compression.NoCompression,
        )
    from opentelemetry.exporter.otlp.common.http import Compression as JsonCompression

    return JsonExporter(
        endpoint=endpoint,
        headers=headers,
        compression=JsonCompression.GZIP if gzip else JsonCompression.NONE,
    )


@contextmanager
def tracer(
    url: str,
    token: str,
    encoding: Encoding = "protobuf",
    *,
    service: str | None = "glm-prod",
    resource: Mapping[str, Any] | None = None,
    gzip: bool = False,
) -> Iterator[Tracer]:
    """A tracer whose every ended span is exported at once (SimpleSpanProcessor); leaving
    the block shuts the provider down."""
    attrs: dict[str, Any] = dict(resource or {})
    if service is not None:
        attrs["service.name"] = service
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(SimpleSpanProcessor(exporter(url, token, encoding, gzip=gzip)))
    try:
        yield provider.get_tracer("kvwatch-tests")
    finally:
        provider.shutdown()


def genai_span(
    t: Tracer,
    *,
    request_id: str,
    model: str = "glm-5.3",
    prompt: int | None = 1000,
    completion: int | None = 50,
    tenant: str | None = "acme",
    error: bool = False,
    old_names: bool = False,
    **extra: Any,
) -> None:
    """One chat span as the GenAI conventions describe it (``old_names``: vLLM's
    ``gen_ai.usage.prompt_tokens``/``completion_tokens``)."""
    start = time.time_ns() - 2_000_000_000
    span = t.start_span(f"chat {model}", kind=SpanKind.CLIENT, start_time=start)
    span.set_attribute("gen_ai.operation.name", "chat")
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("gen_ai.response.id", request_id)
    if prompt is not None:
        span.set_attribute(
            "gen_ai.usage.prompt_tokens" if old_names else "gen_ai.usage.input_tokens", prompt
        )
    if completion is not None:
        span.set_attribute(
            "gen_ai.usage.completion_tokens" if old_names else "gen_ai.usage.output_tokens",
            completion,
        )
    if tenant is not None:
        span.set_attribute("tenant.id", tenant)
    for k, v in extra.items():
        span.set_attribute(k, v)
    if error:
        span.set_status(Status(StatusCode.ERROR, "upstream failed"))
    span.end(end_time=start + 1_500_000_000)
