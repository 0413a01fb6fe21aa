"""HTTP routes for what the probes reported, read back: deployments and their config history,
requests, pool samples, page events and probes; a thin layer over
:class:`collector.reads.ReadService` (which applies the token's scope)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from collector.api import caller, params
from collector.api import schemas as s
from collector.api.caller import Caller, in_thread
from collector.reads import ReadService

_ERRORS = params.errors(401, 403, 422, 503)
MAX_PAGE = 1000
PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Rows per page")]
MinTokens = Annotated[int | None, Query(ge=0, le=2**62)]
MaxPoints = Annotated[int, Query(ge=1, le=10_000, description="Buckets per series")]
_aware = params.aware


def build_router(reads: ReadService) -> APIRouter:
    r = caller.router()

    @r.get("/v1/deployments", response_model=list[s.DeploymentOut], responses=_ERRORS)
    async def get_deployments(who: Caller) -> Any:
        return await in_thread(reads.deployments, who)

    @r.get(
        "/v1/deployments/{deployment_id}/config-history",
        response_model=list[s.ConfigOut],
        responses=_ERRORS,
    )
    async def get_config_history(deployment_id: str, who: Caller) -> Any:
        return await in_thread(reads.deployment_history, who, deployment_id)

    @r.get("/v1/requests", response_model=s.RequestPage, responses=_ERRORS)
    async def get_requests(
        who: Caller,
        deployment_id: str | None = None,
        model_id: str | None = None,
        tenant: str | None = None,
        route: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        min_prompt_tokens: MinTokens = None,
        limit: PageLimit = 100,
        cursor: str | None = None,
    ) -> Any:
        return await in_thread(
            reads.requests,
            who,
            deployment_id=deployment_id,
            model_id=model_id,
            tenant=tenant,
            route=route,
            since=_aware(since, "since"),
            until=_aware(until, "until"),
            min_prompt_tokens=min_prompt_tokens,
            limit=limit,
            cursor=cursor,
        )

    @r.get("/v1/pool-samples", response_model=s.PoolSeries, responses=_ERRORS)
    async def get_pool_samples(
        who: Caller,
        deployment_id: str | None = None,
        node: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        max_points: MaxPoints = 500,
    ) -> Any:
        return await in_thread(
            reads.pool_samples,
            who,
            deployment_id=deployment_id,
            node=node,
            since=_aware(since, "since"),
            until=_aware(until, "until"),
            max_points=max_points,
            now=datetime.now(UTC),
        )

    @r.get("/v1/page-events", response_model=s.PageEventPage, responses=_ERRORS)
    async def get_page_events(
        who: Caller,
        deployment_id: str | None = None,
        kind: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: PageLimit = 100,
        cursor: str | None = None,
    ) -> Any:
        return await in_thread(
            reads.page_events,
            who,
            deployment_id=deployment_id,
            kind=kind,
            tenant=tenant,
            since=_aware(since, "since"),
            until=_aware(until, "until"),
            limit=limit,
            cursor=cursor,
        )

    @r.get("/v1/probes", response_model=list[s.ProbeOut], responses=_ERRORS)
    async def get_probes(who: Caller) -> Any:
        return await in_thread(reads.probes, who)

    return r
