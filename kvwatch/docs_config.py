"""``docs/configuration.md``, generated from the settings classes so it cannot drift.

    python -m kvwatch.docs_config > docs/configuration.md      (or: make docs-config)

A table per pydantic-settings class (variable, type, default, the field's ``description``),
then the variables the command line reads (from the ``kvwatch`` command's options) and the
engine plugins' switches. ``tests/test_docs_config.py`` regenerates the page and fails when
the committed one differs: add or change a setting, then regenerate.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from collector.settings import Settings
from dashboard.settings import DashboardSettings
from engine_probe.settings import ProbeSettings, ProducerSettings
from kvwatch.gateway.settings import GatewaySettings

COMMAND = "python -m kvwatch.docs_config > docs/configuration.md"

#: (heading, class, what reads it). ProducerSettings is ProbeSettings' first fields.
SECTIONS: tuple[tuple[str, type[BaseSettings], str], ...] = (
    (
        "The collector",
        Settings,
        "`collector.settings.Settings`: read by `kvwatch serve` and by every command that opens "
        "the database (`kvwatch db`, `tokens`, `alerts`, `report`, `retention`, ...).",
    ),
    (
        "Producers: the probe, the engines, the scraper, the verifier",
        ProbeSettings,
        "`engine_probe.settings.ProbeSettings`: the probe inside an engine (refengine, the vLLM "
        "and SGLang plugins), `kvwatch scrape` and the gateway's records. "
        f"`{ProducerSettings.__name__}`, what `kvwatch verify` reads, is its first "
        f"{len(ProducerSettings.model_fields)} fields.",
    ),
    (
        "The gateway",
        GatewaySettings,
        "`kvwatch.gateway.settings.GatewaySettings`: `kvwatch gateway` (each option overrides "
        "its variable). Maps (tenant keys, safe contexts) are space-separated `NAME=VALUE` "
        'pairs (`KVWATCH_GATEWAY_TENANT_KEYS="acme=sk-1 globex=sk-2"`) or a JSON object.',
    ),
    (
        "The dashboard",
        DashboardSettings,
        "`dashboard.settings.DashboardSettings`: `kvwatch dashboard` (each option overrides "
        "its variable).",
    ),
)

#: Read with ``os.environ`` inside the engines, not through a settings class.
ENGINE_SWITCHES: tuple[tuple[str, str, str], ...] = (
    (
        "KVWATCH_VLLM_PROBE",
        "`1`",
        "vLLM plugin: `0` keeps the plugin off even with `KVWATCH_COLLECTOR_URL` set.",
    ),
    (
        "KVWATCH_SGLANG_PROBE",
        "unset",
        "SGLang plugin: `1` attaches the probe to every `ModelRunner`'s KV pools.",
    ),
    (
        "KVWATCH_SGLANG_ZEROIZE",
        "unset",
        "SGLang plugin: `1` zeroes freed KV pages (hardening; stale reads then report `zeroized`).",
    ),
)

INTRO = f"""\
# Configuration

*Generated from the settings classes by `{COMMAND}`
(`make docs-config`); do not edit it by hand. A setting's text is the `description=` of its
field: change it there and regenerate (`tests/test_docs_config.py` fails until the page
matches the code).*

Every setting is an environment variable: `KVWATCH_` and the field's name in capitals.
Where a command has an option for a setting (`--database-url`, `--port`, `--deployment`,
...), the option wins over the variable, and the variable over the default. Nothing is read
from a file: set the variables in the service's environment (a systemd unit, a container's
`env`). An exported but empty `KVWATCH_COLLECTOR_URL` or `KVWATCH_INGEST_TOKEN` counts as
unset (a probe is then a no-op).

