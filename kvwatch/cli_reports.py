"""``kvwatch report`` (inventory, limits card) and ``kvwatch audit`` (the hash chain), through
the same services as the HTTP API."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from collector.errors import CollectorError
from collector.timefmt import iso, parse_bounded
from kvwatch.cli_common import (
    Col,
    DbUrl,
    KvwatchTyper,
    WideOpt,
    database,
    err,
    stdout_console,
    table,
)

# `kvwatch report breach` (kvwatch/cli_breach.py) joins this app: kvwatch/cli.py registers it
# with `report_app.command("breach")(breach)`.
report_app = KvwatchTyper(
    help="Reports: breach assessment, inventory, limits card, quarterly review.",
    no_args_is_help=True,
)
audit_app = KvwatchTyper(help="The hash-chained audit log.", no_args_is_help=True)


def _when(value: str) -> datetime:
    """An ISO 8601 instant (naive: UTC); a bad one is a usage error (exit 2)."""
    try:
        return parse_bounded(value)
    except ValueError as exc:
        raise typer.BadParameter(f"{value!r} is not an ISO 8601 time in range ({exc})") from None


def _json_default(o: Any) -> Any:
    if isinstance(o, datetime):
        return iso(o)
    raise TypeError(f"cannot serialise {type(o).__name__}")


def _dumps(doc: Any) -> str:
    return json.dumps(doc, indent=2, default=_json_default)


def _cell_time(dt: datetime | None) -> str:
    """A table cell: the JSON format, to the second."""
    return "" if dt is None else iso(dt.replace(microsecond=0))


Since = Annotated[
    datetime,
    typer.Option(parser=_when, metavar="TIME", help="Window start (ISO 8601; naive is UTC)."),
]
Until = Annotated[
    datetime, typer.Option(parser=_when, metavar="TIME", help="Window end (exclusive).")
]


@report_app.command("inventory")
def report_inventory(
    model: Annotated[str, typer.Option("--model", help="The model id.")],
    since: Since,
    until: Until,
    min_prompt_tokens: Annotated[
        int | None, typer.Option(min=0, help="Count prompts of at least this many tokens.")
    ] = None,
    deployment: Annotated[str | None, typer.Option(help="Only this deployment.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """Which deployments, tenants and routes called MODEL in [SINCE, UNTIL): requests, distinct
    prompts, requests with prompts of at least N tokens, the largest prompt, first and last seen
    (at 80 columns without the route and first seen: --wide)."""
    from collector.reports.inventory import InventoryQuery, InventoryService

    q = InventoryQuery(
        model_id=model,
        since=since,
        until=until,
        min_prompt_tokens=min_prompt_tokens,
        deployment_id=deployment,
    )
    with database(database_url) as (db, _):
        doc = InventoryService(db).inventory(q)
    if as_json:
        print(_dumps(doc))
        return
    cols: list[str | Col] = ["deployment", "tenant", Col("route", wide=True), "requests", "prompts"]
    if min_prompt_tokens is not None:
        cols.append(f"prompt ≥ {min_prompt_tokens}")
    t = table(*cols, "max prompt", Col("first seen", wide=True), "last seen", wide=wide)
    for r in doc["rows"]:
        cells = [
            r["deployment_id"],
            r["tenant"],
            r["route"] or "",
            str(r["requests"]),
            str(r["prompts"]),
        ]
        if min_prompt_tokens is not None:
            cells.append(str(r["at_or_above"]))
        mx = r["max_prompt_tokens"]
        cells += [
            "" if mx is None else str(mx),
            _cell_time(r["first_seen"]),
            _cell_time(r["last_seen"]),
        ]
        t.add_row(*cells)
    stdout_console().print(t)
    tot = doc["totals"]
    above = ""
    if min_prompt_tokens is not None:
        above = f", {tot['at_or_above']} with prompt >= {min_prompt_tokens}"
    largest = tot["max_prompt_tokens"] if tot["max_prompt_tokens"] is not None else "-"
    err.print(
        f"{tot['requests']} requests ({tot['prompts']} distinct prompts) to {model} from "
        f"{tot['tenants']} tenant(s){above}; "
        f"largest prompt {largest}"
    )


class CardFormat(StrEnum):
    json = "json"
    md = "md"
    pdf = "pdf"


@report_app.command("limits")
def report_limits(
    deployment: Annotated[str, typer.Option(help="The deployment id.")],
    format: Annotated[
        CardFormat, typer.Option("--format", help="json, md or pdf (pdf needs --out).")
    ] = CardFormat.md,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Write limits-<deployment>.<format> into this directory."),
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """The deployment's limits card: the verdict per model (verified safe context and when,
    UNSAFE with the leak, or not verified), advertised context, pool capacity, and whether the
    verification is stale."""
    from collector.reports.limits import LimitsService, to_markdown
    from collector.reports.limits_pdf import render_pdf

    if format is CardFormat.pdf and out_dir is None:
        err.print(
            "[red]error:[/] --format pdf needs --out DIR (a PDF is not written to a terminal)"
        )
        raise typer.Exit(2)
    from collector.limits import Limits

    with database(database_url) as (db, s):
        card = LimitsService(db, Limits.for_settings(db, s)).card(deployment, datetime.now(UTC))
    data: bytes
    if format is CardFormat.pdf:
        data = render_pdf(card)
    else:
        text = to_markdown(card) if format is CardFormat.md else _dumps(card) + "\n"
        data = text.encode()
    if out_dir is None:
        sys.stdout.write(data.decode())
        return
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in deployment)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"limits-{safe}.{format.value}"
        path.write_bytes(data)
    except OSError as exc:
        err.print(f"[red]error:[/] cannot write into {out_dir}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    print(path)


@audit_app.command("verify")
def audit_verify(
    bundle: Annotated[
        Path | None,
        typer.Option(help="Check an exported bundle (kvwatch audit export) instead, offline."),
    ] = None,
    keys: Annotated[
        Path | None,
        typer.Option(
            "--keys",
            help="The published key set (JWK set file or key directory); default: the "
            "configured key directory's.",
        ),
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Check the audit log's hash chain and its signed checkpoints. Exit 0 intact; 1 naming
    the first entry where it breaks (edited, inserted, deleted or reordered), a checkpoint
    whose signature or signed head does not match (a chain rewritten without the key), an
    entry older than twice the checkpoint period that no checkpoint covers, or a bundle
    whose manifest.sig is missing or invalid."""
    from collector.reports.audit import AuditLog, verify_bundle_keyed
    from collector.signing import load_key_set
    from kvwatch.cli_common import settings

    if bundle is not None:
        s = settings(database_url)
        try:
            key_set = load_key_set(keys) if keys is not None else s.key_ring().public_set()
            if not key_set.get("keys") and (bundle / "keys.jwks").is_file():
                key_set = load_key_set(bundle / "keys.jwks")
                kids = ", ".join(k.get("kid", "?") for k in key_set["keys"])
                err.print(
                    "[yellow]warning:[/] no --keys given: checked against the bundle's own key "
                    f"set ({kids}); compare these key ids with the published ones (GET "
                    "/v1/signing-keys, kvwatch keys public): a forger can ship a key of their own"
                )
            check = verify_bundle_keyed(bundle, key_set, s.audit_checkpoint_s)
        except CollectorError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
    else:
        _warn_if_a_bare_sqlite_copy(database_url)
        with database(database_url) as (db, s):
            key_set = load_key_set(keys) if keys is not None else s.key_ring().public_set()
            log = AuditLog(db, s.key_ring(), s.audit_checkpoint_s)
            check = log.verify_keyed(key_set, datetime.now(UTC))
    chain = check.chain
    if check.ok:
        err.print(f"[green]intact:[/] {chain.entries} entries; head {chain.head or '-'}")
        if not check.keyed:
            err.print("unsigned: no published signing key, the chain is checked unkeyed only")
        elif check.signed_through is None:
            err.print("no signed checkpoint yet (every entry is younger than the period)")
        else:
            by = ", ".join(
                f"{k} ({'retired ' + r if r else 'current'})" for k, r in check.keys.items()
            )
            err.print(
                f"signed through entry {check.signed_through} ({check.signed_entries} of "
                f"{chain.entries} entries) by {check.checkpoints} checkpoint(s); keys: {by}",
                markup=False,
            )
        return
    where = f"broken at entry {check.first_bad_id}" if check.first_bad_id else "not intact"
    err.print(f"[red]{where}:[/] ", end="")
    err.print(f"{check.problem} ({chain.entries} entries read)", markup=False)
    raise typer.Exit(1)


