"""``kvwatch policies``, ``alerts``, ``silences`` and ``incidents``: rule packs, and what
operators do with what they raise (through the same service as the HTTP API)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvwatch.cli_common import (
    Col,
    DbUrl,
    KvwatchTyper,
    Listing,
    WideOpt,
    database,
    err,
    moment,
    relative,
    stdout_console,
    table,
    to_second,
)
from policies.lifecycle import IncidentState, State
from policies.signals import Severity

if TYPE_CHECKING:
    from collector.alerting.service import AlertingService
    from collector.db import Database
    from collector.settings import Settings

policies_app = KvwatchTyper(help="Rule packs: check and list.", no_args_is_help=True)
alerts_app = KvwatchTyper(help="Alerts: list and acknowledge.", no_args_is_help=True)
silences_app = KvwatchTyper(help="Silences: hold back notifications.", no_args_is_help=True)
incidents_app = KvwatchTyper(
    help="Incidents: list, acknowledge, own, annotate, link alerts, read the timeline, close.",
    no_args_is_help=True,
)

PacksDir = Annotated[
    Path | None,
    typer.Option("--packs-dir", envvar="KVWATCH_POLICY_PACKS_DIR", help="Operator rule packs."),
]


def _rules_table(rules: list[object], wide: bool) -> Listing:
    from policies.durations import format_duration

    # for and resolve after: the pack's own values, in its notation
    t = table(
        Col("rule", nowrap=True), Col("kind", wide=True), Col("severity", nowrap=True), "for",
        "resolve after", "pack", Col("source", wide=True), wide=wide,
    )  # fmt: skip

    for r in rules:
        t.add_row(
            r.name,  # type: ignore[attr-defined]
            r.kind,  # type: ignore[attr-defined]
            r.severity,  # type: ignore[attr-defined]
            format_duration(r.for_s),  # type: ignore[attr-defined]
            format_duration(r.resolve_after_s),  # type: ignore[attr-defined]
            r.pack,  # type: ignore[attr-defined]
            r.source,  # type: ignore[attr-defined]
        )
    return t


@policies_app.command("check")
def policies_check(
    path: Annotated[Path, typer.Argument(help="A pack file, or a directory of packs.")],
    wide: WideOpt = False,
) -> None:
    """Validate a pack (or every pack in a directory, together with the default pack).
    Exit 0 valid, 1 invalid: every problem is listed, one a line, each naming file, line,
    rule and field."""
    from rich.markup import escape

    from policies import PackError
    from policies.pack import check_path

    try:
        ruleset = check_path(path)
    except PackError as exc:
        problems = exc.errors
        if len(problems) > 1:
            err.print(f"[red]invalid:[/] {len(problems)} problems")
        for e in problems:
            err.print(f"[red]invalid:[/] {escape(e.describe())}")
        raise typer.Exit(1) from None
    stdout_console().print(_rules_table(list(ruleset.rules), wide))
    err.print(f"[green]valid:[/] {len(ruleset.rules)} rules in {len(ruleset.packs)} pack(s)")


@policies_app.command("list")
def policies_list(packs_dir: PacksDir = None, wide: WideOpt = False) -> None:
    """The rules in force: the default pack and the operator packs."""
    from policies import PackError, load_ruleset

    try:
        ruleset = load_ruleset(packs_dir)
    except PackError as exc:
        err.print(f"[red]invalid:[/] {exc}")
        raise typer.Exit(1) from None
    stdout_console().print(_rules_table(list(ruleset.rules), wide))


def _service(db: Database, s: Settings) -> AlertingService:
    """The service the API runs, with the installation's identity: what a command sends out
    (an incident's acknowledgement) is labelled and linked as the collector's own."""
    from collector.alerting.service import AlertingService
    from collector.installation import Identity
    from policies import load_ruleset

    return AlertingService(db, load_ruleset(s.policy_packs_dir), identity=Identity.of(s))


def _now() -> datetime:
    return datetime.now(UTC)


@alerts_app.command("list")
def alerts_list(
    state: Annotated[State | None, typer.Option(help="Only alerts in this state.")] = None,
    severity: Annotated[Severity | None, typer.Option(help="Only alerts of this severity.")] = None,
    limit: int = 100,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """Alerts, newest first. At 80 columns: id, state, severity, rule, deployment and when it
    started (--wide adds who acknowledged it and its summary; --json everything)."""
    with database(database_url) as (db, s):
        alerts = _service(db, s).list_alerts(state=state, severity=severity, limit=limit)
    if as_json:
        for a in alerts:
            print(json.dumps(a, sort_keys=True))
        return
    now = _now()
    t = table(
        Col("id", nowrap=True),
        Col("state", nowrap=True),
        Col("severity", nowrap=True),
        Col("rule", nowrap=True),
        "deployment",
        Col("started", nowrap=True),
        Col("acked", wide=True),
        Col("summary", wide=True),
        wide=wide,
    )
    for a in alerts:
        t.add_row(
            str(a["id"]),
            a["state"],
            a["severity"],
            a["rule"],
            a["deployment_id"] or "",
            relative(a["starts_at"], now),
            a["acked_by"] or "",
            a["annotations"].get("summary", ""),
        )
    stdout_console().print(t)


@alerts_app.command("ack")
def alerts_ack(
    alert_id: int,
    by: Annotated[str, typer.Option(help="Who acknowledges.")],
    comment: Annotated[str | None, typer.Option(help="Why, or what is being done.")] = None,
    database_url: DbUrl = None,
) -> None:
    """Acknowledge an alert: no repeat notifications until it resolves."""
    with database(database_url) as (db, s):
        a = _service(db, s).ack(alert_id, by, comment, _now())
    if a["acked_by"] != by or comment != a.get("ack_comment"):
        err.print(
            f"alert {a['id']} ({a['rule']}) was already acknowledged by {a['acked_by']} at "
            f"{a['acked_at']}; nothing changed"
        )
        return
    err.print(f"alert {a['id']} ({a['rule']}) acknowledged by {a['acked_by']}")


@silences_app.command("create")
def silences_create(
    match: Annotated[
        list[str], typer.Option("--match", help="label=value (repeatable); label=~regex")
    ],
    duration: Annotated[str, typer.Option("--for", help="How long, e.g. 2h.")],
    by: Annotated[str, typer.Option(help="Who silences.")],
    comment: Annotated[str, typer.Option(help="Why.")],
    database_url: DbUrl = None,
) -> None:
    """Hold back notifications of alerts matching every matcher, for a while."""
    from policies.durations import human_duration, parse_duration

    matchers = []
    for m in match:
        name, sep, value = m.partition("=")
        if not sep:
            err.print(f"[red]error:[/] --match {m!r}: expected label=value")
            raise typer.Exit(2)
        regex = value.startswith("~")
        matchers.append({"name": name, "value": value[1:] if regex else value, "regex": regex})
    try:
        seconds = parse_duration(duration)
    except ValueError as exc:
        err.print(f"[red]error:[/] --for: {exc}")
        raise typer.Exit(2) from None
    now = _now()
    ends = _silence_end(now, seconds, duration)
    with database(database_url) as (db, s):
        sil = _service(db, s).silence(matchers, now, ends, by, comment, now)
    err.print(f"silence {sil['id']} for {human_duration(seconds)}, until {sil['ends_at']}")
    print(sil["id"])


def _silence_end(now: datetime, seconds: float, duration: str) -> datetime:
    """When a silence of ``seconds`` from ``now`` ends, if that lies in the range every time
    kvwatch takes (``collector.timefmt.bounded``, as the API's ``duration`` is checked);
    else exit 2 naming --for. Past what a datetime holds is the same mistake, not a crash."""
    from collector.timefmt import EARLIEST, LATEST, bounded

    try:
        return bounded(now + timedelta(seconds=seconds))
    except OverflowError:
        why = (
            f"its end lies past the year 9999, outside the range kvwatch accepts "
            f"({EARLIEST:%Y-%m-%d} to {LATEST:%Y-%m-%d} UTC)"
        )
    except ValueError as exc:
        why = f"its end, {exc}"
    err.print(f"[red]error:[/] --for {duration}: the silence is too long: {why}")
    raise typer.Exit(2)


@silences_app.command("list")
def silences_list(
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """Silences, newest first: each one's state (active, pending, ended, or expired: ended
    early by `kvwatch silences expire`), its matchers, when it ends or really ended, who made
    it and why."""
    with database(database_url) as (db, s):
        silences = _service(db, s).list_silences()
    if as_json:
        for x in silences:
            print(json.dumps(x, sort_keys=True))
        return
    now = _now()
    t = table(
        Col("id", nowrap=True), Col("state", nowrap=True), "matchers", "ends", "by",
        Col("comment", wide=True), wide=wide,
    )  # fmt: skip
    for x in silences:
        t.add_row(
            str(x["id"]),
            _silence_state(x, now),
            ", ".join(
                f"{m['name']}{'=~' if m['regex'] else '='}{m['value']}" for m in x["matchers"]
            ),
            moment(x["ends_at"], now),
            x["created_by"],
            x["comment"],
        )
    stdout_console().print(t)


def _silence_state(doc: dict[str, Any], now: datetime) -> str:
    """A silence document's ``ends_at`` is already its real end (its expiry, if expired early)."""
    if doc["active"]:
        return "active"
    if doc["expired_at"] is not None and doc["expired_at"] == doc["ends_at"]:
        return "expired"
    return "ended" if datetime.fromisoformat(doc["ends_at"]) <= now else "pending"


@silences_app.command("expire")
def silences_expire(
    silence_id: int, by: Annotated[str, typer.Option(help="Who.")], database_url: DbUrl = None
) -> None:
    """End a silence now: notifications of the alerts it held back are sent again."""
    from collector.timefmt import iso

    now = _now()
    with database(database_url) as (db, s):
        doc = _service(db, s).expire_silence(silence_id, by, now)
    if doc["expired_at"] != iso(now):
        err.print(
            f"silence {silence_id} was already expired at {to_second(doc['expired_at'])}; "
            "nothing changed"
        )
        return
    err.print(f"silence {silence_id} expired at {to_second(doc['expired_at'])}")


@incidents_app.command("list")
def incidents_list(
    state: Annotated[
        IncidentState | None, typer.Option(help="Only incidents in this state.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """Incidents, newest first: when kvwatch became aware of each, and by when to notify: as
    processor (the default) each affected customer without undue delay (GDPR Art. 33(2),
    KVWATCH_CONTROLLER_NOTICE_TARGET_H), as controller the authority within 72 hours
    (Art. 33(1)); and which parties were not yet sent a notice."""
    from collector.cases.api_view import case_view

    now = _now()
    with database(database_url) as (db, s):
        incidents = _service(db, s).list_incidents(state)
        duties = {i["id"]: case_view(db, s, i["id"], now=now)["duty"] for i in incidents}
    if as_json:
        for i in incidents:
            print(json.dumps(i | {"duty": duties[i["id"]]}, sort_keys=True))
        return
    t = table(
        Col("id", nowrap=True), Col("state", nowrap=True), "deployment",
        Col("aware since", wide=True), "notify by", "not sent", Col("title", wide=True),
        wide=wide,
    )  # fmt: skip
    for i in incidents:
        d = duties[i["id"]]
        t.add_row(
            str(i["id"]),
            i["state"],
            i["deployment_id"],
            to_second(i["awareness_at"]),
            moment(d["due_at"], now) if i["state"] == "open" else to_second(d["due_at"]),
            ", ".join(d["pending"]) or "-",
            i["title"],
        )
    stdout_console().print(t)
    rules = sorted({d["rule"] for d in duties.values()})
    for rule in rules:
        err.print(f"notify by: {rule}")


@incidents_app.command("close")
def incidents_close(
    incident_id: int,
    by: Annotated[str, typer.Option(help="The person closing it.")],
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit log).")],
    database_url: DbUrl = None,
) -> None:
    """Close an incident: a person, with a reason."""
    with database(database_url) as (db, s):
        inc = _service(db, s).close_incident(incident_id, by, reason, _now())
    if inc["closed_by"] != by or inc["close_reason"] != reason:
        err.print(
            f"incident {incident_id} was already closed by {inc['closed_by']} at "
            f"{inc['closed_at']}; nothing changed"
        )
        return
    err.print(f"incident {incident_id} closed by {by}")


By = Annotated[str, typer.Option(help="Who (recorded in the audit log).")]


@incidents_app.command("ack")
def incidents_ack(incident_id: int, by: By, database_url: DbUrl = None) -> None:
    """Acknowledge an incident: someone is on it. Receivers are told (incident.acknowledged),
    so a pager stops escalating; the first acknowledgement stands."""
    with database(database_url) as (db, s):
        inc = _service(db, s).ack_incident(incident_id, by, _now())
    if inc["acked_by"] != by:
        err.print(
            f"incident {incident_id} was already acknowledged by {inc['acked_by']} at "
            f"{to_second(inc['acked_at'])}; nothing changed"
        )
        return
    err.print(f"incident {incident_id} acknowledged by {by}")


@incidents_app.command("assign")
def incidents_assign(
    incident_id: int,
    owner: Annotated[str, typer.Option(help="Who owns it from now on.")],
    by: By,
    database_url: DbUrl = None,
) -> None:
    """Give an open incident an owner (the one who drives it to closed)."""
    with database(database_url) as (db, s):
        _service(db, s).assign_incident(incident_id, owner, by, _now())
    err.print(f"incident {incident_id} is owned by {owner}")


@incidents_app.command("note")
def incidents_note(
    incident_id: int,
    text: Annotated[str, typer.Option(help="The note (at most 4000 characters).")],
    by: By,
    database_url: DbUrl = None,
) -> None:
    """Add a note to an incident's timeline (open or closed)."""
    with database(database_url) as (db, s):
        _service(db, s).note_incident(incident_id, text, by, _now())
    err.print(f"note added to incident {incident_id}")


@incidents_app.command("link")
def incidents_link(incident_id: int, alert_id: int, by: By, database_url: DbUrl = None) -> None:
    """Link an alert to an open incident."""
    with database(database_url) as (db, s):
        _service(db, s).link_alert(incident_id, alert_id, by, _now())
    err.print(f"alert {alert_id} linked to incident {incident_id}")


@incidents_app.command("unlink")
def incidents_unlink(incident_id: int, alert_id: int, by: By, database_url: DbUrl = None) -> None:
    """Unlink an alert from an open incident; kvwatch will not link it back by itself."""
    with database(database_url) as (db, s):
        _service(db, s).unlink_alert(incident_id, alert_id, by, _now())
    err.print(f"alert {alert_id} unlinked from incident {incident_id}")


@incidents_app.command("timeline")
def incidents_timeline(
    incident_id: int,
    as_json: Annotated[bool, typer.Option("--json", help="The entries as JSON.")] = False,
    database_url: DbUrl = None,
) -> None:
    """Everything that happened to an incident and around it, oldest first: alerts, who
    acknowledged and owns it, notes, notifications delivered, verifications, engine config
    changes, deadline changes, notices and decisions."""
    with database(database_url) as (db, s):
        entries = _service(db, s).incident_timeline(incident_id, _now())
    if as_json:
        stdout_console().print_json(json.dumps(entries))
        return
    t = table(Col("at", nowrap=True), Col("what", nowrap=True), "who", "details")
    for e in entries:
        t.add_row(to_second(e["at"]), e["kind"], e["actor"], e["text"])
    stdout_console().print(t)
