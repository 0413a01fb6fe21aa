"""HTTP routes for alerts, silences, incidents, verifications and rules: a thin layer over
:class:`collector.alerting.service.AlertingService`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, Field

from collector.alerting.service import AlertingService
from collector.api import caller, params
from collector.api.caller import Caller, in_thread
from collector.deployment_facts import MAX_RUN_S
from collector.errors import Forbidden, InvalidInput, PayloadTooLarge
from collector.reports.notice import NoticeService
from collector.tokens import Principal
from policies.durations import parse_duration
from policies.lifecycle import IncidentState, State
from policies.signals import Severity

_ERRORS = params.errors(401, 403, 404, 409, 413, 422, 503)
Text = Annotated[str, Field(min_length=1, max_length=2000)]
Who = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


class AckIn(BaseModel):
    by: Who | None = Field(default=None, description="Who acknowledges (default: the token's name)")
    comment: Text | None = None


class MatcherIn(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
    value: Annotated[str, Field(max_length=1000)]
    regex: bool = False


class SilenceIn(BaseModel):
    matchers: list[MatcherIn] = Field(min_length=1, max_length=32)
    starts_at: datetime | None = Field(default=None, description="Default: now")
    ends_at: datetime | None = Field(default=None, description="Or give `duration`")
    duration: str | None = Field(default=None, description="e.g. 2h; instead of ends_at")
    created_by: Who | None = None
    comment: Text


class CloseIn(BaseModel):
    reason: Text
    by: Who | None = None


class ByIn(BaseModel):
    by: Who | None = Field(default=None, description="Who (default: the token's name)")


class OwnerIn(ByIn):
    owner: Who


class NoteIn(ByIn):
    text: Annotated[str, Field(min_length=1, max_length=4000)]


class LinkIn(ByIn):
    alert_id: Annotated[int, Field(ge=1, le=2**63 - 1)]


class VerificationIn(BaseModel):
    deployment_id: Annotated[
        str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
    ]
    model_id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
    passed: bool
    verified_safe_context: Annotated[int, Field(ge=1, le=2**40)] | None = None
    engine_version: Annotated[str, Field(max_length=64)] | None = None
    pool_capacity_tokens: Annotated[int, Field(ge=0, le=2**40)] | None = None
    quantization: Annotated[str, Field(max_length=64)] | None = None
    tp_size: Annotated[int, Field(ge=1, le=4096)] | None = None
    cuda_graphs: bool | None = None
    verified_at: datetime | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    #: the run this verification announced (``POST /v1/verification-runs``): recording it
    #: ends the run's window
    run_id: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None


_DEPLOYMENT = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
_TENANT = Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")


class VerificationRunIn(BaseModel):
    """A verification about to send its prompts, and the tenants whose keys it sends them
    with: their traffic on the deployment until the run is recorded (or ``max_duration_s``
    passes) is the run's own."""

    deployment_id: Annotated[str, _DEPLOYMENT]
    tenants: Annotated[list[Annotated[str, _TENANT]], Field(min_length=1, max_length=32)]
    max_duration_s: Annotated[float, Field(gt=0, le=MAX_RUN_S)] = 900.0


_aware = params.aware
MAX_ID = 2**63 - 1  # ids are BIGINT: anything larger is no id (and no 500)
Id = Annotated[int, Path(ge=1, le=MAX_ID)]


def _operator(who: Principal) -> None:
    """Alerts and incidents name tenants: operators' data, not a tenant's."""
    if who.kind == "read" and who.tenant is not None:
        raise Forbidden("a tenant-scoped read token cannot read alerts or incidents")
    who.require("admin", "read")


def _tenant(who: Principal) -> str | None:
    """The tenant of a tenant-scoped read token (it sees only incidents that concern it)."""
    return who.tenant if who.kind == "read" else None


