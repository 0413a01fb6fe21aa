"""HTTP routes for stored reports: ``POST /v1/reports`` builds, stores and audits a breach
assessment or a quarterly review; ``GET /v1/reports`` lists them; ``GET
/v1/reports/{report_id}`` returns one as JSON, CSV (every affected request of a breach,
streamed from the database; a review's rows) or its PDF."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.convertors import Convertor, register_url_convertor

from collector.api import caller, params
from collector.api.caller import Caller, in_thread
from collector.api.files import attachment, attachment_file
from collector.errors import Forbidden, InvalidInput, NotFound
from collector.reports.breach import BreachScope, BreachService
from collector.reports.breach_model import from_document, to_document
from collector.reports.notice import NoticeService
from collector.reports.notice import render_pdf as notice_pdf
from collector.reports.notice import to_markdown as notice_md
from collector.reports.review import ReviewScope, ReviewService
from collector.reports.review import to_csv as review_csv
from collector.reports.signed import report_json_bytes
from collector.reports.stored import ID_PATTERN, ReportStore

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
    """Only report ids (``rpt_…``, ``rev_…``) match, so other ``/v1/reports/<name>`` routes
    stay reachable."""

    regex = ID_PATTERN

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("rpt", _ReportId())


class ReportIn(BaseModel):
    kind: Literal["breach", "review"] = Field(
        description="breach: incident_id, or model_id + since + until; review: since/until "
        "(default: the 90 days before now) and deployment_id"
    )
    incident_id: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    model_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    deployment_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_prompt_tokens: Annotated[int, Field(ge=0, le=2**40)] | None = None
    late_reason: Annotated[str, Field(min_length=1, max_length=2000)] | None = Field(
        default=None, description="Why notification is late (used only past the deadline)"
    )


_aware = params.aware


_BREACH_ONLY = ("incident_id", "model_id", "min_prompt_tokens", "late_reason")


def build_router(
    service: BreachService,
    reviews: ReviewService,
    store: ReportStore,
    notices: NoticeService,
) -> APIRouter:
    r = caller.router()

    def _review(body: ReportIn, created_by: str) -> dict[str, Any]:
        given = [f for f in _BREACH_ONLY if getattr(body, f) is not None]
        if given:
            raise InvalidInput(
                f"a review takes since, until and deployment_id; {given[0]} is for breach reports",
                [{"field": f, "message": "not a review parameter"} for f in given],
            )
        scope = ReviewScope(
            since=_aware(body.since, "since"),
            until=_aware(body.until, "until"),
            deployment_id=body.deployment_id,
        )
        return reviews.create(scope, created_by=created_by)

    @r.post(
        "/v1/reports",
        status_code=201,
        responses=_ERRORS,
        summary="Generate a breach assessment or quarterly review (stored, and written to the "
        "audit log)",
    )
    async def create_report(body: ReportIn, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="report")
        if body.kind == "review":
            doc = await in_thread(_review, body, who.label)
            return _created(
                doc["report_id"], doc["kind"], doc["evidence_sha256"], doc["generated_at"]
            )
        scope = BreachScope(
            incident_id=body.incident_id,
            model_id=body.model_id,
            since=_aware(body.since, "since"),
            until=_aware(body.until, "until"),
            min_prompt_tokens=body.min_prompt_tokens,
            deployment_id=body.deployment_id,
        )
        report = await in_thread(
            service.create, scope, created_by=who.label, late_reason=body.late_reason
        )
        return _created(report.report_id, report.kind, report.evidence_sha256, report.generated_at)

    @r.get("/v1/reports", responses=_ERRORS, summary="Stored reports, newest first")
    async def list_reports(
        who: Caller,
        kind: Literal["breach", "review"] | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        who.require("admin", grant="report")
        return {"items": await in_thread(store.listing, limit, kind)}

    @r.get(
        "/v1/reports/{report_id:rpt}",
        responses={
            **_ERRORS,
            **params.errors(
                409,
                e409="The breach report's affected requests changed since it was generated, "
                "or it is of a schema this kvwatch does not read",
            ),
            200: {"content": {"text/csv": {}, "application/pdf": {}}},
        },
        summary="A stored report: JSON, CSV (a breach's affected requests, a review's rows) or "
        "its PDF",
    )
    async def get_report(
        report_id: str,
        who: Caller,
        format: Annotated[Literal["json", "csv", "pdf"], Query()] = "json",
    ) -> Response:
        who.require("admin", grant="report")
        doc = await in_thread(store.get, report_id)
        kind = doc.get("kind", "breach")
        name = f"{kind}-{report_id}"
        if format == "json":
            # As stored: its evidence hash was taken over this document, whatever its schema;
            # in the bytes its signature covers (the CLI writes the same).
            return Response(report_json_bytes(doc), media_type="application/json")
        if kind == "review":
            from collector.reports.review_pdf import render_pdf as review_pdf

            if format == "csv":
                return attachment(review_csv(doc), name, "csv")
            return attachment(await in_thread(review_pdf, doc), name, "pdf")
        # A schema this kvwatch does not read is a 409 naming it, never a 500.
        report = await in_thread(from_document, doc)
        if format == "csv":
            # Every affected request, from the database; counted before the first byte, so a
            # report whose rows changed since is a 409, never a short file.
            return attachment_file(await in_thread(service.csv_file, report), name, "csv")
        from collector.reports.breach_pdf import render_pdf as breach_pdf

        return attachment(await in_thread(breach_pdf, report), name, "pdf")

    @r.get(
        "/v1/reports/{report_id:rpt}/signature",
        responses={**_ERRORS, 200: {"content": {"application/jose": {}}}},
        summary="A stored report's signature: the compact JWS over its JSON, CSV and PDF "
        "(save it as <kind>-<id>.sig beside them; kvwatch report verify checks them)",
    )
    async def get_report_signature(report_id: str, who: Caller) -> Response:
        who.require("admin", grant="report")
        token = await in_thread(store.signature, report_id)
        if token is None:
            raise NotFound(f"report {report_id} was stored before reports were signed")
        return Response(token, media_type="application/jose")

    @r.get(
        "/v1/signing-keys",
        responses=_ERRORS,
        summary="The published signing keys (a JWK set, retired keys included): what "
        "kvwatch's signatures are checked against",
    )
    async def get_signing_keys(who: Caller) -> dict[str, Any]:
        who.require("admin", "read")
        return await in_thread(service.settings.key_ring().public_set)

    @r.get(
        "/v1/incidents/{incident_id}/assessment",
        responses=_ERRORS,
        summary="The incident's breach assessment as it stands now (not stored: POST "
        "/v1/reports stores one)",
    )
    async def incident_assessment(
        incident_id: Annotated[int, Path(ge=1, le=2**63 - 1)], who: Caller
    ) -> dict[str, Any]:
        if who.kind == "read" and who.tenant is not None:
            raise Forbidden("a tenant-scoped read token cannot read incidents")
        who.require("admin", "read")
        scope = BreachScope(incident_id=incident_id)
        report = await in_thread(lambda: service.build(scope, now=datetime.now(UTC)))
        return to_document(report)

    @r.get(
        "/v1/incidents/{incident_id}/notice",
        responses={**_ERRORS, 200: {"content": {"application/pdf": {}, "text/markdown": {}}}},
        summary="The notice to one tenant about the incident (audited); names no other tenant",
    )
    async def incident_notice(
        incident_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
        tenant: Annotated[str, Query(min_length=1, max_length=128)],
        who: Caller,
        format: Annotated[Literal["json", "md", "pdf"], Query()] = "json",
    ) -> Response:
        who.require("admin", grant="report")
        doc = await in_thread(
            notices.notice, incident_id, tenant, created_by=who.label, now=datetime.now(UTC)
        )
        name = f"notice-{incident_id}-{tenant}"
        if format == "pdf":
            return attachment(await in_thread(notice_pdf, doc), name, "pdf")
        if format == "md":
            return Response(notice_md(doc), media_type="text/markdown")
        return JSONResponse(doc)

    return r


def _created(rid: str, kind: str, evidence_sha256: str, generated_at: str) -> dict[str, Any]:
    return {
        "report_id": rid,
        "kind": kind,
        "evidence_sha256": evidence_sha256,
        "generated_at": generated_at,
        "links": {f: f"/v1/reports/{rid}?format={f}" for f in ("json", "csv", "pdf")},
    }
