"""How routes learn who calls (:mod:`collector.api.caller`): the token is resolved only once
FastAPI has validated the request, so an invalid request is a 422 whatever its token, and it
never reaches the token store (nor the token's use audit)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from collector import models as m
from collector.api import errors
from collector.api.caller import Caller, router
from collector.db import Database
from collector.errors import Unauthorized
from collector.tokens import Principal
from tests.conftest import Collector

# One invalid request per router that takes a Caller: alerts, breach, reports, dashboard, reads.
INVALID = [
    ("GET", "/v1/alerts?limit=0", None),
    ("GET", "/v1/alerts/0", None),
    ("POST", "/v1/silences", {"matchers": []}),
    ("GET", "/v1/reports?limit=0", None),
    ("GET", "/v1/inventory", None),
    ("GET", "/v1/stats/prompt-tokens?max_points=0", None),
    ("GET", "/v1/requests?limit=0", None),
]


def _last_used(db_url: str) -> list[Any]:
    db = Database(db_url)
    try:
        with db.read() as conn:
            return list(conn.execute(select(m.ApiToken.last_used_at)).scalars())
    finally:
        db.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_validation_comes_before_the_token(collector: Collector) -> None:
    fresh = collector.token("admin")  # never used yet
    for token in (None, "not-a-token", fresh):
        with collector.client(token) as c:
            for method, path, body in INVALID:
                r = c.request(method, path, **({} if body is None else {"json": body}))
                assert r.status_code == 422, (token, path, r.text)
                assert r.json()["error"]["code"] == "invalid_input"
    # No route looked the tokens up: none has been used.
    assert _last_used(collector.db_url) == [None, None, None]
    with collector.client(None) as c:
        assert c.get("/v1/alerts").status_code == 401
    with collector.client(fresh) as c:
        assert c.get("/v1/alerts").status_code == 200
    assert sum(u is not None for u in _last_used(collector.db_url)) == 1


def _app(api: APIRouter) -> FastAPI:
    def authenticate(authorization: str | None) -> Principal:
        if authorization != "Bearer good":
            raise Unauthorized("unknown or revoked token")
        return Principal(token_id=1, kind="admin", tenant=None, deployment_id=None, label="t")

    @api.get("/who")
    async def who(caller: Caller, n: int = 1) -> dict[str, Any]:
        return {"label": caller.label, "n": n}

    app = FastAPI()
    errors.install(app)
    app.state.authenticator = authenticate
    app.include_router(api)
    return app


@pytest.mark.parametrize(
    ("api", "bad_and_unauthenticated"),
    [(router(), 422), (APIRouter(), 401)],
    ids=["caller-router", "plain-router"],
)
def test_a_caller_is_a_principal_on_any_router(
    api: APIRouter, bad_and_unauthenticated: int
) -> None:
    """On the routers of collector.api.caller the token waits for validation; on any other
    router the dependency still hands the route a principal (resolving it at once)."""
    with TestClient(_app(api)) as c:
        assert c.get("/who", headers={"Authorization": "Bearer good"}).json() == {
            "label": "t",
            "n": 1,
        }
        assert c.get("/who").status_code == 401
        assert c.get("/who?n=x").status_code == bad_and_unauthenticated
