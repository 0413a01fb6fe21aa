"""HTTP routes for API tokens (admin): list, create, revoke, rotate; a thin layer over
:class:`collector.tokens.TokenService`. A secret is in the answer that creates it, never
again."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, Field

from collector.api import caller, params
from collector.api.caller import Caller, in_thread
from collector.errors import InvalidInput
from collector.grace import DEFAULT_GRACE_S
from collector.timefmt import iso
from collector.tokens import Principal, TokenService
from policies.durations import parse_duration

_ERRORS = params.errors(401, 403, 404, 409, 422, 503)
Ref = Annotated[
    str,
    Path(
        min_length=1,
        max_length=256,
        description="Token id (18, #18, id:18) or unique name (name:NAME for any name)",
    ),
]
Duration = Annotated[str, Field(min_length=1, max_length=32, description="e.g. 30d, 12h")]
Scope = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]


class CreateIn(BaseModel):
    kind: Literal["ingest", "read", "admin"]
    tenant: Scope | None = Field(default=None, description="Scope a read token to one tenant")
    deployment_id: Scope | None = Field(
        default=None, description="Scope an ingest token to one deployment"
    )
    name: Scope | None = Field(default=None, description="Unique among valid tokens")
    expires_in: Duration | None = None


class RotateIn(BaseModel):
    grace: Duration | None = Field(
        default=None,
        description=f"How long the old token keeps working (default {DEFAULT_GRACE_S // 3600}h)",
    )
    expires_in: Duration | None = Field(default=None, description="The new token's lifetime")


def _seconds(value: str | None, field: str) -> float | None:
    if value is None:
        return None
    try:
        return float(parse_duration(value))
    except ValueError as exc:
        raise InvalidInput(f"{field}: {exc}", {"field": field}) from None


def who_is(who: Principal) -> dict[str, Any]:
    person = who.person
    return {
        "name": who.label,
        "kind": who.kind,
        "role": who.role,
        "tenant": who.tenant,
        "deployment_id": who.deployment_id,
        "may": who.may(),
        "person": None
        if person is None
        else {
            "subject": person.subject,
            "email": person.email,
            "name": person.name,
            "issuer": person.issuer,
        },
        "expires_at": None if who.expires_at_us is None else iso(who.expires_at_us),
    }


def build_router(tokens: TokenService) -> APIRouter:
    r = caller.router()

    @r.get(
        "/v1/whoami",
        responses=params.errors(401, 403, 503),
        summary="Who the caller is and what they may do (a token, or a signed-in person)",
        description="may: read, respond (acknowledge, silence, work incidents), report "
        "(generate and read reports and notices), admin, ingest; tenant: the one tenant the "
        "caller sees, else null. The dashboard shows and enforces what this says.",
    )
    async def whoami(who: Caller) -> dict[str, Any]:
        return who_is(who)

    @r.get("/v1/tokens", responses=_ERRORS, summary="Every token, without its secret")
    async def list_tokens(who: Caller) -> list[dict[str, Any]]:
        who.require("admin")
        return await in_thread(tokens.list)

    @r.post("/v1/tokens", responses=_ERRORS, status_code=201, summary="Create a token")
    async def create_token(body: CreateIn, who: Caller) -> dict[str, Any]:
        who.require("admin")
        doc, secret = await in_thread(
            lambda: tokens.create(
                kind=body.kind,
                tenant=body.tenant,
                deployment_id=body.deployment_id,
                name=body.name,
                expires_in_s=_seconds(body.expires_in, "expires_in"),
                actor=who.label,
            )
        )
        return {"token": doc, "secret": secret}

    @r.post(
        "/v1/tokens/{ref}/revoke",
        responses=_ERRORS,
        summary="Revoke a token now, and the generations of its lineage before it (every "
        "replica within KVWATCH_TOKEN_CACHE_S)",
    )
    async def revoke_token(
        ref: Ref,
        who: Caller,
        keep_previous: Annotated[
            bool,
            Query(description="Leave the generations it replaced to their grace period"),
        ] = False,
    ) -> dict[str, Any]:
        who.require("admin")
        return await in_thread(
            lambda: tokens.revoke(ref, actor=who.label, keep_previous=keep_previous)
        )

    @r.post(
        "/v1/tokens/{ref}/rotate",
        responses=_ERRORS,
        status_code=201,
        summary="A new token with the same scope; the old one expires after a grace period",
    )
    async def rotate_token(ref: Ref, who: Caller, body: RotateIn | None = None) -> dict[str, Any]:
        who.require("admin")
        body = body or RotateIn()
        grace = _seconds(body.grace, "grace")
        new, secret, old = await in_thread(
            lambda: tokens.rotate(
                ref,
                actor=who.label,
                grace_s=DEFAULT_GRACE_S if grace is None else grace,
                expires_in_s=_seconds(body.expires_in, "expires_in"),
            )
        )
        return {"token": new, "secret": secret, "old": old}

    return r
