"""The outbox (notifications waiting for delivery) and the endpoints they go to.

**At most ``max_per_minute`` alert notifications per endpoint per minute**, then a digest:
an alert document (``alert.*``) for an endpoint that has had its share of the current
minute is folded into that minute's digest for the endpoint (one ``alert.digest`` row,
``msg_<endpoint>_digest_<minute>``, due when the minute ends), which lists the alerts held
back (the latest state of each, at most :data:`DIGEST_ALERTS`) and how many notifications
it stands for. Nothing is dropped, and a storm of alerts (made-up probe ids, say) costs a
receiver ``max_per_minute + 1`` messages a minute. Incident notifications are never held:
they are the pages. A digest not yet due never holds up the messages behind it (the
dispatcher passes over it until its minute has ended).

``enqueue`` runs inside the transaction of the alert or incident change that caused the
notification: either both commit or neither does, so a notification is never lost to a crash
between the two, nor sent for a change that rolled back. The dispatcher
(``collector.notify.dispatcher``) delivers the rows afterwards.

Endpoint URLs are operator configuration. Only http(s) is accepted, but any host is: the
collector will POST to internal addresses (cloud metadata services, admin ports on
localhost) if told to, so whoever can add endpoints must be trusted like an operator, and a
deployment that must not reach internal networks should egress through a filtering proxy.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import ColumnElement, Connection, case, delete, func, insert, select, update

from collector import audit
from collector import models as m
from collector.errors import Conflict, InvalidInput, NotFound
from collector.grace import DEFAULT_GRACE_S, checked_grace
from collector.notify import payloads, signing
from collector.timefmt import as_datetime, iso
from engine_probe.events import is_valid_id

SEVERITIES = ("info", "warning", "critical")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}
DOC_TYPES = (
    "alert.firing",
    "alert.resolved",
    "alert.repeat",
    "alert.digest",
    "incident.opened",
    "incident.acknowledged",
    "incident.reminder",
    "incident.repeat",
    "incident.closed",
)
_ROUTING_KEY = re.compile(r"[A-Za-z0-9]{20,64}")
MIN_SECRET_BYTES = 24  # the Standard Webhooks minimum for HMAC secrets
DEFAULT_MAX_PER_MINUTE = 30
DIGEST = "alert.digest"
DIGEST_ALERTS = 100  # alerts listed in one digest; the rest are counted
_MINUTE_US = 60_000_000


def new_msg_id() -> str:
    # url-safe base64 never contains '.', which the signed content uses as its separator
    return "msg_" + secrets.token_urlsafe(18)


def enqueue(
    conn: Connection,
    doc: dict[str, Any],
    *,
    severity: str,
    now_us: int,
    kinds: tuple[str, ...] | None = None,
    max_per_minute: int | None = None,
) -> int:
    """Queue ``doc`` for every enabled endpoint whose ``min_severity`` is at most
    ``severity`` (and whose kind is in ``kinds``, when given), in the caller's transaction.
    Returns the number of rows written. ``max_per_minute``: an alert document for an
    endpoint past it this minute goes into the minute's digest (the module's note).

    An endpoint gets only the alerts at or above its ``min_severity``: a group or a re-send
    that holds a critical alert and warnings reaches a critical-only receiver with the
    critical one alone. An incident's notice goes whole (the incident is critical; its linked
    alerts are its context, not pages of their own)."""
    if severity not in _RANK:
        raise InvalidInput(f"severity must be one of {', '.join(SEVERITIES)}, not {severity!r}")
    if doc.get("type") not in DOC_TYPES:
        raise InvalidInput(f"unknown notification type {doc.get('type')!r}")
    endpoints = conn.execute(
        select(m.NotifyEndpoint.id, m.NotifyEndpoint.min_severity, m.NotifyEndpoint.kind).where(
            m.NotifyEndpoint.enabled.is_(True)
        )
    ).all()
    rows = []
    by_floor: dict[int, str | None] = {}  # one encoding per severity floor
    minute = now_us - now_us % _MINUTE_US
    held: dict[int, int] = {}
    if max_per_minute is not None and str(doc["type"]).startswith("alert.") and endpoints:
        o = m.OutboxMessage
        held = dict(
            conn.execute(
                select(o.endpoint_id, func.count())
                .where(
                    o.endpoint_id.in_([e.id for e in endpoints]),
                    o.created_at >= minute,
                    o.event_type != DIGEST,
                )
                .group_by(o.endpoint_id)
            ).all()
        )
    for e in endpoints:
        floor = _RANK.get(e.min_severity, 0)
        if floor > _RANK[severity] or (kinds is not None and e.kind not in kinds):
            continue
        if floor not in by_floor:
            by_floor[floor] = _encoded_for(doc, floor)
        data = by_floor[floor]
        if data is None:
            continue
        if max_per_minute is not None and held.get(e.id, 0) >= max_per_minute:
            _fold_into_digest(conn, e.id, json.loads(data), minute, max_per_minute, now_us)
            continue
        rows.append(
            {
                "msg_id": new_msg_id(),
                "endpoint_id": e.id,
                "event_type": doc["type"],
                "data": data,
                "created_at": now_us,
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": now_us,
            }
        )
    if rows:
        conn.execute(insert(m.OutboxMessage), rows)
    return len(rows)


def _fold_into_digest(
    conn: Connection, endpoint_id: int, doc: dict[str, Any], minute: int, limit: int, now_us: int
) -> None:
    """Add ``doc`` (as this endpoint gets it) to the endpoint's digest of ``minute``."""
    o = m.OutboxMessage
    msg_id = f"msg_{endpoint_id}_digest_{minute // 1_000_000}"
    row = conn.execute(select(o.id, o.data).where(o.msg_id == msg_id)).first()
    digest: dict[str, Any] = (
        json.loads(row.data)
        if row is not None
        else {
            "type": DIGEST,
            "created_at": doc.get("created_at"),
            "instance": doc.get("instance"),
            "group_key": msg_id,
            "group_labels": {"kvwatch_digest": "true"},
            "alerts": [],
            "incident": None,
            "digest": {
                "window_start_us": minute,
                "window_end_us": minute + _MINUTE_US,
                "limit_per_minute": limit,
                "notifications": 0,
                "by_type": {},
                "alerts_omitted": 0,
            },
        }
    )
    d = digest["digest"]
    d["notifications"] += 1
    d["by_type"][doc["type"]] = d["by_type"].get(doc["type"], 0) + 1
    listed = {a["fingerprint"]: a for a in digest["alerts"]}
    for a in doc.get("alerts") or []:
        if a["fingerprint"] in listed or len(listed) < DIGEST_ALERTS:
            listed[a["fingerprint"]] = a  # the latest state of each alert
        else:
            d["alerts_omitted"] += 1
    digest["alerts"] = list(listed.values())
    data = payloads.encode(digest).decode()
    if row is None:
        conn.execute(
            insert(o).values(
                msg_id=msg_id,
                endpoint_id=endpoint_id,
                event_type=DIGEST,
                data=data,
                created_at=now_us,
                status="pending",
                attempts=0,
                next_attempt_at=minute + _MINUTE_US,  # sent when its minute has ended
            )
        )
    else:
        conn.execute(update(o).where(o.id == row.id).values(data=data))


