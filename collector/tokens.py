"""API tokens: creation, lookup, their lifecycle (list, revoke, expire, rotate), and the
principal a request acts as.

Tokens are 256 bits from ``secrets`` and stored only as SHA-256. Lookup is by the hash's
unique index, so the time a check takes does not depend on how much of a guess matches.

Lifecycle invariants:

* a token is valid while ``revoked_at`` is NULL and ``expires_at`` is NULL or in the future;
  every replica checks both at lookup and caches a valid token for at most
  ``KVWATCH_TOKEN_CACHE_S`` (never past its expiry), so a revocation takes effect within that;
* a rotation creates a token with the same kind, scope and name, and sets the old one to
  expire after a grace period (``collector.grace.DEFAULT_GRACE_S`` unless given), so probes can be
  reconfigured without losing events; both belong to one *lineage* (``lineage_id``, the first
  token's id), and a probe id registered to a lineage accepts any of its valid tokens;
* revoking a token revokes the generations of its lineage before it too (the ones it
  replaced, usually the leaked secret a rotation was made for), unless ``keep_previous``;
  the tokens that replaced it are not touched. A revoked or expired token can still be
  rotated: its replacement joins the lineage, so a probe's spooled events under the lineage's
  probe ids can be delivered with it;
* a name is held by at most one valid token (``name_held``, under a unique index, so two
  replicas creating one name at once cannot both succeed); a rotation passes the name on, a
  revocation releases it, an expired holder gives it up when a new token claims it;
* a reference is an id (``18``, ``#18``, ``id:18``) or a name (``name:18`` for a name of
  digits only, which new tokens cannot take);
* every operation is in the audit log (``token.create``, ``token.revoke``,
  ``token.rotate``); a secret is never stored nor shown after creation.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Connection, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import (
    CollectorError,
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    Unauthorized,
    Unavailable,
)
from collector.grace import DEFAULT_GRACE_S, checked_grace
from collector.timefmt import as_micros, iso, now_micros

if TYPE_CHECKING:
    from collector.oidc import OidcVerifier

log = logging.getLogger("kvwatch.tokens")

TokenKind = Literal["ingest", "read", "admin"]
KINDS: tuple[TokenKind, ...] = ("ingest", "read", "admin")
# What a signed-in person's role adds to reading (collector.oidc): ``respond`` acknowledges,
# silences and works incidents; ``report`` generates and reads reports and notices.
Grant = Literal["respond", "report"]
MAX_LIFETIME_S = 10 * 365 * 24 * 3600


@dataclass(frozen=True, slots=True)
class Person:
    """A person as their identity provider's ID token names them."""

    subject: str
    email: str | None
    name: str | None
    issuer: str


