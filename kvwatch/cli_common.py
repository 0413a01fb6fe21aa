"""What every ``kvwatch`` command module shares: settings, the database option, errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from collector.db import Database
    from collector.settings import Settings
    from engine_probe import ProbeSettings

err = Console(stderr=True, soft_wrap=True)  # a long path is not broken across lines

DbUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="KVWATCH_DATABASE_URL", help="SQLAlchemy URL."),
]


def settings(database_url: str | None = None) -> Settings:
    """The collector settings from the environment (and ``--database-url``); a bad one is
    named by its environment variable and exits 2."""
    from pydantic import ValidationError

    from collector.settings import Settings

    try:
        return Settings(database_url=database_url) if database_url else Settings()
    except ValidationError as exc:
        for e in exc.errors():
            name = "KVWATCH_" + "_".join(str(p) for p in e["loc"]).upper()
            err.print(f"[red]error:[/] {name}: {e['msg']}")
        raise typer.Exit(2) from None


@contextmanager
def database(database_url: str | None) -> Iterator[tuple[Database, Settings]]:
    """The migrated database; collector errors (not found, conflict, bad input) print their
    message and exit 2."""
    from collector import migrate
    from collector.db import Database
    from collector.errors import CollectorError

    s = settings(database_url)
    migrate.upgrade(s.database_url)
    db = Database(s.database_url)
    try:
        yield db, s
    except CollectorError as exc:
        err.print(f"[red]error:[/] {exc.message}")
        raise typer.Exit(2) from None
    finally:
        db.dispose()


def probe_settings_or_exit(**overrides: Any) -> ProbeSettings:
    """A producer's probe settings from the ``KVWATCH_*`` environment and ``overrides``
    (those not None); a bad value ends the command with exit 2, naming its variable."""
    from pydantic import ValidationError

    from engine_probe import ProbeSettings

    try:
        return ProbeSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for e in exc.errors():
            err.print(f"[red]error:[/] KVWATCH_{str(e['loc'][0]).upper()}: {e['msg']}")
        raise typer.Exit(2) from None
