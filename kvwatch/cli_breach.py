"""``kvwatch report breach``: the breach assessment of an incident or a window, written as
JSON, CSV (the affected requests) and the audit PDF."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from collector.timefmt import parse_bounded
from kvwatch.cli_common import DbUrl, database, err


def _when(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_bounded(value)
    except ValueError as exc:
        err.print(f"[red]error:[/] {name}: not an ISO 8601 time in range: {value!r} ({exc})")
        raise typer.Exit(2) from None


def breach(
    out: Annotated[Path, typer.Option("--out", help="Directory for the three files.")],
    incident: Annotated[int | None, typer.Option("--incident", help="Incident id.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model id (window).")] = None,
    since: Annotated[
        str | None, typer.Option(help="Window start, ISO 8601 (UTC if naive).")
    ] = None,
    until: Annotated[str | None, typer.Option(help="Window end, ISO 8601 (UTC if naive).")] = None,
    min_prompt_tokens: Annotated[
        int | None, typer.Option("--min-prompt-tokens", min=0, help="Smallest prompt counted.")
    ] = None,
    deployment: Annotated[
        str | None, typer.Option(help="Limit a window to one deployment.")
    ] = None,
    late_reason: Annotated[
        str | None, typer.Option(help="Why notification is late (past the deadline).")
    ] = None,
    by: Annotated[str, typer.Option(help="Who generates it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """Breach assessment of --incident ID, or of --model M --since T --until T: writes
    breach-<id>.json/.csv/.pdf to --out, records it in the audit log, prints the paths."""

    from collector.reports.breach import BreachScope, BreachService
    from collector.reports.breach_model import to_document
    from collector.reports.breach_pdf import render_pdf
    from collector.reports.signed import report_json_bytes, sig_path
    from collector.reports.stored import ReportStore

    if incident is not None and model is not None:
        err.print("[red]error:[/] give --incident, or --model with --since and --until, not both")
        raise typer.Exit(2)
    scope = BreachScope(
        incident_id=incident,
        model_id=model,
        since=_when(since, "--since"),
        until=_when(until, "--until"),
        min_prompt_tokens=min_prompt_tokens,
        deployment_id=deployment,
    )
    with database(database_url) as (db, s):
        service = BreachService(db, s)
        report = service.create(scope, created_by=by, late_reason=late_reason)
        signature = ReportStore(db).signature(report.report_id)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"breach-{report.report_id}"
        paths = [stem.with_suffix(".json"), stem.with_suffix(".csv"), stem.with_suffix(".pdf")]
        # Every affected request, streamed from the database into a .part file that becomes
        # the CSV only once its rows are the ones the report counted.
        part = stem.with_suffix(".csv.part")
        try:
            with part.open("wb") as fh:
                service.write_csv(report, fh.write)
            part.replace(paths[1])
        finally:
            part.unlink(missing_ok=True)
    doc = to_document(report)
    _write_whole(paths[0], report_json_bytes(doc))
    _write_whole(paths[2], render_pdf(report))
    if signature is not None:
        _write_whole(sig_path(stem), signature.encode())
        paths.append(sig_path(stem))
    for p in paths:
        typer.echo(str(p))


def _write_whole(path: Path, data: bytes) -> None:
    """``path`` appears whole or not at all (written beside it, then renamed): a command
    killed midway leaves a ``.part`` file, never a truncated report."""
    part = path.with_name(path.name + ".part")
    try:
        part.write_bytes(data)
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)


def report_verify(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Files to check: a report's .json, .csv, .pdf, or any file with a .sig "
            "beside it (a notice's .json/.md/.pdf)."
        ),
    ] = None,
    keys: Annotated[
        Path | None,
        typer.Option(
            "--keys",
            help="The published key set (a JWK set file, or a key directory); default: the "
            "configured key directory's public set.",
        ),
    ] = None,
    bundle: Annotated[
        Path | None,
        typer.Option(help="Check a case file (kvwatch incidents export) offline instead."),
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Check files against their signatures (``S.sig`` beside ``S.json/.csv/.pdf``): the
    signature against the published keys (which key, and whether it is retired), the file's
    SHA-256, and when it differs, exactly what: a JSON path by path against the signed
    conclusions, a CSV by recounting its rows, a PDF by reading its text back. A breach
    report without a .sig (made before signing) has its evidence hash checked, and is said
    to be unsigned. Exit 0 intact, 1 altered (or a signature that does not verify), 2
    unreadable."""
    from collector.errors import CollectorError
    from collector.reports.signed import Unreadable, check_signed_file, key_words, sig_path

    if bundle is not None:
        from kvwatch.cli_casefile import verify_case_bundle

        verify_case_bundle(bundle, keys)
        return
    if not paths:
        err.print("[red]error:[/] give the files to check, or --bundle DIR")
        raise typer.Exit(2)
    key_set: dict[str, object] | None = None  # read when a signed file needs it
    worst = 0
    for path in paths:
        if path.suffix == ".sig" and path.is_file():  # a signature given itself (a glob)
            key_set = key_set or _key_set(keys, database_url)
            code, line = _signature_alone(path, key_set)
            worst = _worse(worst, code)
            (typer.echo if code == 0 else _eprint)(line)
            continue
        if not sig_path(path).exists():
            code, line = _unsigned_check(path)
            worst = _worse(worst, code)
            (typer.echo if code == 0 else _eprint)(line)
            continue
        key_set = key_set or _key_set(keys, database_url)
        try:
            check = check_signed_file(path, key_set)
        except (Unreadable, CollectorError) as exc:
            _eprint(f"error: {path}: {exc}")
            worst = _worse(worst, 2)
            continue
        if check.ok:
            typer.echo(f"intact: {path} ({check.summary})")
            continue
        worst = _worse(worst, 1)
        _eprint(f"ALTERED: {path} ({check.summary})")
        for p in check.problems:
            _eprint(f"  {p}")
        if check.signed is None:
            continue
        if check.signed.retired_at:
            _eprint(f"  (signed by {key_words(check.signed)})")
    if worst:
        raise typer.Exit(worst)