def _encoded_for(doc: dict[str, Any], floor: int) -> str | None:
    """The document as an endpoint with this severity floor gets it; None: nothing for it."""
    if doc.get("incident") or not doc.get("alerts"):
        return payloads.encode(doc).decode()
    kept = [a for a in doc["alerts"] if _RANK.get(a.get("severity", ""), 0) >= floor]
    if not kept:
        return None
    return payloads.encode(
        doc if len(kept) == len(doc["alerts"]) else {**doc, "alerts": kept}
    ).decode()


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """An endpoint as operators see it: the secret is never part of it, and the URL's
    password (``user:pass@host``) shows as ``***``."""

    id: int
    name: str
    kind: str
    url: str
    format: str
    min_severity: str
    enabled: bool
    disabled_reason: str | None
    created_at: datetime
    pending: int
    # a rotation's replaced secret signs beside the new one until then (None: it does not)
    previous_secret_until: datetime | None = None


def add_endpoint(
    conn: Connection,
    name: str,
    url: str,
    kind: str = "webhook",
    format: str | None = None,
    min_severity: str = "info",
    secret: str | None = None,
    *,
    now_us: int,
    actor: str = "cli",
) -> tuple[int, str | None]:
    """Add an endpoint; returns (id, secret). A webhook gets a new signing secret unless one
    is given; an Alertmanager endpoint has none (its API takes unsigned alerts).

    ``format`` defaults to ``kvwatch`` for webhooks; Alertmanager endpoints are always
    ``alertmanager``."""
    if not is_valid_id(name):
        raise InvalidInput(
            f"name: {name!r} is not a valid name (letters, digits, ._:/@+=-; at most 128)",
            {"field": "name"},
        )
    check_url(url)
    if kind not in payloads.KINDS:
        raise InvalidInput(
            f"kind must be one of {', '.join(payloads.KINDS)}, not {kind!r}", {"field": "kind"}
        )
    if format is None:
        format = {"alertmanager": "alertmanager", "pagerduty": "pagerduty"}.get(kind, "kvwatch")
    if (kind == "pagerduty") != (format == "pagerduty"):
        raise InvalidInput(
            "format: a pagerduty endpoint takes PagerDuty's Events API v2, and only it does",
            {"field": "format"},
        )
    if format not in payloads.FORMATS:
        raise InvalidInput(
            f"format must be one of {', '.join(payloads.FORMATS)}, not {format!r}",
            {"field": "format"},
        )
    if kind == "alertmanager" and format != "alertmanager":
        raise InvalidInput(
            "format: an alertmanager endpoint takes Alertmanager's API v2 alerts; "
            "use --kind webhook for a kvwatch-format webhook",
            {"field": "format"},
        )
    if min_severity not in _RANK:
        raise InvalidInput(
            f"min_severity must be one of {', '.join(SEVERITIES)}, not {min_severity!r}",
            {"field": "min_severity"},
        )
    secret = _checked_secret(kind, secret)
    if conn.execute(select(m.NotifyEndpoint.id).where(m.NotifyEndpoint.name == name)).first():
        raise Conflict(f"an endpoint named {name!r} exists already")
    endpoint_id = conn.execute(
        insert(m.NotifyEndpoint)
        .values(
            name=name,
            kind=kind,
            url=url,
            format=format,
            secret=secret,
            min_severity=min_severity,
            enabled=True,
            disabled_reason=None,
            lease_owner=None,
            lease_until=None,
            created_at=now_us,
        )
        .returning(m.NotifyEndpoint.id)
    ).scalar_one()
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="notify.endpoint.add",
        subject=f"endpoint:{name}",
        # Host only: paths and queries of webhook URLs often carry credentials, and the
        # audit log is append-only.
        detail={
            "kind": kind,
            "format": format,
            "min_severity": min_severity,
            "host": urlsplit(url).hostname,
        },
    )
    # a routing key is the operator's own, never echoed
    return endpoint_id, (secret if kind == "webhook" else None)


