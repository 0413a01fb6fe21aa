"""``create_app(engine, ...)``: the server, wired. Each area is a router module of this
package; what they share (the engine thread, the tenants, the served model, the body reader,
the metrics) is built here, per app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
from fastapi import FastAPI

from refengine.engine import Engine
from refengine.metrics import ServerMetrics
from refengine.server import completions, errors, health, models, openapi, tokenize
from refengine.server.auth import Tenants
from refengine.server.bodies import Bodies
from refengine.server.driver import EngineDriver


def create_app(
    engine: Engine,
    *,
    tenant_keys: dict[str, str] | None = None,
    model_id: str | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """The server for ``engine`` (see :mod:`refengine.server`).

    ``tenant_keys``: NAME -> KEY; ``None`` accepts every key as its own tenant (an empty
    dict accepts none). ``model_id``: the id served and checked against requests' ``model``
    (default ``engine.config.model_id``). ``max_body_bytes``: default 16 MiB plus 6 bytes per
    token of advertised context. Raises ``ValueError`` for an empty tenant name or key, or a
    key shared by two tenants. The engine thread starts with the app's lifespan and stops
    with it; nothing else may step ``engine`` meanwhile."""
    served_id = model_id or engine.config.model_id
    tenants = Tenants(tenant_keys)
    # A prompt of the advertised context, JSON-escaped at worst (\\u00XX per byte), fits.
    bodies = Bodies(max_body_bytes or (16 << 20) + 6 * engine.config.advertised_context)
    driver = EngineDriver(engine)
    served = models.ServedModel(served_id, engine.config)
    metrics = ServerMetrics(engine, served_id)

    app = FastAPI(
        title="refengine",
        version="1",
        description="OpenAI-compatible server of refengine, kvwatch's reference paged-KV "
        "engine. Every /v1 endpoint needs `Authorization: Bearer KEY`.",
        lifespan=_lifespan(driver),
    )
    app.state.engine = engine
    app.state.driver = driver
    app.state.model_id = served_id
    app.state.metrics = metrics
    errors.install(app)

    app.include_router(
        completions.build_router(engine, driver, metrics, served, tenants.of, bodies)
    )
    app.include_router(tokenize.build_router(engine, served, tenants.of, bodies))
    app.include_router(models.build_router(served, tenants.of))
    app.include_router(health.build_router(driver, metrics))
    openapi.install(app)
    return app


def _lifespan(driver: EngineDriver) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The engine thread runs while the app does."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        driver.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(driver.stop)

    return lifespan
