"""HTTP routes for reports: the inventory, limits cards, the quarterly review and the
audit-log check; a thin layer over :mod:`collector.reports` and
:class:`collector.reports.audit.AuditLog`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response

from collector import text
from collector.api import caller, params
from collector.api.caller import Caller, in_thread
from collector.api.files import attachment
from collector.audit_checkpoints import KeyedCheck
from collector.errors import Forbidden
from collector.limits import Limits
from collector.reports.audit import AuditLog
from collector.reports.inventory import InventoryQuery, InventoryService
from collector.reports.limits import LimitsService, to_markdown
from collector.reports.limits_pdf import render_pdf as render_limits_pdf
from collector.reports.review import ReviewScope, ReviewService
from collector.reports.review import to_csv as review_csv
from collector.timefmt import iso

_ERRORS = params.errors(401, 403, 404, 422, 503)


_aware = params.aware


def build_router(
    inventory: InventoryService,
    limits: LimitsService,
    review: ReviewService,
    audit_log: AuditLog,
    in_force: Limits,
) -> APIRouter:
    r = caller.router()

    @r.get(
        "/v1/limits",
        responses=_ERRORS,
        summary="The limit in force per deployment and model",
        description="The one decision every part of kvwatch measures prompts against and "
        "the gateway enforces (policies.limits): tokens (0: every prompt refused; null: none "
        "known), source (verified, configured, pool, failed-verification, none), whether it "
        "is stale and why, the verification it rests on, the verdict and the warning to "
        "show, and the same in words (text). An ingest token reads its own deployment's "
        "(the gateway's read); a deployment not known yet has none.",
    )
    async def get_limits(who: Caller, deployment_id: str | None = None) -> dict[str, Any]:
        who.require("admin", "read", "ingest")
        if who.kind == "ingest" and who.deployment_id is not None:
            if deployment_id not in (None, who.deployment_id):
                raise Forbidden(f"this ingest token is bound to deployment {who.deployment_id!r}")
            deployment_id = who.deployment_id
        now = datetime.now(UTC)
        found = await in_thread(
            in_force.of, None if deployment_id is None else {deployment_id}, now
        )
        return {"generated_at": iso(now), "limits": [lim.as_json() for lim in found]}

    @r.get(
        "/v1/inventory",
        responses=_ERRORS,
        summary="Requests to a model in a window, per deployment, tenant and route",
        description="Per (deployment, tenant, route): requests whose first event lies in "
        "[since, until), prompts (distinct: a prompt that several requests share counts once), "
        "how many requests had at least min_prompt_tokens prompt tokens, the largest prompt, "
        "first and last seen. A tenant-scoped read token sees only its own tenant's rows.",
    )
    async def get_inventory(
        model_id: Annotated[str, Query(min_length=1, max_length=256)],
        since: datetime,
        until: datetime,
        who: Caller,
        min_prompt_tokens: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        deployment_id: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
    ) -> dict[str, Any]:
        who.require("admin", "read")
        q = InventoryQuery(
            model_id=model_id,
            since=_aware(since, "since"),
            until=_aware(until, "until"),
            min_prompt_tokens=min_prompt_tokens,
            deployment_id=deployment_id,
            tenant=who.tenant_filter(None),
        )
        return await in_thread(inventory.inventory, q)

    @r.get(
        "/v1/deployments/{deployment_id}/limits-card",
        responses={**_ERRORS, 200: {"content": {"text/markdown": {}, "application/pdf": {}}}},
        summary="The deployment's limits card (JSON, Markdown or PDF)",
    )
    async def get_limits_card(
        deployment_id: str,
        who: Caller,
        format: Literal["json", "md", "pdf"] = "json",
    ) -> Any:
        who.require("admin", "read")
        # The leaking tenant pairs name other tenants: not on a tenant's card.
        card = await in_thread(
            lambda: limits.card(
                deployment_id, datetime.now(UTC), name_tenants=who.tenant_filter(None) is None
            )
        )
        if format == "md":
            md = text.encode(to_markdown(card))
            return Response(md, media_type="text/markdown; charset=utf-8")
        if format == "pdf":
            data = await in_thread(render_limits_pdf, card)
            return Response(data, media_type="application/pdf")
        return card

    @r.get(
        "/v1/review",
        responses={**_ERRORS, 200: {"content": {"text/csv": {}, "application/pdf": {}}}},
        summary="The quarterly review: max/p99 prompt tokens per route and model vs the safe "
        "threshold",
        description="Per deployment, route and model, requests whose first event lies in "
        "[since, until) (default: the 90 days before now): count, max and exact p99 prompt "
        "tokens, weekly max/p99 and their slopes, against the verified safe context (else "
        "min(advertised, prefill pool), unverified); rows at >= 80% are highlighted. JSON, CSV "
        "(one row per route and model) or PDF.",
    )
    async def get_review(
        who: Caller,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        format: Literal["json", "csv", "pdf"] = "json",
    ) -> Any:
        who.require("admin", "read")
        if who.tenant_filter(None) is not None:
            who.require("admin")  # every tenant's routes: not for a tenant-scoped token
        scope = ReviewScope(
            since=None if since is None else _aware(since, "since"),
            until=None if until is None else _aware(until, "until"),
            deployment_id=deployment_id,
        )
        doc = await in_thread(review.build, scope)
        name = f"review-{doc['report_id']}"
        if format == "csv":
            return attachment(review_csv(doc), name, "csv")
        if format == "pdf":
            from collector.reports.review_pdf import render_pdf

            return attachment(await in_thread(render_pdf, doc), name, "pdf")
        return doc

    @r.get(
        "/v1/audit/verify",
        responses=_ERRORS,
        summary="Check the audit log's hash chain and its signed checkpoints",
        description="ok: the chain is intact and every checkpoint's signature and signed head "
        "match it, with no entry older than twice the checkpoint period left unsigned "
        "(docs/signing.md); signed_through: the last entry a checkpoint signs.",
    )
    async def verify_audit(who: Caller) -> dict[str, Any]:
        who.require("admin", grant="report")

        def check() -> KeyedCheck:
            keys = audit_log.ring.public_set() if audit_log.ring else {"keys": []}
            return audit_log.verify_keyed(keys, datetime.now(UTC))

        c = await in_thread(check)
        return {
            "ok": c.ok,
            "entries": c.chain.entries,
            "first_bad_id": c.first_bad_id,
            "problem": c.problem,
            "head": c.chain.head,
            "keyed": c.keyed,
            "checkpoints": c.checkpoints,
            "signed_through": c.signed_through,
        }

    return r
