"""Tenants: who a ``/v1`` call is, from its ``Authorization: Bearer KEY`` (a 401 in OpenAI's
shape for a missing or unknown key). The key itself goes no further than this module."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

from fastapi import Request

from refengine.server.errors import APIError


class Tenants:
    """``tenant_keys``: NAME -> KEY, only those keys accepted and the tenant is NAME; ``None``
    accepts every key as its own tenant, ``key-`` plus the first 16 hex digits of its SHA-256
    (an empty dict accepts none). Raises ``ValueError`` for an empty tenant name or key, or a
    key shared by two tenants, when built."""

    def __init__(self, tenant_keys: Mapping[str, str] | None) -> None:
        self._resolve = _resolver(tenant_keys)

    def of(self, request: Request) -> str:
        """The tenant of ``request``."""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        challenge = {"WWW-Authenticate": "Bearer"}
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
                code="invalid_api_key",
                headers=challenge,
            )
        tenant = self._resolve(key)
        if tenant is None:
            raise APIError(
                401, "Incorrect API key provided.", code="invalid_api_key", headers=challenge
            )
        return tenant


def _resolver(tenant_keys: Mapping[str, str] | None) -> Callable[[str], str | None]:
    """KEY -> tenant name, or None for an unknown key."""

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    if tenant_keys is None:
        return lambda key: f"key-{digest(key)[:16]}"
    by_digest: dict[str, str] = {}
    for name, key in tenant_keys.items():
        if not isinstance(name, str) or not name:
            raise ValueError("tenant names must be non-empty strings")
        if not isinstance(key, str) or not key:
            raise ValueError(f"tenant {name!r} has an empty key")
        d = digest(key)
        if d in by_digest:
            raise ValueError(f"tenants {by_digest[d]!r} and {name!r} share one key")
        by_digest[d] = name
    # Looked up by digest: comparing the presented key against each secret byte by byte
    # would leak timing.
    return lambda key: by_digest.get(digest(key))