def build_router(
    service: AlertingService, notices: NoticeService, max_evidence_bytes: int
) -> APIRouter:
    r = caller.router()

    @r.get("/v1/alerts", responses=_ERRORS, summary="Alerts, newest first")
    async def list_alerts(
        who: Caller,
        state: State | None = None,
        severity: Severity | None = None,
        rule: str | None = None,
        deployment_id: str | None = None,
        before_id: Annotated[
            int | None, Query(ge=1, le=MAX_ID, description="Page: alerts older than this id")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        _operator(who)
        return await in_thread(
            service.list_alerts,
            state=state,
            severity=severity,
            rule=rule,
            deployment_id=deployment_id,
            after_id=before_id,
            limit=limit,
        )

    @r.get("/v1/alerts/{alert_id}", responses=_ERRORS, summary="One alert and its history")
    async def get_alert(alert_id: Id, who: Caller) -> dict[str, Any]:
        _operator(who)
        return await in_thread(service.alert, alert_id)

    @r.post("/v1/alerts/{alert_id}/ack", responses=_ERRORS, summary="Acknowledge an alert")
    async def ack_alert(alert_id: Id, who: Caller, body: AckIn | None = None) -> dict[str, Any]:
        who.require("admin", grant="respond")
        body = body or AckIn()
        by = who.acting_as(body.by)
        return await in_thread(service.ack, alert_id, by, body.comment, datetime.now(UTC))

    @r.get("/v1/silences", responses=_ERRORS, summary="Silences, newest first")
    async def list_silences(who: Caller) -> list[dict[str, Any]]:
        _operator(who)
        return await in_thread(service.list_silences)

    @r.post(
        "/v1/silences",
        responses=_ERRORS,
        status_code=201,
        summary="Silence matching alerts' notifications",
    )
    async def create_silence(body: SilenceIn, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        now = datetime.now(UTC)
        starts = _aware(body.starts_at, "starts_at") or now
        if body.ends_at is not None and body.duration is not None:
            raise InvalidInput("give ends_at or duration, not both", {"field": "duration"})
        if body.ends_at is not None:
            ends = _aware(body.ends_at, "ends_at")
        elif body.duration is not None:
            try:
                ends = params.aware(
                    starts + timedelta(seconds=parse_duration(body.duration)), "duration"
                )
            except (ValueError, OverflowError) as exc:
                raise InvalidInput(f"duration: {exc}", {"field": "duration"}) from None
        else:
            raise InvalidInput("a silence needs ends_at or duration", {"field": "ends_at"})
        assert ends is not None
        matchers = [m.model_dump() for m in body.matchers]
        by = who.acting_as(body.created_by)
        return await in_thread(service.silence, matchers, starts, ends, by, body.comment, now)

    @r.delete("/v1/silences/{silence_id}", responses=_ERRORS, summary="Expire a silence now")
    async def expire_silence(silence_id: Id, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        return await in_thread(service.expire_silence, silence_id, who.label, datetime.now(UTC))

    @r.get("/v1/incidents", responses=_ERRORS, summary="Incidents, newest first")
    async def list_incidents(
        who: Caller,
        state: IncidentState | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        tenant = _tenant(who)
        if tenant is not None:
            return await in_thread(
                notices.tenant_incidents, tenant, state=state, limit=limit, now=datetime.now(UTC)
            )
        _operator(who)
        return await in_thread(service.list_incidents, state, limit)

    @r.get(
        "/v1/incidents/{incident_id}",
        responses=_ERRORS,
        summary="One incident and its alerts (to a tenant-scoped token: its own side of it)",
    )
    async def get_incident(incident_id: Id, who: Caller) -> dict[str, Any]:
        tenant = _tenant(who)
        if tenant is not None:
            return await in_thread(notices.tenant_view, incident_id, tenant, now=datetime.now(UTC))
        _operator(who)
        return await in_thread(service.incident, incident_id)

    @r.post(
        "/v1/incidents/{incident_id}/close",
        responses=_ERRORS,
        summary="Close an incident (a person, with a reason)",
    )
    async def close_incident(incident_id: Id, body: CloseIn, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        by = who.acting_as(body.by)
        return await in_thread(
            service.close_incident, incident_id, by, body.reason, datetime.now(UTC)
        )

    @r.post(
        "/v1/incidents/{incident_id}/ack",
        responses=_ERRORS,
        summary="Acknowledge an incident: someone is on it (the first acknowledgement stands)",
    )
    async def ack_incident(
        incident_id: Id, who: Caller, body: ByIn | None = None
    ) -> dict[str, Any]:
        who.require("admin", grant="respond")
        by = who.acting_as(body.by if body else None)
        return await in_thread(service.ack_incident, incident_id, by, datetime.now(UTC))

    @r.post("/v1/incidents/{incident_id}/owner", responses=_ERRORS, summary="Give it an owner")
    async def assign_incident(incident_id: Id, body: OwnerIn, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        by = who.acting_as(body.by)
        return await in_thread(
            service.assign_incident, incident_id, body.owner, by, datetime.now(UTC)
        )

    @r.post("/v1/incidents/{incident_id}/notes", responses=_ERRORS, summary="Add a note")
    async def note_incident(incident_id: Id, body: NoteIn, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        by = who.acting_as(body.by)
        return await in_thread(service.note_incident, incident_id, body.text, by, datetime.now(UTC))

    @r.post("/v1/incidents/{incident_id}/links", responses=_ERRORS, summary="Link an alert")
    async def link_alert(incident_id: Id, body: LinkIn, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        by = who.acting_as(body.by)
        return await in_thread(
            service.link_alert, incident_id, body.alert_id, by, datetime.now(UTC)
        )

    @r.delete(
        "/v1/incidents/{incident_id}/links/{alert_id}",
        responses=_ERRORS,
        summary="Unlink an alert (not linked back automatically)",
    )
    async def unlink_alert(incident_id: Id, alert_id: Id, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="respond")
        return await in_thread(
            service.unlink_alert, incident_id, alert_id, who.label, datetime.now(UTC)
        )

    @r.get(
        "/v1/incidents/{incident_id}/timeline",
        responses=_ERRORS,
        summary="Everything that happened to the incident and around it, oldest first",
    )
    async def incident_timeline(incident_id: Id, who: Caller) -> list[dict[str, Any]]:
        _operator(who)
        return await in_thread(service.incident_timeline, incident_id, datetime.now(UTC))

    @r.get("/v1/verifications", responses=_ERRORS, summary="Verifications, newest first")
    async def list_verifications(
        who: Caller,
        deployment_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        who.require("admin", "read", "ingest")
        if who.kind == "ingest" and who.deployment_id is not None:
            # An ingest token writes for its deployment; what it reads back is limited to it.
            if deployment_id not in (None, who.deployment_id):
                raise Forbidden(f"this ingest token is bound to deployment {who.deployment_id!r}")
            deployment_id = who.deployment_id
        return await in_thread(service.list_verifications, deployment_id, limit)

    @r.get(
        "/v1/verifications/{verification_id}",
        responses=_ERRORS,
        summary="One verification with its evidence (admin: the evidence names tenants)",
    )
    async def get_verification(verification_id: Id, who: Caller) -> dict[str, Any]:
        who.require("admin", grant="report")
        return await in_thread(service.verification, verification_id)

    @r.post(
        "/v1/verifications", responses=_ERRORS, status_code=201, summary="Record a verification"
    )
    async def add_verification(body: VerificationIn, who: Caller) -> dict[str, Any]:
        who.require("admin", "ingest")
        if who.kind == "ingest" and who.deployment_id not in (None, body.deployment_id):
            raise Forbidden(f"this ingest token is bound to deployment {who.deployment_id!r}")
        values = body.model_dump()
        values["verified_at"] = _aware(body.verified_at, "verified_at")
        size = len(json.dumps(body.evidence, separators=(",", ":")).encode())
        if size > max_evidence_bytes:
            raise PayloadTooLarge(
                f"evidence of {size} bytes exceeds the limit of {max_evidence_bytes} "
                "(KVWATCH_MAX_EVIDENCE_BYTES)",
                {"field": "evidence", "limit_bytes": max_evidence_bytes},
            )
        return await in_thread(service.add_verification, values, who.label, datetime.now(UTC))

    @r.post(
        "/v1/verification-runs",
        responses=_ERRORS,
        status_code=201,
        summary="Announce a verification run (its own traffic is not evaluated)",
    )
    async def announce_verification_run(body: VerificationRunIn, who: Caller) -> dict[str, Any]:
        who.require("admin", "ingest")
        if who.kind == "ingest" and who.deployment_id not in (None, body.deployment_id):
            raise Forbidden(f"this ingest token is bound to deployment {who.deployment_id!r}")
        return await in_thread(
            service.announce_verification_run, body.model_dump(), who.label, datetime.now(UTC)
        )

    @r.post(
        "/v1/verification-runs/{run_id}/end",
        responses=_ERRORS,
        summary="End a verification run that records no verification",
    )
    async def end_verification_run(run_id: Id, who: Caller) -> dict[str, Any]:
        who.require("admin", "ingest")
        return await in_thread(
            service.end_verification_run,
            run_id,
            who.deployment_id if who.kind == "ingest" else None,
            datetime.now(UTC),
        )

    @r.get("/v1/rules", responses=_ERRORS, summary="The rules in force and their health")
    async def list_rules(who: Caller) -> list[dict[str, Any]]:
        _operator(who)
        return await in_thread(service.rules_health)

    return r
