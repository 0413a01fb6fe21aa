"""HTTP routes for scheduled verifications (admin only): a thin layer over
:class:`collector.verify_schedules.VerifyScheduleService`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field, field_validator

from collector.api import caller, params
from collector.api.caller import Caller, in_thread
from collector.verify_schedules import (
    EVERY_RANGE,
    MAX_BUDGET,
    VerifyScheduleService,
    every_seconds,
)

_ERRORS = params.errors(401, 403, 404, 422, 503)


class ScheduleIn(BaseModel):
    endpoint: Annotated[str, Field(min_length=1, max_length=2000)]
    model_id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
    deployment_id: Annotated[
        str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
    ]
    every: str = Field(description=f"How often, e.g. 6h ({EVERY_RANGE})")
    keys_from: Annotated[
        str,
        Field(
            min_length=5,
            max_length=1000,
            description="Where the collector reads the tenant keys at run time: env:VARIABLE "
            "(named with KVWATCH_VERIFY_KEYS_ENV_PREFIX) or file:NAME (in "
            "KVWATCH_VERIFY_KEYS_DIR), holding NAME=KEY pairs. The keys are never stored.",
        ),
    ]
    budget: Annotated[int, Field(ge=1, le=MAX_BUDGET)] = 200
    max_context: Annotated[int, Field(ge=64, le=2**40)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0

    @field_validator("every")
    @classmethod
    def _every(cls, value: str) -> str:
        every_seconds(value)  # ValueError (not a duration, or out of range): a 422 naming it
        return value


def build_router(service: VerifyScheduleService) -> APIRouter:
    r = caller.router()

    @r.get("/v1/verify-schedules", responses=_ERRORS, summary="Scheduled verifications")
    async def list_schedules(who: Caller) -> list[dict[str, Any]]:
        who.require("admin")
        return await in_thread(service.list)

    @r.post(
        "/v1/verify-schedules",
        responses=_ERRORS,
        status_code=201,
        summary="Schedule a verification (runs at once, then every `every`)",
    )
    async def add_schedule(body: ScheduleIn, who: Caller) -> dict[str, Any]:
        who.require("admin")
        values = body.model_dump()
        values["every_s"] = every_seconds(body.every)
        return await in_thread(service.add, values, who.label, datetime.now(UTC))

    @r.delete("/v1/verify-schedules/{schedule_id}", responses=_ERRORS, summary="Remove a schedule")
    async def remove_schedule(
        schedule_id: Annotated[int, Path(ge=1)], who: Caller
    ) -> dict[str, Any]:
        who.require("admin")
        return await in_thread(service.remove, schedule_id, who.label, datetime.now(UTC))

    return r
