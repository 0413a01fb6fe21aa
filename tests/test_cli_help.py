"""Every ``kvwatch ... --help``, as a person reads it in an 80-column terminal: every command
and group says what it does, no environment variable name (nor any other word) is cut with
an ellipsis, nothing is wider than the terminal, and flags show as flags (``--yes``, not
``--yes <bool>``). The walk covers the whole command tree, so a new command is checked too."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvwatch.cli import app

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENV_NAME = re.compile(r"\bKVWATCH_[A-Z0-9_]*[A-Z0-9]")


def _walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(typer.main.get_command(app)))
EACH_COMMAND = pytest.mark.parametrize(
    ("path", "command"), COMMANDS, ids=[" ".join(p) or "kvwatch" for p, _ in COMMANDS]
)


def help_at_80(*path: str) -> str:
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "LINES": "50"})
    assert r.exit_code == 0, r.output
    return ANSI.sub("", r.stdout)


def declared_env_names(command: Any) -> set[str]:
    """The variables the command reads (its options' ``envvar``) and those its help texts
    name (settings read by the collector, gateway or dashboard themselves)."""
    names = set(ENV_NAME.findall(command.help or ""))
    for p in command.params:
        if getattr(p, "hidden", False):
            continue
        envvar = getattr(p, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
        names.update(ENV_NAME.findall(getattr(p, "help", None) or ""))
    return names


def test_the_walk_sees_the_whole_tree() -> None:
    paths = {" ".join(p) for p, _ in COMMANDS}
    assert {"", "silences list", "verify schedule add", "engine serve", "gateway"} <= paths
    assert len(COMMANDS) > 40


@EACH_COMMAND
def test_help_fits_80_columns_cuts_no_name_and_shows_flags_as_flags(
    path: tuple[str, ...], command: Any
) -> None:
    text = help_at_80(*path)
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, "\n".join(wide)
    assert "…" not in text, text  # rich's mark of a cut word
    shown = set(re.findall(r"[A-Za-z0-9_]+", text))
    missing = {name for name in declared_env_names(command) if name not in shown}
    assert not missing, f"{sorted(missing)} not whole in:\n{text}"
    assert "<bool>" not in text and "BOOLEAN" not in text, text


@EACH_COMMAND
def test_every_command_and_group_says_what_it_does(path: tuple[str, ...], command: Any) -> None:
    assert (command.help or "").strip(), f"kvwatch {' '.join(path)} has no help text"
    short = command.get_short_help_str(limit=300)
    assert short.strip() and "\n" not in short, short
    if path:
        # ... and its parent's list of commands shows that description beside its name.
        listing = help_at_80(*path[:-1])
        row = next(line for line in listing.splitlines() if f"│ {path[-1]} " in line)
        assert row.split(path[-1], 1)[1].strip(" │"), row


def test_an_env_var_has_a_line_of_its_own_and_a_flag_no_type() -> None:
    (line,) = [ln for ln in help_at_80("verify").splitlines() if "KVWATCH_DEPLOYMENT_ID" in ln]
    assert line.strip(" │") == "[env var: KVWATCH_DEPLOYMENT_ID]", line
    assert re.search(r"│ +--yes +Do it", help_at_80("erase"))
    gateway = help_at_80("gateway")
    assert re.search(r"│ --tokenize-endpoint +Count", gateway), gateway
    assert re.search(r"│ --no-tokenize-endpoint +\S", gateway), gateway
