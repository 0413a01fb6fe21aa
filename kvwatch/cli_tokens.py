"""``kvwatch tokens``: create, list, revoke and rotate API tokens (straight on the database,
like the other admin commands; the same operations are on ``/v1/tokens`` for an admin
token). A secret is printed once, alone on the last line, and never stored."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated

import typer

from collector.grace import DEFAULT_GRACE_S
from collector.tokens import TokenKind
from kvwatch.cli_common import (
    Col,
    DbUrl,
    KvwatchTyper,
    WideOpt,
    database,
    duration_option,
    err,
    relative,
    stdout_console,
    table,
    to_second,
)

tokens_app = KvwatchTyper(
    help="API tokens: create, list, revoke, rotate (each in the audit log).",
    no_args_is_help=True,
)


@tokens_app.command("create")
def tokens_create(
    kind: Annotated[TokenKind, typer.Option(help="What the token may do.")],
    tenant: Annotated[str | None, typer.Option(help="Scope a read token to one tenant.")] = None,
    deployment: Annotated[
        str | None, typer.Option(help="Scope an ingest token to one deployment.")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="A label for people, unique among valid tokens.")
    ] = None,
    expires_in: Annotated[
        str | None,
        typer.Option("--expires-in", metavar="DURATION", help="It stops working after, e.g. 90d."),
    ] = None,
    by: Annotated[str, typer.Option(help="Who creates it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """Create a token and print it once, alone on the last line. Only its hash is stored."""
    from collector.tokens import TokenService

    seconds = duration_option(expires_in, "--expires-in")
    with database(database_url) as (db, _):
        doc, secret = TokenService(db).create(
            kind=kind,
            tenant=tenant,
            deployment_id=deployment,
            name=name,
            expires_in_s=seconds,
            actor=by,
        )
    from policies.durations import human_duration

    scope = f" tenant={tenant}" if tenant else f" deployment={deployment}" if deployment else ""
    until = ""
    if doc["expires_at"] and seconds is not None:
        until = f", valid until {doc['expires_at']} (for {human_duration(seconds)})"
    err.print(f"created {kind} token #{doc['id']}{scope}{until}; it is shown once, store it now:")
    print(secret)


@tokens_app.command("list")
def tokens_list(
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """Every token: id, kind, scope, name, created, how long ago it was last used, how long
    until it expires, state (at 80 columns without created and last used: --wide). Never a
    secret. 'last used' is exact to within
    KVWATCH_TOKEN_USE_AUDIT_S (one audit entry per period)."""
    from collector.tokens import TokenService

    with database(database_url) as (db, _):
        docs = TokenService(db).list()
    if as_json:
        print(json.dumps(docs, indent=2))
        return
    now = datetime.now(UTC)
    rows = table(
        Col("id", nowrap=True), Col("kind", nowrap=True), "scope", "name",
        Col("created", wide=True), Col("last used", wide=True), "expires",
        Col("state", nowrap=True), wide=wide,
    )  # fmt: skip
    for d in docs:
        scope = (
            f"tenant={d['tenant']}"
            if d["tenant"]
            else f"deployment={d['deployment_id']}"
            if d["deployment_id"]
            else "-"
        )
        rows.add_row(
            str(d["id"]),
            d["kind"],
            scope,
            d["name"] or "-",
            to_second(d["created_at"]),
            relative(d["last_used_at"], now) or "never",
            relative(d["expires_at"], now) or "never",
            d["state"],
        )
    stdout_console().print(rows)


@tokens_app.command("revoke")
def tokens_revoke(
    token: Annotated[
        str,
        typer.Argument(
            metavar="ID_OR_NAME",
            help="Token id (18, #18, id:18) or unique name (name:NAME for any name).",
        ),
    ],
    keep_previous: Annotated[
        bool,
        typer.Option(
            "--keep-previous",
            help="Leave the tokens it replaced (by rotation) to their grace period.",
        ),
    ] = False,
    by: Annotated[str, typer.Option(help="Who revokes it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """Revoke a token now, and the tokens it replaced by rotation that still work (the old
    secret, usually the leaked one), unless --keep-previous. Every collector stops accepting
    them within KVWATCH_TOKEN_CACHE_S (5s by default)."""
    from collector.tokens import TokenService
    from policies.durations import format_duration

    with database(database_url) as (db, settings):
        doc = TokenService(db).revoke(token, actor=by, keep_previous=keep_previous)
    lag = format_duration(settings.token_cache_s)  # a setting, shown as configured
    also = ", ".join(f"#{i}" for i in doc["also_revoked"])
    err.print(
        f"token #{doc['id']} ({doc['kind']}, {doc['name'] or doc['prefix']}) revoked at "
        f"{doc['revoked_at']}"
        + (f", with the tokens it replaced ({also})" if also else "")
        + f"; collectors refuse {'them' if also else 'it'} within {lag}"
    )


@tokens_app.command("rotate")
def tokens_rotate(
    token: Annotated[
        str,
        typer.Argument(
            metavar="ID_OR_NAME",
            help="Token id (18, #18, id:18) or unique name (name:NAME for any name).",
        ),
    ],
    grace: Annotated[
        str,
        typer.Option(metavar="DURATION", help="How long the old token keeps working (≤ 30d)."),
    ] = f"{DEFAULT_GRACE_S // 3600}h",
    expires_in: Annotated[
        str | None,
        typer.Option("--expires-in", metavar="DURATION", help="The new token's lifetime."),
    ] = None,
    by: Annotated[str, typer.Option(help="Who rotates it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """A new token with the same kind, scope and name, printed once on the last line; the
    old one keeps working for --grace so probes can be reconfigured without losing events
    (a probe's events stay its own across the rotation)."""
    from collector.tokens import TokenService

    grace_s = duration_option(grace, "--grace")
    assert grace_s is not None
    with database(database_url) as (db, _):
        new, secret, old = TokenService(db).rotate(
            token,
            actor=by,
            grace_s=grace_s,
            expires_in_s=duration_option(expires_in, "--expires-in"),
        )
    until = (
        f"#{old['id']} was already {old['state']}"
        if old["state"] != "valid"
        else f"#{old['id']} works until {old['expires_at']} "
        f"({relative(old['expires_at'], datetime.now(UTC))})"
    )
    err.print(
        f"token #{new['id']} replaces #{old['id']} ({new['kind']}); {until}. The new token "
        "is shown once, store it now:"
    )
    print(secret)
