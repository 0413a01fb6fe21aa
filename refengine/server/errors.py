"""Every error answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
:class:`APIError`, the one type a route raises for it, and the handlers that answer it,
Starlette's HTTP errors (404, 405) and anything unhandled (a 500 that says nothing more)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# The server's one logger, named as it was when the server was a single module.
log = logging.getLogger("refengine.server")


class APIError(Exception):
    """An error answered in OpenAI's shape: the HTTP boundary's type, raised only inside this
    package's routes and turned into a response by its exception handler. The engine's
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


def install(app: FastAPI) -> None:
    """The handlers: an :class:`APIError` as itself, Starlette's HTTP errors (a 404 naming
    the URL) as ``invalid_request_error``, anything else as a logged 500."""

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
