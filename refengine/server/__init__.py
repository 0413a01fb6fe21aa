"""refengine's OpenAI-compatible HTTP server: ``create_app(engine, ...)`` builds it.

Endpoints
---------
``POST /v1/completions`` (``prompt``: one string, or a list holding one string),
``POST /v1/chat/completions`` (``messages``), both non-streaming and SSE streaming
(``"stream": true``: ``data: {chunk}\\n\\n`` lines ending with ``data: [DONE]\\n\\n``; with
``"stream_options": {"include_usage": true}`` a last chunk with empty ``choices`` carries
``usage``), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``POST /tokenize`` (vLLM's shape:
``prompt`` or chat ``messages`` in, ``{"count", "max_model_len", "tokens", "token_strs"}`` out;
the byte tokenizer and the chat template below, so ``count`` equals the ``prompt_tokens`` the
same prompt would be charged; nothing is queued or allocated), ``GET /health`` (no auth:
200 while the engine thread runs, 503 once it has stopped or failed), and ``GET /metrics``
(no auth: Prometheus metrics in vLLM's names, see :mod:`refengine.metrics`).

Shapes follow OpenAI's: ``id`` (the engine's request id, see below), ``object``, ``created``,
``model``, ``choices[0]`` with ``finish_reason`` (``stop`` on end of text, ``length`` on the
token budget), and ``usage`` {``prompt_tokens``, ``completion_tokens``, ``total_tokens``} (the
byte tokenizer's counts; completion tokens include the end-of-text token). Sampling fields
(``temperature``, ``top_p``, ``stop``, ...) are accepted and ignored: the lab model decodes
greedily. ``n`` must be 1. ``max_tokens`` defaults to 16 for completions (as OpenAI's) and to
"as much as fits" for chat; chat's ``max_completion_tokens`` wins over ``max_tokens``.

Prefix cache
------------
``cache_salt`` (vLLM's request field: a non-empty string) salts the prefix cache's keys, as
vLLM's does, whenever the cache is on (``shared`` or ``salted``; ``salted`` adds the tenant
itself); it is accepted and ignored with it off. ``usage`` also carries vLLM's
``prompt_tokens_details: {"cached_tokens": N}`` (the prompt tokens served from the cache, 0
with it off; the streamed final usage chunk too). The model card always says
``prefix_caching`` and ``prefix_cache`` (the mode).

Chat template
-------------
``messages`` become one prompt string, one line per message: ``f"{role}: {content}\\n"``
(a content list contributes its ``text`` parts, concatenated; ``null`` content is empty).
The lab model reads its KV cache back, so a chat answer is that templated prompt.

Tenants and auth
----------------
Every ``/v1`` call needs ``Authorization: Bearer KEY``. With ``tenant_keys`` (NAME -> KEY)
only those keys are accepted and the tenant is NAME; without, every key is accepted and is
its own tenant, named ``key-`` plus the first 16 hex digits of the key's SHA-256 (the key
itself never reaches the engine, its observers, or a log). A missing or unknown key is a 401.

Request ids
-----------
The server names every request (``cmpl-<hex>`` / ``chatcmpl-<hex>``) and hands that name to
the engine, so the response ``id``, the ``X-Request-Id`` response header and what a probe
records are one and the same. A client's own ``X-Request-Id`` header is ignored: ids must be
unique among live requests and must not be choosable by one tenant to collide with (or
probe for) another tenant's.

Errors
------
``{"error": {"message", "type", "param", "code"}}``, as OpenAI's: 400 ``invalid_request_error``
for a body that is not JSON or has bad fields (never a 500); 400 with code
``context_length_exceeded`` (param ``prompt`` or ``messages``) when the engine refuses the
prompt, before anything was generated (streaming too: the refusal comes as that JSON error,
not as a stream); 401 ``invalid_api_key``; 404 ``model_not_found`` when ``model`` names
another model (an absent ``model`` means the served one); 413 for a body over
``max_body_bytes``; 503 once the engine thread has stopped. In ``legacy`` mode a prompt the
engine rejected inside prefill is still answered 200, exactly as the incident's engine did,
and the response says nothing about it: observing that is the probe's job.

Threading
---------
One background thread (:class:`EngineDriver`, started in the app's lifespan, stopped at
shutdown) drives the engine: ``step()`` while it has work, ``wait_for_work()`` otherwise.
Handlers call ``submit`` in a worker thread (it can wait up to one step for the engine's
lock); the engine hands each request's deltas to the event loop with
``call_soon_threadsafe``. A client that goes away has its request aborted by the engine
thread, between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from refengine.engine import Engine
from refengine.errors import ContextLengthExceeded, InvalidRequest
from refengine.metrics import ServerMetrics
from refengine.request import Request as EngineRequest
from refengine.request import TokenDelta

log = logging.getLogger("refengine.server")
_B = TypeVar("_B", bound=BaseModel)

Kind = Literal["completion", "chat"]


# -- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape: the HTTP boundary's type, raised only inside this
    module's routes and turned into a response by its exception handler. The engine's
    :class:`~refengine.errors.RefEngineError` is translated into it where a route calls the
    engine; it is deliberately not one itself (see that class)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class EngineUnavailable(APIError):
    def __init__(self, why: str) -> None:
        super().__init__(503, why, type="server_error", code="engine_unavailable")


# -- request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    cache_salt: str | None = Field(default=None, min_length=1)


class CompletionRequest(_Body):
    """``POST /v1/completions``; fields not listed are accepted and ignored."""

    prompt: str | list[str]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Body):
    """``POST /v1/chat/completions``; fields not listed are accepted and ignored."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): ``prompt``, or chat ``messages`` rendered with the
    chat template. ``add_generation_prompt`` and ``add_special_tokens`` are accepted and change
    nothing (the template has no generation prompt; no special token is ever added)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The chat template: one ``"{role}: {content}\\n"`` line per message."""
    lines = []
    for i, m in enumerate(messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"content parts of type {part.type!r} are not supported; "
                        "only 'text' parts are",
                        param=f"messages.{i}.content.{j}",
                    )
                texts.append(part.text)
            content = "".join(texts)
        lines.append(f"{m.role}: {content}\n")
    return "".join(lines)


def _parse(cls: type[_B], raw: bytes) -> _B:
    try:
        return cls.model_validate_json(raw)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        loc = [str(p) for p in e.get("loc", ())]
        if e["type"] == "json_invalid":
            raise APIError(400, f"The request body is not valid JSON: {e['msg']}") from None
        if not loc:
            raise APIError(400, f"The request body must be a JSON object: {e['msg']}") from None
        # ``param`` is the top-level field (union members add their type names deeper in the
        # location); the message names the full location.
        param, where = loc[0], ".".join(loc)
        if e["type"] == "missing":
            raise APIError(400, f"Missing required field '{where}'.", param=param) from None
        raise APIError(400, f"Invalid value for '{where}': {e['msg']}", param=param) from None


# -- the engine thread ------------------------------------------------------------------------


class EngineDriver:
    """The one thread that drives the engine, and the waiters it must not strand.

    Invariants: after ``start()`` and until ``stop()`` or a failure, exactly one thread calls
    ``engine.step()``; every registered waiter is told (``on_fail``) if that thread ends
    while the request is still registered, so no handler waits forever; once stopped or
    failed, ``register`` refuses.
    """

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed: str | None = "the engine thread has not started"
        self._waiters: dict[str, Callable[[APIError], None]] = {}
        self._aborts: deque[str] = deque()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._closed is None

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine driver was already started")
            self._closed = None
            self._thread = threading.Thread(target=self._run, name="refengine-driver", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close("the server is shutting down")

    def register(self, request_id: str, on_fail: Callable[[APIError], None]) -> None:
        with self._lock:
            if self._closed is not None:
                raise EngineUnavailable(self._closed)
            self._waiters[request_id] = on_fail

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (no-op if it already finished)."""
        self._aborts.append(request_id)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                while self._aborts:
                    engine.abort(self._aborts.popleft())
                if engine.has_work:
                    engine.step()
                else:
                    engine.wait_for_work(self.idle_wait_s)
        except BaseException as exc:
            self.failure = exc
            log.exception("the engine thread failed; refusing new requests")
            self._close("the engine failed; see the server log")

    def _close(self, why: str) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = why
            waiters = list(self._waiters.values())
            self._waiters.clear()
        for on_fail in waiters:
            on_fail(EngineUnavailable(why))


