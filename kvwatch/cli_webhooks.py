"""``kvwatch webhooks``: notification endpoints, and checking a delivery's signature."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy import Connection

from collector.grace import DEFAULT_GRACE_S
from collector.timefmt import iso, now_micros, to_micros
from kvwatch.cli_common import (
    Col,
    DbUrl,
    KvwatchTyper,
    WideOpt,
    database,
    duration_option,
    err,
    moment,
    stdout_console,
    table,
)

webhooks_app = KvwatchTyper(
    help="Notification endpoints (signed webhooks, Alertmanager) and signature checks.",
    no_args_is_help=True,
)


@contextmanager
def _db(database_url: str | None, *, write: bool = True) -> Iterator[Connection]:
    """A transaction on the migrated database; collector errors become exit code 2."""
    with database(database_url) as (db, _), db.write() if write else db.read() as conn:
        yield conn


@webhooks_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="A unique name for the endpoint.")],
    url: Annotated[str, typer.Argument(help="http(s) URL (Alertmanager: its base URL).")],
    kind: Annotated[
        str,
        typer.Option(
            help="webhook (signed POSTs) | alertmanager (its /api/v2/alerts) | pagerduty "
            "(Events API v2: https://events.pagerduty.com/v2/enqueue, --secret ROUTING_KEY)."
        ),
    ] = "webhook",
    format: Annotated[
        str | None,
        typer.Option(
            "--format", help="Webhook body: kvwatch | alertmanager (webhook v4). [kvwatch]"
        ),
    ] = None,
    min_severity: Annotated[
        str, typer.Option(help="Least severity sent: info | warning | critical.")
    ] = "info",
    secret: Annotated[
        str | None,
        typer.Option(
            help="A whsec_ signing secret to use instead of a new one; for pagerduty, the "
            "service's routing key (required)."
        ),
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Add an endpoint; a webhook's new secret is printed once, alone on the last line.

    The collector POSTs to whatever host the URL names, internal ones included: only let
    trusted operators add endpoints."""
    from collector.notify.outbox import add_endpoint, redacted_url

    with _db(database_url) as conn:
        endpoint_id, new_secret = add_endpoint(
            conn,
            name,
            url,
            kind=kind,
            format=format,
            min_severity=min_severity,
            secret=secret,
            now_us=now_micros(),
        )
    err.print(f"added {kind} endpoint #{endpoint_id} {name!r} -> {redacted_url(url)}")
    if new_secret is not None:
        err.print("its signing secret is shown once; give it to the receiver now:")
        print(new_secret)


