"""The gateway's settings: one class, every field an environment variable ``KVWATCH_<NAME>``.

``KVWATCH_COLLECTOR_URL``, ``KVWATCH_INGEST_TOKEN`` and ``KVWATCH_DEPLOYMENT_ID`` are the names
every producer shares (see :mod:`engine_probe.settings`); the gateway reads the deployment's
limits in force (GET /v1/limits) with them. Everything else is ``KVWATCH_GATEWAY_*``.

Maps (tenant keys, safe contexts) come from the environment as space-separated ``NAME=VALUE``
pairs (``KVWATCH_GATEWAY_TENANT_KEYS="acme=sk-1 globex=sk-2"``) or as a JSON object.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine_probe.events import MAX_TOKENS, is_valid_id

Tokenizer = Literal["bytes", "estimate"]


def parse_pairs(value: object, what: str) -> object:
    """``"A=1 B=2"`` (or a list of ``"A=1"``, or a JSON object) -> dict; other values pass."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            try:
                return json.loads(text)
            except ValueError:
                raise ValueError(f"{what}: not a JSON object") from None
        value = text.split()
    if isinstance(value, list | tuple):
        out: dict[str, str] = {}
        # A key may contain "=" (base64 padding): split tenant keys at the first "=". A safe
        # context is a number: split at the last, so a model id may contain "=".
        split = str.rpartition if what == "safe contexts" else str.partition
        for item in value:
            name, sep, rest = split(str(item), "=")
            if not sep or not name.strip() or not rest.strip():
                # Never echo the item: it may hold a key.
                raise ValueError(f"{what}: expected NAME=VALUE with a non-empty name and value")
            if name.strip() in out:
                raise ValueError(f"{what}: {name.strip()!r} is given twice")
            out[name.strip()] = rest.strip()
        return out
    return value


OnFailed = Literal["refuse", "warn"]
Salting = Literal["per-tenant", "off"]
#: the shortest salt secret taken (characters): 128 bits as hex
MIN_SALT_SECRET_CHARS = 32


