"""``kvwatch incidents set-deadline|set-awareness|decide|case`` and ``kvwatch incidents
notify …``: the incident's case register (collector/cases), through the same services as
the HTTP API."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from collector.timefmt import parse_bounded
from kvwatch.cli_alerts import incidents_app
from kvwatch.cli_common import (
    Col,
    DbUrl,
    KvwatchTyper,
    WideOpt,
    database,
    err,
    stdout_console,
    table,
    to_second,
)

notify_app = KvwatchTyper(
    help="Notify each party: prepare, approve, send, ack, confirm-deletion, list.",
    no_args_is_help=True,
)
incidents_app.add_typer(notify_app, name="notify")

By = Annotated[str, typer.Option("--by", help="The person taking the step (audit log).")]


def _now() -> datetime:
    return datetime.now(UTC)


def _at(value: str) -> datetime:
    try:
        return parse_bounded(value)
    except ValueError as exc:
        err.print(f"[red]error:[/] --at: not an ISO 8601 time in range: {value!r} ({exc})")
        raise typer.Exit(2) from None


def _set(
    incident_id: int, field: str, at: str, why: str, by: str, database_url: str | None
) -> None:
    from collector.cases.facts import FactService

    when = _at(at)
    with database(database_url) as (db, _):
        out = FactService(db).set(incident_id, field, when, why=why, by=by, now=_now())
    err.print(f"incident {incident_id} {field}: {out['old']} -> {out['new']} (by {by}, logged)")


@incidents_app.command("set-deadline")
def set_deadline(
    incident_id: int,
    at: Annotated[str, typer.Option("--at", help="The new deadline, ISO 8601 (UTC if naive).")],
    why: Annotated[str, typer.Option("--why", help="Why it changes (audit log).")],
    by: By,
    database_url: DbUrl = None,
) -> None:
    """Change an incident's notification deadline, with who and why (audit-logged with the
    old and new value; `kvwatch audit verify` checks the database against it)."""
    _set(incident_id, "deadline_at", at, why, by, database_url)


@incidents_app.command("set-awareness")
def set_awareness(
    incident_id: int,
    at: Annotated[str, typer.Option("--at", help="When the operator became aware, ISO 8601.")],
    why: Annotated[str, typer.Option("--why", help="Why it changes (audit log).")],
    by: By,
    database_url: DbUrl = None,
) -> None:
    """Change when the operator became aware of the incident, with who and why (logged)."""
    _set(incident_id, "awareness_at", at, why, by, database_url)


@incidents_app.command("decide")
def decide(
    incident_id: int,
    kind: Annotated[
        str,
        typer.Option(
            help="containment | engine_upgrade | deletion_request | art34 | notification | other"
        ),
    ],
    status: Annotated[str, typer.Option(help="done | open (decided, not yet carried out)")],
    what: Annotated[str, typer.Option(help="The decision or measure.")],
    why: Annotated[str, typer.Option(help="Why.")],
    by: By,
    supersedes: Annotated[
        int | None, typer.Option(help="The id of the decision this one replaces.")
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Record a decision or measure in the incident's register (GDPR Art. 33(5)); prints it
    as JSON."""
    from collector.cases.decisions import DecisionService

    with database(database_url) as (db, _):
        d = DecisionService(db).decide(
            incident_id,
            kind=kind,
            status=status,
            what=what,
            why=why,
            by=by,
            now=_now(),
            supersedes=supersedes,
        )
    typer.echo(json.dumps(asdict(d), sort_keys=True))


@incidents_app.command("case")
def case(incident_id: int, database_url: DbUrl = None) -> None:
    """The incident's case register as JSON: each party's notification status and the
    decisions."""
    from collector.cases.api_view import case_view

    with database(database_url) as (db, s):
        doc = case_view(db, s, incident_id, now=_now())
    typer.echo(json.dumps(doc, indent=2, sort_keys=True))


def _write(out: Path | None, notice_id: str, data: bytes, signature: str | None) -> None:
    from collector.cases.notifications import write_files

    if out is None:
        return
    for p in write_files(out, notice_id, data, signature):
        typer.echo(str(p))


