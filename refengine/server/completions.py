"""``POST /v1/completions`` and ``POST /v1/chat/completions``: each request named, submitted
to the engine and answered whole or as an SSE stream, in OpenAI's shapes (see
:mod:`refengine.server`)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from refengine.engine import Engine
from refengine.errors import ContextLengthExceeded, InvalidRequest
from refengine.metrics import ServerMetrics
from refengine.request import Request as EngineRequest
from refengine.server.bodies import Bodies
from refengine.server.driver import EngineDriver, Flight
from refengine.server.errors import APIError
from refengine.server.models import ServedModel
from refengine.server.openapi import body_schema
from refengine.server.schemas import (
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
    chat_prompt,
)

Kind = Literal["completion", "chat"]


def build_router(
    engine: Engine,
    driver: EngineDriver,
    metrics: ServerMetrics,
    served: ServedModel,
    tenant_of: Callable[[Request], str],
    bodies: Bodies,
) -> APIRouter:
    answer = _Completions(engine, driver, metrics, served.id)
    r = APIRouter()

    @r.post(
        "/v1/completions",
        summary="Text completion (OpenAI-compatible)",
        openapi_extra=body_schema("CompletionRequest"),
    )
    async def completions(request: Request) -> Any:
        tenant = tenant_of(request)
        body = await bodies.parse(CompletionRequest, request)
        served.check(body.model)
        _check_n(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "Send exactly one prompt per request.", param="prompt")
            prompt = prompt[0]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await answer.run(
            "completion",
            tenant,
            prompt,
            max_tokens,
            bool(body.stream),
            _include_usage(body),
            body.cache_salt,
        )

    @r.post(
        "/v1/chat/completions",
        summary="Chat completion (OpenAI-compatible)",
        openapi_extra=body_schema("ChatCompletionRequest"),
    )
    async def chat_completions(request: Request) -> Any:
        tenant = tenant_of(request)
        body = await bodies.parse(ChatCompletionRequest, request)
        served.check(body.model)
        _check_n(body)
        prompt = chat_prompt(body.messages)
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        elif body.max_tokens is not None:
            max_tokens = body.max_tokens
        else:  # as much as fits: the engine caps it by the context and the pool
            max_tokens = engine.config.advertised_context
        return await answer.run(
            "chat",
            tenant,
            prompt,
            max_tokens,
            bool(body.stream),
            _include_usage(body),
            body.cache_salt,
        )

    return r


class _Completions:
    """Submits one request to the engine and answers it, whole or streamed.

    Invariant: a request registered with the driver is unregistered however its handler or
    stream ends, and aborted in the engine unless it finished."""

    def __init__(
        self, engine: Engine, driver: EngineDriver, metrics: ServerMetrics, served: str
    ) -> None:
        self.engine = engine
        self.driver = driver
        self.metrics = metrics
        self.served = served
        self.cached = engine.config.prefix_caching

    async def run(
        self,
        kind: Kind,
        tenant: str,
        prompt: str,
        max_tokens: int,
        stream: bool,
        include_usage: bool,
        cache_salt: str | None = None,
    ) -> Any:
        engine, driver = self.engine, self.driver
        prefix, route, param = (
            ("cmpl", "/v1/completions", "prompt")
            if kind == "completion"
            else ("chatcmpl", "/v1/chat/completions", "messages")
        )
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        flight = Flight(
            asyncio.get_running_loop(),
            every_delta=stream,
            on_finish=lambda: driver.unregister(rid),
            metrics=self.metrics,
        )
        driver.register(rid, flight.on_fail)

        def submit() -> EngineRequest:
            return engine.submit(
                prompt,
                tenant,
                max_tokens,
                rid,
                route=route,
                on_delta=flight.on_delta,
                cache_salt=cache_salt,
            )

        try:
            req = await anyio.to_thread.run_sync(submit)
        except ContextLengthExceeded as exc:
            driver.unregister(rid)
            raise APIError(400, str(exc), param=param, code=exc.code) from None
        except InvalidRequest as exc:
            driver.unregister(rid)
            raise APIError(400, str(exc), param=param) from None
        except BaseException:
            driver.unregister(rid)
            raise
        headers = {"X-Request-Id": rid}
        if stream:
            return StreamingResponse(
                self._stream(kind, req, flight, include_usage),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        finished = False
        try:
            while not finished:
                item = await flight.queue.get()
                if isinstance(item, APIError):
                    raise item
                finished = item.finished
        finally:
            if not finished:
                driver.abort(rid)
            driver.unregister(rid)
        text = req.completion().text
        choice: dict[str, Any] = {"index": 0}
        if kind == "completion":
            choice |= {"text": text, "logprobs": None}
        else:
            choice |= {"message": {"role": "assistant", "content": text}, "logprobs": None}
        choice["finish_reason"] = req.finish_reason
        body = {
            "id": rid,
            "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": int(req.created),
            "model": self.served,
            "choices": [choice],
            "usage": _usage(req, self.cached),
        }
        return JSONResponse(body, headers=headers)

    async def _stream(
        self, kind: Kind, req: EngineRequest, flight: Flight, include_usage: bool
    ) -> AsyncIterator[bytes]:
        rid = req.request_id
        base: dict[str, Any] = {
            "id": rid,
            "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
            "created": int(req.created),
            "model": self.served,
        }
        if include_usage:
            base["usage"] = None

        def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> bytes:
            choice: dict[str, Any] = {"index": 0}
            if kind == "completion":
                choice |= {"text": text or "", "logprobs": None}
            else:
                delta: dict[str, str] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice |= {"delta": delta, "logprobs": None}
            choice["finish_reason"] = finish_reason
            return _sse({**base, "choices": [choice]})

        finished = False
        try:
            if kind == "chat":
                yield chunk("", None, role=True)
            while not finished:
                items = [await flight.queue.get()]
                while not flight.queue.empty():  # coalesce what the engine already produced
                    items.append(flight.queue.get_nowait())
                text = []
                for item in items:
                    if isinstance(item, APIError):
                        yield _sse(item.body())
                        return
                    text.append(item.text)
                    finished = item.finished
                piece = "".join(text)
                if finished:
                    if kind == "chat":
                        if piece:
                            yield chunk(piece, None)
                        yield chunk(None, req.finish_reason)
                    else:
                        yield chunk(piece, req.finish_reason)
                elif piece:
                    yield chunk(piece, None)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(req, self.cached)})
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.driver.abort(rid)
            self.driver.unregister(rid)


def _check_n(body: CompletionBody) -> None:
    if body.n not in (None, 1):
        raise APIError(400, "Only n=1 is supported.", param="n")


def _include_usage(body: CompletionBody) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _usage(req: EngineRequest, cached: bool) -> dict[str, Any]:
    """OpenAI's usage with vLLM's ``prompt_tokens_details.cached_tokens``, 0 with the prefix
    cache off (``cached`` false), as vLLM with ``--enable-prompt-tokens-details`` reports
    it: a client can then tell caching off from a cache that did not hit, which timing
    alone cannot (``kvwatch verify``'s prefix-cache phase reads it)."""
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.completion_tokens,
        "total_tokens": req.prompt_tokens + req.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens if cached else 0},
    }


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
