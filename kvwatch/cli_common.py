"""What every ``kvwatch`` command module shares: settings, the database option, errors, the
help's layout (:class:`KvwatchTyper`) and how tables and durations are printed."""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from collector import text

if TYPE_CHECKING:
    from collector.db import Database
    from collector.settings import Settings
    from engine_probe import ProbeSettings

err = Console(stderr=True, soft_wrap=True)  # a long path is not broken across lines

# Every command's exit code when it could not run (docs/using.md, "Exit codes and --debug").
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
            msg = str(e["msg"]).removeprefix("Value error, ")
            if not e["loc"]:  # a rule across settings: its message names them
                err.print(f"[red]error:[/] {escape(msg)}")
                continue
            name = "KVWATCH_" + "_".join(str(p) for p in e["loc"]).upper()
            err.print(f"[red]error:[/] {name}: {escape(msg)}")
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


# -- tables and times -------------------------------------------------------------------------


def stdout_console() -> Console:
    """Where a command prints its table: the terminal's width, or COLUMNS when set; into a
    pipe or a file without COLUMNS, 200 columns, so that a row stays one line for grep."""
    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit()
    return Console(width=200 if piped else None)


@dataclass(frozen=True)
class Col:
    """A column of a :class:`Listing`. ``wide``: left out where the terminal is too narrow for
    every column (``--wide`` keeps it). ``nowrap``: a short value that reads as one token (an
    id, a state, a rule's name), never broken across lines; the other columns give way."""

    header: str
    wide: bool = False
    nowrap: bool = False


class Listing:
    """What a ``list`` command prints: a table that fits the terminal and never loses a
    character.

    Where every column fits (a pipe without COLUMNS is 200 wide), every column is shown, so a
    row stays one line for grep. Where they do not, the columns marked ``wide`` are left out
    (a dim line under the table names them and ``--wide``), so an 80-column terminal gets the
    columns a person triages with, one or two lines a row, instead of every cell wrapped to a
    few letters. A cell wraps at spaces; a word wider than its column (a long deployment id)
    folds onto the next lines whole, never cut with '…'.
    """

    def __init__(self, *columns: str | Col, wide: bool = False) -> None:
        self.columns = [c if isinstance(c, Col) else Col(c) for c in columns]
        self.wide = wide
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        # a lone surrogate an older version stored cannot be printed: shown as U+FFFD
        self.rows.append(tuple(text.scrub(c) for c in cells))

    def _table(self, keep: list[int]) -> Table:
        t = Table()
        for i in keep:
            c = self.columns[i]
            t.add_column(c.header, overflow="fold", no_wrap=c.nowrap)
        for row in self.rows:
            t.add_row(*(row[i] for i in keep))
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        every = list(range(len(self.columns)))
        full = self._table(every)
        # measured unbounded: a table's measurement is capped at the width it is given
        natural = console.measure(full, options=options.update_width(1 << 20)).maximum
        if self.wide or natural <= options.max_width or not any(c.wide for c in self.columns):
            yield full
            return
        keep = [i for i in every if not self.columns[i].wide]
        yield self._table(keep)
        left_out = ", ".join(c.header for c in self.columns if c.wide)
        yield Text(f"(not shown at this width: {left_out}; --wide shows them)", style="dim")


def table(*columns: str | Col, wide: bool = False) -> Listing:
    """A :class:`Listing` of these columns (``wide``: every column, whatever the width)."""
    return Listing(*columns, wide=wide)


# The options every list command takes, with one meaning each.
WideOpt = Annotated[bool, typer.Option("--wide", help="Every column, however narrow the terminal.")]


def duration_option(value: str | None, option: str) -> float | None:
    """An option's duration (``90s``, ``15m``, ``24h``, ``7d``) in seconds; None stays None;
    anything else is typer's usage error naming ``option`` (exit 2)."""
    from policies.durations import parse_duration

    if value is None:
        return None
    try:
        return float(parse_duration(value))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def relative(when: str | None, now: datetime) -> str:
    """An instant (the API's ISO 8601 text) as time from ``now``, the way every kvwatch output
    prints a duration (:func:`policies.durations.human_duration`): ``6m 49s ago``,
    ``in 89d 23h``; '' for None."""
    from policies.durations import human_duration

    if when is None:
        return ""
    seconds = (datetime.fromisoformat(when) - now).total_seconds()
    return f"in {human_duration(seconds)}" if seconds > 0 else f"{human_duration(-seconds)} ago"