def _signature_alone(path: Path, key_set: dict[str, object]) -> tuple[int, str]:
    """A ``.sig`` given on its own: does it verify, and what does it sign (the files are
    checked when they are given)."""
    from collector.reports.signed import key_words
    from collector.signing import SignatureInvalid, verify

    try:
        v = verify(path.read_text(encoding="ascii"), key_set)
    except (OSError, UnicodeDecodeError) as exc:
        return 2, f"error: {path}: {exc}"
    except SignatureInvalid as exc:
        return 1, f"ALTERED: {path}: the signature does not verify: {exc.message}"
    files = ", ".join(sorted(v.claims.get("files", {})))
    return 0, f"valid: {path} ({v.claims.get('sub')}, by {key_words(v)}; signs {files})"


def _eprint(line: str) -> None:
    err.print(line, markup=False, highlight=False)


def _worse(a: int, b: int) -> int:
    """Altered (1) outranks unreadable (2): a forgery is the finding, whatever else."""
    if 1 in (a, b):
        return 1
    return max(a, b)


def _key_set(keys: Path | None, database_url: str | None) -> dict[str, object]:
    """The key set signatures are checked against: ``--keys``, else the configured key
    directory's published set (exit 2 when there is none)."""
    from collector.errors import CollectorError
    from collector.signing import load_key_set
    from kvwatch.cli_common import settings

    try:
        if keys is not None:
            if not keys.exists():
                raise FileNotFoundError(f"--keys {keys}: no such file or directory")
            doc = load_key_set(keys)
            where = str(keys)
        else:
            ring = settings(database_url).key_ring()
            doc, where = ring.public_set(), str(ring.directory)
    except (CollectorError, FileNotFoundError) as exc:
        _eprint(f"error: {getattr(exc, 'message', None) or exc}")
        raise typer.Exit(2) from None
    if not doc.get("keys"):
        _eprint(f"error: no published signing key in {where} (give --keys FILE)")
        raise typer.Exit(2)
    return doc