@webhooks_app.command("list")
def list_(
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """List endpoints: state, pending messages, why one is disabled (at 80 columns without the
    kind and format: --wide). Never a secret."""
    from collector.notify.outbox import list_endpoints
    from policies.durations import human_duration

    now = datetime.now(UTC)
    with _db(database_url, write=False) as conn:
        endpoints = list_endpoints(conn, to_micros(now))
    if as_json:
        for e in endpoints:
            print(json.dumps(_endpoint_doc(e), sort_keys=True))
        return
    if not endpoints:
        err.print("no endpoints")
        return
    t = table(
        Col("name", nowrap=True), Col("kind", wide=True), Col("format", wide=True),
        Col("least", nowrap=True), "url", Col("pending", nowrap=True), "state", wide=wide,
    )  # fmt: skip
    for e in endpoints:
        state = "enabled" if e.enabled else f"DISABLED ({e.disabled_reason})"
        if e.previous_secret_until is not None:
            left = human_duration((e.previous_secret_until - now).total_seconds())
            state += f"; old secret signs {left} more"
        t.add_row(e.name, e.kind, e.format, e.min_severity, e.url, str(e.pending), state)
    stdout_console().print(t)


def _endpoint_doc(e: Any) -> dict[str, Any]:
    """An endpoint as JSON: what the table shows, never its secret."""
    return {
        "name": e.name,
        "kind": e.kind,
        "format": e.format,
        "min_severity": e.min_severity,
        "url": e.url,
        "pending": e.pending,
        "enabled": e.enabled,
        "disabled_reason": e.disabled_reason,
        "previous_secret_until": iso(e.previous_secret_until),
    }


@webhooks_app.command("remove")
def remove(name: str, database_url: DbUrl = None) -> None:
    """Remove an endpoint and its undelivered messages."""
    from collector.notify.outbox import remove_endpoint

    with _db(database_url) as conn:
        dropped = remove_endpoint(conn, name, now_us=now_micros())
    err.print(f"removed {name!r}; {dropped} undelivered message(s) dropped with it")


@webhooks_app.command("rotate-secret")
def rotate_secret(
    name: str,
    secret: Annotated[
        str | None,
        typer.Option(
            help="The whsec_ secret to use instead of a new one; for pagerduty, the new "
            "routing key (required)."
        ),
    ] = None,
    grace: Annotated[
        str,
        typer.Option(
            metavar="DURATION",
            help="How long the replaced secret keeps signing beside the new one (each message "
            "carries both signatures), for the receiver to switch: 90m, 24h, 7d; 0 stops it at "
            "once (a leaked secret). Webhooks only; ≤ 30d.",
        ),
    ] = f"{DEFAULT_GRACE_S // 3600}h",
    database_url: DbUrl = None,
) -> None:
    """Give an endpoint a new signing secret in place: its undelivered messages stay queued
    and go out signed with the new one, and during --grace with the replaced one too (a
    webhook's new secret is printed once, alone on the last line)."""
    from collector.notify.outbox import rotate_secret as rotate

    grace_s = duration_option(grace, "--grace")
    assert grace_s is not None
    with _db(database_url) as conn:
        new, kept_until = rotate(conn, name, secret=secret, grace_s=grace_s, now_us=now_micros())
    signed = "signed with it"
    if kept_until is not None:
        signed += (
            f", and with the replaced secret too until {moment(iso(kept_until), datetime.now(UTC))}"
        )
    err.print(f"rotated the secret of {name!r}; undelivered messages go out {signed}")
    if secret is None:
        err.print("the new signing secret is shown once; give it to the receiver now:")
        print(new)


@webhooks_app.command("enable")
def enable(name: str, database_url: DbUrl = None) -> None:
    """Enable an endpoint again (after a 410 Gone); its pending messages resume in order."""
    from collector.notify.outbox import enable_endpoint

    with _db(database_url) as conn:
        enable_endpoint(conn, name, now_us=now_micros())
    err.print(f"enabled {name!r}")


@webhooks_app.command("verify")
def verify(
    secret: Annotated[str, typer.Option(help="The endpoint's whsec_ secret.")],
    body_file: Annotated[
        Path, typer.Option("--body-file", help="The raw request body, as received ('-': stdin).")
    ],
    id: Annotated[str, typer.Option("--id", help="The webhook-id header.")],
    timestamp: Annotated[str, typer.Option(help="The webhook-timestamp header.")],
    signature: Annotated[str, typer.Option(help="The webhook-signature header.")],
    tolerance: Annotated[
        float, typer.Option(help="Seconds the timestamp may be off from now.")
    ] = 300,
) -> None:
    """Check a delivery's Standard Webhooks signature.

    Exit 0 if valid, 1 if not (the reason on stderr), 2 if the secret or body is unusable."""
    import sys

    from collector.errors import InvalidInput
    from collector.notify.signing import WebhookVerificationError
    from collector.notify.signing import verify as verify_signature

    try:
        body = sys.stdin.buffer.read() if str(body_file) == "-" else body_file.read_bytes()
    except OSError as exc:
        err.print(f"[red]error:[/] cannot read the body: {exc}")
        raise typer.Exit(2) from None
    headers = {"webhook-id": id, "webhook-timestamp": timestamp, "webhook-signature": signature}
    try:
        verify_signature(secret, headers, body, tolerance_s=tolerance)
    except WebhookVerificationError as exc:
        err.print(f"invalid: {exc.message}")
        raise typer.Exit(1) from None
    except InvalidInput as exc:
        err.print(f"[red]error:[/] {exc.message}")
        raise typer.Exit(2) from None
    err.print("valid")
