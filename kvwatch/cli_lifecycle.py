"""``kvwatch retention`` and ``kvwatch erase``: the data lifecycle."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated

import typer

from kvwatch.cli_common import DbUrl, KvwatchTyper, database, err

retention_app = KvwatchTyper(
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
    compact: Annotated[
        bool,
        typer.Option(
            "--compact",
            help="Also rewrite the files: VACUUM on SQLite, VACUUM FULL of the changed tables "
            "on PostgreSQL (an exclusive lock while it runs).",
        ),
    ] = False,
    by: By = "cli",
    database_url: DbUrl = None,
) -> None:
    """Remove a tenant's name and request ids from every table, in one transaction: its own
    rows and the alerts, notifications, silences and reports about it are deleted; other
    tenants' records and documents that name it (as a whole id, JSON walked) have the name
    replaced by <erased>; audit details naming it are redacted. The audit chain's hashes
    and the fields they cover are kept, so `kvwatch audit verify` still passes. On SQLite
    the freed bytes are zeroed and the WAL checkpointed; on PostgreSQL they stay until VACUUM
    (--compact runs it). Prints, as JSON, the rows removed and rewritten per table, what was
    kept and why, and what may still hold the erased bytes."""
    from collector.lifecycle.erasure import ErasureService

    if not yes:
        err.print(f"[red]error:[/] erasing {tenant!r} cannot be undone: add --yes")
        raise typer.Exit(2)
    with database(database_url) as (db, _):
        result = ErasureService(db).erase_tenant(
            tenant, by=by, now=datetime.now(UTC), compact=compact
        )
    print(json.dumps(result, indent=2))
    removed = ", ".join(f"{t} {n}" for t, n in result["removed"].items()) or "nothing"
    rewritten = ", ".join(f"{t} {n}" for t, n in result["rewritten"].items()) or "nothing"
    log = result["audit_log"]
    n = result["request_ids"]
    err.print(f"erased tenant {tenant!r} and its {n} request id(s)", markup=False)
    err.print(f"rows removed: {removed}", markup=False)
    err.print(f"rows rewritten (name or ids replaced): {rewritten}", markup=False)
    err.print(f"audit entries redacted: {log['redacted']}", markup=False)
    for what, why in result["kept"].items():
        err.print(f"kept ({what}): {why}", markup=False)
    err.print(f"may still hold the erased bytes: {result['storage']['remains']}", markup=False)
    if log["named_in_hashed_fields"]:
        ids = ", ".join(map(str, log["named_in_hashed_fields"]))
        err.print(f"audit entries still naming it in hashed fields: {ids}", markup=False)
