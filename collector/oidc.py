"""People signed in through OpenID Connect: their ID tokens verified, their roles mapped.

The dashboard signs a person in at the organisation's identity provider (``st.login``) and
forwards the person's **ID token** as the bearer token of every API call. The collector
verifies it here, as Kubernetes' API server verifies the ID tokens ``kubectl`` forwards:

* the signature, with a key the issuer publishes (``jwks_uri`` of its discovery document),
  by an asymmetric algorithm only (``alg: none`` and HMAC are refused: an HMAC "signed" with
  a public key proves nothing);
* ``iss`` is the configured issuer, ``aud`` names the configured audience (the dashboard's
  client id), ``exp`` is in the future and ``nbf``/``iat`` not, each within the allowed clock
  skew; ``sub`` is present.

Why the ID token and not the access token: an ID token is a JWT signed by the issuer at
every OIDC provider, with the dashboard's client id as audience; access tokens are opaque at
several (oidc-provider's default, Okta's org server, Google), and where they are JWTs their
audience differs per provider. Minting a kvwatch token after checking the ID token would add
a signing key and an exchange to guard, and a session outliving the person's ID token.

Keys are cached (``jwks_cache_s``). A token whose ``kid`` is unknown makes the verifier read
the keys again, at most once per ``jwks_refetch_s`` (a flood of made-up kids must not turn
into a flood of requests to the issuer): that is how a rotated key is picked up.

Roles come from one claim (``roles_claim``, a dotted path for nested claims such as
Keycloak's ``realm_access.roles``) through a :class:`RoleMap`. A person is given the
strongest role mapped (``admin`` > ``operator`` > ``auditor``); without one of those, one
``tenant:<name>`` role, with exactly a tenant-scoped read token's view. No mapped role, or
roles for two tenants and nothing above them, is refused (403) with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml
from joserfc import jwt
from joserfc.errors import (
    BadSignatureError,
    DecodeError,
    ExpiredTokenError,
    InvalidClaimError,
    InvalidKeyIdError,
    JoseError,
    MissingClaimError,
)
from joserfc.jwk import KeySet
from joserfc.jws import JWSRegistry, extract_compact

from collector.errors import Forbidden, InvalidInput, Unauthorized, Unavailable
from collector.settings import secure_url
from collector.timefmt import iso
from collector.tokens import Grant, Person, Principal, TokenKind

if TYPE_CHECKING:
    from collector.settings import Settings

# asymmetric signatures only: what OIDC providers sign ID tokens with
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512")
_REGISTRY = JWSRegistry(algorithms=list(ALGORITHMS))
_MAX_TOKEN_BYTES = 16 * 1024
_MAX_SUBJECT, _MAX_EMAIL = 128, 110  # a person's label fits the audit log's 256 characters
_MAX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z: past it, no time is written

log = logging.getLogger("kvwatch.oidc")

UNMAPPED_PREFIX = "kvwatch:"  # without a role map, the claim values that name roles
_RANK: dict[str, int] = {"admin": 3, "operator": 2, "auditor": 1}
_ROLE: dict[str, tuple[TokenKind, frozenset[Grant]]] = {
    "admin": ("admin", frozenset()),
    "operator": ("read", frozenset({"respond", "report"})),
    "auditor": ("read", frozenset({"report"})),
}


def parse_role(text: str) -> str:
    """``admin``, ``operator``, ``auditor`` or ``tenant:<name>``; else :class:`ValueError`."""
    text = text.strip()
    if text in _RANK:
        return text
    kind, sep, tenant = text.partition(":")
    if kind == "tenant" and sep and tenant.strip():
        return f"tenant:{tenant.strip()}"
    raise ValueError(f"{text!r} is not a role (admin, operator, auditor or tenant:<name>)")


@dataclass(frozen=True, slots=True)
class RoleMap:
    """Claim values to kvwatch roles. Invariant: every value of ``roles`` passed
    :func:`parse_role`. Empty: a claim value ``kvwatch:<role>`` is that role (the prefix, so
    that a group merely named ``admin`` elsewhere grants nothing here)."""

    roles: Mapping[str, tuple[str, ...]]

    @classmethod
    def load(cls, path: Path | None) -> RoleMap:
        """Read the YAML file ``roles: {claim value: role or [roles]}``; a bad file raises
        :class:`InvalidInput` naming the file and the entry."""
        if path is None:
            return cls({})
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InvalidInput(f"{path}: cannot read the role map: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise InvalidInput(f"{path}: not YAML: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != {"roles"} or not isinstance(doc["roles"], dict):
            raise InvalidInput(f"{path}: a role map is one mapping, roles: {{claim value: role}}")
        roles: dict[str, tuple[str, ...]] = {}
        for value, given in doc["roles"].items():
            items = given if isinstance(given, list) else [given]
            if not items or not all(isinstance(i, str) for i in items):
                raise InvalidInput(f"{path}: roles.{value}: give a role or a list of roles")
            try:
                roles[str(value)] = tuple(parse_role(i) for i in items)
            except ValueError as exc:
                raise InvalidInput(f"{path}: roles.{value}: {exc}") from None
        return cls(roles)

    def roles_for(self, values: list[str]) -> list[str]:
        if not self.roles:
            out = []
            for v in values:
                if not v.startswith(UNMAPPED_PREFIX):
                    continue  # a group named "admin" elsewhere must not be kvwatch's admin
                try:
                    out.append(parse_role(v.removeprefix(UNMAPPED_PREFIX)))
                except ValueError:
                    continue
            return out
        return [r for v in values for r in self.roles.get(v, ())]


def _claim(claims: Mapping[str, Any], path: str) -> Any:
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def person_label(subject: str, email: str | None) -> str:
    """How the audit log, acks and the dashboard name a person (within the audit log's 256
    characters: e-mail and subject are cut to fit)."""
    return f"{email} (oidc sub {subject})" if email else f"oidc sub {subject}"


def principal_for(
    claims: Mapping[str, Any], *, issuer: str, roles_claim: str, role_map: RoleMap
) -> Principal:
    """The principal a verified ID token's claims make: pure, so every rule of the mapping
    is testable without a provider."""
    sub = str(claims["sub"])[:_MAX_SUBJECT]
    email = claims.get("email")
    # an address the issuer has not verified may be anyone's: the subject names them alone
    if not isinstance(email, str) or claims.get("email_verified") is False:
        email = None
    email = email[:_MAX_EMAIL] if email else None
    name = claims.get("name") if isinstance(claims.get("name"), str) else None
    person = Person(subject=sub, email=email, name=name and name[:_MAX_EMAIL], issuer=issuer)
    label = person_label(sub, email)
    raw = _claim(claims, roles_claim)
    values = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    values = [v for v in values if isinstance(v, str)]
    roles = role_map.roles_for(values)
    ranked = [r for r in roles if r in _RANK]
    if ranked:
        role = max(ranked, key=_RANK.__getitem__)
        kind, grants = _ROLE[role]
        return Principal(0, kind, None, None, label, role=role, grants=grants, person=person)
    tenants = sorted({r.split(":", 1)[1] for r in roles})
    who = email or sub
    if not tenants:
        shown = ", ".join(values[:10]) if values else "none"
        raise Forbidden(
            f"{who} has no kvwatch role: the {roles_claim!r} claim holds {shown}, and none of "
            "it maps to admin, operator, auditor or tenant:<name> (ask an administrator to "
            "add your group to the role map)",
            {"reason": "no_role", "claim": roles_claim, "subject": sub, "email": email},
        )
    if len(tenants) > 1:
        raise Forbidden(
            f"{who} maps to more than one tenant ({', '.join(tenants)}) and no wider role: "
            "kvwatch shows a person one tenant's data, so the role map must give one",
            {"reason": "several_tenants", "tenants": tenants, "subject": sub, "email": email},
        )
    return Principal(0, "read", tenants[0], None, label, role=f"tenant:{tenants[0]}", person=person)


class _IssuerKeys:
    """The issuer's published keys, read through its discovery document.

    Invariants: ``keys`` were read at ``read_at`` (monotonic) from ``jwks_uri``; at most one
    thread reads from the issuer at a time, and no other waits for it (they use the keys at
    hand, or are answered 503 at once where there are none yet), so a slow or unreachable
    issuer holds one worker thread, never the collector's pool; a failed read is not tried
    again for ``backoff_s``; keys past ``cache_s`` keep being used while the issuer cannot
    be read; a read for an unknown kid happens at most once per ``refetch_s``."""

    def __init__(self, issuer: str, client: httpx.Client, cache_s: float, refetch_s: float) -> None:
        self.issuer = issuer
        self.client = client
        self.cache_s = cache_s
        self.refetch_s = refetch_s
        self.backoff_s = max(1.0, min(refetch_s, 10.0))
        self.jwks_uri: str | None = None
        self.keys: KeySet | None = None
        self.read_at = float("-inf")
        self.failed_at = float("-inf")
        self.failure = ""
        self._reading = threading.Lock()

    def current(self) -> KeySet:
        now = time.monotonic()
        if self.keys is not None and now - self.read_at < self.cache_s:
            return self.keys
        return self._read(now)

    def after_unknown_kid(self) -> KeySet | None:
        """The keys read again, for a kid the ones at hand lack; None where they were read
        less than ``refetch_s`` ago (a flood of made-up kids must not become a flood of
        requests to the issuer)."""
        now = time.monotonic()
        if now - self.read_at < self.refetch_s:
            return None
        before = self.read_at
        keys = self._read(now)
        return keys if self.read_at != before else None

    def _read(self, now: float) -> KeySet:
        if now - self.failed_at < self.backoff_s:
            return self._fallback(self.failure)
        if not self._reading.acquire(blocking=False):
            return self._fallback("the issuer's keys are being read; try again in a moment")
        try:
            self._fetch()
        except Unavailable as exc:
            self.failed_at, self.failure = time.monotonic(), exc.message
            if self.keys is not None:
                log.warning("keeping the issuer's keys read before: %s", exc.message)
            return self._fallback(exc.message)
        finally:
            self._reading.release()
        assert self.keys is not None
        return self.keys

    def _fallback(self, why: str) -> KeySet:
        if self.keys is None:
            raise Unavailable(why)
        return self.keys

    def _fetch(self) -> None:
        if self.jwks_uri is None:
            url = self.issuer.rstrip("/") + "/.well-known/openid-configuration"
            meta = _get_json(self.client, url, "the issuer's discovery document")
            if not isinstance(meta, dict) or not isinstance(meta.get("jwks_uri"), str):
                raise Unavailable(f"the discovery document at {url} names no jwks_uri")
            if meta.get("issuer") != self.issuer:
                raise Unavailable(
                    f"the discovery document at {url} names issuer {meta.get('issuer')!r}, "
                    f"not {self.issuer!r}"
                )
            jwks_uri = str(meta["jwks_uri"])
            if not secure_url(jwks_uri):
                raise Unavailable(
                    f"the discovery document at {url} names keys at {jwks_uri!r}: not https "
                    "(nor loopback)"
                )
            self.jwks_uri = jwks_uri
        doc = _get_json(self.client, self.jwks_uri, "the issuer's keys")
        try:
            keys = KeySet.import_key_set(doc)
        except (JoseError, ValueError, TypeError, KeyError) as exc:
            msg = f"the issuer's keys at {self.jwks_uri} are not a JWK set: {exc}"
            raise Unavailable(msg) from None
        self.keys, self.read_at = keys, time.monotonic()


def _get_json(client: httpx.Client, url: str, what: str) -> Any:
    try:
        r = client.get(url)
        r.raise_for_status()
        return r.json()
    except httpx.HTTPStatusError as exc:
        raise Unavailable(f"{what} ({url}) answered HTTP {exc.response.status_code}") from None
    except httpx.HTTPError as exc:
        raise Unavailable(f"cannot read {what} ({url}): {exc}") from None
    except ValueError:
        raise Unavailable(f"{what} ({url}) is not JSON") from None


class OidcVerifier:
    """Verifies ID tokens of one issuer and maps them to principals. Thread-safe: the
    authenticator calls it from worker threads. Discovery happens on first use, so a
    collector starts while its identity provider is down (its machine tokens keep working)."""

    def __init__(
        self,
        *,
        issuer: str,
        audience: str,
        client_id: str | None = None,
        roles_claim: str = "groups",
        role_map: RoleMap | None = None,
        leeway_s: float = 60.0,
        jwks_cache_s: float = 3600.0,
        jwks_refetch_s: float = 30.0,
        http_timeout_s: float = 10.0,
    ):
        self.issuer = issuer  # exactly: iss is compared as a string (Auth0's ends in "/")
        self.audience = audience
        self.client_id = client_id or audience  # whom the tokens' azp must name
        self.roles_claim = roles_claim
        self.role_map = role_map or RoleMap({})
        self.leeway_s = int(leeway_s)
        self._client = httpx.Client(timeout=http_timeout_s, follow_redirects=False)
        self._keys = _IssuerKeys(issuer, self._client, jwks_cache_s, jwks_refetch_s)

    def close(self) -> None:
        self._client.close()

    def verify(self, token: str) -> Principal:
        """The principal of a valid ID token; :class:`Unauthorized` naming what is wrong,
        :class:`Forbidden` for a valid token of a person without a role."""
        if len(token) > _MAX_TOKEN_BYTES:
            raise Unauthorized("the sign-in token is too large", {"reason": "malformed"})
        _check_shape(token)  # before anything reaches the issuer
        try:
            try:
                decoded = jwt.decode(token, self._keys.current(), registry=_REGISTRY)
            except InvalidKeyIdError:
                fresh = self._keys.after_unknown_kid()
                if fresh is None:
                    raise
                decoded = jwt.decode(token, fresh, registry=_REGISTRY)
        except InvalidKeyIdError:
            raise Unauthorized(
                "the sign-in token is signed with a key the issuer does not publish "
                f"(kid {_kid(token)!r})",
                {"reason": "unknown_key"},
            ) from None
        except BadSignatureError:
            raise Unauthorized(
                "the sign-in token's signature does not verify", {"reason": "bad_signature"}
            ) from None
        except (DecodeError, ValueError, TypeError) as exc:
            raise Unauthorized(
                f"the sign-in token is not a signed JWT: {exc}", {"reason": "malformed"}
            ) from None
        except JoseError as exc:
            # alg none, HS256 and the like: not an algorithm an issuer signs ID tokens with
            raise Unauthorized(
                f"the sign-in token is refused: {exc.description or exc.error} (accepted "
                f"algorithms: {', '.join(ALGORITHMS)})",
                {"reason": "algorithm"},
            ) from None
        claims = decoded.claims
        self._check_claims(claims)
        principal = principal_for(
            claims, issuer=self.issuer, roles_claim=self.roles_claim, role_map=self.role_map
        )
        return _with_expiry(principal, claims["exp"])

    def _check_claims(self, claims: dict[str, Any]) -> None:
        """iss, sub, aud (and azp), exp, nbf and iat, as OIDC Core 3.1.3.7 asks of a
        client: a 401 naming the first that is wrong."""
        exp = claims.get("exp")
        if not isinstance(exp, int | float) or isinstance(exp, bool) or not 0 < exp < _MAX_TIME:
            raise Unauthorized("the sign-in token has no usable exp", {"reason": "missing_claim"})
        registry = jwt.JWTClaimsRegistry(
            leeway=self.leeway_s,
            iss={"essential": True, "value": self.issuer},
            sub={"essential": True},
        )
        try:
            registry.validate(claims)
        except ExpiredTokenError:
            raise Unauthorized(
                f"the sign-in token expired at {_when(exp)}: sign in again",
                {"reason": "expired"},
            ) from None
        except MissingClaimError as exc:
            raise Unauthorized(
                f"the sign-in token has no {exc.claim!r} claim", {"reason": "missing_claim"}
            ) from None
        except InvalidClaimError as exc:
            if exc.claim == "iss":
                raise Unauthorized(
                    f"the sign-in token was issued by {claims.get('iss')!r}; this collector "
                    f"trusts {self.issuer!r}",
                    {"reason": "issuer"},
                ) from None
            if exc.claim in ("nbf", "iat"):
                raise Unauthorized(
                    f"the sign-in token is not valid yet (its {exc.claim} is ahead of this "
                    "clock by more than the allowed skew)",
                    {"reason": "invalid_claim"},
                ) from None
            raise Unauthorized(
                f"the sign-in token's {exc.claim!r} claim is not valid",
                {"reason": "invalid_claim"},
            ) from None
        except JoseError as exc:  # any other claim joserfc refuses
            raise Unauthorized(
                f"the sign-in token is refused: {exc.description or exc.error}",
                {"reason": "invalid_claim"},
            ) from None
        # the skew bounds a token from a clock ahead of ours; an expiry stands as the issuer
        # set it, so a session ends when its ID token does
        if exp <= time.time():
            raise Unauthorized(
                f"the sign-in token expired at {_when(exp)}: sign in again",
                {"reason": "expired"},
            )
        aud = claims.get("aud")
        auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if self.audience not in auds:
            raise Unauthorized(
                f"the sign-in token is for audience {aud!r}; this collector accepts "
                f"{self.audience!r}",
                {"reason": "audience"},
            )
        azp = claims.get("azp")
        if (azp is not None and azp != self.client_id) or (len(auds) > 1 and azp is None):
            raise Unauthorized(
                f"the sign-in token was issued to client {azp!r}, not {self.client_id!r} (azp)",
                {"reason": "audience"},
            )
        if "events" in claims:  # a back-channel logout token names the client too
            raise Unauthorized("a logout token is not an ID token", {"reason": "not_an_id_token"})


def _with_expiry(p: Principal, exp: Any) -> Principal:
    if not isinstance(exp, int | float):
        return p
    return Principal(
        p.token_id,
        p.kind,
        p.tenant,
        p.deployment_id,
        p.label,
        None,
        int(exp * 1_000_000),
        role=p.role,
        grants=p.grants,
        person=p.person,
    )


def _check_shape(token: str) -> None:
    """A compact JWS of an accepted algorithm, or a 401 saying what it is not."""
    try:
        header = extract_compact(token.encode()).protected
    except (JoseError, ValueError, TypeError) as exc:
        raise Unauthorized(
            f"the sign-in token is not a signed JWT: {exc}", {"reason": "malformed"}
        ) from None
    alg = header.get("alg")
    if alg not in ALGORITHMS:
        raise Unauthorized(
            f"the sign-in token is signed with {alg!r}, not an accepted algorithm "
            f"(accepted algorithms: {', '.join(ALGORITHMS)})",
            {"reason": "algorithm"},
        )
    if header.get("typ") in ("logout+jwt", "at+jwt"):
        raise Unauthorized(
            f"a {header['typ']} token is not an ID token", {"reason": "not_an_id_token"}
        )


def _kid(token: str) -> str | None:
    try:
        return extract_compact(token.encode()).protected.get("kid")
    except (JoseError, ValueError, TypeError):
        return None


def _when(exp: Any) -> str:
    return iso(int(exp * 1_000_000)) if isinstance(exp, int | float) else "an unknown time"


def build_verifier(settings: Settings) -> OidcVerifier | None:
    """The verifier the settings describe (``KVWATCH_OIDC_*``), or None where no issuer is
    set. A bad role map raises :class:`CollectorError` at start, not at a person's first
    request."""
    if settings.oidc_issuer is None:
        return None
    audience = settings.oidc_audience or settings.oidc_client_id
    assert audience is not None  # Settings refuses an issuer without one
    return OidcVerifier(
        issuer=settings.oidc_issuer,
        audience=audience,
        client_id=settings.oidc_client_id,
        roles_claim=settings.oidc_roles_claim,
        role_map=RoleMap.load(settings.oidc_role_map),
        leeway_s=settings.oidc_clock_skew_s,
        jwks_cache_s=settings.oidc_jwks_cache_s,
        jwks_refetch_s=settings.oidc_jwks_refetch_s,
        http_timeout_s=settings.oidc_http_timeout_s,
    )
