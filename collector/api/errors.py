"""Every error answered as ``{"error": {"code", "message", "details"}}``: the handlers for the
collector's own errors, FastAPI's validation errors and Starlette's HTTP errors, and the
middleware that refuses NUL in the URL before any route runs."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from collector.errors import CollectorError


def error(
    status: int,
    code: str,
    message: str,
    details: Any = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "details": details}},
        status_code=status,
        headers=headers,
    )


class RejectNul:
    """PostgreSQL can neither store nor compare NUL: refuse it in the URL before any route
    reaches the database (a 400, never a 500)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (
            b"%00" in scope.get("query_string", b"") or "\x00" in scope.get("path", "")
        ):
            response = error(400, "bad_request", "NUL characters are not allowed in the URL")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def install(app: FastAPI) -> None:
    """The NUL check in front of every route, and the error handlers."""
    app.add_middleware(RejectNul)

    @app.exception_handler(CollectorError)
    async def _collector_error(_: Request, exc: CollectorError) -> JSONResponse:
        headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        return error(exc.status, exc.code, exc.message, exc.details, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"field": ".".join(str(p) for p in e.get("loc", ())[1:]) or None, "message": e["msg"]}
            for e in exc.errors()
        ]
        first = details[0] if details else {"field": None, "message": "invalid request"}
        return error(422, "invalid_input", f"{first['field']}: {first['message']}", details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error(exc.status_code, code, str(exc.detail))
