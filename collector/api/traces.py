"""``POST /v1/traces``: OTLP/HTTP trace export (:class:`collector.otlp.service.TraceIngest`).

OpenTelemetry exporters send here as they send to an OpenTelemetry Collector's
``/v1/traces``: protobuf or JSON, maybe gzip, the ingest token in ``Authorization``
(``OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer%20<token>"``). The answer is
``ExportTraceServiceResponse`` in the request's encoding; errors are kvwatch's JSON error
body with the status OTLP's retry rules expect (400/401/403/413/415 are final, 429 and 503
are retried).
"""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
from fastapi import APIRouter, Request, Response

from collector.api import params
from collector.api import schemas as s
from collector.api.bodies import read_producer_body
from collector.api.caller import in_thread
from collector.bus.ingest import BusIngest
from collector.otlp import wire
from collector.otlp.service import TraceIngest

_ERRORS = params.errors(
    401,
    403,
    422,
    503,
    e400="Not an OTLP ExportTraceServiceRequest (malformed protobuf, JSON or gzip)",
)
_EXPORT_RESPONSE = {
    "type": "object",
    "description": "ExportTraceServiceResponse (OTLP/JSON): partialSuccess only when spans "
    "were rejected",
    "properties": {
        "partialSuccess": {
            "type": "object",
            "properties": {
                "rejectedSpans": {"type": "string", "description": "int64, as proto3 JSON"},
                "errorMessage": {"type": "string"},
            },
        }
    },
}


def build_router(
    traces: TraceIngest, limiter: anyio.CapacityLimiter, bus: BusIngest | None = None
) -> APIRouter:
    """``limiter``: how many requests are written at once (shared with ``/v1/events``).
    ``bus``: accepted requests are published to the ingest bus instead of stored here."""
    r = APIRouter()

    @r.post(
        "/v1/traces",
        response_class=Response,
        responses={
            200: {
                "description": "Stored whole; spans that could not be stored are counted in "
                "partialSuccess, with the first reasons",
                "content": {
                    wire.PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                    wire.JSON: {"schema": _EXPORT_RESPONSE},
                },
            },
            **_ERRORS,
            413: {"model": s.ErrorResponse, "description": "Body or spans over the limits"},
            415: {
                "model": s.ErrorResponse,
                "description": "Not application/x-protobuf nor application/json, or an "
                "encoding other than gzip",
            },
            429: {
                "model": s.ErrorResponse,
                "description": "The token named too many new deployments, models or routes "
                "in the last hour (the limit is named); nothing stored, retry later",
            },
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    wire.PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                    wire.JSON: {
                        "schema": {
                            "type": "object",
                            "description": "ExportTraceServiceRequest (OTLP/JSON)",
                        }
                    },
                },
            }
        },
        summary="OTLP/HTTP traces: GenAI spans become request records, all stored or none",
    )
    async def post_traces(request: Request, authorization: params.Auth = None) -> Response:
        params.known_params(request, set())  # a misspelt option is never silently ignored
        who = await in_thread(traces.authenticate, authorization)
        body = await read_producer_body(request, traces.settings.max_body_bytes, who.token_id)
        ctype = request.headers.get("content-type", "")
        encoding = request.headers.get("content-encoding", "")
        now = datetime.now(UTC)
        if bus is not None:
            result = await bus.spans(who, body, ctype, encoding, now)
        else:
            result = await anyio.to_thread.run_sync(
                traces.export, who, body, ctype, encoding, now, limiter=limiter
            )
        mime = wire.media_type(ctype)
        return Response(
            wire.encode_response(mime, len(result.refused), result.error_message),
            media_type=mime,
        )

    return r
