"""HTTP routes the dashboard reads: the fleet and aggregate statistics. Each answers from
rollups or indexed queries (:mod:`collector.rollups.stats`), never with raw rows beyond a
bounded top list. A tenant-scoped read token sees only its tenant's traffic."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query

from collector.api import caller, params
from collector.api.caller import Caller, in_thread
from collector.errors import InvalidInput
from collector.fleet import FleetService
from collector.rollups.stats import Scope, StatsService, Window
from collector.timefmt import iso, to_micros

_ERRORS = params.errors(401, 403, 422, 503)
Label = Annotated[str | None, Query(min_length=1, max_length=256)]
Points = Annotated[int, Query(ge=1, le=2_000, description="Buckets per series")]


def _window(since: datetime | None, until: datetime | None, points: int) -> Window:
    """Default: the 24 hours before ``until`` (default now)."""
    hi = params.aware(until, "until") or datetime.now(UTC)
    try:
        lo = params.aware(since, "since") or hi - timedelta(hours=24)
    except OverflowError:
        raise InvalidInput("until is too early for a 24-hour window", {"field": "until"}) from None
    if lo >= hi:
        raise InvalidInput(
            f"inverted window: since ({iso(lo)}) must be before until ({iso(hi)})",
            {"field": "since"},
        )
    return Window(to_micros(lo), to_micros(hi), points)


def build_router(fleet: FleetService, stats: StatsService) -> APIRouter:
    r = caller.router()

    @r.get(
        "/v1/fleet",
        responses=_ERRORS,
        summary="Every deployment: limits, verification, status and firing alerts",
        description="Per deployment: nodes, per model the advertised context, prefill pool, "
        "verified safe context (date, age, engine version, stale or failed), a status (red: "
        "pool below advertised, stale or failed verification, critical alert; amber: not "
        "verified or a warning firing) with its reasons, and counts of firing alerts and "
        "open incidents.",
    )
    async def get_fleet(who: Caller) -> dict[str, Any]:
        who.require("admin", "read")
        return await in_thread(fleet.fleet, datetime.now(UTC))

    @r.get(
        "/v1/stats/prompt-tokens",
        responses=_ERRORS,
        summary="Prompt tokens per model and route over time, against the safe-context lines",
        description="From 5-minute rollups (the open one recomputed at most once a minute, so "
        "the newest minute may be missing):"
        " per (model, route, bucket) requests, prompts and prompt_tokens (usage: a prompt "
        "that several requests share, as parallel-sampling children do, counts once), "
        "rejected, max (exact), mean, p50 and p99 "
        "(upper bounds of 9%-wide bins, clipped to the max) and how many reached 80% and 100% "
        "of the model's limit in force (whole bins whose largest prompt reached the line: an "
        "upper bound); the same per route over the window; a histogram per model; and the "
        "lines (the smallest limit in force among the deployments serving the model, with its "
        "source, staleness and words).",
    )
    async def get_prompt_tokens(
        who: Caller,
        model_id: Label = None,
        route: Label = None,
        deployment_id: Label = None,
        since: datetime | None = None,
        until: datetime | None = None,
        max_points: Points = 200,
    ) -> dict[str, Any]:
        who.require("admin", "read")
        scope = Scope(model_id, route, deployment_id, who.tenant_filter(None))
        window = _window(since, until, max_points)
        return await in_thread(stats.prompt_tokens, scope, window)

    @r.get(
        "/v1/stats/top-prompts",
        responses=_ERRORS,
        summary="The largest prompts in a window: the requests nearest the threshold",
        description="Requests (counts and labels only) ordered by prompt tokens, largest "
        "first, each with its model's safe context and the ratio to it.",
    )
    async def get_top_prompts(
        who: Caller,
        model_id: Label = None,
        route: Label = None,
        deployment_id: Label = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 20,
    ) -> dict[str, Any]:
        who.require("admin", "read")
        scope = Scope(model_id, route, deployment_id, who.tenant_filter(None))
        window = _window(since, until, 1)
        return await in_thread(stats.top_prompts, scope, window, limit)

    @r.get(
        "/v1/stats/page-events",
        responses=_ERRORS,
        summary="Page reuse, KV transfers, stale reads and canary hits per time bucket",
        description="Per deployment, event kind and bucket: events, pages and cross-tenant "
        "events. A tenant-scoped token counts only events its tenant is a party to.",
    )
    async def get_page_event_stats(
        who: Caller,
        deployment_id: Label = None,
        since: datetime | None = None,
        until: datetime | None = None,
        max_points: Points = 200,
    ) -> dict[str, Any]:
        who.require("admin", "read")
        scope = Scope(deployment_id=deployment_id, tenant=who.tenant_filter(None))
        return await in_thread(stats.page_events, scope, _window(since, until, max_points))

    return r
