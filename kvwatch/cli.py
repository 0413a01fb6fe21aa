"""The ``kvwatch`` command line: the one front door that wires the parts together."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvwatch.cli_alerts import alerts_app, incidents_app, policies_app, silences_app
from kvwatch.cli_breach import breach, report_notice, report_verify
from kvwatch.cli_bus import BusUrl, bus_app, bus_settings, check_bus, writer
from kvwatch.cli_casefile import incidents_export
from kvwatch.cli_cases import notify_app  # noqa: F401 - registers incidents' case commands
from kvwatch.cli_common import (
    DEBUG,
    EXIT_COULD_NOT_RUN,
    DbUrl,
    KvwatchGroup,
    KvwatchTyper,
    err,
    probe_settings_or_exit,
    redacted,
    stop_cleanly_on_sigterm,
)
from kvwatch.cli_common import settings as collector_settings
from kvwatch.cli_dashboard import dashboard
from kvwatch.cli_gateway import gateway
from kvwatch.cli_keys import keys_app
from kvwatch.cli_kv_events import kv_events
from kvwatch.cli_lifecycle import erase, retention_app
from kvwatch.cli_reports import audit_app, report_app
from kvwatch.cli_scrape import scrape
from kvwatch.cli_tokens import tokens_app
from kvwatch.cli_verify import verify_app
from kvwatch.cli_webhooks import webhooks_app

if TYPE_CHECKING:
    from collector.db import Database
    from collector.settings import Settings

app = KvwatchTyper(
    cls=KvwatchGroup,
    help="kvwatch: KV-cache safety and compliance for multi-tenant LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = KvwatchTyper(help="Database schema.", no_args_is_help=True)
engine_app = KvwatchTyper(help="refengine, the reference paged-KV engine.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(tokens_app, name="tokens")
app.add_typer(keys_app, name="keys")
app.add_typer(engine_app, name="engine")
app.add_typer(webhooks_app, name="webhooks")
app.add_typer(policies_app, name="policies")
app.add_typer(alerts_app, name="alerts")
app.add_typer(silences_app, name="silences")
app.add_typer(incidents_app, name="incidents")
incidents_app.command("export")(incidents_export)
app.add_typer(report_app, name="report")
report_app.command("breach")(breach)
report_app.command("verify")(report_verify)
report_app.command("notice")(report_notice)
app.add_typer(audit_app, name="audit")
app.add_typer(verify_app, name="verify")
app.command("gateway")(gateway)
app.command("dashboard")(dashboard)
app.command("scrape")(scrape)
app.command("kv-events")(kv_events)
app.add_typer(retention_app, name="retention")
app.command("erase")(erase)


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            envvar="KVWATCH_DEBUG",
            help="On a failure, also show its traceback (before the one line saying what failed).",
        ),
    ] = False,
) -> None:
    ctx.meta[DEBUG] = debug


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [KVWATCH_HOST].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [KVWATCH_PORT].")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Processes sharing the port [KVWATCH_WORKERS].")
    ] = None,
    database_url: DbUrl = None,
    bus: BusUrl = None,
) -> None:
    """Run the collector (HTTP API, ingest, /metrics, scheduled verifications and scrapes).
    With ``--bus``, accepted batches are published to the ingest bus (NATS JetStream) and
    ``kvwatch writer`` processes store them (docs/scaling.md)."""
    import os

    import uvicorn
    from rich.markup import escape

    from collector.errors import CollectorError
    from collector.oidc import RoleMap
    from collector.scrape import UnusableScrapeTargets, open_targets
    from kvwatch.embedded import collector_app
    from kvwatch.scheduled_scrape import scrape_target

    settings = collector_settings(database_url) if not bus else bus_settings(bus, database_url)
    if settings.bus_url is not None:
        check_bus(settings)  # one line, not a traceback, for a bus that cannot be used
    try:
        # Here, once, as a bad setting is: a worker process whose app cannot be built would
        # be started again and again.
        open_targets(settings, scrape_target)
    except UnusableScrapeTargets as exc:
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    try:  # the role map too, for the same reason: one line naming the file and its entry
        RoleMap.load(settings.oidc_role_map)
    except CollectorError as exc:
        err.print(f"[red]error:[/] KVWATCH_OIDC_ROLE_MAP: {escape(exc.message)}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    n = workers or settings.workers
    if n == 1:
        # Migrated here, not in the app's startup: a database it cannot reach then ends the
        # command with the CLI's one line, not uvicorn's traceback after its banner.
        collector = collector_app(settings.model_copy(update={"auto_migrate": False}))
        _database_ready(settings, collector.state.db)
        app_or_path: object = collector
    else:
        # Workers build their own app from the environment; migrate once, here, first. The
        # rule packs too are loaded here once: a worker whose packs do not load would die
        # with a traceback and be started again, and again (one line here instead).
        from policies import load_ruleset

        load_ruleset(settings.policy_packs_dir)
        _database_ready(settings, None)
        os.environ["KVWATCH_DATABASE_URL"] = settings.database_url
        os.environ["KVWATCH_AUTO_MIGRATE"] = "false"
        if bus:
            os.environ["KVWATCH_BUS_URL"] = bus
        app_or_path = "kvwatch.embedded:collector_app"
    stop_cleanly_on_sigterm()
    uvicorn.run(
        app_or_path,  # type: ignore[arg-type]
        factory=n > 1,
        workers=n if n > 1 else None,
        host=host or settings.host,
        port=port or settings.port,
        log_level="info",
        access_log=False,
    )


app.command("writer")(writer)
app.add_typer(bus_app, name="bus")


def _database_ready(settings: Settings, db: Database | None) -> None:
    """Migrate the database (KVWATCH_AUTO_MIGRATE) or check that it answers; raises what the
    driver raises, for :class:`~kvwatch.cli_common.KvwatchGroup` to report."""
    from collector import migrate
    from collector.db import Database

    if settings.auto_migrate:
        migrate.upgrade(settings.database_url)
        return
    probe = db or Database(settings.database_url)
    try:
        probe.ping()
    finally:
        if db is None:
            probe.dispose()


@db_app.command("upgrade")
def db_upgrade(database_url: DbUrl = None) -> None:
    """Apply Alembic migrations up to head."""
    from collector import migrate

    settings = collector_settings(database_url)
    migrate.upgrade(settings.database_url)
    err.print(f"[green]database at head[/] ({redacted(settings.database_url)})")


@app.command()
def demo(
    dir: Annotated[
        Path | None, typer.Option("--dir", help="Where to leave kvwatch.db and artefacts.")
    ] = None,
) -> None:
    """Replay the incident end to end on the embedded SQLite default."""
    from kvwatch.demo import run_demo

    raise typer.Exit(run_demo(dir))


class EngineMode(StrEnum):
    legacy = "legacy"
    hardened = "hardened"


class EngineTopology(StrEnum):
    monolithic = "monolithic"
    disaggregated = "disaggregated"


class PrefixCacheMode(StrEnum):
    off = "off"
    shared = "shared"
    salted = "salted"


class KVDtype(StrEnum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


def _tenant_keys(values: list[str] | None) -> list[str] | None:
    """Check ``NAME=KEY`` values (typer callback: a bad one is a usage error, exit 2)."""
    names: set[str] = set()
    keys: set[str] = set()
    for value in values or []:
        name, sep, key = value.partition("=")
        name, key = name.strip(), key.strip()
        if not sep or not name or not key:
            # Never echo the value: it holds a key.
            raise typer.BadParameter("expected NAME=KEY with a non-empty name and key")
        if name in names:
            raise typer.BadParameter(f"tenant {name!r} is given twice")
        if key in keys:
            raise typer.BadParameter(f"tenant {name!r} reuses another tenant's key")
        names.add(name)
        keys.add(key)
    return values


@engine_app.command("serve")
def engine_serve(
    mode: Annotated[
        EngineMode,
        typer.Option(help="legacy reproduces the incident; hardened rejects cleanly."),
    ] = EngineMode.hardened,
    topology: Annotated[
        EngineTopology, typer.Option(help="One pool, or prefill and decode pools.")
    ] = EngineTopology.monolithic,
    advertised_context: Annotated[
        int, typer.Option(min=1, help="Tokens the API accepts (bytes: the tokenizer is bytes).")
    ] = 8192,
    pool_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens of the prefill pool (or of the only pool).")
    ] = 16384,
    decode_pool_tokens: Annotated[
        int | None,
        typer.Option(
            min=1, help="Tokens of the decode pool (disaggregated; default: --pool-tokens)."
        ),
    ] = None,
    tenant_key: Annotated[
        list[str] | None,
        typer.Option(
            "--tenant-key",
            metavar="NAME=KEY",
            callback=_tenant_keys,
            envvar="KVWATCH_ENGINE_TENANT_KEYS",
            show_envvar=False,
            help="Accept only these bearer keys, each naming its tenant (repeatable; also "
            "KVWATCH_ENGINE_TENANT_KEYS, space-separated). Without: each key is its own tenant.",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port.")] = 8000,
    page_size: Annotated[int, typer.Option(min=1, help="Tokens per KV page.")] = 16,
    max_batch: Annotated[int, typer.Option(min=1, help="Most requests per decode step.")] = 32,
    zeroize_on_free: Annotated[
        bool, typer.Option(help="Zero freed KV pages (the hardening option).")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    kv_dtype: Annotated[KVDtype, typer.Option(help="KV cache dtype.")] = KVDtype.float32,
    model_id: Annotated[str, typer.Option(help="The model id served.")] = "refengine-lab",
    torch_threads: Annotated[
        int | None, typer.Option(min=1, help="torch intra-op threads (default: torch's).")
    ] = None,
    deployment: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_DEPLOYMENT_ID",
            help="The deployment this engine's events belong to (default: the model id).",
        ),
    ] = None,
    prefix_cache: Annotated[
        PrefixCacheMode,
        typer.Option(
            help="Keep prompts' full KV pages for later requests with the same prefix: off; "
            "shared (vLLM's keys: tokens and the request's cache_salt, so tenants share "
            "unless their clients salt); salted (the server salts by tenant too: tenants "
            "never share). Monolithic only."
        ),
    ] = PrefixCacheMode.off,
    canary: Annotated[
        bool,
        typer.Option(
            "--canary",
            help="Also paint freed pages and report reads of the paint (a second stale-read "
            "detector; changes what a stale read returns).",
        ),
    ] = False,
    offload_tier_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="Tokens of a host-memory offload tier that prefix pages the pool evicts go "
            "to and are loaded back from (vLLM's CPU offloading, LMCache's CPU tier); 0: "
            "none. Needs --prefix-cache.",
        ),
    ] = 0,
    fault_offload_drops_salt: Annotated[
        bool,
        typer.Option(
            "--fault-offload-drops-salt",
            help="A defect, for tests and demos: the offload tier keys pages by their tokens "
            "alone, dropping the salt (as LMCache's SGLang path did), so other salts and "
            "tenants are served a prefix someone else computed.",
        ),
    ] = False,
) -> None:
    """Run refengine's OpenAI-compatible server (/v1/completions, /v1/chat/completions,
    /v1/models). With KVWATCH_COLLECTOR_URL and KVWATCH_INGEST_TOKEN set, its probe and page
    ledger report every request, pool and stale read to that collector."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        err.print(f"[red]error:[/] --device must be cpu, cuda or cuda:N, not {device!r}")
        raise typer.Exit(2)
    if decode_pool_tokens is not None and topology is not EngineTopology.disaggregated:
        err.print("[red]error:[/] --decode-pool-tokens needs --topology disaggregated")
        raise typer.Exit(2)
    if prefix_cache is not PrefixCacheMode.off and topology is not EngineTopology.monolithic:
        err.print(
            "[red]error:[/] --prefix-cache needs --topology monolithic (a disaggregated "
            "engine's prefill pages leave for the decode pool: nothing would stay cached)"
        )
        raise typer.Exit(2)

    import torch
    import uvicorn

    from engine_probe import configure_probe, shutdown_probe
    from engine_probe.adapters.refengine import attach
    from engine_probe.settings import sanitize_id
    from refengine import Engine, EngineConfig
    from refengine.server import create_app

    if device.startswith("cuda") and not torch.cuda.is_available():
        err.print("[red]error:[/] --device cuda, but torch sees no CUDA device")
        raise typer.Exit(2)
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        config = EngineConfig(
            mode=mode.value,
            topology=topology.value,
            advertised_context=advertised_context,
            pool_tokens=pool_tokens,
            decode_pool_tokens=decode_pool_tokens,
            page_size=page_size,
            max_batch=max_batch,
            zeroize_on_free=zeroize_on_free,
            device=device,
            kv_dtype=kv_dtype.value,
            model_id=model_id,
            prefix_cache=prefix_cache.value,
            offload_tier_tokens=offload_tier_tokens,
            offload_drops_salt=fault_offload_drops_salt,
        )
        engine = Engine(config)
    except (ValueError, RuntimeError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    keys: dict[str, str] | None = None
    if tenant_key:
        keys = {}
        for value in tenant_key:
            name, _, key = value.partition("=")
            keys[name.strip()] = key.strip()
    probe_settings = probe_settings_or_exit(
        deployment_id=deployment or sanitize_id(model_id, fallback="refengine")
    )
    fastapi_app = create_app(engine, tenant_keys=keys, model_id=model_id)
    pools = ", ".join(f"{p.name} {p.capacity_tokens} tokens" for p in engine.pools.values())
    tenants = ", ".join(sorted(keys)) if keys else "one per bearer key"
    caching = prefix_cache.value + (" by tenant" if prefix_cache is PrefixCacheMode.salted else "")
    err.print(
        f"refengine {mode.value} {topology.value} serving {model_id!r} on http://{host}:{port}/v1"
        f" - advertised context {advertised_context} tokens; pools: {pools}; tenants: {tenants}"
        f"; prefix cache: {caching}"
        + (f"; offload tier {offload_tier_tokens} tokens" if offload_tier_tokens else "")
        + (" (FAULT: the tier drops the salt)" if fault_offload_drops_salt else "")
    )
    probe = configure_probe(probe_settings)
    if probe.enabled:
        attach(engine, probe, deployment_id=probe_settings.deployment_id, canary=canary)
        detectors = "page ledger" + (" and canary" if canary else "")
        err.print(
            f"reporting to {probe_settings.collector_url} as deployment "
            f"{probe_settings.deployment_id!r} ({detectors})"
        )
    else:
        err.print(
            "[yellow]not reporting:[/] KVWATCH_COLLECTOR_URL is not set, so this engine's "
            "requests, pools and stale reads go nowhere (set it and KVWATCH_INGEST_TOKEN)"
        )
    stop_cleanly_on_sigterm()
    try:
        uvicorn.run(fastapi_app, host=host, port=port, log_level="info", access_log=False)
    finally:
        if probe.enabled and not shutdown_probe(probe_settings.probe_atexit_timeout_s + 8):
            kept = (
                f"the rest is in {probe_settings.probe_spool_dir}, sent by the next start"
                if probe_settings.probe_spool_dir is not None
                else "the rest is lost (KVWATCH_PROBE_SPOOL_DIR keeps it on disk)"
            )
            err.print(f"[yellow]warning:[/] not every event reached the collector; {kept}")


if __name__ == "__main__":  # pragma: no cover
    app()
