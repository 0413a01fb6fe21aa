"""API tokens: creation, lookup, and the principal a request acts as.

Tokens are 256 bits from ``secrets`` and stored only as SHA-256. Lookup is by the hash's
unique index, so the time a check takes does not depend on how much of a guess matches.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import Connection, insert, or_, select, update

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import CollectorError, Forbidden, InvalidInput, Unauthorized
from collector.timefmt import now_micros

log = logging.getLogger("kvwatch.tokens")

TokenKind = Literal["ingest", "read", "admin"]
KINDS: tuple[TokenKind, ...] = ("ingest", "read", "admin")


@dataclass(frozen=True, slots=True)
class Principal:
    token_id: int
    kind: TokenKind
    tenant: str | None
    deployment_id: str | None
    label: str

    def require(self, *kinds: TokenKind) -> None:
        if self.kind not in kinds:
            raise Forbidden(f"a {self.kind} token cannot do this; needs {' or '.join(kinds)}")

    def tenant_filter(self, requested: str | None) -> str | None:
        """The tenant a query must be limited to. A tenant-scoped token may only ask for its
        own tenant; it never widens to others."""
        if self.kind == "read" and self.tenant is not None:
            if requested is not None and requested != self.tenant:
                raise Forbidden(f"this token is scoped to tenant {self.tenant!r}")
            return self.tenant
        return requested


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    conn: Connection,
    *,
    kind: str,
    now_us: int,
    tenant: str | None = None,
    deployment_id: str | None = None,
    name: str | None = None,
    actor: str = "cli",
) -> tuple[int, str]:
    """Create a token; returns (id, secret). The secret is never stored or shown again."""
    if kind not in KINDS:
        raise InvalidInput(f"token kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if tenant is not None and kind != "read":
        raise InvalidInput("--tenant scopes read tokens only")
    if deployment_id is not None and kind != "ingest":
        raise InvalidInput("--deployment scopes ingest tokens only")
    secret = f"kvw_{kind}_{secrets.token_urlsafe(32)}"
    token_id = conn.execute(
        insert(m.ApiToken)
        .values(
            kind=kind,
            tenant=tenant,
            deployment_id=deployment_id,
            name=name,
            prefix=secret[:16],
            token_hash=hash_token(secret),
            created_at=now_us,
        )
        .returning(m.ApiToken.id)
    ).scalar_one()
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="token.create",
        subject=f"token:{token_id}",
        detail={"kind": kind, "tenant": tenant, "deployment_id": deployment_id, "name": name},
    )
    return token_id, secret


def authenticate(conn: Connection, authorization: str | None) -> Principal:
    """Resolve an ``Authorization: Bearer ...`` header to a principal, or raise 401."""
    if not authorization:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    scheme, _, secret = authorization.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise Unauthorized("the Authorization header must be 'Bearer <token>'")
    row = conn.execute(
        select(
            m.ApiToken.id,
            m.ApiToken.kind,
            m.ApiToken.tenant,
            m.ApiToken.deployment_id,
            m.ApiToken.prefix,
            m.ApiToken.name,
            m.ApiToken.revoked_at,
        ).where(m.ApiToken.token_hash == hash_token(secret))
    ).first()
    if row is None or row.revoked_at is not None:
        raise Unauthorized("unknown or revoked token")
    # Who acted, in the audit log and on acks: the token's name when it has one.
    return Principal(row.id, row.kind, row.tenant, row.deployment_id, row.name or row.prefix)


def record_use(conn: Connection, principal: Principal, *, now_us: int, every_us: int) -> bool:
    """Write a ``token.use`` audit entry unless one was written for this token within
    ``every_us`` (by any replica: the token row is the arbiter). Returns whether it wrote."""
    t = m.ApiToken
    claimed = conn.execute(
        update(t)
        .where(
            t.id == principal.token_id,
            or_(t.last_used_at.is_(None), t.last_used_at <= now_us - every_us),
        )
        .values(last_used_at=now_us)
    ).rowcount
    if claimed:
        audit.append(
            conn,
            now_us=now_us,
            actor=principal.label,
            action="token.use",
            subject=f"token:{principal.token_id}",
            detail={"kind": principal.kind},
        )
    return bool(claimed)


class Authenticator:
    """Resolves bearer tokens, remembering valid ones for ``ttl_s`` seconds so a busy probe
    does not cost a database round trip per batch. Unknown tokens are never cached (a flood
    of guesses must not grow memory); a revoked token stops working within ``ttl_s``.

    Use is audited: the first use of a token in every ``use_audit_s`` writes a ``token.use``
    entry (a busy ingest token would otherwise flood the log). Failing to write it never
    fails the request."""

    def __init__(
        self,
        db: Database,
        ttl_s: float = 5.0,
        max_entries: int = 10_000,
        use_audit_s: float = 3600.0,
    ):
        self.db = db
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.use_audit_s = use_audit_s
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._audited: dict[int, float] = {}  # token id -> monotonic time of its last entry

    def __call__(self, authorization: str | None) -> Principal:
        now = time.monotonic()
        hit = self._cache.get(authorization) if authorization else None
        if hit is not None and hit[0] > now:
            return hit[1]
        with self.db.read() as conn:
            principal = authenticate(conn, authorization)
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        assert authorization is not None  # authenticate() refused a missing header
        self._cache[authorization] = (now + self.ttl_s, principal)
        last = self._audited.get(principal.token_id)
        if last is None or now - last >= self.use_audit_s:
            self._audit_use(principal, now)
        return principal

    def _audit_use(self, principal: Principal, now: float) -> None:
        try:
            with self.db.write() as conn:
                record_use(
                    conn,
                    principal,
                    now_us=now_micros(),
                    every_us=int(self.use_audit_s * 1_000_000),
                )
        except CollectorError as exc:  # the database is busy or down: try on a later miss
            log.warning("token use not audited: %s", exc.message)
            return
        if len(self._audited) >= self.max_entries:
            self._audited.clear()
        self._audited[principal.token_id] = now
