"""What every ``kvwatch`` command module shares: settings, the database option, errors."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

if TYPE_CHECKING:
    from collector.db import Database
    from collector.settings import Settings
    from engine_probe import ProbeSettings

err = Console(stderr=True, soft_wrap=True)  # a long path is not broken across lines

# Every command's exit code when it could not run (README, "Exit codes and --debug").
EXIT_COULD_NOT_RUN = 2

DEBUG = "kvwatch.debug"  # key in the root context's meta: --debug was given

# The database URL the running command resolved, for the one line that reports a database it
# could not use: the driver's exception does not say which database it was.
_database_url: ContextVar[str | None] = ContextVar("kvwatch_database_url", default=None)

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
        s = Settings(database_url=database_url) if database_url else Settings()
    except ValidationError as exc:
        for e in exc.errors():
            name = "KVWATCH_" + "_".join(str(p) for p in e["loc"]).upper()
            err.print(f"[red]error:[/] {name}: {escape(str(e['msg']))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    _check_url(s.database_url)
    _database_url.set(s.database_url)
    return s


def _check_url(url: str) -> None:
    """Refuse a database URL SQLAlchemy cannot parse, or whose driver it does not know,
    before anything tries to connect (where it would end in a traceback)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        # The URL itself is not echoed: it did not parse, so its password cannot be hidden.
        err.print(
            "[red]error:[/] KVWATCH_DATABASE_URL (or --database-url) is not a usable "
            f"SQLAlchemy URL: {escape(str(exc))}"
        )
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None


def redacted(url: str) -> str:
    """A database URL fit to print: its password, if any, as ``***``."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@contextmanager
def database(database_url: str | None) -> Iterator[tuple[Database, Settings]]:
    """The migrated database; collector errors (not found, conflict, bad input) print their
    message and exit 2. A database that cannot be reached ends the command in
    :class:`KvwatchGroup`, which names it."""
    from collector import migrate
    from collector.db import Database
    from collector.errors import CollectorError, Unavailable

    s = settings(database_url)
    migrate.upgrade(s.database_url)
    db = Database(s.database_url)
    try:
        yield db, s
    except CollectorError as exc:
        if type(exc) is Unavailable:
            raise
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    finally:
        db.dispose()


def _database_failure(exc: BaseException, url: str | None) -> str | None:
    """What to tell a person when ``exc`` says the database at ``url`` could not be used:
    what failed, the URL with its password hidden, what to check. None for any other
    exception (a bug keeps its traceback)."""
    from alembic.util import CommandError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DatabaseError, InterfaceError, OperationalError

    from collector.errors import Unavailable

    where = f"the database {redacted(url)}" if url else "the database"
    if isinstance(exc, CommandError):
        return (
            f"cannot migrate {where}: {exc}; check KVWATCH_DATABASE_URL (or --database-url) "
            "and that no newer kvwatch has migrated it"
        )
    sqlite = url is not None and make_url(url).get_backend_name() == "sqlite"
    if type(exc) is Unavailable:
        # It wraps the driver's error (bare, or in SQLAlchemy's), which says why.
        cause = exc.__cause__
        reason = _driver_reason(str(getattr(cause, "orig", None) or cause or exc.message))
    elif isinstance(exc, (OperationalError, InterfaceError)) or type(exc) is DatabaseError:
        if getattr(exc.orig, "sqlite_errorname", None) == "SQLITE_ERROR":
            # SQLite's generic code: a statement it refused (no such table, bad SQL), a bug
            # to see in full, not a database it could not open.
            return None
        reason = _driver_reason(str(exc.orig))
    elif isinstance(exc, OSError) and sqlite and _about_file_of(exc, url):
        reason = exc.strerror or str(exc)
    else:
        return None
    if sqlite:
        return (
            f"cannot open {where}: {reason}; check KVWATCH_DATABASE_URL (or --database-url), "
            "that its directory exists and is writable, and that the file is a kvwatch database"
        )
    return (
        f"cannot reach {where}: {reason}; check KVWATCH_DATABASE_URL (or --database-url), "
        "that the server runs and accepts connections, and that the user and database exist"
    )


def _driver_reason(message: str) -> str:
    """What a driver's message says went wrong, without its preamble: psycopg prefixes the
    server's answer with every address it tried (``connection to server at "h", port p
    failed: ...``), across several lines when it tried several."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        _, found, tail = line.rpartition(" failed: ")
        if found and tail:
            reason = tail.removeprefix("FATAL:").strip()
            return reason[:1].lower() + reason[1:]
    return lines[0] if lines else "no reason given"


def _about_file_of(exc: OSError, url: str | None) -> bool:
    """Whether ``exc`` concerns the SQLite database's file or a folder on its way."""
    from sqlalchemy.engine import make_url

    if url is None or exc.filename is None:
        return False
    database = make_url(url).database
    if not database or database == ":memory:":
        return False
    db_file = Path(database).absolute()
    failed = Path(str(exc.filename)).absolute()
    return failed == db_file or failed in db_file.parents


class KvwatchGroup(TyperGroup):
    """The root command group, which every command runs inside: a database a command cannot
    use ends it with one line naming the database (password hidden) and what to check, and
    exit 2; with ``--debug`` the traceback comes first."""

    # Any: the context typer passes is its vendored click's, which it exports under no name.
    def invoke(self, ctx: Any) -> Any:
        token = _database_url.set(None)
        try:
            return super().invoke(ctx)
        except Exception as exc:
            line = _database_failure(exc, _database_url.get())
            if line is None:
                raise
            if ctx.meta.get(DEBUG):
                traceback.print_exception(exc)
            err.print(f"[red]error:[/] {escape(line)}")
            raise typer.Exit(EXIT_COULD_NOT_RUN) from None
        finally:
            _database_url.reset(token)


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
