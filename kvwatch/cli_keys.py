"""``kvwatch keys``: the signing keys (generate, rotate, list, publish the public set).

Keys live in the key directory (``KVWATCH_SIGNING_KEY_DIR``; docs/signing.md). Generating and
rotating are written to the audit log; rotating keeps the old key's public half published, so
what it signed stays verifiable.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from kvwatch.cli_common import DbUrl, KvwatchTyper, database, err, settings, stdout_console, table

keys_app = KvwatchTyper(
    help="Signing keys: generate, rotate, list, public (each change in the audit log).",
    no_args_is_help=True,
)
By = Annotated[str, typer.Option("--by", help="Who does it (audit log).")]


@keys_app.command("generate")
def keys_generate(by: By = "cli", database_url: DbUrl = None) -> None:
    """Make the first signing key (an error when there is one: rotate it instead). Prints its
    key id."""
    from collector.keys import KeyAdmin

    with database(database_url) as (db, s):
        kid = KeyAdmin(db, s.key_ring()).generate(actor=by, now=datetime.now(UTC))
        err.print(f"signing key made in {s.key_ring().directory}", markup=False)
    typer.echo(kid)


@keys_app.command("rotate")
def keys_rotate(by: By = "cli", database_url: DbUrl = None) -> None:
    """Make a new current key and retire the old one: its private half is deleted, its
    public half stays in the published set (old signatures stay verifiable). Prints the new
    key id."""
    from collector.keys import KeyAdmin

    with database(database_url) as (db, s):
        old, new = KeyAdmin(db, s.key_ring()).rotate(actor=by, now=datetime.now(UTC))
    err.print(f"retired {old or '(none)'}; current {new}: publish the key set again", markup=False)
    typer.echo(new)


@keys_app.command("list")
def keys_list(database_url: DbUrl = None) -> None:
    """Every key of the published set, oldest first: id, made, retired."""
    ring = settings(database_url).key_ring()
    keys = ring.public_set()["keys"]
    if not keys:
        err.print(f"no signing key in {ring.directory} (kvwatch keys generate)", markup=False)
        return
    t = table("kid", "created", "retired", "state")
    for k in keys:
        retired = k.get("kvwatch_retired_at")
        t.add_row(
            k["kid"],
            k.get("kvwatch_created_at", "-"),
            retired or "-",
            "retired" if retired else "current",
        )
    stdout_console().print(t)


@keys_app.command("public")
def keys_public(
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the JWK set here (default: stdout).")
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """The public JWK set to publish (every key, retired ones included; never a private
    half). The same set is served at GET /v1/signing-keys."""
    doc = settings(database_url).key_ring().public_set()
    text = json.dumps(doc, indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        err.print(f"[red]error:[/] --out {out}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    typer.echo(str(out))
