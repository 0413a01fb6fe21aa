"""The inventory: "did any workflow call model M between T1 and T2 with prompts approaching N
tokens?" Per deployment, tenant and route: requests, prompts (distinct: a prompt that several
requests share, as vLLM's parallel-sampling children do, counts once), how many requests had a
prompt of at least N tokens, the largest prompt, first and last seen.

One GROUP BY over the requests of the window (the ``first_ts`` index bounds the scan): the
answer's size is the number of (deployment, tenant, route) triples, never the number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, case, func, select

from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput
from collector.timefmt import as_datetime, iso

R: Table = m.Request.__table__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class InventoryQuery:
    model_id: str
    since: datetime
    until: datetime
    min_prompt_tokens: int | None = None
    deployment_id: str | None = None
    tenant: str | None = None  # set by the caller's scope (a tenant-scoped token)

    def check(self) -> None:
        if not self.model_id:
            raise InvalidInput("model_id is required", {"field": "model_id"})
        for name in ("since", "until"):
            if getattr(self, name).tzinfo is None:
                raise InvalidInput(f"{name} must carry a time zone", {"field": name})
        if self.since >= self.until:
            raise InvalidInput(
                f"since ({iso(self.since)}) must be before until ({iso(self.until)})",
                {"field": "since"},
            )
        if self.min_prompt_tokens is not None and self.min_prompt_tokens < 0:
            raise InvalidInput("min_prompt_tokens must be >= 0", {"field": "min_prompt_tokens"})


def inventory_rows(conn: Connection, q: InventoryQuery) -> list[dict[str, Any]]:
    """Repository: the per-(deployment, tenant, route) aggregates of ``[since, until)``."""
    threshold = q.min_prompt_tokens
    at_or_above = (
        func.sum(case((R.c.prompt_tokens >= threshold, 1), else_=0))
        if threshold is not None
        else None
    )
    cols = [
        R.c.deployment_id,
        R.c.tenant,
        R.c.route,
        func.count().label("requests"),
        func.sum(case((R.c.prompt_shared_with.is_not(None), 1), else_=0)).label("shared"),
        func.max(R.c.prompt_tokens).label("max_prompt_tokens"),
        func.min(R.c.first_ts).label("first_seen"),
        func.max(R.c.last_ts).label("last_seen"),
    ]
    if at_or_above is not None:
        cols.append(at_or_above.label("at_or_above"))
    stmt = (
        select(*cols)
        .where(R.c.model_id == q.model_id, m.requests_since(R.c, q.since), R.c.first_ts < q.until)
        .group_by(R.c.deployment_id, R.c.tenant, R.c.route)
        .order_by(R.c.deployment_id, R.c.tenant, R.c.route)
    )
    if q.deployment_id is not None:
        stmt = stmt.where(R.c.deployment_id == q.deployment_id)
    if q.tenant is not None:
        stmt = stmt.where(R.c.tenant == q.tenant)
    out = []
    for r in conn.execute(stmt):
        out.append(
            {
                # one model on two deployments is two answers: which one served the prompt
                "deployment_id": r.deployment_id,
                "tenant": r.tenant,
                "route": r.route,
                "requests": int(r.requests),
                "prompts": int(r.requests) - int(r.shared or 0),
                "at_or_above": int(r.at_or_above or 0) if threshold is not None else None,
                "max_prompt_tokens": (
                    int(r.max_prompt_tokens) if r.max_prompt_tokens is not None else None
                ),
                "first_seen": as_datetime(r.first_seen),
                "last_seen": as_datetime(r.last_seen),
            }
        )
    return out


class InventoryService:
    def __init__(self, db: Database):
        self.db = db

    def inventory(self, q: InventoryQuery) -> dict[str, Any]:
        q.check()
        with self.db.read() as conn:
            rows = inventory_rows(conn, q)
        maxes = [r["max_prompt_tokens"] for r in rows if r["max_prompt_tokens"] is not None]
        return {
            "model_id": q.model_id,
            "since": q.since,
            "until": q.until,
            "min_prompt_tokens": q.min_prompt_tokens,
            "deployment_id": q.deployment_id,
            "tenant": q.tenant,
            "totals": {
                "requests": sum(r["requests"] for r in rows),
                "prompts": sum(r["prompts"] for r in rows),
                "at_or_above": (
                    sum(r["at_or_above"] for r in rows) if q.min_prompt_tokens is not None else None
                ),
                "max_prompt_tokens": max(maxes) if maxes else None,
                "tenants": len({r["tenant"] for r in rows}),
                "routes": len({r["route"] for r in rows}),
            },
            "rows": rows,
        }
