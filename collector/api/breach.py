"""HTTP routes for breach-assessment reports: ``POST /v1/reports`` builds, stores and audits
one; ``GET /v1/reports/{report_id}`` returns it as JSON, CSV (the affected requests) or the
audit PDF."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.convertors import Convertor, register_url_convertor

from collector.api import params
from collector.api.files import attachment
from collector.reports.breach import BreachScope, BreachService, to_csv
from collector.tokens import Principal

Auth = params.Auth
_ERRORS = params.errors(
    401,
    403,
    404,
    422,
    503,
    e404="No such incident or report",
    e422="Invalid parameters: missing scope, inverted window",
)


class _ReportId(Convertor[str]):
    """Only ``rpt_…`` ids match, so other ``/v1/reports/<name>`` routes stay reachable."""

    regex = "rpt_[A-Za-z0-9]{1,60}"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("rpt", _ReportId())


class ReportIn(BaseModel):
    kind: Literal["breach"]
    incident_id: Annotated[int, Field(ge=1)] | None = None
    model_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    deployment_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_prompt_tokens: Annotated[int, Field(ge=0, le=2**40)] | None = None
    late_reason: Annotated[str, Field(min_length=1, max_length=2000)] | None = Field(
        default=None, description="Why notification is late (used only past the deadline)"
    )


_aware = params.aware


def build_router(
    service: BreachService, principal: Callable[[str | None], Awaitable[Principal]]
) -> APIRouter:
    r = APIRouter()
    run = anyio.to_thread.run_sync

    @r.post(
        "/v1/reports",
        status_code=201,
        responses=_ERRORS,
        summary="Generate a breach-assessment report (stored, and written to the audit log)",
    )
    async def create_report(body: ReportIn, authorization: Auth = None) -> dict[str, Any]:
        who = await principal(authorization)
        who.require("admin")
        scope = BreachScope(
            incident_id=body.incident_id,
            model_id=body.model_id,
            since=_aware(body.since),
            until=_aware(body.until),
            min_prompt_tokens=body.min_prompt_tokens,
            deployment_id=body.deployment_id,
        )
        report = await run(
            lambda: service.create(scope, created_by=who.label, late_reason=body.late_reason)
        )
        return {
            "report_id": report["report_id"],
            "kind": "breach",
            "evidence_sha256": report["evidence_sha256"],
            "generated_at": report["generated_at"],
            "links": {
                f: f"/v1/reports/{report['report_id']}?format={f}" for f in ("json", "csv", "pdf")
            },
        }

    @r.get("/v1/reports", responses=_ERRORS, summary="Stored reports, newest first")
    async def list_reports(
        authorization: Auth = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        who = await principal(authorization)
        who.require("admin")
        return {"items": await run(service.stored, limit)}

    @r.get(
        "/v1/reports/{report_id:rpt}",
        responses={
            **_ERRORS,
            200: {"content": {"text/csv": {}, "application/pdf": {}}},
        },
        summary="A stored report: JSON, CSV of the affected requests, or the audit PDF",
    )
    async def get_report(
        report_id: str,
        authorization: Auth = None,
        format: Annotated[Literal["json", "csv", "pdf"], Query()] = "json",
    ) -> Response:
        who = await principal(authorization)
        who.require("admin")
        report = await run(service.get, report_id)
        name = f"breach-{report_id}"
        if format == "csv":
            return attachment(to_csv(report), name, "csv")
        if format == "pdf":
            from collector.reports.breach_pdf import render_pdf

            return attachment(await run(render_pdf, report), name, "pdf")
        return JSONResponse(report)

    return r