@notify_app.command("prepare")
def notify_prepare(
    incident_id: int,
    party: Annotated[str, typer.Option(help="The tenant, or the authority (controller role).")],
    by: By,
    out: Annotated[
        Path | None, typer.Option(help="Write <notice id>.json and .sig into this directory.")
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Prepare (build, store, sign, log) the notice to one party; prints its id."""
    from collector.cases.notifications import NotificationService

    with database(database_url) as (db, s):
        p = NotificationService(db, s).prepare(incident_id, party, by=by, now=_now())
    err.print(
        f"prepared {p.notification.notice_id} for {party} (sha256 {p.notification.notice_sha256})"
    )
    typer.echo(p.notification.notice_id)
    _write(out, p.notification.notice_id, p.notice_json, p.notification.signature)


def _step(
    notice_id: str, step: str, by: str, database_url: str | None, channel: str | None = None
) -> tuple[bytes, str | None]:
    from collector.cases.notifications import NotificationService

    with database(database_url) as (db, s):
        svc = NotificationService(db, s)
        n = svc.step(notice_id, step, by=by, now=_now(), channel=channel)
        _, data = svc.notice(notice_id)
    err.print(f"{notice_id} ({n.party}): {step} by {by}; now {n.state}")
    return data, n.signature


@notify_app.command("approve")
def notify_approve(notice_id: str, by: By, database_url: DbUrl = None) -> None:
    """Approve a prepared notice for sending."""
    _step(notice_id, "approve", by, database_url)


@notify_app.command("send")
def notify_send(
    notice_id: str,
    by: By,
    channel: Annotated[str, typer.Option(help="How it was sent (email to whom, portal, letter).")],
    out: Annotated[
        Path | None, typer.Option(help="Write <notice id>.json and .sig into this directory.")
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Record that an approved notice was sent, by whom and by which channel."""
    data, sig = _step(notice_id, "send", by, database_url, channel)
    _write(out, notice_id, data, sig)


@notify_app.command("ack")
def notify_ack(
    notice_id: str,
    by: Annotated[str, typer.Option("--by", help="Who at the party acknowledged it.")],
    database_url: DbUrl = None,
) -> None:
    """Record the party's acknowledgement of a sent notice."""
    _step(notice_id, "ack", by, database_url)


@notify_app.command("confirm-deletion")
def notify_confirm_deletion(
    notice_id: str,
    by: Annotated[str, typer.Option("--by", help="Who at the party confirmed it.")],
    database_url: DbUrl = None,
) -> None:
    """Record that a receiving party confirmed it deleted what it received."""
    _step(notice_id, "confirm-deletion", by, database_url)


@notify_app.command("list")
def notify_list(incident_id: int, wide: WideOpt = False, database_url: DbUrl = None) -> None:
    """Each party of the incident: due, prepared, approved, sent, acknowledged, late (at 80
    columns the party, when due, state, when sent and late: --wide shows every column)."""
    from collector.cases.notifications import NotificationService

    with database(database_url) as (db, s):
        rows = NotificationService(db, s).status(incident_id, now=_now())
    t = table(
        "party", Col("kind", wide=True), Col("due", nowrap=True), Col("notice", wide=True),
        Col("state", nowrap=True), Col("sent", nowrap=True), Col("channel", wide=True),
        Col("ack", wide=True), Col("deleted", wide=True), Col("late", nowrap=True), wide=wide,
    )  # fmt: skip
    for r in rows:
        t.add_row(
            r.party,
            r.party_kind,
            to_second(r.due_at),
            r.notice_id or "-",
            r.state,
            to_second(r.sent_at) if r.sent_at else "-",
            r.channel or "-",
            to_second(r.acknowledged_at) if r.acknowledged_at else "-",
            to_second(r.deletion_confirmed_at) if r.deletion_confirmed_at else "-",
            "late" if r.late else ("overdue" if r.overdue else "no"),
        )
    stdout_console().print(t)
