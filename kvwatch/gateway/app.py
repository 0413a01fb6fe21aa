"""The gateway's HTTP routes: a thin layer over :class:`ProxyService`.

``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not), ``GET /v1/models``
and ``GET /v1/models/{id}`` need ``Authorization: Bearer KEY`` (a tenant's key); ``GET
/healthz`` and ``GET /metrics`` (Prometheus, see :mod:`kvwatch.gateway.metrics`) do not.
Every error is answered in OpenAI's shape, a 500 included.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engine_probe.probe import BaseProbe
from kvwatch.gateway.auth import TenantKeys
from kvwatch.gateway.counting import PromptCounter
from kvwatch.gateway.errors import BodyTooLarge, GatewayError, InvalidRequest, NotFound
from kvwatch.gateway.isolation import Isolation
from kvwatch.gateway.limits import LimitsSource, SafeContexts
from kvwatch.gateway.metrics import GatewayMetrics
from kvwatch.gateway.records import Recorder
from kvwatch.gateway.service import ProxyService
from kvwatch.gateway.settings import GatewaySettings
from kvwatch.gateway.upstream import Upstream

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it


def _error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(settings: GatewaySettings, *, probe: BaseProbe | None = None) -> FastAPI:
    """The gateway for ``settings``. Records go to ``probe`` (default: the process's probe,
    see :func:`engine_probe.configure_probe`). Connections to the upstream and the reading of
    verifications start and stop with the app's lifespan."""
    keys = TenantKeys(settings.gateway_tenant_keys)
    limits = SafeContexts(
        settings.gateway_safe_contexts,
        settings.gateway_on_failed_verification,
        deployment_id=settings.deployment_id or "",
        keep_s=settings.gateway_limits_keep_s if settings.reads_verifications else None,
    )
    upstream = Upstream(settings)
    metrics = GatewayMetrics(limits)
    secret = settings.gateway_salt_secret
    isolation = Isolation(
        salting=settings.gateway_salt_prefix_cache,
        tag_tenants=settings.gateway_tag_tenants,
        secret=secret.get_secret_value() if secret is not None else None,
    )
    if isolation.generated:
        log.warning(
            "KVWATCH_GATEWAY_SALT_SECRET is not set: per-tenant prefix-cache salts come from "
            "a secret generated for this process, so they change when it restarts (each "
            "tenant's cache starts afresh) and differ between replicas; set it to keep them"
        )
    service = ProxyService(
        upstream,
        PromptCounter(settings, upstream),
        limits,
        Recorder(probe, metrics),
        secrets=[*settings.gateway_tenant_keys.values(), settings.gateway_upstream_key or ""],
        warn_ratio=settings.gateway_warn_ratio,
        isolation=isolation,
    )
    source = LimitsSource(settings, limits) if settings.reads_verifications else None
    max_body = settings.gateway_max_body_bytes

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        collector = httpx.AsyncClient(timeout=10, trust_env=False, follow_redirects=False)
        try:
            if source is not None:
                await source.start(collector)
            yield
        finally:
            if source is not None:
                await source.stop()
            await collector.aclose()
            await upstream.aclose()

    app = FastAPI(
        title="kvwatch gateway",
        version="1",
        description="OpenAI-compatible proxy that records every request's token counts and "
        "refuses prompts above the model's verified safe context.",
        lifespan=lifespan,
    )
    app.state.limits = limits
    app.state.metrics = metrics

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(NotFound(f"Invalid URL ({request.method} {request.url.path})"))
        error = InvalidRequest(str(exc.detail), headers=exc.headers)
        error.status = exc.status_code
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(InvalidRequest(f"Invalid request: {exc.errors()[0]['msg']}"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in the gateway", exc_info=exc)
        error = GatewayError("The gateway had an error processing the request.")
        return _error_response(error)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise BodyTooLarge(f"The request body exceeds {max_body} bytes.")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise BodyTooLarge(f"The request body exceeds {max_body} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    @app.post("/v1/completions", summary="Text completion, proxied and recorded")
    async def completions(request: Request) -> Response:
        caller = keys.authenticate(request.headers.get("authorization"))
        return await service.generate("completion", caller, await read_body(request))

    @app.post("/v1/chat/completions", summary="Chat completion, proxied and recorded")
    async def chat_completions(request: Request) -> Response:
        caller = keys.authenticate(request.headers.get("authorization"))
        return await service.generate("chat", caller, await read_body(request))

    @app.get("/v1/models", summary="The upstream's models")
    async def models(request: Request) -> Response:
        caller = keys.authenticate(request.headers.get("authorization"))
        return await service.passthrough_get("/v1/models", caller)

    @app.get("/v1/models/{model:path}", summary="One of the upstream's models")
    async def model(model: str, request: Request) -> Response:
        caller = keys.authenticate(request.headers.get("authorization"))
        return await service.model(model, caller)

    @app.get("/healthz", summary="Liveness of the gateway (no auth)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics (no auth)")
    async def prometheus_metrics() -> Response:
        # Open, as Prometheus scrapes it: counters and histograms, never one request's figures.
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
