"""Who is calling, and calling a service off the event loop: what every route module shares
besides its parameters (:mod:`collector.api.params`).

A route names its caller with a parameter typed :data:`Caller`: the principal of the
request's bearer token, resolved by the app's authenticator (``app.state.authenticator``)
in a worker thread. Routes of the routers :func:`router` builds resolve it only once FastAPI
has validated the request, as the routes always did: a request both unauthenticated and
invalid is answered 422 (not 401), and an invalid one never reaches the token store nor its
use audit. (A FastAPI dependency runs before the route's own parameters are validated; the
dependency therefore only reads the header, and :class:`CallerRoute` resolves it.)

The same routes refuse a JSON body holding text that cannot be stored and served back (a
lone surrogate, NUL, a number that is not finite: :mod:`collector.api.text`), and answer a
result holding such text from an older version's rows with U+FFFD in its place, never a 500.

``POST /v1/events`` authenticates its own way (:meth:`collector.ingest.IngestService.authenticate`)
and takes no :data:`Caller`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, ParamSpec, TypeVar

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic_core import PydanticSerializationError

from collector import text
from collector.api.params import Auth, known_params
from collector.errors import InvalidInput
from collector.tokens import Principal

P = ParamSpec("P")
T = TypeVar("T")


async def in_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in a worker thread: services block on the database."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


@dataclass(frozen=True, slots=True)
class _Token:
    """A request's ``Authorization`` header, not resolved yet."""

    authenticate: Callable[[str | None], Principal]
    authorization: str | None

    async def principal(self) -> Principal:
        return await in_thread(self.authenticate, self.authorization)


async def _token(request: Request, authorization: Auth = None) -> Principal | _Token:
    token = _Token(request.app.state.authenticator, authorization)
    if isinstance(request.scope.get("route"), CallerRoute):
        return token  # resolved after validation, by the route
    return await token.principal()  # a route of some other router: resolve it now


Caller = Annotated[Principal, Depends(_token)]

_RESOLVES = "_kvwatch_resolves_caller"
# what the endpoint returned, kept for the one case FastAPI cannot serialize it (text an
# older version stored): CallerRoute then answers it scrubbed instead of a 500
_RESULT: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("_kvwatch_result")


def _resolving_caller(
    endpoint: Callable[..., Coroutine[Any, Any, Any]],
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """``endpoint`` with its :data:`Caller` parameters resolved first (FastAPI has validated
    the request by the time it calls this)."""
    if getattr(endpoint, _RESOLVES, False):
        return endpoint
    if not inspect.iscoroutinefunction(endpoint):
        raise TypeError(f"{endpoint.__name__}: routes here are async (they await the caller)")

    @functools.wraps(endpoint)  # FastAPI reads the signature, the name and the annotations
    async def resolved(**values: Any) -> Any:
        for name, value in values.items():
            if isinstance(value, _Token):
                values[name] = await value.principal()
        result = await endpoint(**values)
        box = _RESULT.get(None)
        if box is not None:
            box.append(result)
        return result

    setattr(resolved, _RESOLVES, True)
    return resolved


class CallerRoute(APIRoute):
    """A route whose :data:`Caller` is resolved after the request is validated, and which
    refuses a query parameter it does not declare (422 naming it): one rule for every read,
    so a misspelt filter is never silently ignored."""

    def __init__(
        self, path: str, endpoint: Callable[..., Coroutine[Any, Any, Any]], **kwargs: Any
    ) -> None:
        super().__init__(path, _resolving_caller(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # (APIRoute builds the handler inside its __init__, with self.dependant already set)
        known = _query_names(self.dependant)
        takes_body = self.body_field is not None
        status = self.status_code or 200

        async def checked(request: Request) -> Response:
            known_params(request, known)
            if takes_body and _is_json(request):
                await _check_body(request)
            box: list[Any] = []
            token = _RESULT.set(box)
            try:
                return await handler(request)
            except (PydanticSerializationError, UnicodeEncodeError):
                if not box:
                    raise
                return JSONResponse(text.scrub(jsonable_encoder(box[0])), status_code=status)
            finally:
                _RESULT.reset(token)

        return checked


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "application/json").split(";", 1)[0].strip()
    return kind == "application/json" or kind.endswith("+json")


async def _check_body(request: Request) -> None:
    """Refuse a body :func:`collector.api.text.check_document` refuses. The parsed body is
    kept on the request, so FastAPI does not parse it again; a body that is no JSON at all
    is left to FastAPI's own 422."""
    if not await request.body():
        return
    try:
        doc = await request.json()
    except RecursionError:
        raise InvalidInput("body: nests too deeply", {"field": "body"}) from None
    except ValueError:
        return
    text.check_document(doc)


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route declares, its dependencies' included."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def router() -> APIRouter:
    """A router for routes that take a :data:`Caller`."""
    return APIRouter(route_class=CallerRoute)
