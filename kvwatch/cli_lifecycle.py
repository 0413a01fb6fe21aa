"""``kvwatch retention`` and ``kvwatch erase``: the data lifecycle."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated

import typer

from kvwatch.cli_common import DbUrl, database, err

retention_app = typer.Typer(
    help="How long request, pool and page data is kept, per deployment.", no_args_is_help=True
)
By = Annotated[str, typer.Option("--by", help="Who does it (audit log).")]


@retention_app.command("set")
def retention_set(
    deployment: Annotated[str, typer.Option(help="The deployment.")],
    days: Annotated[int, typer.Option(help="Days of data to keep (1-36500).")],
    by: By = "cli",
    database_url: DbUrl = None,
) -> None:
    """Set a deployment's retention (audited)."""
    from collector.lifecycle.retention import RetentionService

    with database(database_url) as (db, s):
        RetentionService(db, s.retention_days).set_policy(
            deployment, days, by=by, now=datetime.now(UTC)
        )
    err.print(f"{deployment}: keep {days} days")


@retention_app.command("show")
def retention_show(database_url: DbUrl = None) -> None:
    """Each deployment's retention (its policy, else KVWATCH_RETENTION_DAYS)."""
    from collector.lifecycle.retention import RetentionService

    with database(database_url) as (db, s):
        rows = RetentionService(db, s.retention_days).policies()
    for r in rows:
        days = "forever" if r["keep_days"] is None else f"{r['keep_days']} days"
        print(f"{r['deployment_id']}\t{days}\t{r['source'] or ''}".rstrip())


@retention_app.command("apply")
def retention_apply(
    dry_run: Annotated[bool, typer.Option(help="Count what would go; delete nothing.")] = False,
    by: By = "cli",
    database_url: DbUrl = None,
) -> None:
    """Delete request, pool and page data older than each deployment's retention, keeping
    what an open incident references. Prints the result as JSON."""
    from collector.lifecycle.retention import RetentionService

    with database(database_url) as (db, s):
        result = RetentionService(db, s.retention_days).apply(
            now=datetime.now(UTC), by=by, dry_run=dry_run
        )
    print(json.dumps(result, indent=2))


def erase(
    tenant: Annotated[str, typer.Option(help="The tenant whose records are removed.")],
    yes: Annotated[bool, typer.Option("--yes", help="Do it (there is no undo).")] = False,
    by: By = "cli",
    database_url: DbUrl = None,
) -> None:
    """Remove a tenant's records everywhere kvwatch stores them (requests, page events,
    alerts, notifications, reports, tokens), blank it where it was the other party, redact
    audit details naming it, and record the erasure in the audit log. Prints counts as JSON."""
    from collector.lifecycle.erasure import ErasureService

    if not yes:
        err.print(f"[red]error:[/] erasing {tenant!r} cannot be undone: add --yes")
        raise typer.Exit(2)
    with database(database_url) as (db, _):
        result = ErasureService(db).erase_tenant(tenant, by=by, now=datetime.now(UTC))
    print(json.dumps(result, indent=2))
