"""The routes a load balancer and Prometheus call, without a token: ``/healthz`` (the process
answers), ``/readyz`` (the database answers too) and ``/metrics``."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from collector.api import params
from collector.api import schemas as s
from collector.api.caller import in_thread
from collector.errors import CollectorError, Unauthorized
from collector.metrics import CollectorMetrics


def build_router(
    metrics: CollectorMetrics,
    ping: Callable[[], None],
    *,
    metrics_token: str | None = None,
    bus_problem: Callable[[], str | None] | None = None,
) -> APIRouter:
    """``ping``: raises a :class:`CollectorError` when the database does not answer.
    ``metrics_token`` (KVWATCH_METRICS_TOKEN): if set, /metrics needs it as a bearer token.
    ``bus_problem`` (with the ingest bus): why the bus cannot take batches, or None. Then
    readiness is the bus's: ingest needs the bus, not the database (a database outage is
    said in ``detail`` and leaves the collector ready)."""
    r = APIRouter()
    expected = None if metrics_token is None else f"Bearer {metrics_token}".encode()

    @r.get("/metrics", include_in_schema=True, response_class=Response)
    async def get_metrics(authorization: params.Auth = None) -> Response:
        if expected is not None and not hmac.compare_digest(
            (authorization or "").encode(), expected
        ):
            raise Unauthorized("/metrics needs the scrape token (KVWATCH_METRICS_TOKEN)")
        data = await in_thread(generate_latest, metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @r.get("/healthz", response_model=s.Health)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/readyz", response_model=s.Health, responses={503: {"model": s.Health}})
    async def readyz() -> Any:
        database = None
        try:
            await in_thread(ping)
        except CollectorError as exc:
            database = exc.message
        if bus_problem is not None:
            problem = bus_problem()
            if problem is not None:
                return JSONResponse({"status": "unavailable", "detail": problem}, 503)
            if database is not None:
                return {"status": "ok", "detail": f"ingest goes to the bus; {database}"}
            return {"status": "ok"}
        if database is not None:
            return JSONResponse({"status": "unavailable", "detail": database}, 503)
        return {"status": "ok"}

    return r