def to_second(when: str | None) -> str:
    """An instant (ISO 8601, UTC) to the second: ``2026-12-02T15:34:00Z``; '' for None."""
    if when is None:
        return ""
    exact = datetime.fromisoformat(when).replace(microsecond=0).isoformat()
    return exact.removesuffix("+00:00") + "Z"


def moment(when: str | None, now: datetime) -> str:
    """An instant to the second, with its time from ``now``: ``2026-12-02T15:34:00Z (in 2h)``."""
    return f"{to_second(when)} ({relative(when, now)})" if when is not None else ""


# -- help -----------------------------------------------------------------------------------
#
# typer lays an option out in four columns (names, negative names, type, help) that leave the
# help a dozen characters at 80 columns, where rich cuts every longer word with an ellipsis
# (environment variable names first), and it shows a flag's type (`--yes <bool>`). kvwatch's
# commands and groups render their option panels with `_options_panel` instead: the names
# and the type on the left (a negative flag, or a type that does not fit, on a line of its
# own), the help on the right with its environment variable on a line of its own, and no
# type for a flag. Every other part of the help is typer's.

_NAMES_MAX = 28  # a type joins its option's line up to this width, else goes below it


def _short_help(help_text: str | None) -> str | None:
    """A command's line in its group's list: its help's first sentence, on one line."""
    if not help_text:
        return None
    first = " ".join(help_text.split("\n\n", 1)[0].split())
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`])", first, maxsplit=1)[0]


def _options_panel(
    *, name: str, params: list[Any], ctx: Any, markup_mode: str, console: Console
) -> None:
    """typer's ``_print_options_panel``, laid out to fit: see above."""
    from rich.panel import Panel
    from typer import rich_utils as ru

    if not params:
        return
    table = Table(
        highlight=True, show_header=False, expand=True, box=None, padding=(0, 1), pad_edge=False
    )
    required = any(p.required for p in params)
    if required:
        table.add_column(no_wrap=True, width=1)
    table.add_column(no_wrap=True)
    table.add_column(ratio=1, overflow="fold")
    for param in params:
        row: list[Any] = (
            [Text(ru.REQUIRED_SHORT_STRING, style=ru.STYLE_REQUIRED_SHORT)]
            if (required and param.required)
            else ([""] if required else [])
        )
        table.add_row(*row, _param_names(param, ctx), _param_help(param, ctx, markup_mode))
    console.print(
        Panel(
            table,
            border_style=ru.STYLE_OPTIONS_PANEL_BORDER,
            title=name,
            title_align=ru.ALIGN_OPTIONS_PANEL,
        )
    )


def _param_names(param: Any, ctx: Any) -> Text:
    from typer import rich_utils as ru
    from typer.core import TyperArgument

    if isinstance(param, TyperArgument):
        label = param.display_name_raw
        if param.metavar is None and param.nargs != 1:
            label += "..."
        first = label
    else:
        opts = sorted(param.opts, key=lambda o: o.startswith("--"))  # -x before --long
        first = ", ".join(opts)
    lines = [ru.highlighter(Text(first))]
    for negative in getattr(param, "secondary_opts", None) or []:
        lines.append(ru.negative_highlighter(Text(negative)))
    kind = None if getattr(param, "is_flag", False) else param.display_type_rich(ctx=ctx)
    if kind:
        number_range = param._get_number_range_help_str()
        kind = f"{kind} [{number_range}]" if number_range else kind
        typed = Text(kind, style=ru.STYLE_TYPES)
        if len(lines) == 1 and len(first) + 1 + len(kind) <= _NAMES_MAX:
            lines[0].append(" ").append_text(ru.types_highlighter(typed))
        else:
            lines.append(Text("  ").append_text(ru.types_highlighter(typed)))
    return Text("\n").join(lines)


def _param_help(param: Any, ctx: Any, markup_mode: str) -> Text:
    """The help, then its default and whether it is required; the environment variable on a
    line of its own, so that it wraps as a whole."""
    from typer import rich_utils as ru
    from typer.core import TyperArgument, TyperOption

    cell = Text(overflow="fold")
    help_value: str | None = getattr(param, "help", None)
    if help_value:
        paragraphs = [" ".join(p.split()) for p in help_value.split("\n\n")]
        text = "\n".join(paragraphs).strip()
        prose = Text(text) if markup_mode != "rich" else Text.from_markup(text)
        cell.append_text(ru.highlighter(prose))
    extras: list[Text] = []
    if isinstance(param, TyperOption | TyperArgument):
        default = param._extract_default_help_str(ctx=ctx)
        shown = isinstance(param.show_default, str)
        if shown or (default is not None and (param.show_default or ctx.show_default)):
            text = param._get_default_string(
                ctx=ctx, show_default_is_str=shown, default_value=default
            )
            if text:
                extras.append(Text(ru.DEFAULT_STRING.format(text), style=ru.STYLE_OPTION_DEFAULT))
    if param.required:
        extras.append(Text(ru.REQUIRED_LONG_STRING, style=ru.STYLE_REQUIRED_LONG))
    for extra in extras:
        if cell:
            cell.append(" ")
        cell.append_text(extra)
    envvar = getattr(param, "envvar", None)
    if envvar and getattr(param, "show_envvar", False):
        names = envvar if isinstance(envvar, str) else ", ".join(envvar)
        if cell:
            cell.append("\n")
        cell.append(ru.ENVVAR_STRING.format(names), style=ru.STYLE_OPTION_ENVVAR)
    return cell


@contextmanager
def _kvwatch_options_panels() -> Iterator[None]:
    from typer import rich_utils

    typers = rich_utils._print_options_panel
    rich_utils._print_options_panel = _options_panel
    try:
        yield
    finally:
        rich_utils._print_options_panel = typers


class _KvwatchHelp:
    """What kvwatch's commands and groups share: their help laid out to fit (see
    ``_options_panel``), and a one-line short help (their help's first sentence) for the
    group's list."""

    short_help: str | None
    help: str | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_help = self.short_help or _short_help(self.help)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _kvwatch_options_panels():
            super().format_help(ctx, formatter)  # type: ignore[misc]


class KvwatchCommand(_KvwatchHelp, TyperCommand):
    """A kvwatch command."""


class KvwatchSubgroup(_KvwatchHelp, TyperGroup):
    """A group of kvwatch commands."""


class KvwatchTyper(typer.Typer):
    """``typer.Typer`` whose groups are :class:`KvwatchSubgroup` and whose commands are
    :class:`KvwatchCommand` unless told otherwise: every kvwatch app is one."""

    def __init__(self, *, cls: type[TyperGroup] | None = None, **kwargs: Any) -> None:
        super().__init__(cls=cls or KvwatchSubgroup, **kwargs)

    def command(
        self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kwargs: Any
    ) -> Any:
        return super().command(name, cls=cls or KvwatchCommand, **kwargs)


class KvwatchGroup(KvwatchSubgroup):
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
                line = _pack_failure(exc)
            if line is None:
                raise
            if ctx.meta.get(DEBUG):
                traceback.print_exception(exc)
            err.print(f"[red]error:[/] {escape(line)}")
            raise typer.Exit(EXIT_COULD_NOT_RUN) from None
        finally:
            _database_url.reset(token)


def _pack_failure(exc: BaseException) -> str | None:
    """A rule pack that does not load (``KVWATCH_POLICY_PACKS_DIR``), met by a command that
    loads the packs (``kvwatch serve``, ``kvwatch writer``): every problem, one line each,
    naming file, line and field. None for any other exception."""
    from policies.errors import PackError

    if not isinstance(exc, PackError):
        return None
    return "the rule packs do not load (KVWATCH_POLICY_PACKS_DIR):\n" + str(exc)


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


def stop_cleanly_on_sigterm() -> None:
    """A server stopped with SIGTERM (``kill``, systemd, Kubernetes) that shut down gracefully
    did what it was asked: exit 0, after the ``finally`` blocks that flush its probe. Uvicorn
    handles the signal, shuts down, then raises it again for the handler it found installed;
    with the default one the process dies by it (143, which a shell's ``wait`` under ``set -e``
    reads as a failure) before anything after ``uvicorn.run`` runs."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
