"""HTTP routes of an incident's case register: its facts (awareness, deadline: changed only
with who and why), each party's notification (prepare, then approve, send, ack,
confirm-deletion) and the decision register. Reads: operators (admin or an untenanted read
token); every change: admin."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from collector.api import caller, params
from collector.api.alerts import Id, Text, Who
from collector.api.caller import Caller, in_thread
from collector.cases.api_view import case_view
from collector.cases.decisions import DecisionService
from collector.cases.facts import FactService
from collector.cases.notifications import NotificationService
from collector.db import Database
from collector.errors import Forbidden, NotFound
from collector.settings import Settings
from collector.tokens import Principal

_ERRORS = params.errors(
    401,
    403,
    404,
    409,
    422,
    503,
    e404="No such incident or notice",
    e409="The notice is not in the state this step needs (send before approve)",
    e422="Invalid body: unknown field, kind, status or party, empty reason",
)
NoticeId = Annotated[str, Field(min_length=5, max_length=64, pattern=r"^ntc_[A-Za-z0-9]+$")]


class FactIn(BaseModel):
    field: Literal["awareness_at", "deadline_at"]
    at: datetime
    why: Text
    by: Who | None = None


class DecisionIn(BaseModel):
    kind: Literal[
        "containment", "engine_upgrade", "deletion_request", "art34", "notification", "other"
    ]
    status: Literal["done", "open"]
    what: Annotated[str, Field(min_length=1, max_length=4000)]
    why: Annotated[str, Field(min_length=1, max_length=4000)]
    by: Who | None = None
    supersedes: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None


class PrepareIn(BaseModel):
    party: Annotated[str, Field(min_length=1, max_length=128)]
    by: Who | None = None


class StepIn(BaseModel):
    notice_id: NoticeId
    step: Literal["approve", "send", "ack", "confirm-deletion"]
    channel: Who | None = Field(default=None, description="How it was sent (send only)")
    by: Who | None = Field(default=None, description="Who took the step (default: the token)")


def _operator(who: Principal) -> None:
    if who.kind == "read" and who.tenant is not None:
        raise Forbidden("a tenant-scoped read token cannot read an incident's case register")
    who.require("admin", "read")


def build_router(db: Database, settings: Settings) -> caller.APIRouter:
    r = caller.router()
    facts = FactService(db)
    decisions = DecisionService(db)
    notifications = NotificationService(db, settings)

    @r.get(
        "/v1/incidents/{incident_id}/case",
        responses=_ERRORS,
        summary="The incident's case register: facts, each party's notification status, decisions",
    )
    async def get_case(incident_id: Id, who: Caller) -> dict[str, Any]:
        _operator(who)
        return await in_thread(case_view, db, settings, incident_id, now=datetime.now(UTC))

    @r.post(
        "/v1/incidents/{incident_id}/facts",
        responses=_ERRORS,
        summary="Change the incident's awareness or deadline, with who and why (logged)",
    )
    async def set_fact(incident_id: Id, body: FactIn, who: Caller) -> dict[str, Any]:
        who.require("admin")
        at = params.aware(body.at, "at")
        assert at is not None
        return await in_thread(
            facts.set,
            incident_id,
            body.field,
            at,
            why=body.why,
            by=who.acting_as(body.by),
            now=datetime.now(UTC),
        )

    @r.post(
        "/v1/incidents/{incident_id}/decisions",
        status_code=201,
        responses=_ERRORS,
        summary="Record a decision or measure (GDPR Art. 33(5); logged)",
    )
    async def decide(incident_id: Id, body: DecisionIn, who: Caller) -> dict[str, Any]:
        who.require("admin")
        d = await in_thread(
            lambda: decisions.decide(
                incident_id,
                kind=body.kind,
                status=body.status,
                what=body.what,
                why=body.why,
                by=who.acting_as(body.by),
                now=datetime.now(UTC),
                supersedes=body.supersedes,
            )
        )
        return asdict(d)

    @r.post(
        "/v1/incidents/{incident_id}/notifications",
        status_code=201,
        responses=_ERRORS,
        summary="Prepare the notice to one party: built, stored, signed and logged (not sent)",
    )
    async def prepare(incident_id: Id, body: PrepareIn, who: Caller) -> dict[str, Any]:
        who.require("admin")
        p = await in_thread(
            lambda: notifications.prepare(
                incident_id, body.party, by=who.acting_as(body.by), now=datetime.now(UTC)
            )
        )
        return {**asdict(p.notification), "notice": p.notice}

    @r.post(
        "/v1/incidents/{incident_id}/notifications/steps",
        responses=_ERRORS,
        summary="Approve, send, acknowledge a notice, or record the deletion confirmation",
    )
    async def step(incident_id: Id, body: StepIn, who: Caller) -> dict[str, Any]:
        who.require("admin")

        def run() -> dict[str, Any]:
            rec, _ = notifications.notice(body.notice_id)
            if rec.incident_id != incident_id:
                raise NotFound(f"no notice {body.notice_id} of incident {incident_id}")
            n = notifications.step(
                body.notice_id,
                body.step,
                by=who.acting_as(body.by),
                now=datetime.now(UTC),
                channel=body.channel,
            )
            return asdict(n)

        return await in_thread(run)

    return r
