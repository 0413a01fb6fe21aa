"""``POST /tokenize`` (vLLM's shape): the byte tokenizer and the chat template, so ``count``
equals the ``prompt_tokens`` the same prompt would be charged; nothing is queued or
allocated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from refengine.engine import Engine
from refengine.server.bodies import Bodies
from refengine.server.errors import APIError
from refengine.server.models import ServedModel
from refengine.server.openapi import body_schema
from refengine.server.schemas import TokenizeRequest, chat_prompt


def build_router(
    engine: Engine, served: ServedModel, tenant_of: Callable[[Request], str], bodies: Bodies
) -> APIRouter:
    r = APIRouter()

    @r.post(
        "/tokenize",
        summary="Tokenize a prompt or chat messages (vLLM-compatible)",
        openapi_extra=body_schema("TokenizeRequest"),
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        tenant_of(request)
        body = await bodies.parse(TokenizeRequest, request)
        served.check(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Send exactly one of 'prompt' and 'messages'.", param="prompt")
        text = body.prompt if body.prompt is not None else chat_prompt(body.messages or [])
        tokens = engine.tokenizer.encode(text)
        strs = None
        if body.return_token_strs:
            strs = [bytes([t]).decode("utf-8", errors="replace") for t in tokens]
        return {
            "count": len(tokens),
            "max_model_len": engine.config.advertised_context,
            "tokens": tokens,
            "token_strs": strs,
        }

    return r
