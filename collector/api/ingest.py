"""``POST /v1/events``: a probe's batch, stored whole or not at all
(:class:`collector.ingest.IngestService`).

It authenticates its own way, not through :data:`collector.api.caller.Caller`: an ingest
token, and a refusal counted in the ingest metrics. The body is read here, under the size
limit, before the service decodes it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import anyio
from fastapi import APIRouter, Request

from collector.api import params
from collector.api import schemas as s
from collector.api.bodies import read_producer_body
from collector.api.caller import in_thread
from collector.api.openapi import EVENTS_SCHEMA
from collector.bus.ingest import BusIngest
from collector.ingest import IngestService

_ERRORS = params.errors(401, 403, 422, 503)


def build_router(
    ingest: IngestService,
    max_body_bytes: int,
    limiter: anyio.CapacityLimiter,
    bus: BusIngest | None = None,
) -> APIRouter:
    """``limiter``: how many batches are written at once. Decoding runs outside it, with
    at most one batch more in hand than there are writers, so decoded batches waiting for
    the writer stay few. ``bus``: accepted batches are published to the ingest bus instead
    of stored here (``kvwatch serve --bus``)."""
    in_hand = anyio.CapacityLimiter(limiter.total_tokens + 1)
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
        params.known_params(request, set())  # a misspelt option is never silently ignored
        who = await in_thread(ingest.authenticate, authorization)
        body = await read_producer_body(request, max_body_bytes, who.token_id)
        ctype = request.headers.get("content-type", "")
        now = datetime.now(UTC)
        if bus is not None:
            return (await bus.events(who, body, ctype, now)).as_dict()
        async with in_hand:
            # Decoding and shaping touch no database: outside the write limiter.
            batch = await anyio.to_thread.run_sync(ingest.prepare, who, body, ctype, now)
            result = await anyio.to_thread.run_sync(
                ingest.store_batch, who, batch, now, limiter=limiter
            )
        return result.as_dict()

    return r