def check_url(url: str) -> None:
    """Refuse anything but an absolute http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise InvalidInput(f"url: not a valid URL: {exc}", {"field": "url"}) from None
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidInput(
            f"url: scheme must be http or https, not {parts.scheme or 'none'!r}",
            {"field": "url"},
        )
    if not parts.hostname:
        raise InvalidInput("url: must name a host (http(s)://host[:port]/path)", {"field": "url"})


def previous_secret_in_force(now_us: int) -> ColumnElement[bool]:
    """Whether a rotation's replaced secret still signs at ``now_us``: the one test of its
    grace, for the dispatcher's signatures and the endpoints' list."""
    return m.NotifyEndpoint.previous_secret_until > now_us


def list_endpoints(conn: Connection, now_us: int) -> list[EndpointInfo]:
    pending = (
        select(m.OutboxMessage.endpoint_id, func.count().label("n"))
        .where(m.OutboxMessage.status == "pending")
        .group_by(m.OutboxMessage.endpoint_id)
        .subquery()
    )
    e = m.NotifyEndpoint
    rows = conn.execute(
        select(
            e.id,
            e.name,
            e.kind,
            e.url,
            e.format,
            e.min_severity,
            e.enabled,
            e.disabled_reason,
            e.created_at,
            func.coalesce(pending.c.n, 0).label("pending"),
            case(
                (
                    previous_secret_in_force(now_us),
                    e.previous_secret_until,
                ),
                else_=None,
            ).label("previous_secret_until"),
        )
        .outerjoin(pending, pending.c.endpoint_id == e.id)
        .order_by(e.name)
    ).all()
    return [
        EndpointInfo(
            **{
                **row._mapping,
                "url": redacted_url(row.url),
                "previous_secret_until": as_datetime(row.previous_secret_until),
            }
        )
        for row in rows
    ]


def redacted_url(url: str) -> str:
    """``url`` fit to print: a password in it (``https://user:pass@host/``) as ``***``.

    Listings are read over shoulders, pasted into tickets and kept in CI logs; the stored URL
    keeps the password, which the dispatcher needs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


def enable_endpoint(conn: Connection, name: str, *, now_us: int, actor: str = "cli") -> None:
    """Enable an endpoint (after a 410, say); its pending messages go out again in order."""
    done = conn.execute(
        update(m.NotifyEndpoint)
        .where(m.NotifyEndpoint.name == name)
        .values(enabled=True, disabled_reason=None)
    )
    if done.rowcount == 0:
        raise NotFound(f"no endpoint named {name!r}")
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="notify.endpoint.enable",
        subject=f"endpoint:{name}",
    )