@audit_app.command("checkpoint")
def audit_checkpoint(
    by: Annotated[str, typer.Option(help="Who signs it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """Sign the chain's head now (an audit.checkpoint entry), as the collector does every
    KVWATCH_AUDIT_CHECKPOINT_S. Prints the entry id signed."""
    from collector.reports.audit import AuditLog

    with database(database_url) as (db, s):
        eid = AuditLog(db, s.key_ring(), s.audit_checkpoint_s).checkpoint(
            actor=by, now=datetime.now(UTC)
        )
    if eid is None:
        err.print("nothing to sign: the log is empty or its last entry is a checkpoint")
        return
    typer.echo(str(eid))


def _warn_if_a_bare_sqlite_copy(database_url: str | None) -> None:
    """A SQLite file in WAL mode with no ``-wal`` beside it is either cleanly closed (all
    there) or a copy taken from a running collector without its ``-wal`` (recent entries
    missing): the file cannot tell which, so say so rather than call a partial log intact."""
    from kvwatch.cli_common import settings

    url = settings(database_url).database_url
    if not url.startswith("sqlite:///"):
        return
    path = Path(url.removeprefix("sqlite:///"))
    try:
        with path.open("rb") as f:
            header = f.read(20)
    except OSError:
        return
    wal_mode = len(header) == 20 and header[18] == 2 and header[19] == 2
    if wal_mode and not Path(f"{path}-wal").exists():
        err.print(
            f"[yellow]warning:[/] {path} is in WAL mode with no {path.name}-wal beside it. If it "
            "was copied from a running collector without its -wal, the newest entries are not "
            "in it and the check below cannot see them: copy with `kvwatch audit export` or "
            "`sqlite3 SRC '.backup DST'` instead."
        )


@audit_app.command("export")
def audit_export(
    out: Annotated[Path, typer.Option("--out", help="An empty (or new) directory.")],
    by: Annotated[str, typer.Option(help="Who exports it (the checkpoint's actor).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """Write the audit log as a self-contained bundle (entries.jsonl, manifest.json with the
    head hash and every file's SHA-256, manifest.sig signing both) that `kvwatch audit
    verify --bundle DIR` checks without the database. The head is signed (a checkpoint)
    first."""
    from collector.reports.audit import AuditLog

    with database(database_url) as (db, s):
        log = AuditLog(db, s.key_ring(), s.audit_checkpoint_s)
        manifest, check = log.export(out, datetime.now(UTC), actor=by)
    state = "intact" if check.ok else f"NOT intact ({check.problem})"
    err.print(f"exported {manifest['entries']} entries, chain {state}; head {manifest['head']}")
    typer.echo(str(out))


@report_app.command("review")
def report_review(
    out_dir: Annotated[
        Path, typer.Option("--out", help="Write review-<id>.json/.csv/.pdf into this directory.")
    ],
    since: Annotated[
        datetime | None,
        typer.Option(parser=_when, metavar="TIME", help="Window start (default: until - 90 days)."),
    ] = None,
    until: Annotated[
        datetime | None,
        typer.Option(parser=_when, metavar="TIME", help="Window end, exclusive (default: now)."),
    ] = None,
    deployment: Annotated[str | None, typer.Option(help="Only this deployment.")] = None,
    by: Annotated[str, typer.Option(help="Who generates it (audit log).")] = "cli",
    database_url: DbUrl = None,
) -> None:
    """The quarterly review: per route and model, request count, max and p99 prompt tokens and
    their weekly trend against the safe threshold; rows at >= 80% highlighted. Stored and
    recorded in the audit log like a breach report; writes JSON, CSV and PDF to --out and
    prints the paths."""
    from collector.limits import Limits
    from collector.reports.review import ReviewScope, ReviewService, to_csv
    from collector.reports.review_pdf import render_pdf
    from collector.reports.signed import report_json_bytes, sig_path
    from collector.reports.stored import ReportStore

    with database(database_url) as (db, s):
        doc = ReviewService(db, Limits.for_settings(db, s), s.key_ring()).create(
            ReviewScope(since=since, until=until, deployment_id=deployment), created_by=by
        )
        signature = ReportStore(db).signature(doc["report_id"])
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"review-{doc['report_id']}"
        paths = [stem.with_suffix(s) for s in (".json", ".csv", ".pdf")]
        # the bytes the signature covers (collector.reports.signed)
        paths[0].write_bytes(report_json_bytes(doc))
        paths[1].write_bytes(to_csv(doc).encode())
        paths[2].write_bytes(render_pdf(doc))
        if signature is not None:
            sig_path(stem).write_text(signature, encoding="ascii")
            paths.append(sig_path(stem))
    except OSError as exc:
        err.print(f"[red]error:[/] cannot write into {out_dir}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    tot = doc["totals"]
    err.print(
        f"{tot['requests']} requests, {tot['routes']} route/model rows, "
        f"{tot['highlighted']} highlighted"
    )
    for p in paths:
        print(p)
