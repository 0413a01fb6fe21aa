"""``kvwatch gateway``: the guarding OpenAI-compatible proxy (``kvwatch.gateway``)."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvwatch.cli_common import err, probe_settings_or_exit, stop_cleanly_on_sigterm

if TYPE_CHECKING:
    from kvwatch.gateway import GatewaySettings


class Tokenizer(StrEnum):
    bytes = "bytes"
    estimate = "estimate"


class SaltPrefixCache(StrEnum):
    per_tenant = "per-tenant"
    off = "off"


class OnFailedVerification(StrEnum):
    refuse = "refuse"
    warn = "warn"


def _gateway_settings(overrides: dict[str, Any]) -> GatewaySettings:
    """The environment's settings with the given options on top; a bad one is named (by its
    environment variable) and exits 2. Values are never echoed: they may hold keys."""
    from pydantic import ValidationError

    from kvwatch.gateway import GatewaySettings

    try:
        return GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for e in exc.errors():
            field = str(e["loc"][0]) if e["loc"] else ""
            name = f"KVWATCH_{field.upper()}" if field else "settings"
            msg = "missing (give --upstream)" if e["type"] == "missing" else e["msg"]
            err.print(f"[red]error:[/] {name}: {msg}")
        raise typer.Exit(2) from None


def gateway(
    upstream: Annotated[
        str | None,
        typer.Option(
            help="Root URL of the OpenAI-compatible upstream (a trailing /v1 is fine) "
            "[KVWATCH_GATEWAY_UPSTREAM]."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address [KVWATCH_GATEWAY_HOST].")] = None,
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Port [KVWATCH_GATEWAY_PORT; 8780].")
    ] = None,
    tenant_key: Annotated[
        list[str] | None,
        typer.Option(
            "--tenant-key",
            metavar="NAME=KEY",
            help="A tenant and its bearer key (repeatable) [KVWATCH_GATEWAY_TENANT_KEYS, "
            "space-separated]. Without: every key is its own tenant and passes upstream.",
        ),
    ] = None,
    upstream_key: Annotated[
        str | None,
        typer.Option(
            help="Send this key upstream instead of the client's [KVWATCH_GATEWAY_UPSTREAM_KEY; "
            "prefer the variable: options show in the process list]."
        ),
    ] = None,
    safe_context: Annotated[
        list[str] | None,
        typer.Option(
            "--safe-context",
            metavar="MODEL=N",
            help="Refuse prompts over N tokens for MODEL ('*': every model; repeatable) "
            "[KVWATCH_GATEWAY_SAFE_CONTEXTS].",
        ),
    ] = None,
    deployment: Annotated[
        str | None,
        typer.Option(
            help="Deployment id: records are filed under it, and with KVWATCH_COLLECTOR_URL and "
            "KVWATCH_INGEST_TOKEN the collector's limits in force guard too "
            "[KVWATCH_DEPLOYMENT_ID]."
        ),
    ] = None,
    tokenizer: Annotated[
        Tokenizer | None,
        typer.Option(
            help="Counting without the upstream's /tokenize: bytes (byte-level engines such as "
            "refengine) or estimate (an over-estimate) [KVWATCH_GATEWAY_TOKENIZER; estimate]."
        ),
    ] = None,
    tokenize_endpoint: Annotated[
        bool | None,
        typer.Option(
            "--tokenize-endpoint/--no-tokenize-endpoint",
            help="Count with the upstream's POST /tokenize where it has one "
            "[KVWATCH_GATEWAY_TOKENIZE_ENDPOINT; on].",
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Seconds to wait for the upstream's next bytes before a 504 "
            "[KVWATCH_GATEWAY_TIMEOUT_S; 600].",
        ),
    ] = None,
    connect_timeout: Annotated[
        float | None,
        typer.Option(min=0.001, help="Seconds to connect [KVWATCH_GATEWAY_CONNECT_TIMEOUT_S; 5]."),
    ] = None,
    on_failed_verification: Annotated[
        OnFailedVerification | None,
        typer.Option(
            help="When a model's latest verification failed: refuse prompts above the last "
            "value measured clean (all, when none was), or only warn; also, once the "
            "collector's limits are older than KVWATCH_GATEWAY_LIMITS_KEEP_S (900 s), refuse "
            "every prompt or warn [KVWATCH_GATEWAY_ON_FAILED_VERIFICATION; refuse].",
        ),
    ] = None,
    tag_tenants: Annotated[
        bool | None,
        typer.Option(
            "--tag-tenants/--no-tag-tenants",
            help="Tell the engine's probe each request's tenant and route: vllm_xargs "
            "(vLLM) and the X-SMG-Routing-Key header (SGLang). Off for an upstream that "
            "refuses unknown fields [KVWATCH_GATEWAY_TAG_TENANTS; on].",
        ),
    ] = None,
    salt_prefix_cache: Annotated[
        SaltPrefixCache | None,
        typer.Option(
            help="per-tenant: replace each request's cache_salt with its tenant's (derived "
            "from KVWATCH_GATEWAY_SALT_SECRET; generated at start when unset), so no tenant "
            "is served another's cached prefix; off: pass the client's "
            "[KVWATCH_GATEWAY_SALT_PREFIX_CACHE; per-tenant].",
        ),
    ] = None,
    verification_refresh: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Seconds between readings of the collector's limits in force "
            "[KVWATCH_GATEWAY_VERIFICATION_REFRESH_S; 60].",
        ),
    ] = None,
) -> None:
    """Run the guarding proxy: records every request, refuses prompts over the safe context."""
    import logging

    import uvicorn

    from engine_probe import configure_probe, shutdown_probe
    from kvwatch.gateway import create_app

    settings = _gateway_settings(
        {
            "gateway_upstream": upstream,
            "gateway_host": host,
            "gateway_port": port,
            "gateway_tenant_keys": tenant_key,
            "gateway_upstream_key": upstream_key,
            "gateway_safe_contexts": safe_context,
            "deployment_id": deployment,
            "gateway_tokenizer": tokenizer.value if tokenizer else None,
            "gateway_tokenize_endpoint": tokenize_endpoint,
            "gateway_timeout_s": timeout,
            "gateway_connect_timeout_s": connect_timeout,
            "gateway_verification_refresh_s": verification_refresh,
            "gateway_tag_tenants": tag_tenants,
            "gateway_salt_prefix_cache": salt_prefix_cache.value if salt_prefix_cache else None,
            "gateway_on_failed_verification": on_failed_verification.value
            if on_failed_verification
            else None,
        }
    )
    shared: dict[str, Any] = {
        "collector_url": settings.collector_url,
        "ingest_token": settings.ingest_token,
        "deployment_id": settings.deployment_id,
    }
    probe_settings = probe_settings_or_exit(**shared)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream request
    probe = configure_probe(probe_settings)
    if not probe.enabled:
        err.print(
            "[yellow]warning:[/] KVWATCH_COLLECTOR_URL is not set: requests are guarded and "
            "proxied, but not recorded"
        )
    info = settings.describe()
    err.print(
        f"kvwatch gateway on http://{settings.gateway_host}:{settings.gateway_port}/v1 -> "
        + "; ".join(f"{k}: {v}" for k, v in info.items())
    )
    stop_cleanly_on_sigterm()
    try:
        uvicorn.run(
            create_app(settings),
            host=settings.gateway_host,
            port=settings.gateway_port,
            log_level="info",
            access_log=False,
        )
    finally:
        shutdown_probe()
