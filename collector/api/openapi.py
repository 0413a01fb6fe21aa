"""The collector's OpenAPI document: FastAPI's, plus the wire contract's event schemas
(generated from the msgspec types the ingest decoder uses), the bearer security scheme
that every operation but /healthz, /readyz and /metrics needs, and the 413 that the body
limit (:mod:`collector.api.bodies`) answers on every operation that may take a body."""

from __future__ import annotations

from typing import Any, Final

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine_probe import events as ev

# Methods whose requests may carry a body: the body-limit middleware answers 413 to any of
# them, whether or not the route reads one (a route without a body parameter included).
_BODY_METHODS = frozenset({"post", "put", "patch", "delete"})
_TOO_LARGE: Final = {
    "description": "Body over KVWATCH_MAX_REQUEST_BYTES (refused before the route runs; "
    "nothing stored)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}

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
            _document_body_limit(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_body_limit(doc: dict[str, Any]) -> None:
    """List 413 on every operation that takes a body or whose method may carry one, in one
    place: the middleware refuses them all, so no route has to remember to say so. A route
    that documents its own 413 (ingest's larger, streamed limit) keeps its wording."""
    for item in doc.get("paths", {}).values():
        for method, op in item.items():
            if "requestBody" in op or method in _BODY_METHODS:
                responses = op.setdefault("responses", {})
                responses.setdefault("413", _TOO_LARGE)
                op["responses"] = dict(sorted(responses.items()))
