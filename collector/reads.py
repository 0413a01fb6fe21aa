"""The read service: who may see what, paging, and time windows. Routes call this; this
calls ``collector.queries``."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime, timedelta
from typing import Any

from collector import queries
from collector.db import Database
from collector.errors import BadRequest, InvalidInput
from collector.timefmt import as_micros, to_micros
from collector.tokens import Principal

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def encode_cursor(key: tuple[int, int]) -> str:
    return base64.urlsafe_b64encode(f"{key[0]}:{key[1]}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> tuple[int, int] | None:
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        a, b = (int(x) for x in raw.split(":"))
        if not (_I64_MIN <= a <= _I64_MAX and _I64_MIN <= b <= _I64_MAX):
            raise ValueError("out of range")
        return a, b
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise BadRequest("cursor is not one this API returned", {"field": "cursor"}) from None


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    more = len(items) > limit
    items = items[:limit]
    nxt = encode_cursor(items[-1]["_key"]) if more and items else None
    for it in items:
        it.pop("_key", None)
    return {"items": items, "next_cursor": nxt}


def _redact_other_party(item: dict[str, Any], tenant: str) -> None:
    """A tenant learns that its data crossed a boundary, never who was on the other side."""
    if item["tenant"] != tenant:
        item["tenant"] = item["request_id"] = None
    if item["other_tenant"] != tenant:
        item["other_tenant"] = item["other_request_id"] = None


class ReadService:
    def __init__(self, db: Database):
        self.db = db

    def deployments(self, who: Principal) -> list[dict[str, Any]]:
        who.require("read", "admin")
        with self.db.read() as conn:
            return queries.list_deployments(conn)

    def deployment_history(self, who: Principal, deployment_id: str) -> list[dict[str, Any]]:
        who.require("read", "admin")
        with self.db.read() as conn:
            return queries.config_history(conn, deployment_id)

    def requests(
        self,
        who: Principal,
        *,
        deployment_id: str | None,
        model_id: str | None,
        tenant: str | None,
        route: str | None,
        since: datetime | None,
        until: datetime | None,
        min_prompt_tokens: int | None,
        limit: int,
        cursor: str | None,
    ) -> dict[str, Any]:
        who.require("read", "admin")
        f = queries.RequestFilter(
            deployment_id=deployment_id,
            model_id=model_id,
            tenant=who.tenant_filter(tenant),
            route=route,
            since_us=as_micros(since),
            until_us=as_micros(until),
            min_prompt_tokens=min_prompt_tokens,
        )
        with self.db.read() as conn:
            items = queries.list_requests(conn, f, limit=limit + 1, after=decode_cursor(cursor))
        return _page(items, limit)

    def pool_samples(
        self,
        who: Principal,
        *,
        deployment_id: str | None,
        node: str | None,
        since: datetime | None,
        until: datetime | None,
        max_points: int,
        now: datetime,
    ) -> dict[str, Any]:
        who.require("read", "admin")
        until = until or now
        try:
            since = since or until - timedelta(hours=1)
        except OverflowError:
            raise InvalidInput(
                "until is too early for a one-hour window", {"field": "until"}
            ) from None
        if since >= until:
            raise InvalidInput("since must be before until", {"field": "since"})
        with self.db.read() as conn:
            width, rows = queries.pool_samples(
                conn,
                deployment_id=deployment_id,
                node=node,
                since_us=to_micros(since),
                until_us=to_micros(until),
                max_points=max_points,
            )
        return {
            "since": since,
            "until": until,
            "bucket_seconds": width / 1_000_000,
            "items": rows,
        }

    def page_events(
        self,
        who: Principal,
        *,
        deployment_id: str | None,
        kind: str | None,
        tenant: str | None,
        since: datetime | None,
        until: datetime | None,
        limit: int,
        cursor: str | None,
    ) -> dict[str, Any]:
        who.require("read", "admin")
        scope = who.tenant_filter(tenant)
        with self.db.read() as conn:
            items = queries.list_page_events(
                conn,
                deployment_id=deployment_id,
                kind=kind,
                tenant=scope,
                since_us=as_micros(since),
                until_us=as_micros(until),
                limit=limit + 1,
                after=decode_cursor(cursor),
            )
        if who.tenant is not None and who.kind == "read":
            for it in items:
                _redact_other_party(it, who.tenant)
        return _page(items, limit)

    def probes(self, who: Principal) -> list[dict[str, Any]]:
        who.require("admin")
        with self.db.read() as conn:
            return queries.list_probes(conn)
