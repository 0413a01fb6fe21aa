"""The routes without auth: ``GET /health`` (200 while the engine thread runs, 503 once it
has stopped or failed) and ``GET /metrics`` (Prometheus metrics in vLLM's names)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from refengine.metrics import ServerMetrics
from refengine.server.driver import EngineDriver


def build_router(driver: EngineDriver, metrics: ServerMetrics) -> APIRouter:
    r = APIRouter()

    @r.get("/health", summary="Liveness of the engine thread (no auth)")
    async def health() -> JSONResponse:
        if driver.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @r.get("/metrics", summary="Prometheus metrics in vLLM's names (no auth)")
    async def prometheus_metrics() -> Response:
        # Open, as Prometheus scrapes it: nothing here describes one request.
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return r