def _checked_secret(kind: str, secret: str | None) -> str | None:
    """The secret an endpoint of ``kind`` keeps: None for Alertmanager (not signed), the
    routing key for PagerDuty, the given or a new ``whsec_`` secret for a webhook."""
    if kind == "alertmanager":
        if secret is not None:
            raise InvalidInput("secret: alertmanager endpoints are not signed", {"field": "secret"})
        return None
    if kind == "pagerduty":
        # the routing (integration) key of a PagerDuty service's Events API v2 integration
        if not secret or not _ROUTING_KEY.fullmatch(secret):
            raise InvalidInput(
                "secret: a pagerduty endpoint needs its service's routing key "
                "(--secret; letters and digits, 20 to 64)",
                {"field": "secret"},
            )
        return secret
    if secret is None:
        return signing.new_secret()
    if len(signing.secret_key(secret)) < MIN_SECRET_BYTES:
        raise InvalidInput(
            f"secret: use at least {MIN_SECRET_BYTES} random bytes", {"field": "secret"}
        )
    return secret


def rotate_secret(
    conn: Connection,
    name: str,
    *,
    secret: str | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    now_us: int,
    actor: str = "cli",
) -> tuple[str, int | None]:
    """Give an endpoint a new signing secret (a webhook: a new one unless given; PagerDuty:
    the new routing key), in place: its pending messages stay queued, and each is signed with
    the secret in force when it is sent. Returns the secret and when the replaced one stops
    signing (None: it already has). Removing and adding the endpoint instead would drop
    them.

    ``grace_s``: how long a webhook's replaced secret keeps signing beside the new one (each
    message carries both signatures), so its receiver can change secrets without refusing a
    message in between. A rotation during another's grace replaces the older secret, which
    stops signing at once. A routing key is not a signature: PagerDuty has no grace."""
    e = m.NotifyEndpoint
    checked_grace(grace_s)
    # locked: two rotations at once must not both keep the same replaced secret
    row = conn.execute(
        select(e.id, e.kind, e.secret).where(e.name == name).with_for_update()
    ).first()
    if row is None:
        raise NotFound(f"no endpoint named {name!r}")
    if row.kind == "alertmanager":
        raise InvalidInput("secret: alertmanager endpoints are not signed", {"field": "secret"})
    secret = _checked_secret(row.kind, secret)
    assert secret is not None
    keep = row.kind == "webhook" and grace_s > 0 and row.secret is not None
    until = now_us + int(grace_s * 1_000_000) if keep else None
    conn.execute(
        update(e)
        .where(e.id == row.id)
        .values(
            secret=secret,
            previous_secret=row.secret if keep else None,
            previous_secret_until=until,
        )
    )
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="notify.endpoint.rotate",
        subject=f"endpoint:{name}",
        detail={"previous_signs_until": iso(until)} if until is not None else None,
    )
    return secret, until


def forget_replaced_secrets(conn: Connection, now_us: int) -> int:
    """Delete the replaced secrets whose grace has ended (they sign nothing any more, and a
    secret kept is a secret that can leak from the database or its backups). Returns how
    many were deleted."""
    e = m.NotifyEndpoint
    done = conn.execute(
        update(e)
        .where(e.previous_secret_until <= now_us)
        .values(previous_secret=None, previous_secret_until=None)
    )
    return int(done.rowcount or 0)


def replaced_secrets_due(conn: Connection, now_us: int) -> bool:
    """Whether :func:`forget_replaced_secrets` has anything to delete (a read, so a pass
    with nothing to do takes no write lock)."""
    e = m.NotifyEndpoint
    return (
        conn.execute(select(e.id).where(e.previous_secret_until <= now_us).limit(1)).first()
        is not None
    )


def remove_endpoint(conn: Connection, name: str, *, now_us: int, actor: str = "cli") -> int:
    """Remove an endpoint; its outbox rows and their attempts go with it (FK cascade).
    Returns how many undelivered messages were dropped with it."""
    row = conn.execute(select(m.NotifyEndpoint.id).where(m.NotifyEndpoint.name == name)).first()
    if row is None:
        raise NotFound(f"no endpoint named {name!r}")
    dropped = conn.execute(
        select(func.count()).where(
            m.OutboxMessage.endpoint_id == row.id, m.OutboxMessage.status == "pending"
        )
    ).scalar_one()
    conn.execute(delete(m.NotifyEndpoint).where(m.NotifyEndpoint.id == row.id))
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="notify.endpoint.remove",
        subject=f"endpoint:{name}",
        detail={"pending_dropped": dropped},
    )
    return int(dropped)