@dataclass(frozen=True, slots=True)
class Principal:
    token_id: int
    kind: TokenKind
    tenant: str | None
    deployment_id: str | None
    label: str
    lineage_id: int | None = None  # None: the token is its own lineage
    expires_at_us: int | None = None
    # a person signed in through OIDC (collector.oidc), not a token: their role, what it adds
    # to ``kind``, and who they are (subject and e-mail, for the audit log)
    role: str | None = None
    grants: frozenset[Grant] = frozenset()
    person: Person | None = None

    @property
    def lineage(self) -> int:
        return self.lineage_id if self.lineage_id is not None else self.token_id

    def require(self, *kinds: TokenKind, grant: Grant | None = None) -> None:
        """Refuse (403) unless the caller is of one of ``kinds`` or, a person, has ``grant``."""
        if self.kind in kinds or (grant is not None and grant in self.grants):
            return
        if self.person is not None:
            raise Forbidden(f"the {self.role} role cannot do this")
        raise Forbidden(f"a {self.kind} token cannot do this; needs {' or '.join(kinds)}")

    def acting_as(self, claimed: str | None) -> str:
        """Who the audit log and an ack name: a token's caller may name the person it acts
        for; a signed-in person is always named as their identity provider says."""
        if self.person is not None:
            return self.label
        return claimed or self.label

    def token_fields(self) -> dict[str, Any]:
        """The token's own fields, JSON-ready, from which ``Principal(**fields)`` rebuilds
        it (the ingest bus carries them to its writers); a signed-in person's role and
        identity do not travel."""
        return {
            "token_id": self.token_id,
            "kind": self.kind,
            "tenant": self.tenant,
            "deployment_id": self.deployment_id,
            "label": self.label,
            "lineage_id": self.lineage_id,
            "expires_at_us": self.expires_at_us,
        }

    def may(self) -> list[str]:
        """What the caller may do, as ``GET /v1/whoami`` says and the dashboard shows."""
        if self.kind == "admin":
            return ["read", "respond", "report", "admin"]
        if self.kind == "ingest":
            return ["ingest"]
        return ["read", *sorted(self.grants)]

    def tenant_filter(self, requested: str | None) -> str | None:
        """The tenant a query must be limited to. A tenant-scoped token may only ask for its
        own tenant; it never widens to others."""
        if self.kind == "read" and self.tenant is not None:
            if requested is not None and requested != self.tenant:
                raise Forbidden(f"this token is scoped to tenant {self.tenant!r}")
            return self.tenant
        return requested


def looks_like_jwt(secret: str) -> bool:
    """A compact JWS (three base64url parts: a signed-in person's ID token), as no kvwatch
    token is (``kvw_...``)."""
    return secret.count(".") == 2 and not secret.startswith("kvw_")


def token_digest(token: str) -> str:
    """A short digest naming one sign-in session in the audit log (never the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


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
    expires_in_s: float | None = None,
    lineage_id: int | None = None,
) -> tuple[int, str]:
    """Create a token; returns (id, secret). The secret is never stored or shown again.
    ``expires_in_s``: it stops working that long after ``now_us``. A name is unique among
    valid tokens (so ``revoke NAME`` means one token), except within a rotation's lineage."""
    if expires_in_s is not None and not 0 < expires_in_s <= MAX_LIFETIME_S:
        raise InvalidInput(
            f"expires_in must be between 1 second and 10 years, not {expires_in_s:g} s",
            {"field": "expires_in"},
        )
    if name is not None and lineage_id is None and _as_id(name) is not None:
        raise InvalidInput(
            f"name: {name!r} is digits only and would read as a token id", {"field": "name"}
        )
    if name is not None:
        _claim_name(conn, name, lineage_id, now_us)
    expires_us = None if expires_in_s is None else now_us + int(expires_in_s * 1_000_000)
    if kind not in KINDS:
        raise InvalidInput(f"token kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if tenant is not None and kind != "read":
        raise InvalidInput("--tenant scopes read tokens only")
    if deployment_id is not None and kind != "ingest":
        raise InvalidInput("--deployment scopes ingest tokens only")
    secret = f"kvw_{kind}_{secrets.token_urlsafe(32)}"
    try:
        with conn.begin_nested():  # a lost race on the name leaves the transaction usable
            token_id = conn.execute(
                insert(m.ApiToken)
                .values(
                    kind=kind,
                    tenant=tenant,
                    deployment_id=deployment_id,
                    name=name,
                    name_held=name,
                    prefix=secret[:16],
                    token_hash=hash_token(secret),
                    created_at=now_us,
                    expires_at=expires_us,
                    lineage_id=lineage_id,
                )
                .returning(m.ApiToken.id)
            ).scalar_one()
    except IntegrityError:
        raise Conflict(
            f"a valid token is already named {name!r} (created at the same moment, by "
            "another request); names must be unique",
            {"field": "name"},
        ) from None
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="token.create",
        subject=f"token:{token_id}",
        detail={
            "kind": kind,
            "tenant": tenant,
            "deployment_id": deployment_id,
            "name": name,
            "expires_at": iso(expires_us),
            "lineage_id": lineage_id,
        },
    )
    return token_id, secret


def _claim_name(conn: Connection, name: str, lineage_id: int | None, now_us: int) -> None:
    """Make ``name`` free for a new token of ``lineage_id`` (None: a new lineage): released
    by holders that are no longer valid, and by a valid holder of the same lineage (the
    token a rotation replaces). A valid holder of another lineage refuses it."""
    t = m.ApiToken
    holder = conn.execute(select(t).where(t.name_held == name)).first()
    if holder is None:
        return
    same = lineage_id is not None and (holder.lineage_id or holder.id) == lineage_id
    if token_doc(holder, now_us)["state"] == "valid" and not same:
        raise Conflict(
            f"a valid token is already named {name!r} (#{holder.id}); names must be unique "
            "(rotate it, or revoke it first)",
            {"field": "name", "token_id": holder.id},
        )
    conn.execute(update(t).where(t.id == holder.id).values(name_held=None))


def _valid(conn: Connection, now_us: int) -> Any:
    t = m.ApiToken
    return select(t).where(
        t.revoked_at.is_(None), or_(t.expires_at.is_(None), t.expires_at > now_us)
    )


def token_doc(row: Any, now_us: int) -> dict[str, Any]:
    """What anyone may know of a token: everything but its secret (the prefix identifies it
    in logs and errors)."""
    expires = as_micros(row.expires_at)
    state = (
        "revoked"
        if row.revoked_at is not None
        else "expired"
        if expires is not None and expires <= now_us
        else "valid"
    )
    return {
        "id": row.id,
        "kind": row.kind,
        "tenant": row.tenant,
        "deployment_id": row.deployment_id,
        "name": row.name,
        "prefix": row.prefix,
        "created_at": iso(as_micros(row.created_at)),
        "last_used_at": iso(row.last_used_at),
        "expires_at": iso(expires),
        "revoked_at": iso(as_micros(row.revoked_at)),
        "lineage_id": row.lineage_id if row.lineage_id is not None else row.id,
        "state": state,
    }


def list_tokens(conn: Connection, now_us: int) -> list[dict[str, Any]]:
    rows = conn.execute(select(m.ApiToken).order_by(m.ApiToken.id)).all()
    return [token_doc(r, now_us) for r in rows]


_MAX_ID = 2**63 - 1  # the id column's range (BIGINT); a larger id names no token


def _as_id(id_or_name: str | int) -> int | None:
    """An id when the reference is one: an int, or ASCII digits only. ``str.isdigit`` alone
    admits every Unicode digit (a full-width one, U+FF11, read as 1: another token than the
    one meant; a superscript two, U+00B2, that ``int`` refuses), so anything but 0-9 is a
    name."""
    if isinstance(id_or_name, int):
        return id_or_name
    return int(id_or_name) if id_or_name.isascii() and id_or_name.isdigit() else None


def find_token(conn: Connection, id_or_name: str | int, now_us: int) -> Any:
    """A token by id (``18``, ``#18``, ``id:18``), or by name (``name:NAME`` whatever the
    name, or a plain name) among valid tokens (one, or the newest of one lineage); a name
    shared by tokens of different lineages (an older version's race) is refused, naming
    their ids."""
    t = m.ApiToken
    token_id: int | None = None
    if isinstance(id_or_name, str) and id_or_name.startswith("name:"):
        id_or_name = id_or_name.removeprefix("name:")
    elif isinstance(id_or_name, str) and id_or_name.startswith(("#", "id:")):
        ref = id_or_name.removeprefix("#").removeprefix("id:")
        token_id = _as_id(ref)
        if token_id is None:
            raise NotFound(f"no token {id_or_name!r}: an id is digits")
    else:
        token_id = _as_id(id_or_name)
    if token_id is not None:
        row = (
            None if token_id > _MAX_ID else conn.execute(select(t).where(t.id == token_id)).first()
        )
        if row is None:
            raise NotFound(f"no token #{id_or_name}")
        return row
    rows = conn.execute(_valid(conn, now_us).where(t.name == id_or_name).order_by(t.id)).all()
    if not rows:
        raise NotFound(f"no valid token named {id_or_name!r}")
    lineages = {r.lineage_id if r.lineage_id is not None else r.id for r in rows}
    if len(lineages) > 1:
        ids = ", ".join(f"#{r.id}" for r in rows)
        raise Conflict(f"{len(rows)} valid tokens are named {id_or_name!r} ({ids}): give an id")
    return rows[-1]