# -- one request in flight --------------------------------------------------------------------


class _Flight:
    """One submitted request: the engine's deltas, handed to the event loop, and counted."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        every_delta: bool,
        on_finish: Callable[[], None],
        metrics: ServerMetrics,
    ) -> None:
        self.loop = loop
        self.every_delta = every_delta
        self.on_finish = on_finish
        self.metrics = metrics
        self.queue: asyncio.Queue[TokenDelta | APIError] = asyncio.Queue()
        self.arrived = time.monotonic()
        self.first_token = False

    def _post(self, item: TokenDelta | APIError) -> None:
        # A closed loop (the server stopped) has nobody waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_delta(self, delta: TokenDelta) -> None:
        # Called in the engine thread with its lock held: post, never raise.
        req = delta.request
        if delta.token_ids:
            if not self.first_token:  # prefill's token: the prompt is processed
                self.first_token = True
                self.metrics.first_token(req.prompt_tokens, time.monotonic() - self.arrived)
            self.metrics.generated(len(delta.token_ids))
        if delta.finished:
            reason = delta.finish_reason or "abort"
            self.metrics.finished(
                reason, req.prompt_tokens, req.completion_tokens, time.monotonic() - self.arrived
            )
            # Forget the waiter here too, so nothing leaks if no handler reads to the end
            # (a client gone before its stream started).
            self.on_finish()
        if self.every_delta or delta.finished:
            self._post(delta)

    def on_fail(self, error: APIError) -> None:
        self._post(error)


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


# -- the app ----------------------------------------------------------------------------------


def _tenant_resolver(tenant_keys: Mapping[str, str] | None) -> Callable[[str], str | None]:
    """KEY -> tenant name, or None for an unknown key."""

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    if tenant_keys is None:
        return lambda key: f"key-{digest(key)[:16]}"
    by_digest: dict[str, str] = {}
    for name, key in tenant_keys.items():
        if not isinstance(name, str) or not name:
            raise ValueError("tenant names must be non-empty strings")
        if not isinstance(key, str) or not key:
            raise ValueError(f"tenant {name!r} has an empty key")
        d = digest(key)
        if d in by_digest:
            raise ValueError(f"tenants {by_digest[d]!r} and {name!r} share one key")
        by_digest[d] = name
    # Looked up by digest: comparing the presented key against each secret byte by byte
    # would leak timing.
    return lambda key: by_digest.get(digest(key))


def create_app(
    engine: Engine,
    *,
    tenant_keys: dict[str, str] | None = None,
    model_id: str | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """The server for ``engine`` (see the module docstring).

    ``tenant_keys``: NAME -> KEY; ``None`` accepts every key as its own tenant (an empty
    dict accepts none). ``model_id``: the id served and checked against requests' ``model``
    (default ``engine.config.model_id``). ``max_body_bytes``: default 16 MiB plus 6 bytes per
    token of advertised context. Raises ``ValueError`` for an empty tenant name or key, or a
    key shared by two tenants. The engine thread starts with the app's lifespan and stops
    with it; nothing else may step ``engine`` meanwhile."""
    served = model_id or engine.config.model_id
    resolve = _tenant_resolver(tenant_keys)
    # A prompt of the advertised context, JSON-escaped at worst (\\u00XX per byte), fits.
    body_limit = max_body_bytes or (16 << 20) + 6 * engine.config.advertised_context
    driver = EngineDriver(engine)
    started = int(time.time())
    metrics = ServerMetrics(engine, served)
    cached = engine.config.prefix_caching

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        driver.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(driver.stop)

    app = FastAPI(
        title="refengine",
        version="1",
        description="OpenAI-compatible server of refengine, kvwatch's reference paged-KV "
        "engine. Every /v1 endpoint needs `Authorization: Bearer KEY`.",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.driver = driver
    app.state.model_id = served
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return APIError(
            500, "The server had an error processing the request.", type="server_error"
        ).response()

    def tenant_of(request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        challenge = {"WWW-Authenticate": "Bearer"}
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
                code="invalid_api_key",
                headers=challenge,
            )
        tenant = resolve(key)
        if tenant is None:
            raise APIError(
                401, "Incorrect API key provided.", code="invalid_api_key", headers=challenge
            )
        return tenant

    def check_model(name: str | None) -> None:
        if name is not None and name != served:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{served}'.",
                param="model",
                code="model_not_found",
            )

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > body_limit:
            raise APIError(413, f"The request body exceeds {body_limit} bytes.")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > body_limit:
                raise APIError(413, f"The request body exceeds {body_limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    def model_card() -> dict[str, Any]:
        return {
            "id": served,
            "object": "model",
            "created": started,
            "owned_by": "refengine",
            "max_model_len": engine.config.advertised_context,
            "prefix_caching": engine.config.prefix_caching,
            "prefix_cache": engine.config.prefix_cache,
        }

    async def run(
        kind: Kind,
        tenant: str,
        prompt: str,
        max_tokens: int,
        stream: bool,
        include_usage: bool,
        cache_salt: str | None = None,
    ) -> Any:
        prefix, route, param = (
            ("cmpl", "/v1/completions", "prompt")
            if kind == "completion"
            else ("chatcmpl", "/v1/chat/completions", "messages")
        )
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        flight = _Flight(
            asyncio.get_running_loop(),
            every_delta=stream,
            on_finish=lambda: driver.unregister(rid),
            metrics=metrics,
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
                _stream(kind, req, flight, include_usage),
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
            "model": served,
            "choices": [choice],
            "usage": _usage(req, cached),
        }
        return JSONResponse(body, headers=headers)

    async def _stream(
        kind: Kind, req: EngineRequest, flight: _Flight, include_usage: bool
    ) -> AsyncIterator[bytes]:
        rid = req.request_id
        base: dict[str, Any] = {
            "id": rid,
            "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
            "created": int(req.created),
            "model": served,
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
                yield _sse({**base, "choices": [], "usage": _usage(req, cached)})
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                driver.abort(rid)
            driver.unregister(rid)

    @app.post(
        "/v1/completions",
        summary="Text completion (OpenAI-compatible)",
        openapi_extra=_body_schema("CompletionRequest"),
    )
    async def completions(request: Request) -> Any:
        tenant = tenant_of(request)
        body = _parse(CompletionRequest, await read_body(request))
        check_model(body.model)
        _check_n(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "Send exactly one prompt per request.", param="prompt")
            prompt = prompt[0]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await run(
            "completion",
            tenant,
            prompt,
            max_tokens,
            bool(body.stream),
            _include_usage(body),
            body.cache_salt,
        )

    @app.post(
        "/v1/chat/completions",
        summary="Chat completion (OpenAI-compatible)",
        openapi_extra=_body_schema("ChatCompletionRequest"),
    )
    async def chat_completions(request: Request) -> Any:
        tenant = tenant_of(request)
        body = _parse(ChatCompletionRequest, await read_body(request))
        check_model(body.model)
        _check_n(body)
        prompt = chat_prompt(body.messages)
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        elif body.max_tokens is not None:
            max_tokens = body.max_tokens
        else:  # as much as fits: the engine caps it by the context and the pool
            max_tokens = engine.config.advertised_context
        return await run(
            "chat",
            tenant,
            prompt,
            max_tokens,
            bool(body.stream),
            _include_usage(body),
            body.cache_salt,
        )

    @app.post(
        "/tokenize",
        summary="Tokenize a prompt or chat messages (vLLM-compatible)",
        openapi_extra=_body_schema("TokenizeRequest"),
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        tenant_of(request)
        body = _parse(TokenizeRequest, await read_body(request))
        check_model(body.model)
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

    @app.get("/v1/models", summary="The served model")
    async def models(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}", summary="One model")
    async def model(model: str, request: Request) -> dict[str, Any]:
        tenant_of(request)
        check_model(model)
        return model_card()

    @app.get("/health", summary="Liveness of the engine thread (no auth)")
    async def health() -> JSONResponse:
        if driver.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics in vLLM's names (no auth)")
    async def prometheus_metrics() -> Response:
        # Open, as Prometheus scrapes it: nothing here describes one request.
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

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
    return app


def _check_n(body: _Body) -> None:
    if body.n not in (None, 1):
        raise APIError(400, "Only n=1 is supported.", param="n")


def _include_usage(body: _Body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


_, _DEFS = models_json_schema(
    [
        (CompletionRequest, "validation"),
        (ChatCompletionRequest, "validation"),
        (TokenizeRequest, "validation"),
    ],
    ref_template="#/components/schemas/{model}",
)
_SCHEMAS: dict[str, Any] = _DEFS.get("$defs", {})


def _body_schema(name: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }
