"""``create_app(settings)``: the collector's FastAPI application. Nothing is built at import."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

import anyio
import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from collector import migrate, partitions
from collector.alerting.service import AlertingService
from collector.api import breach as breach_api
from collector.api import dashboard as dashboard_api
from collector.api import params
from collector.api import schemas as s
from collector.api.alerts import build_router
from collector.api.reports import build_router as build_reports_router
from collector.audit import AuditLog
from collector.db import Database
from collector.errors import CollectorError, PayloadTooLarge
from collector.fleet import FleetService
from collector.ingest import IngestService
from collector.metrics import CollectorMetrics
from collector.notify.dispatcher import Dispatcher
from collector.periodic import Periodic
from collector.reads import ReadService
from collector.reports.breach import BreachService
from collector.reports.inventory import InventoryService
from collector.reports.limits import LimitsService
from collector.reports.review import ReviewService
from collector.reports.stored import ReportStore
from collector.rollups.refresh import RollupRefresher
from collector.rollups.stats import StatsService
from collector.scrape import ScheduledScraper
from collector.settings import Settings
from collector.tokens import Authenticator, Principal
from engine_probe import events as ev
from policies import RuleSet, load_ruleset

_ERRORS = params.errors(401, 403, 422, 503)
# The wire contract's JSON Schema, generated from the msgspec types the decoder uses.
(_EVENTS_SCHEMA,), _EVENT_COMPONENTS = msgspec.json.schema_components(
    [list[ev.AnyEvent]], ref_template="#/components/schemas/{name}"
)
Auth = params.Auth
MAX_PAGE = 1000
PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Rows per page")]
MinTokens = Annotated[int | None, Query(ge=0, le=2**62)]
MaxPoints = Annotated[int, Query(ge=1, le=10_000, description="Buckets per series")]


def _error(status: int, code: str, message: str, details: Any = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "details": details}}, status_code=status
    )


_aware = params.aware


class _RejectNul:
    """PostgreSQL can neither store nor compare NUL: refuse it in the URL before any route
    reaches the database (a 400, never a 500)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (
            b"%00" in scope.get("query_string", b"") or "\x00" in scope.get("path", "")
        ):
            response = _error(400, "bad_request", "NUL characters are not allowed in the URL")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    db = Database(settings.database_url, pool_size=settings.db_pool_size)
    metrics = CollectorMetrics(db)
    authenticator = Authenticator(
        db, ttl_s=settings.token_cache_s, use_audit_s=settings.token_use_audit_s
    )
    rules = load_ruleset(settings.policy_packs_dir) if settings.policies_enabled else RuleSet()
    alerting = AlertingService(db, rules)
    ingest = IngestService(
        db, settings, metrics, authenticator, alerting if settings.policies_enabled else None
    )
    reads = ReadService(db)
    scraper = (
        ScheduledScraper(db, settings, ingest, metrics.registry)
        if settings.scrape_targets
        else None
    )
    scrapes = (
        None
        if scraper is None
        else Periodic("scrape", scraper.tick_s, scraper.run_due, at_start=scraper.start)
    )
    timer = (
        Periodic("policy", settings.policy_timer_s, lambda: alerting.tick(datetime.now(UTC)))
        if settings.policies_enabled
        else None
    )
    refresher = RollupRefresher(db)
    # At start, everything marked: what was ingested before this collector started (a demo,
    # a restart, a migration's backfill) shows at once.
    rollups = Periodic(
        "rollups",
        settings.rollup_interval_s,
        refresher.refresh,
        at_start=lambda: refresher.refresh(everything=True),
    )

    def ensure_partitions() -> None:
        with db.write() as conn:
            partitions.ensure(conn, datetime.now(UTC))

    # Next months' partitions exist well before they are needed (PostgreSQL only).
    maintainer = None if db.is_sqlite else Periodic("partitions", 3600.0, ensure_partitions)
    dispatcher = (
        Dispatcher(db, settings, registry=metrics.registry) if settings.notify_enabled else None
    )

    # SQLite takes one writer at a time anyway: more ingest threads would only fight over
    # the GIL and the write lock. PostgreSQL writers run in parallel (the driver releases
    # the GIL while the server works), up to the connection pool.
    ingest_limiter = anyio.CapacityLimiter(1 if db.is_sqlite else settings.db_pool_size)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.auto_migrate:
            await anyio.to_thread.run_sync(migrate.upgrade, settings.database_url)
        if maintainer is not None:
            await anyio.to_thread.run_sync(maintainer.run_once)
        for worker in (timer, dispatcher, rollups, maintainer, scrapes):
            if worker is not None:
                worker.start()
        try:
            yield
        finally:
            for worker in (timer, dispatcher, rollups, maintainer, scrapes):
                if worker is not None:
                    await anyio.to_thread.run_sync(worker.shutdown, 10.0)
            db.dispose()

    app = FastAPI(
        title="kvwatch collector",
        version="1",
        description="Ingests probe events; serves deployments, requests, pool samples and "
        "page events. Every endpoint but /healthz, /readyz and /metrics needs a bearer token.",
        lifespan=lifespan,
    )
    app.add_middleware(_RejectNul)
    app.state.settings = settings
    app.state.db = db
    app.state.metrics = metrics
    app.state.authenticator = authenticator  # collector.api.caller resolves tokens with it
    app.state.alerting = alerting
    app.state.policy_timer = timer
    app.state.dispatcher = dispatcher
    app.state.rollups = rollups
    app.state.scrapes = scrapes

    @app.exception_handler(CollectorError)
    async def _collector_error(_: Request, exc: CollectorError) -> JSONResponse:
        return _error(exc.status, exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"field": ".".join(str(p) for p in e.get("loc", ())[1:]) or None, "message": e["msg"]}
            for e in exc.errors()
        ]
        first = details[0] if details else {"field": None, "message": "invalid request"}
        return _error(422, "invalid_input", f"{first['field']}: {first['message']}", details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    async def principal(authorization: str | None) -> Principal:
        return await anyio.to_thread.run_sync(authenticator, authorization)

    @app.post(
        "/v1/events",
        response_model=s.IngestResponse,
        responses={
            **_ERRORS,
            413: {"model": s.ErrorResponse, "description": "Batch or body over the limits"},
            415: {"model": s.ErrorResponse, "description": "Not JSON or NDJSON"},
            422: {"model": s.ErrorResponse, "description": "Bad events: index and field each"},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": _EVENTS_SCHEMA},
                    "application/x-ndjson": {"schema": {"type": "string"}},
                },
            }
        },
        summary="Ingest one probe's batch: all events stored, or none",
    )
    async def post_events(request: Request, authorization: Auth = None) -> dict[str, Any]:
        who = await anyio.to_thread.run_sync(ingest.authenticate, authorization)
        body = await _read_body(request, settings.max_body_bytes)
        ctype = request.headers.get("content-type", "")
        now = datetime.now(UTC)
        result = await anyio.to_thread.run_sync(
            ingest.ingest, who, body, ctype, now, limiter=ingest_limiter
        )
        return result.as_dict()

    @app.get("/v1/deployments", response_model=list[s.DeploymentOut], responses=_ERRORS)
    async def get_deployments(authorization: Auth = None) -> Any:
        who = await principal(authorization)
        return await anyio.to_thread.run_sync(reads.deployments, who)

    @app.get(
        "/v1/deployments/{deployment_id}/config-history",
        response_model=list[s.ConfigOut],
        responses=_ERRORS,
    )
    async def get_config_history(deployment_id: str, authorization: Auth = None) -> Any:
        who = await principal(authorization)
        return await anyio.to_thread.run_sync(reads.deployment_history, who, deployment_id)

    @app.get("/v1/requests", response_model=s.RequestPage, responses=_ERRORS)
    async def get_requests(
        authorization: Auth = None,
        deployment_id: str | None = None,
        model_id: str | None = None,
        tenant: str | None = None,
        route: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        min_prompt_tokens: MinTokens = None,
        limit: PageLimit = 100,
        cursor: str | None = None,
    ) -> Any:
        who = await principal(authorization)
        return await anyio.to_thread.run_sync(
            lambda: reads.requests(
                who,
                deployment_id=deployment_id,
                model_id=model_id,
                tenant=tenant,
                route=route,
                since=_aware(since),
                until=_aware(until),
                min_prompt_tokens=min_prompt_tokens,
                limit=limit,
                cursor=cursor,
            )
        )

    @app.get("/v1/pool-samples", response_model=s.PoolSeries, responses=_ERRORS)
    async def get_pool_samples(
        authorization: Auth = None,
        deployment_id: str | None = None,
        node: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        max_points: MaxPoints = 500,
    ) -> Any:
        who = await principal(authorization)
        return await anyio.to_thread.run_sync(
            lambda: reads.pool_samples(
                who,
                deployment_id=deployment_id,
                node=node,
                since=_aware(since),
                until=_aware(until),
                max_points=max_points,
                now=datetime.now(UTC),
            )
        )

    @app.get("/v1/page-events", response_model=s.PageEventPage, responses=_ERRORS)
    async def get_page_events(
        authorization: Auth = None,
        deployment_id: str | None = None,
        kind: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: PageLimit = 100,
        cursor: str | None = None,
    ) -> Any:
        who = await principal(authorization)
        return await anyio.to_thread.run_sync(
            lambda: reads.page_events(
                who,
                deployment_id=deployment_id,
                kind=kind,
                tenant=tenant,
                since=_aware(since),
                until=_aware(until),
                limit=limit,
                cursor=cursor,
            )
        )

    @app.get("/v1/probes", response_model=list[s.ProbeOut], responses=_ERRORS)
    async def get_probes(authorization: Auth = None) -> Any:
        who = await principal(authorization)
        return await anyio.to_thread.run_sync(reads.probes, who)

    reviews = ReviewService(db)
    app.include_router(build_router(alerting))
    app.include_router(
        breach_api.build_router(BreachService(db, settings), reviews, ReportStore(db))
    )
    app.include_router(
        build_reports_router(InventoryService(db), LimitsService(db), reviews, AuditLog(db))
    )
    app.include_router(dashboard_api.build_router(FleetService(db), StatsService(db)))

    @app.get("/metrics", include_in_schema=True, response_class=Response)
    async def get_metrics() -> Response:
        data = await anyio.to_thread.run_sync(generate_latest, metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=s.Health)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=s.Health, responses={503: {"model": s.Health}})
    async def readyz() -> Any:
        try:
            await anyio.to_thread.run_sync(db.ping)
        except CollectorError as exc:
            return JSONResponse({"status": "unavailable", "detail": exc.message}, 503)
        return {"status": "ok"}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(_EVENT_COMPONENTS)
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            doc["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


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