def revoke_token(
    conn: Connection,
    id_or_name: str | int,
    *,
    actor: str,
    now_us: int,
    keep_previous: bool = False,
) -> dict[str, Any]:
    """Revoke a token (by id or unique name) at once, and the generations of its lineage
    before it that still work (``keep_previous``: those keep their grace period). Revoking
    one twice is a no-op that says so. The answer is the token, with ``also_revoked``: the
    ids of the earlier generations this revoked."""
    t = m.ApiToken
    row = find_token(conn, id_or_name, now_us)
    lineage = row.lineage_id if row.lineage_id is not None else row.id
    targets = [row]
    if not keep_previous:
        earlier = conn.execute(
            _valid(conn, now_us).where(or_(t.id == lineage, t.lineage_id == lineage), t.id < row.id)
        ).all()
        targets += list(earlier)
    also: list[int] = []
    for r in targets:
        if r.revoked_at is not None:
            continue
        conn.execute(update(t).where(t.id == r.id).values(revoked_at=now_us, name_held=None))
        detail: dict[str, Any] = {"kind": r.kind, "name": r.name}
        if r.id != row.id:
            also.append(r.id)
            detail["with"] = row.id  # an earlier generation, revoked with the one named
        audit.append(
            conn,
            now_us=now_us,
            actor=actor,
            action="token.revoke",
            subject=f"token:{r.id}",
            detail=detail,
        )
    fresh = conn.execute(select(t).where(t.id == row.id)).one()
    return token_doc(fresh, now_us) | {"also_revoked": also}


def rotate_token(
    conn: Connection,
    id_or_name: str | int,
    *,
    actor: str,
    now_us: int,
    grace_s: float = DEFAULT_GRACE_S,
    expires_in_s: float | None = None,
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A new token with the old one's kind, scope and name (and lifetime, unless
    ``expires_in_s``), in its lineage; the old one expires ``grace_s`` from now (sooner if it
    already would). An expired or revoked token is rotated too (it stays as it is): its
    replacement answers for the lineage's probe ids, so what a probe spooled under them can
    still be delivered. Returns (new token, its secret, old token)."""
    checked_grace(grace_s)
    old = find_token(conn, id_or_name, now_us)
    lineage = old.lineage_id if old.lineage_id is not None else old.id
    if expires_in_s is None and old.expires_at is not None:
        # the new token lives as long as the old one was given to
        expires_in_s = (as_micros(old.expires_at) - as_micros(old.created_at)) / 1_000_000
    new_id, secret = create_token(
        conn,
        kind=old.kind,
        tenant=old.tenant,
        deployment_id=old.deployment_id,
        name=old.name,
        now_us=now_us,
        actor=actor,
        expires_in_s=expires_in_s,
        lineage_id=lineage,
    )
    ends = now_us + int(grace_s * 1_000_000)
    current = as_micros(old.expires_at)
    if old.revoked_at is None and (current is None or ends < current):
        conn.execute(update(m.ApiToken).where(m.ApiToken.id == old.id).values(expires_at=ends))
    audit.append(
        conn,
        now_us=now_us,
        actor=actor,
        action="token.rotate",
        subject=f"token:{old.id}",
        detail={"new_token_id": new_id, "old_expires_at": iso(min(ends, current or ends))},
    )
    t = m.ApiToken
    rows = {r.id: r for r in conn.execute(select(t).where(t.id.in_([old.id, new_id])))}
    return token_doc(rows[new_id], now_us), secret, token_doc(rows[old.id], now_us)


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
            m.ApiToken.expires_at,
            m.ApiToken.lineage_id,
        ).where(m.ApiToken.token_hash == hash_token(secret))
    ).first()
    if row is None or row.revoked_at is not None:
        raise Unauthorized("unknown or revoked token")
    expires = as_micros(row.expires_at)
    if expires is not None and expires <= now_micros():
        raise Unauthorized(f"token {row.prefix}… expired at {iso(expires)}")
    # Who acted, in the audit log and on acks: the token's name when it has one.
    return Principal(
        row.id,
        row.kind,
        row.tenant,
        row.deployment_id,
        row.name or row.prefix,
        row.lineage_id,
        expires,
    )


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


def audit_person(conn: Connection, principal: Principal, *, session: str) -> None:
    """``person.use``: a signed-in person's first request of a sign-in session (one ID
    token) on a replica, naming them (subject, e-mail), their role and the session's end."""
    person = principal.person
    assert person is not None
    audit.append(
        conn,
        now_us=now_micros(),
        actor=principal.label,
        action="person.use",
        subject=f"person:{person.subject}",
        detail={
            "subject": person.subject,
            "email": person.email,
            "issuer": person.issuer,
            "role": principal.role,
            "session": session,
            "expires_at": iso(principal.expires_at_us) if principal.expires_at_us else None,
        },
    )


