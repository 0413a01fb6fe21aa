"""The body limit every route but the producers' (``POST /v1/events``, ``POST /v1/traces``)
shares; those two stream their own, larger limit (a probe's batch, an exporter's spans)
through :func:`read_producer_body`.

A body is read up to the limit before any route runs, and refused with 413 past it (the
declared ``Content-Length`` is refused before a byte is read). Bodies here are small JSON
documents, so holding one in memory is the price of a route never seeing a partial one.
A client that leaves before its body is whole is one INFO line, and no route runs: there is
nobody to answer and nothing to store.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request

from collector.api.errors import error
from collector.errors import BadRequest, PayloadTooLarge

log = logging.getLogger("kvwatch.bodies")

EXEMPT = frozenset({"/v1/events", "/v1/traces"})


class LimitBody:
    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in EXEMPT:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, int(declared))
            return
        messages: list[dict[str, Any]] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] == "http.disconnect":
                _left(scope, size)
                return
            if message["type"] != "http.request":
                break  # nothing this middleware knows: let the app see it as it would
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(scope, receive, send, None)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any, declared: int | None) -> None:
        what = f"body of {declared} bytes" if declared is not None else "body"
        response = error(
            413,
            "payload_too_large",
            f"{what} exceeds the limit of {self.limit} bytes (KVWATCH_MAX_REQUEST_BYTES)",
            {"limit_bytes": self.limit},
        )
        await response(scope, receive, send)


def _left(scope: Any, received: int) -> None:
    """A client gone mid-upload (a stopped tool, a dropped network): routine and harmless,
    so INFO and no traceback, as ``POST /v1/events`` says it."""
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "?"
    log.info(
        "%s %s: %s disconnected after %d bytes, before sending the whole body; nothing stored",
        scope.get("method", "?"),
        scope.get("path", "?"),
        peer,
        received,
    )


async def read_producer_body(request: Request, limit: int, token_id: int) -> bytes:
    """A producer's whole body, at most ``limit`` bytes (413 past it: a declared
    ``Content-Length`` before a byte is read). A client that leaves mid-upload (a stopped
    probe, a dropped network) is routine and harmless: one INFO line, nothing stored."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"body of {declared} bytes exceeds the limit of {limit}", {"limit_bytes": limit}
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"body exceeds the limit of {limit} bytes", {"limit_bytes": limit}
                )
            chunks.append(chunk)
    except ClientDisconnect:
        peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
        log.info(
            "%s %s: %s (token #%d) disconnected before sending the whole body; nothing stored",
            request.method,
            request.url.path,
            peer,
            token_id,
        )
        # Nobody reads this answer; it only ends the request.
        raise BadRequest("the client disconnected before sending the whole body") from None
    return b"".join(chunks)
