"""What every route module shares: the token header, error responses for the OpenAPI
document, naive times read as UTC, and refusing unknown query parameters."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, overload

from fastapi import Header, Request

from collector.api import schemas as s
from collector.errors import InvalidInput
from collector.timefmt import bounded

Auth = Annotated[str | None, Header(include_in_schema=False)]

_DESCRIPTIONS = {
    400: "Malformed request: a cursor this API did not issue, NUL in the URL, an unparsable body",
    401: "Missing or unknown token",
    403: "The token may not do this",
    404: "No such object",
    409: "Not in a state that allows this",
    413: "Body or document over its size limit",
    422: "Invalid parameters",
    503: "The database (or, with the ingest bus, the bus) is unavailable, or the bus is "
    "full; retry (after Retry-After when given)",
}


def errors(*codes: int, **overrides: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these status codes, and 400, which any route may answer
    (``e404="..."`` overrides a text)."""
    return {
        code: {
            "model": s.ErrorResponse,
            "description": overrides.get(f"e{code}", _DESCRIPTIONS[code]),
        }
        for code in sorted({400, *codes})
    }


@overload
def aware(dt: datetime, field: str) -> datetime: ...
@overload
def aware(dt: None, field: str) -> None: ...
def aware(dt: datetime | None, field: str) -> datetime | None:
    """A query time as an aware UTC instant. Naive times are read as UTC: what a person
    typing ?since=2026-08-27 means. A time outside 1970-01-01 to 2200-01-01 UTC
    (:func:`collector.timefmt.bounded`) is refused here, naming ``field``, before any service
    computes with it."""
    if dt is None:
        return None
    try:
        return bounded(dt)
    except ValueError as exc:
        raise InvalidInput(f"{field}: {exc}", [{"field": field, "message": str(exc)}]) from None


def known_params(request: Request, known: set[str]) -> None:
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        expected = (
            f"expected one of {', '.join(sorted(known))}"
            if known
            else "this endpoint takes no query parameters"
        )
        raise InvalidInput(
            f"unknown parameter {unknown[0]!r}; {expected}",
            [{"field": u, "message": "unknown parameter"} for u in unknown],
        )
