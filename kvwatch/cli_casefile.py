"""``kvwatch incidents export`` (the case file) and its offline check, ``kvwatch report
verify --bundle DIR`` (collector/cases/casefile.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from kvwatch.cli_common import DbUrl, database, err


def incidents_export(
    incident_id: Annotated[int, typer.Argument(help="The incident.", min=1)],
    out: Annotated[Path, typer.Option("--out", help="An empty (or new) directory.")],
    by: Annotated[str, typer.Option(help="Who exports it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """Write the incident's case file, one signed bundle: the breach assessment (JSON, CSV of
    the affected requests, PDF, signature), the notices sent, the notifications and decision
    register, the audit extract with a signed checkpoint, the public key set, and a signed
    manifest of every file's SHA-256. `kvwatch report verify --bundle DIR` checks it offline.
    Recorded in the audit log (case.export). Prints the files."""
    from collector.cases.casefile import MANIFEST, MANIFEST_SIG, CaseFiles

    with database(database_url) as (db, s):
        manifest = CaseFiles(db, s).export(incident_id, out, actor=by, now=datetime.now(UTC))
    err.print(
        f"case file of incident {incident_id}: report {manifest['report_id']}, "
        f"{len(manifest['notices'])} notice(s), {manifest['decisions']} decision(s), "
        f"{manifest['audit']['entries']} audit entries",
        markup=False,
    )
    for name in [*manifest["files"], MANIFEST, MANIFEST_SIG]:
        typer.echo(str(out / name))


def verify_case_bundle(bundle: Path, keys: Path | None) -> None:
    """``kvwatch report verify --bundle``: exit 0 intact, 1 altered, 2 not a case file."""
    from collector.cases.casefile import KEYS, verify_case
    from collector.errors import CollectorError
    from collector.reports.signed import Unreadable
    from collector.signing import load_key_set

    try:
        if keys is not None:
            key_set: dict[str, Any] = load_key_set(keys)
        else:
            key_set = load_key_set(bundle / KEYS)
            kids = ", ".join(k.get("kid", "?") for k in key_set["keys"])
            err.print(
                f"warning: no --keys given: checked against the case file's own key set "
                f"({kids}). Compare these key ids with the published ones (GET "
                "/v1/signing-keys, kvwatch keys public): anyone can sign with a key of their "
                "own.",
                markup=False,
            )
        check = verify_case(bundle, key_set)
    except (CollectorError, Unreadable) as exc:
        err.print(f"error: {getattr(exc, 'message', None) or exc}", markup=False)
        raise typer.Exit(2) from None
    for line in check.lines:
        typer.echo(f"intact: {line}")
    if check.ok:
        typer.echo(f"intact: case file {bundle}")
        return
    err.print(f"ALTERED: case file {bundle}", markup=False)
    for line in check.problems:
        err.print(f"  {line}", markup=False)
    raise typer.Exit(1)