def audit_refusal(conn: Connection, refused: Forbidden, session: str) -> None:
    """``person.refused``: a person the identity provider signed in, whom no role lets in."""
    from collector.oidc import person_label

    d = refused.details if isinstance(refused.details, dict) else {}
    sub, email = str(d.get("subject")), d.get("email")
    audit.append(
        conn,
        now_us=now_micros(),
        actor=person_label(sub, email),
        action="person.refused",
        subject=f"person:{sub}",
        detail={"subject": sub, "email": email, "reason": refused.message, "session": session},
    )


def _expired(principal: Principal) -> bool:
    return principal.expires_at_us is not None and principal.expires_at_us <= now_micros()


class Authenticator:
    """Resolves bearer tokens, remembering valid ones for ``ttl_s`` seconds so a busy probe
    does not cost a database round trip per batch. Unknown tokens are never cached (a flood
    of guesses must not grow memory); a revoked token stops working within ``ttl_s`` (within
    ``ttl_s + grace_s`` when the database is unreachable and ``grace_s`` is set).

    Use is audited: the first use of a token in every ``use_audit_s`` writes a ``token.use``
    entry (a busy ingest token would otherwise flood the log). Failing to write it never
    fails the request."""

    def __init__(
        self,
        db: Database,
        ttl_s: float = 5.0,
        max_entries: int = 10_000,
        use_audit_s: float = 3600.0,
        grace_s: float = 0.0,
        oidc: OidcVerifier | None = None,
    ):
        self.db = db
        self.oidc = oidc
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.max_entries = max_entries
        self.use_audit_s = use_audit_s
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._audited: dict[int, float] = {}  # token id -> monotonic time of its last entry
        self._sessions: set[str] = set()  # sign-in sessions audited (collector.oidc)

    def close(self) -> None:
        """Close the identity provider's connections (the app's shutdown)."""
        if self.oidc is not None:
            self.oidc.close()

    def __call__(self, authorization: str | None) -> Principal:
        now = time.monotonic()
        hit = self._cache.get(authorization) if authorization else None
        if hit is not None and hit[0] > now:
            return hit[1]
        if authorization:
            scheme, _, secret = authorization.partition(" ")
            if scheme.lower() == "bearer" and looks_like_jwt(secret.strip()):
                return self._person(authorization, secret.strip(), now)
        try:
            with self.db.read() as conn:
                principal = authenticate(conn, authorization)
        except Unavailable:
            # ``grace_s`` (the ingest bus): a token confirmed less than that long ago stays
            # valid through a database outage; its revocation waits for the database.
            if hit is not None and now < hit[0] + self.grace_s and not _expired(hit[1]):
                return hit[1]
            raise
        assert authorization is not None  # authenticate() refused a missing header
        self._remember(authorization, principal, now)
        last = self._audited.get(principal.token_id)
        if last is None or now - last >= self.use_audit_s:
            self._audit_use(principal, now)
        return principal

    def _remember(self, authorization: str, principal: Principal, now: float) -> None:
        """Cache a valid principal for ``ttl_s``, never past its expiry (a token's or an ID
        token's)."""
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        until = now + self.ttl_s
        if principal.expires_at_us is not None:
            until = min(until, now + (principal.expires_at_us - now_micros()) / 1e6)
        self._cache[authorization] = (until, principal)

    def _person(self, authorization: str, token: str, now: float) -> Principal:
        """A signed-in person's ID token (:mod:`collector.oidc`): verified without the
        database, remembered until it expires (at most ``ttl_s``), and the first use of each
        sign-in session on this replica written to the audit log (``person.use``)."""
        if self.oidc is None:
            raise Unauthorized(
                "this collector accepts no sign-in tokens (KVWATCH_OIDC_ISSUER is not set); "
                "use a kvwatch token"
            )
        try:
            principal = self.oidc.verify(token)
        except Forbidden as exc:  # signed in, but no role: the refusal names the person
            refused = exc
            self._audit_session(token, lambda conn, s: audit_refusal(conn, refused, s))
            raise
        self._remember(authorization, principal, now)
        self._audit_session(token, lambda conn, s: audit_person(conn, principal, session=s))
        return principal

    def _audit_session(self, token: str, write: Callable[[Connection, str], None]) -> None:
        """``write`` the audit entry of a sign-in session (one ID token) on its first use on
        this replica; failing to write it never fails the request (as for tokens)."""
        session = token_digest(token)
        if session in self._sessions:
            return
        try:
            with self.db.write() as conn:
                write(conn, session)
        except Exception as exc:
            log.warning("sign-in not audited: %s", getattr(exc, "message", exc))
            return
        if len(self._sessions) >= self.max_entries:
            self._sessions.clear()
        self._sessions.add(session)

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


