"""The collector's OpenAPI document: FastAPI's, plus the wire contract's event schemas
(generated from the msgspec types the ingest decoder uses) and the bearer security scheme
that every operation but /healthz, /readyz and /metrics needs."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine_probe import events as ev

# The wire contract's JSON Schema, generated from the msgspec types the decoder uses.
(EVENTS_SCHEMA,), EVENT_COMPONENTS = msgspec.json.schema_components(
    [list[ev.AnyEvent]], ref_template="#/components/schemas/{name}"
)


def install(app: FastAPI) -> None:
    """Serve the document with the event schemas and the bearer scheme (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(EVENT_COMPONENTS)
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            doc["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
