"""What the gateway does with one request: guard, forward, relay, record.

Per request: parse the body (only to read ``model``, the prompt and the stream flags), check
the prompt against the model's safe context (counting it only when a limit applies; input
that cannot be counted is then refused), forward the body (unchanged, but for the tenant's
tags and prefix-cache salt, :mod:`kvwatch.gateway.isolation`, and a stream's
``stream_options.include_usage``), pass the answer back (an error body with every configured
key replaced by ``***``), and emit the request's one record. Nothing outlives the request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final
from urllib.parse import quote

import anyio
import httpx
import msgspec
from starlette.responses import Response, StreamingResponse

from kvwatch.gateway.auth import Caller
from kvwatch.gateway.counting import Kind, PromptCounter, uncountable
from kvwatch.gateway.errors import (
    BadUpstreamResponse,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    UnsupportedContent,
    UpstreamError,
)
from kvwatch.gateway.isolation import Injection, Isolation
from kvwatch.gateway.limits import Limit, SafeContexts
from kvwatch.gateway.records import Flight, Recorder, finish_status
from kvwatch.gateway.sse import SseScanner
from kvwatch.gateway.upstream import Upstream

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it

ROUTES: Final[dict[Kind, str]] = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_JSON: Final = "application/json"


def limit_headers(limit: Limit) -> dict[str, str]:
    """What every guarded answer says about the guard: the limit in force and its source,
    and a failed verification when there is one (header values are ASCII)."""
    out = {
        "X-Kvwatch-Safe-Context": str(limit.tokens),
        "X-Kvwatch-Safe-Context-Source": limit.source,
    }
    if limit.warning is not None:
        ascii_text = limit.warning.replace("≥", ">=").encode("ascii", "replace").decode()
        out["X-Kvwatch-Warning"] = ascii_text
    return out


def _decode(content: bytes) -> Any:
    try:
        return msgspec.json.decode(content)
    except msgspec.DecodeError:
        return None


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _learn_model(flight: Flight, served: Any) -> None:
    """A request that named no model is recorded under the one the upstream says served it."""
    if flight.model is None and isinstance(served, str):
        flight.model = served


def _first_finish_reason(data: dict[str, Any]) -> Any:
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason")
    return None


class ProxyService:
    def __init__(
        self,
        upstream: Upstream,
        counter: PromptCounter,
        limits: SafeContexts,
        recorder: Recorder,
        *,
        secrets: Iterable[str] = (),
        warn_ratio: float = 0.8,
        isolation: Isolation | None = None,
    ) -> None:
        self.upstream = upstream
        self.isolation = isolation
        self.warn_ratio = warn_ratio
        self.counter = counter
        self.limits = limits
        self.recorder = recorder
        # Keys never relayed back: the upstream key and every tenant's (plus the caller's).
        self._secrets = tuple(s for s in secrets if s)

    def _upstream_error(
        self, status: int, body: Any, caller: Caller, salt: str | None = None
    ) -> UpstreamError:
        # the tenant's salt too: a client that reaches the engine directly could use it
        extra = (caller.key,) if salt is None else (caller.key, salt)
        return UpstreamError(status, body, secrets=(*self._secrets, *extra))

    # -- /v1/models -----------------------------------------------------------------------

    async def passthrough_get(self, path: str, caller: Caller) -> Response:
        """A read-only route (``/v1/models``): forwarded, not recorded."""
        rid = f"gw-{uuid.uuid4().hex[:24]}"
        r = await self.upstream.send("GET", path, caller, rid)
        if r.status_code >= 400:
            raise self._upstream_error(r.status_code, _decode(r.content), caller)
        return Response(r.content, r.status_code, media_type=_JSON, headers={"X-Request-Id": rid})

    async def model(self, model: str, caller: Caller) -> Response:
        """``GET /v1/models/{model}``: the id goes upstream as one quoted path segment, so it
        can neither climb out of ``/v1/models/`` nor add a query."""
        if model in ("", ".", ".."):
            raise InvalidRequest(f"Invalid model id {model!r}.", param="model")
        return await self.passthrough_get(f"/v1/models/{quote(model, safe='')}", caller)

    # -- completions ----------------------------------------------------------------------

    async def generate(self, kind: Kind, caller: Caller, raw: bytes) -> Response:
        flight = Flight(f"gw-{uuid.uuid4().hex[:24]}", caller.tenant, ROUTES[kind])
        try:
            return await self._generate(kind, caller, raw, flight)
        except GatewayError as exc:
            if caller.unverified and isinstance(exc, UpstreamError) and exc.status in (401, 403):
                # No tenant keys: the upstream refused the key, so no tenant is known (a
                # record would make every random key a tenant).
                flight.recorded = True
            self.recorder.failed(flight, exc)
            exc.headers.setdefault("X-Request-Id", flight.request_id)
            for name, value in flight.headers.items():
                exc.headers.setdefault(name, value)
            raise
        except Exception:
            self.recorder.finished(flight, "error", completion_tokens=0)
            raise

    async def _generate(self, kind: Kind, caller: Caller, raw: bytes, flight: Flight) -> Response:
        body = _parse_body(raw)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("'model' must be a string.", param="model")
        flight.model = model
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean (true or false).", param="stream")
        limit = self.limits.limit(model)
        headers = flight.headers
        headers["X-Request-Id"] = flight.request_id
        if limit is not None:
            headers |= limit_headers(limit)
            if (where := uncountable(kind, body)) is not None:
                raise UnsupportedContent(where, headers=headers)
            count = await self.counter.count(kind, body, caller, flight.request_id)
            flight.count = count
            flight.limit_tokens = limit.tokens
            if count.tokens > limit.tokens:
                raise ContextLengthExceeded(
                    prompt_tokens=count.tokens,
                    limit_tokens=limit.tokens,
                    method=count.method,
                    param="prompt" if kind == "completion" else "messages",
                    source=limit.source,
                    failure=limit.warning,
                    headers=headers,
                )
            if limit.tokens > 0 and count.tokens >= self.warn_ratio * limit.tokens:
                near = (
                    f"prompt of {count.tokens} tokens is {count.tokens / limit.tokens:.0%} of "
                    f"the {limit.source} safe context ({limit.tokens} tokens)"
                )
                headers["X-Kvwatch-Warning"] = "; ".join(
                    w for w in (near, headers.get("X-Kvwatch-Warning")) if w
                )
                log.warning("request %s: %s", flight.request_id, near)
        inject = (
            self.isolation.for_request(body, caller.tenant, ROUTES[kind])
            if self.isolation is not None
            else Injection({}, {}, None)
        )
        flight.forwarded_at = time.monotonic()
        if stream is True:
            return await self._stream(kind, inject.applied(body), caller, flight, headers, inject)
        changed = inject.fields or inject.drop
        content = msgspec.json.encode(inject.applied(body)) if changed else raw
        r = await self.upstream.send(
            "POST",
            ROUTES[kind],
            caller,
            flight.request_id,
            content,
            extra_headers=inject.headers,
        )
        data = _decode(r.content)
        if r.status_code >= 400:
            raise self._upstream_error(r.status_code, data, caller, inject.salt)
        if not isinstance(data, dict):
            raise BadUpstreamResponse("The upstream answered with something other than JSON.")
        _learn_model(flight, data.get("model"))
        self.recorder.finished(flight, finish_status(_first_finish_reason(data)), data.get("usage"))
        return Response(r.content, r.status_code, media_type=_JSON, headers=headers)

    async def _stream(
        self,
        kind: Kind,
        body: dict[str, Any],
        caller: Caller,
        flight: Flight,
        headers: dict[str, str],
        inject: Injection,
    ) -> Response:
        options = body.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        wanted = options.get("include_usage") is True
        content = msgspec.json.encode(body | {"stream_options": options | {"include_usage": True}})
        r = await self.upstream.send(
            "POST",
            ROUTES[kind],
            caller,
            flight.request_id,
            content,
            stream=True,
            extra_headers=inject.headers,
        )
        if r.status_code >= 400 or not r.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            try:
                answer = await r.aread()
            except httpx.HTTPError as exc:
                raise self.upstream.translate(exc) from None
            finally:
                await r.aclose()
            data = _decode(answer)
            if r.status_code >= 400:
                raise self._upstream_error(r.status_code, data, caller, inject.salt)
            if not isinstance(data, dict):
                raise BadUpstreamResponse("The upstream answered with something other than JSON.")
            # The upstream answered the stream request in one piece: pass that on as it is.
            _learn_model(flight, data.get("model"))
            status = finish_status(_first_finish_reason(data))
            self.recorder.finished(flight, status, data.get("usage"))
            return Response(answer, r.status_code, media_type=_JSON, headers=headers)
        return StreamingResponse(
            self._relay(r, flight, SseScanner(strip_usage_chunk=not wanted)),
            media_type="text/event-stream",
            headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _relay(
        self, r: httpx.Response, flight: Flight, sse: SseScanner
    ) -> AsyncIterator[bytes]:
        """The upstream's events as they arrive; the record once the stream ends, fails, or
        the client goes away (``aborted``)."""
        outcome = "aborted"
        try:
            try:
                async for chunk in r.aiter_bytes():
                    for event in sse.feed(chunk):
                        yield event
                if tail := sse.close():
                    yield tail
                outcome = "ended"
            except httpx.HTTPError as exc:
                # Headers and 200 are already sent: the error goes down the stream, in
                # OpenAI's shape, as an upstream's own mid-stream error would.
                outcome = "failed"
                error = self.upstream.translate(exc)
                yield b"data: " + msgspec.json.encode(error.body()) + b"\n\n"
            except Exception:
                outcome = "failed"
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await r.aclose()
            _learn_model(flight, sse.model)
            if outcome == "ended" and sse.ended_cleanly:
                self.recorder.finished(flight, finish_status(sse.finish_reason), sse.usage)
            elif outcome == "aborted":
                self.recorder.finished(flight, "aborted", sse.usage)
            else:
                self.recorder.finished(flight, "error", sse.usage)
