"""Tenant isolation the gateway adds to every completion it forwards.

The gateway knows each request's tenant from its key; the engine behind it does not. So,
per request, before the body goes upstream:

* **tags** (``tag_tenants``): the tenant and route for the probe inside the engine. vLLM's
  probe reads ``vllm_xargs.kvwatch_tenant`` and ``vllm_xargs.kvwatch_route``
  (``SamplingParams.extra_args``); the gateway sets both, keeping any other ``vllm_xargs``
  the client sent, and overriding the client's own values of those two, so that no tenant is
  recorded as another. SGLang's OpenAI server ignores ``vllm_xargs`` (its request models drop
  unknown fields) and takes a request's ``routing_key`` from the ``X-SMG-Routing-Key``
  header, which SGLang's probe reads as the tenant (``default_tenant_of``): the gateway sends
  that header too (it never forwards a client's headers, so no client can set it).
* **a per-tenant prefix-cache salt** (``salting == "per-tenant"``): ``cache_salt`` (vLLM
  and SGLang both key their prefix caches by it), set to
  ``HMAC-SHA256(secret, "kvwatch-cache-salt/v1" NUL tenant)`` as 32 hex digits (128 bits),
  replacing whatever the client sent: a tenant cannot borrow another's salt (not even by
  guessing it: without the secret it cannot be computed from the tenant's name), so no
  tenant's request is served another tenant's cached KV.

Without tags (``--no-tag-tenants``), a client's own tenant tags are taken out instead: its
``vllm_xargs.kvwatch_tenant`` and ``kvwatch_route`` and SGLang's ``extra_key`` (which
SGLang's probe reads as the tenant when no routing key is set). The engine then records the
request under no tenant of the client's choosing, never as another tenant's.

Nothing else in the body changes. Salts are never verified by anyone: a new secret gives
every tenant a new salt, so rotating it simply starts every tenant's cache afresh (the old
blocks are never matched again and age out of the engine's cache).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any, Final

# the vLLM extra args the probe inside vLLM reads (the package imports neither vLLM nor torch)
from engine_probe.adapters.vllm import ROUTE_KEY as VLLM_ROUTE_KEY
from engine_probe.adapters.vllm import TENANT_KEY as VLLM_TENANT_KEY
from kvwatch.gateway.errors import InvalidRequest
from kvwatch.gateway.settings import Salting

#: the header SGLang's OpenAI server turns into the request's routing_key
SGLANG_ROUTING_HEADER: Final = "X-SMG-Routing-Key"
#: what the HMAC signs before the tenant: a salt of this gateway's, version 1
SALT_CONTEXT: Final = b"kvwatch-cache-salt/v1\x00"
#: hex digits kept of the HMAC: 128 bits (vLLM takes salts of up to 128 characters)
SALT_HEX_DIGITS: Final = 32


def derive_salt(secret: bytes, tenant: str) -> str:
    """The prefix-cache salt of ``tenant`` under ``secret``."""
    mac = hmac.new(secret, SALT_CONTEXT + tenant.encode(), hashlib.sha256)
    return mac.hexdigest()[:SALT_HEX_DIGITS]


@dataclass(frozen=True, slots=True)
class Injection:
    """What goes upstream for one request: the body's new fields, the extra headers, and
    the salt (kept out of any error body relayed to the client)."""

    fields: dict[str, Any]
    headers: dict[str, str]
    salt: str | None
    drop: frozenset[str] = frozenset()  # the client's fields taken out

    def applied(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as it goes upstream."""
        kept = {k: v for k, v in body.items() if k not in self.drop} if self.drop else body
        return kept | self.fields


class Isolation:
    """The per-request tags and salt. ``secret`` None with per-tenant salting: a random one
    is made for this process (``generated`` says so), and every salt changes at restart."""

    def __init__(self, *, salting: Salting, tag_tenants: bool, secret: str | None) -> None:
        self.salting = salting
        self.tag_tenants = tag_tenants
        self.generated = salting == "per-tenant" and secret is None
        self._secret = (secret or secrets.token_hex(32)).encode()

    def __repr__(self) -> str:  # never the secret
        return f"Isolation(salting={self.salting!r}, tag_tenants={self.tag_tenants!r})"

    def salt(self, tenant: str) -> str:
        return derive_salt(self._secret, tenant)

    def for_request(self, body: dict[str, Any], tenant: str, route: str) -> Injection:
        """The fields and headers to add to ``body`` (raises :class:`InvalidRequest` for a
        client's ``vllm_xargs`` that is not a JSON object, which no engine would take)."""
        fields: dict[str, Any] = {}
        headers: dict[str, str] = {}
        salt: str | None = None
        if self.tag_tenants:
            xargs = body.get("vllm_xargs")
            if xargs is not None and not isinstance(xargs, dict):
                raise InvalidRequest("'vllm_xargs' must be a JSON object.", param="vllm_xargs")
            fields["vllm_xargs"] = {
                **(xargs or {}),
                VLLM_TENANT_KEY: tenant,
                VLLM_ROUTE_KEY: route,
            }
            headers[SGLANG_ROUTING_HEADER] = tenant
        drop: frozenset[str] = frozenset()
        if not self.tag_tenants:
            xargs = body.get("vllm_xargs")
            if isinstance(xargs, dict) and ({VLLM_TENANT_KEY, VLLM_ROUTE_KEY} & xargs.keys()):
                fields["vllm_xargs"] = {
                    k: v for k, v in xargs.items() if k not in (VLLM_TENANT_KEY, VLLM_ROUTE_KEY)
                }
            if "extra_key" in body:
                drop = frozenset({"extra_key"})
        if self.salting == "per-tenant":
            salt = self.salt(tenant)
            fields["cache_salt"] = salt
        return Injection(fields, headers, salt, drop)
