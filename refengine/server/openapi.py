"""The server's OpenAPI document: FastAPI's, plus the request bodies' schemas (the routes read
their bodies themselves, so FastAPI cannot see them) and the bearer security scheme."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from refengine.server.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest

_, _DEFS = models_json_schema(
    [
        (CompletionRequest, "validation"),
        (ChatCompletionRequest, "validation"),
        (TokenizeRequest, "validation"),
    ],
    ref_template="#/components/schemas/{model}",
)
_SCHEMAS: dict[str, Any] = _DEFS.get("$defs", {})


def body_schema(name: str) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is the schema ``name`` (one of the above)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def install(app: FastAPI) -> None:
    """Serve the document with the body schemas and the bearer scheme (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            doc["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