class GatewaySettings(BaseSettings):
    """Settings of one gateway. Immutable once built; ``create_app(settings)`` takes it."""

    model_config = SettingsConfigDict(
        # hide_input_in_errors: a refused value may be a key or the salt secret
        env_prefix="KVWATCH_",
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,
    )

    gateway_upstream: str = Field(
        description="Root URL of the OpenAI-compatible upstream (a trailing /v1 is dropped): "
        "the gateway forwards /v1/... to ROOT/v1/... and counts prompts with ROOT/tokenize."
    )
    gateway_host: str = Field(default="127.0.0.1", description="Address the gateway binds.")
    gateway_port: int = Field(default=8780, ge=1, le=65535, description="Port it binds.")
    gateway_tenant_keys: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        repr=False,
        description="NAME -> bearer key of each tenant. Empty: every bearer key is accepted as "
        "its own tenant (key- plus 16 hex digits of its SHA-256) and passed to the upstream, "
        "which must then authenticate it.",
    )
    gateway_upstream_key: str | None = Field(
        default=None,
        repr=False,
        description="Bearer key sent upstream instead of the client's. Unset: the client's "
        "key passes through, so a per-tenant upstream still tells tenants apart.",
    )
    gateway_safe_contexts: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="MODEL -> safe context in tokens ('*' for every model). Prompts above it "
        "are refused before the upstream sees them. With the collector's limit in force "
        "(GET /v1/limits) too, the smaller of the two applies.",
    )
    gateway_on_failed_verification: OnFailed = Field(
        default="refuse",
        description="When a model's latest verification failed: 'refuse' prompts above the "
        "last value measured clean (every prompt, when none was) or only 'warn' (a response "
        "header and the log). Also what happens once the collector's limits could not be "
        "read for gateway_limits_keep_s: 'refuse' every prompt, or 'warn' and keep the last.",
    )
    gateway_limits_keep_s: float = Field(
        default=900.0,
        gt=0,
        le=7 * 86400,
        description="How long the last limits read from the collector stay in force while it "
        "cannot be read (and how long only the configured limits hold before the first "
        "read); past it, gateway_on_failed_verification decides.",
    )
    gateway_warn_ratio: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="A prompt at this share of its limit gets an X-Kvwatch-Warning header "
        "(the default pack's context_pressure warns at the same 80%).",
    )
    gateway_tokenize_endpoint: bool = Field(
        default=True,
        description="Count prompts with the upstream's POST /tokenize (vLLM, SGLang) when it "
        "has one.",
    )
    gateway_tokenizer: Tokenizer = Field(
        default="estimate",
        description="Without a tokenize endpoint: 'bytes' (one token per UTF-8 byte, chat as "
        "'role: content' lines: byte-level engines such as refengine) or 'estimate' (UTF-8 "
        "bytes of the prompt, of the messages' JSON for chat: an over-estimate).",
    )
    gateway_connect_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="Timeout of connecting to the upstream."
    )
    gateway_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        description="Longest wait for the upstream's next bytes (the answer's start, or the "
        "next chunk of a stream); past it the client gets a 504.",
    )
    gateway_tokenize_timeout_s: float = Field(
        default=10.0, gt=0, le=600, description="Timeout of one POST /tokenize to the upstream."
    )
    gateway_max_body_bytes: int = Field(
        default=64 << 20,
        ge=1024,
        description="Largest client request body, in bytes; over it: 413.",
    )
    gateway_verification_refresh_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="How often the collector's limits in force (GET /v1/limits) are read again.",
    )
    gateway_tag_tenants: bool = Field(
        default=True,
        description="Tag each forwarded completion with its tenant and route for the probe "
        "inside the engine: vllm_xargs kvwatch_tenant and kvwatch_route (vLLM; the client's "
        "own values of those two are replaced) and the X-SMG-Routing-Key header (SGLang's "
        "routing_key). Off for an upstream that refuses unknown fields (a hosted API).",
    )
    gateway_salt_prefix_cache: Salting = Field(
        default="per-tenant",
        description="'per-tenant': set each forwarded completion's cache_salt to the tenant's "
        "salt (HMAC-SHA256 of the tenant under KVWATCH_GATEWAY_SALT_SECRET, 32 hex digits), "
        "replacing any the client sent, so no tenant is served another's cached prefix "
        "(vLLM, SGLang). 'off': the body's cache_salt passes unchanged.",
    )
    gateway_salt_secret: SecretStr | None = Field(
        default=None,
        description="The secret the per-tenant salts are derived from (at least 32 "
        "characters; every replica of one gateway needs the same). A new one gives every "
        "tenant a new salt: a fresh prefix cache. Unset: one is generated at start, and the "
        "salts change at every restart.",
    )
    collector_url: str | None = Field(
        default=None,
        description="The collector the gateway reads the deployment's limits in force from "
        "(GET /v1/limits) and sends its records to.",
    )
    ingest_token: str | None = Field(
        default=None, repr=False, description="The ingest token it reads and sends with."
    )
    deployment_id: str | None = Field(
        default=None,
        description="The deployment whose verified safe contexts the collector holds (and the "
        "one records are filed under).",
    )

    @field_validator("gateway_tenant_keys", mode="before")
    @classmethod
    def _keys_from_text(cls, value: object) -> object:
        return parse_pairs(value, "tenant keys")

    @field_validator("gateway_safe_contexts", mode="before")
    @classmethod
    def _contexts_from_text(cls, value: object) -> object:
        return parse_pairs(value, "safe contexts")

    @field_validator("collector_url", "ingest_token", "deployment_id", "gateway_upstream_key")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value if value is None or value.strip() else None

    @field_validator("gateway_upstream", "collector_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url = value.strip().rstrip("/")
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in ("http", "https") or not rest or rest[0] == "/":
            raise ValueError(f"{value!r} must be an http:// or https:// URL")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @field_validator("gateway_salt_secret", mode="before")
    @classmethod
    def _check_secret(cls, value: object) -> object:
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(text, str):
            text = text.strip()
            if not text:
                return None
            # Never echo the value: it is the secret.
            if len(text) < MIN_SALT_SECRET_CHARS:
                raise ValueError(
                    f"the salt secret must be at least {MIN_SALT_SECRET_CHARS} characters "
                    "(e.g. `openssl rand -hex 32`)"
                )
        return text

    @field_validator("gateway_tenant_keys")
    @classmethod
    def _check_keys(cls, value: dict[str, str]) -> dict[str, str]:
        seen: set[str] = set()
        for name, key in value.items():
            if not is_valid_id(name):
                raise ValueError(
                    f"tenant name {name!r} is not a valid id (letters, digits and ._:/@+=-, "
                    "starting with a letter or digit)"
                )
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"tenant {name!r}: the key is empty or holds whitespace")
            if key in seen:
                raise ValueError(f"tenant {name!r} reuses another tenant's key")
            seen.add(key)
        return value

    @field_validator("gateway_safe_contexts")
    @classmethod
    def _check_contexts(cls, value: dict[str, int]) -> dict[str, int]:
        for model, n in value.items():
            if not 1 <= n <= MAX_TOKENS:
                raise ValueError(f"safe context of {model!r} must be a positive token count")
        return value

    @field_validator("deployment_id")
    @classmethod
    def _check_deployment(cls, value: str | None) -> str | None:
        if value is not None and not is_valid_id(value):
            raise ValueError(f"deployment id {value!r} is not a valid id")
        return value

    @model_validator(mode="after")
    def _check_relations(self) -> Self:
        if self.gateway_upstream_key is not None and not self.gateway_tenant_keys:
            raise ValueError(
                "an upstream key needs tenant keys: without them every bearer key would be "
                "accepted and spend the upstream key"
            )
        return self

    @property
    def reads_verifications(self) -> bool:
        """Whether the collector's verifications feed the guard."""
        return bool(self.collector_url and self.ingest_token and self.deployment_id)

    def describe(self) -> dict[str, Any]:
        """What the gateway runs with, for a start-up line: no keys, no tokens."""
        return {
            "upstream": self.gateway_upstream,
            "tenants": sorted(self.gateway_tenant_keys) or "one per bearer key",
            "upstream_key": "set" if self.gateway_upstream_key else "client keys pass through",
            "safe_contexts": dict(self.gateway_safe_contexts),
            "limits_in_force": (
                f"{self.collector_url}/v1/limits deployment {self.deployment_id}"
                if self.reads_verifications
                else "off"
            ),
            "on_failed_verification": self.gateway_on_failed_verification,
            "counting": ("tokenize endpoint, else " if self.gateway_tokenize_endpoint else "")
            + self.gateway_tokenizer,
            "tenant_tags": "on" if self.gateway_tag_tenants else "off",
            "prefix_cache_salt": "off"
            if self.gateway_salt_prefix_cache == "off"
            else "per-tenant (secret "
            + ("set" if self.gateway_salt_secret else "generated at start")
            + ")",
        }