**Secrets** (ingest and read tokens, tenant and upstream keys, `KVWATCH_METRICS_TOKEN`)
belong in variables rather than options: options show in the process list. Webhook secrets
are not settings: where they live, and who can read them, is in
[Policies](policies.md#notifications-webhooks-and-alertmanager).

A value of the wrong type or outside its range (the type column: `≥`, `>`, `≤`) is refused
when the settings are read: a `kvwatch` command stops with one line naming the variable,
exit 2.
"""


def _code(text: str) -> str:
    return f"`{text}`"


def _escape(text: str) -> str:
    """Markdown for a table cell: pipes escaped, and ``<`` ``>`` ``*`` outside code spans."""
    parts = re.split(r"(`[^`]*`)", text)
    out = [
        p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
        for p in parts
    ]
    return "".join(out).replace("|", "\\|").replace("\n", " ")


def _type_name(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " or ".join(_code(str(a)) for a in args)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in rest)
    if origin is list:
        return f"JSON list of {_type_name(args[0])}" if args else "JSON list"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    names = {str: "text", int: "integer", float: "number", bool: "boolean", Path: "path"}
    if ann in names:
        return names[ann]
    if ann is SecretStr:
        return "secret text"
    if isinstance(ann, type):
        return ann.__name__
    return str(ann)


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _constraints(field: FieldInfo) -> str:
    found: list[str] = []
    for meta in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(meta, attr, None)
            if isinstance(meta, annotated_types.BaseMetadata) and value is not None:
                found.append(f"{sign} {_number(value)}")
    return ", ".join(found)


def _type(field: FieldInfo) -> str:
    text = _type_name(field.annotation)
    bounds = _constraints(field)
    return f"{text}, {bounds}" if bounds else text


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f" ({n // size} {unit})"
    return ""


def _default(name: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None or value in ("", [], {}):
        return "unset"
    if isinstance(value, bool):
        return _code("true" if value else "false")
    if isinstance(value, int | float):
        shown = _code(_number(value))
        return shown + (_bytes(int(value)) if name.endswith("_bytes") else "")
    return _code(str(value))


def env_name(cls: type[BaseSettings], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias or field.alias
    if alias is not None and not isinstance(alias, str):
        raise TypeError(f"{cls.__name__}.{name}: only plain string aliases are documented")
    prefix = cls.model_config.get("env_prefix", "")
    return (alias or f"{prefix}{name}").upper()


def settings_table(cls: type[BaseSettings]) -> Iterator[str]:
    yield "| variable | type | default | meaning |"
    yield "| --- | --- | --- | --- |"
    for name, field in cls.model_fields.items():
        if not field.description:
            raise ValueError(f"{cls.__name__}.{name} has no description=")
        yield (
            f"| `{env_name(cls, name, field)}` | {_escape(_type(field))} | "
            f"{_escape(_default(name, field))} | {_escape(field.description)} |"
        )


def cli_variables() -> dict[str, dict[str, set[str]]]:
    """Variable -> option -> the ``kvwatch`` commands whose option reads it."""
    import typer.main

    from kvwatch.cli import app

    found: dict[str, dict[str, set[str]]] = {}

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, (*path, name))
        for param in cmd.params:
            envvar = getattr(param, "envvar", None)
            names = [envvar] if isinstance(envvar, str) else list(envvar or [])
            for var in names:
                option = max(param.opts, key=len)
                found.setdefault(var, {}).setdefault(option, set()).add(" ".join(path))

    walk(typer.main.get_command(app), ("kvwatch",))
    return found


def _commands(paths: set[str]) -> str:
    if len(paths) <= 3:
        return ", ".join(_code(p) for p in sorted(paths))
    groups = sorted({" ".join(p.split()[:2]) for p in paths})
    return f"{len(paths)} commands: " + ", ".join(_code(g) for g in groups)


def cli_table() -> Iterator[str]:
    yield "| variable | option | commands |"
    yield "| --- | --- | --- |"
    for var, options in sorted(cli_variables().items()):
        for option, paths in sorted(options.items()):
            yield f"| `{var}` | `{option}` | {_escape(_commands(paths))} |"


def render() -> str:
    lines = [INTRO]
    for heading, cls, what in SECTIONS:
        lines += [f"## {heading}", "", what, "", *settings_table(cls), ""]
    lines += [
        "## Command-line options read from variables",
        "",
        "Options of `kvwatch` commands that also read a variable (the variables of the "
        "classes above are read by the commands those name). Keys given this way stay out "
        "of the process list.",
        "",
        *cli_table(),
        "",
        "## Engine plugin switches",
        "",
        "Read by the plugins inside vLLM's and SGLang's processes, beside the producers' "
        "settings above; see [Probing vLLM](vllm.md) and [Probing SGLang](sglang.md).",
        "",
        "| variable | default | meaning |",
        "| --- | --- | --- |",
        *(f"| `{var}` | {default} | {_escape(text)} |" for var, default, text in ENGINE_SWITCHES),
        "",
        "`KVWATCH_TEST_*` variables are for kvwatch's own tests (fault injection, described on "
        "the engines' pages, and the test suite's PostgreSQL server, `KVWATCH_TEST_PG`): never "
        "set them in production.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
