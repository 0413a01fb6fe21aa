"""The served model: its id, which every request's ``model`` must name when it names one
(404 ``model_not_found`` otherwise), and its card; ``GET /v1/models`` and
``GET /v1/models/{id}``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from refengine.config import EngineConfig
from refengine.server.errors import APIError


class ServedModel:
    """The one model this server serves, named ``model_id``, created when this was built."""

    def __init__(self, model_id: str, config: EngineConfig) -> None:
        self.id = model_id
        self.config = config
        self.created = int(time.time())

    def check(self, name: str | None) -> None:
        """Refuse a request naming another model (an absent ``model`` means this one)."""
        if name is not None and name != self.id:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.id}'.",
                param="model",
                code="model_not_found",
            )

    def card(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": "refengine",
            "max_model_len": self.config.advertised_context,
            "prefix_caching": self.config.prefix_caching,
            "prefix_cache": self.config.prefix_cache,
        }


def build_router(served: ServedModel, tenant_of: Callable[[Request], str]) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models", summary="The served model")
    async def models(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [served.card()]}

    @r.get("/v1/models/{model}", summary="One model")
    async def model(model: str, request: Request) -> dict[str, Any]:
        tenant_of(request)
        served.check(model)
        return served.card()

    return r
