"""The ``kvwatch`` command line: the one front door that wires the parts together."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="kvwatch: KV-cache safety and compliance for multi-tenant LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(tokens_app, name="tokens")

err = Console(stderr=True)


def _settings(database_url: str | None = None):  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from collector.settings import Settings

    try:
        return Settings(database_url=database_url) if database_url else Settings()
    except ValidationError as exc:
        for e in exc.errors():
            name = "KVWATCH_" + "_".join(str(p) for p in e["loc"]).upper()
            err.print(f"[red]error:[/] {name}: {e['msg']}")
        raise typer.Exit(2) from None


DbUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="KVWATCH_DATABASE_URL", help="SQLAlchemy URL."),
]


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [KVWATCH_HOST].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [KVWATCH_PORT].")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Processes sharing the port [KVWATCH_WORKERS].")
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Run the collector (HTTP API, ingest, /metrics)."""
    import os

    import uvicorn

    from collector import migrate
    from collector.app import create_app

    settings = _settings(database_url)
    n = workers or settings.workers
    if n == 1:
        app_or_path: object = create_app(settings)
    else:
        # Workers build their own app from the environment; migrate once, here, first.
        if settings.auto_migrate:
            migrate.upgrade(settings.database_url)
        os.environ["KVWATCH_DATABASE_URL"] = settings.database_url
        os.environ["KVWATCH_AUTO_MIGRATE"] = "false"
        app_or_path = "collector.app:create_app"
    uvicorn.run(
        app_or_path,  # type: ignore[arg-type]
        factory=n > 1,
        workers=n if n > 1 else None,
        host=host or settings.host,
        port=port or settings.port,
        log_level="info",
        access_log=False,
    )


@db_app.command("upgrade")
def db_upgrade(database_url: DbUrl = None) -> None:
    """Apply Alembic migrations up to head."""
    from collector import migrate

    settings = _settings(database_url)
    migrate.upgrade(settings.database_url)
    err.print(f"[green]database at head[/] ({_redact(settings.database_url)})")


@tokens_app.command("create")
def tokens_create(
    kind: Annotated[str, typer.Option(help="ingest | read | admin")],
    tenant: Annotated[str | None, typer.Option(help="Scope a read token to one tenant.")] = None,
    deployment: Annotated[
        str | None, typer.Option(help="Scope an ingest token to one deployment.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="A label for people.")] = None,
    database_url: DbUrl = None,
) -> None:
    """Create a token and print it once, alone on the last line. Only its hash is stored."""
    from collector import migrate
    from collector.db import Database
    from collector.errors import CollectorError
    from collector.models import to_micros
    from collector.tokens import create_token
    from engine_probe.events import utcnow

    settings = _settings(database_url)
    migrate.upgrade(settings.database_url)
    db = Database(settings.database_url)
    try:
        with db.write() as conn:
            token_id, secret = create_token(
                conn,
                kind=kind,
                tenant=tenant,
                deployment_id=deployment,
                name=name,
                now_us=to_micros(utcnow()),
            )
    except CollectorError as exc:
        err.print(f"[red]error:[/] {exc.message}")
        raise typer.Exit(2) from None
    finally:
        db.dispose()
    scope = f" tenant={tenant}" if tenant else f" deployment={deployment}" if deployment else ""
    err.print(f"created {kind} token #{token_id}{scope}; it is shown once, store it now:")
    print(secret)


@app.command()
def demo(
    dir: Annotated[
        Path | None, typer.Option("--dir", help="Where to leave kvwatch.db and artefacts.")
    ] = None,
) -> None:
    """Replay the incident end to end on the embedded SQLite default."""
    from kvwatch.demo import run_demo

    raise typer.Exit(run_demo(dir))


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":  # pragma: no cover
    app()