def _unsigned_check(path: Path) -> tuple[int, str]:
    """A breach report's file without a signature (made before reports were signed):
    recompute its evidence hash. A .json is checked against the hash it records; a .csv
    against the .json beside it (same name): its first line must name that hash, and its rows
    must be that report's. Returns (exit code, the line to print)."""
    import json

    from collector.reports.breach import check_csv
    from collector.reports.breach_model import (
        EVIDENCE_KEYS,
        UnreadableReport,
        evidence_digest,
        from_document,
    )

    if path.suffix not in (".json", ".csv"):
        return 2, f"error: {path}: no signature beside it ({path.with_suffix('.sig').name})"
    json_path = path.with_suffix(".json")
    try:
        report = json.loads(json_path.read_text(encoding="utf-8"))
        recorded, report_id = report["evidence_sha256"], report["report_id"]
        if report.get("kind") != "breach":
            raise KeyError("kind")
        missing = [k for k in EVIDENCE_KEYS if k not in report]
        if missing:
            raise ValueError(f"no {', '.join(missing)} section")
    except FileNotFoundError:
        return 2, f"error: {json_path}: no such file (a .csv is checked with its .json)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return 2, f"error: {json_path}: not a kvwatch breach report ({exc})"
    recomputed = evidence_digest(report)
    problems = []
    if recomputed != recorded:
        problems.append(f"the evidence hashes to {recomputed}, the report records {recorded}")
    if path.suffix == ".csv":
        try:
            typed = from_document(report)
        except UnreadableReport as exc:
            if not problems:  # intact, of a schema this kvwatch cannot recount a CSV against
                return 2, f"error: {json_path}: {exc.message}"
            return 1, f"ALTERED: {path} ({report_id}, unsigned): {problems[0]}; {exc.message}"
        try:
            # Streamed: a report's CSV can list millions of requests.
            with path.open(encoding="utf-8", newline="") as fh:
                wrong = check_csv(typed, fh)
        except (OSError, UnicodeDecodeError) as exc:
            return 2, f"error: {path}: {getattr(exc, 'strerror', None) or exc}"
        if wrong:
            problems.append(
                f"{path.name} is not the affected-request list of {json_path.name} "
                f"({'; '.join(wrong)})"
            )
    if problems:
        return 1, f"ALTERED: {path} ({report_id}, unsigned): " + "; ".join(problems)
    return 0, f"intact: {path} ({report_id}, unsigned), evidence_sha256 {recorded}"


def report_notice(
    incident: Annotated[int, typer.Option("--incident", help="Incident id.")],
    tenant: Annotated[str, typer.Option(help="The tenant (customer) the notice is for.")],
    out: Annotated[Path, typer.Option("--out", help="The file to write: .pdf, .json or .md.")],
    by: Annotated[str, typer.Option(help="Who generates it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """The notice to one tenant about an incident: what happened to its requests (the other
    party only as "another customer"), the request to delete what it received, the measures
    and the contact point. Never another tenant's name or request ids."""
    import json
    from datetime import UTC, datetime

    from collector.reports.notice import NoticeService, render_pdf, to_markdown

    if out.suffix not in (".pdf", ".json", ".md"):
        err.print(f"[red]error:[/] --out {out}: the file must end in .pdf, .json or .md")
        raise typer.Exit(2)
    if not out.parent.is_dir():
        err.print(f"[red]error:[/] --out {out}: no such directory {out.parent}")
        raise typer.Exit(2)
    with database(database_url) as (db, s):
        doc = NoticeService(db, s).notice(incident, tenant, created_by=by, now=datetime.now(UTC))
    if out.suffix == ".pdf":
        out.write_bytes(render_pdf(doc))
    elif out.suffix == ".md":
        out.write_text(to_markdown(doc), encoding="utf-8")
    else:
        out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    typer.echo(str(out))
