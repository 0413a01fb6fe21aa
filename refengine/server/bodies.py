"""A request's body: read within the server's limit (413 beyond it, before it is all read
when ``Content-Length`` says so) and parsed into its schema (400 naming the field, never a
500). Routes read their bodies here rather than as FastAPI parameters, whose errors would be
FastAPI's own 422s; each route checks the caller's key first, so no body of an unknown
caller is read."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from refengine.server.errors import APIError

_B = TypeVar("_B", bound=BaseModel)


class Bodies:
    """Reads bodies of at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    async def parse(self, cls: type[_B], request: Request) -> _B:
        """The body of ``request`` as ``cls``."""
        return _parse(cls, await self._read(request))

    async def _read(self, request: Request) -> bytes:
        limit = self.limit
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"The request body exceeds {limit} bytes.")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body exceeds {limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)


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