class TokenService:
    """The token operations the API and the CLI offer an admin, each in one transaction."""

    def __init__(self, db: Database):
        self.db = db

    def list(self) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return list_tokens(conn, now_micros())

    def create(
        self,
        *,
        kind: str,
        tenant: str | None,
        deployment_id: str | None,
        name: str | None,
        expires_in_s: float | None,
        actor: str,
    ) -> tuple[dict[str, Any], str]:
        now_us = now_micros()
        with self.db.write() as conn:
            token_id, secret = create_token(
                conn,
                kind=kind,
                tenant=tenant,
                deployment_id=deployment_id,
                name=name,
                now_us=now_us,
                actor=actor,
                expires_in_s=expires_in_s,
            )
            row = conn.execute(select(m.ApiToken).where(m.ApiToken.id == token_id)).one()
            return token_doc(row, now_us), secret

    def revoke(
        self, id_or_name: str | int, *, actor: str, keep_previous: bool = False
    ) -> dict[str, Any]:
        with self.db.write() as conn:
            return revoke_token(
                conn, id_or_name, actor=actor, now_us=now_micros(), keep_previous=keep_previous
            )

    def rotate(
        self,
        id_or_name: str | int,
        *,
        actor: str,
        grace_s: float = DEFAULT_GRACE_S,
        expires_in_s: float | None = None,
    ) -> tuple[dict[str, Any], str, dict[str, Any]]:
        with self.db.write() as conn:
            return rotate_token(
                conn,
                id_or_name,
                actor=actor,
                now_us=now_micros(),
                grace_s=grace_s,
                expires_in_s=expires_in_s,
            )
