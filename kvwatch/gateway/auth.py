"""Bearer keys -> tenants. Keys are compared by SHA-256 digest in constant time, and never
logged, recorded or echoed."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from kvwatch.gateway.errors import AuthenticationFailed


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the tenant, and the key it presented (to pass upstream).
    ``unverified``: no tenant keys are configured, so only the upstream can tell whether the
    key is real (a request it refuses with 401/403 is not recorded: no tenant is known)."""

    tenant: str
    key: str
    unverified: bool = False

    def __repr__(self) -> str:  # never the key, in a traceback or a log line
        return f"Caller(tenant={self.tenant!r})"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantKeys:
    """NAME -> KEY; with none configured, every key is its own tenant named ``key-`` plus the
    first 16 hex digits of its SHA-256 (refengine's rule, so both name a tenant alike)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._digests = [(name, _digest(key)) for name, key in keys.items()]

    @property
    def open(self) -> bool:
        return not self._digests

    def resolve(self, key: str) -> str | None:
        digest = _digest(key)
        if self.open:
            return f"key-{digest.hex()[:16]}"
        found: str | None = None
        # Every digest is compared, match or not: the time taken says nothing about which.
        for name, known in self._digests:
            if hmac.compare_digest(digest, known):
                found = name
        return found

    def authenticate(self, authorization: str | None) -> Caller:
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as `Authorization: Bearer KEY`."
            )
        tenant = self.resolve(key)
        if tenant is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return Caller(tenant, key, unverified=self.open)
