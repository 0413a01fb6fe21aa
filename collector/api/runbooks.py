"""HTTP route for a rule kind's runbook (containment first), as the dashboard's runbook page
and a notification's link show it. Any read token may read one: a runbook names no tenant."""

from __future__ import annotations

from fastapi import APIRouter

from collector import runbooks
from collector.api import caller, params
from collector.api.caller import Caller, in_thread

_ERRORS = params.errors(401, 403, 404, 422, 503)


def build_router() -> APIRouter:
    r = caller.router()

    @r.get(
        "/v1/runbooks/{kind}",
        responses=_ERRORS,
        summary="A rule kind's runbook, as Markdown",
        description="Containment first (the engine flag, the gateway mode), then how to "
        "confirm with `kvwatch verify`, diagnosis and when to close. 404 for a kind kvwatch "
        "does not have.",
    )
    async def get_runbook(kind: str, who: Caller) -> dict[str, str]:
        who.require("admin", "read")
        text = await in_thread(runbooks.runbook_text, kind)
        return {"kind": kind, "markdown": text}

    return r
