"""``POST /v1/events``: a probe's batch, stored whole or not at all
(:class:`collector.ingest.IngestService`).

It authenticates its own way, not through :data:`collector.api.caller.Caller`: an ingest
token, and a refusal counted in the ingest metrics. The body is read here, under the size
limit, before the service decodes it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import anyio
from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect

from collector.api import params
from collector.api import schemas as s
from collector.api.caller import in_thread
from collector.api.openapi import EVENTS_SCHEMA
from collector.errors import BadRequest, PayloadTooLarge
from collector.ingest import IngestService

log = logging.getLogger("kvwatch.ingest")
_ERRORS = params.errors(401, 403, 422, 503)


def build_router(
    ingest: IngestService, max_body_bytes: int, limiter: anyio.CapacityLimiter
) -> APIRouter:
    """``limiter``: how many batches are written at once."""
    r = APIRouter()

    @r.post(
        "/v1/events",
        response_model=s.IngestResponse,
        responses={
            **_ERRORS,
            413: {"model": s.ErrorResponse, "description": "Batch or body over the limits"},
            415: {"model": s.ErrorResponse, "description": "Not JSON or NDJSON"},
            422: {"model": s.ErrorResponse, "description": "Bad events: index and field each"},
            429: {
                "model": s.ErrorResponse,
                "description": "The token named too many new deployments, nodes, models or "
                "routes in the last hour (the limit is named); nothing stored, retry later",
            },
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": EVENTS_SCHEMA},
                    "application/x-ndjson": {"schema": {"type": "string"}},
                },
            }
        },
        summary="Ingest one probe's batch: all events stored, or none",
    )
    async def post_events(request: Request, authorization: params.Auth = None) -> dict[str, Any]:
        who = await in_thread(ingest.authenticate, authorization)
        try:
            body = await _read_body(request, max_body_bytes)
        except ClientDisconnect:
            # A probe stopped or its network dropped mid-upload: routine, and harmless (nothing
            # was stored; the probe sends the batch again), so no ERROR and no traceback.
            peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
            log.info(
                "POST /v1/events: %s (token #%d) disconnected before sending the whole body; "
                "nothing stored",
                peer,
                who.token_id,
            )
            # Nobody reads this answer; it only ends the request.
            raise BadRequest("the client disconnected before sending the whole body") from None
        ctype = request.headers.get("content-type", "")
        now = datetime.now(UTC)
        result = await anyio.to_thread.run_sync(
            ingest.ingest, who, body, ctype, now, limiter=limiter
        )
        return result.as_dict()

    return r


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"body of {declared} bytes exceeds the limit of {limit}", {"limit_bytes": limit}
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"body exceeds the limit of {limit} bytes", {"limit_bytes": limit}
            )
        chunks.append(chunk)
    return b"".join(chunks)
