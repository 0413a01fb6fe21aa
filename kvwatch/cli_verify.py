"""``kvwatch verify``: the sweep against any OpenAI-compatible endpoint (see
``kvwatch.verify``). Exit 0 pass, 1 a leak or another finding, 2 could not run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvwatch.cli_common import DbUrl, KvwatchTyper, WideOpt, err

if TYPE_CHECKING:
    from collector.verify_schedules import VerifyScheduleService
    from kvwatch.verify import Progress as VerifyProgress
    from kvwatch.verify import Report, UploadResult, VerifierSettings, VerifyOptions

EXIT_PASS, EXIT_FINDING, EXIT_COULD_NOT_RUN = 0, 1, 2


class RouteChoice(StrEnum):
    chat = "chat"
    completions = "completions"


def _keys(values: list[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for value in values:
        name, sep, key = value.partition("=")
        name, key = name.strip(), key.strip()
        if not sep or not name or not key:
            err.print("[red]error:[/] --tenant-key takes NAME=KEY (the key is never printed)")
            raise typer.Exit(EXIT_COULD_NOT_RUN)
        if name in keys:
            err.print(f"[red]error:[/] tenant {escape(repr(name))} is given twice")
            raise typer.Exit(EXIT_COULD_NOT_RUN)
        keys[name] = key
    return keys


def _settings(deployment: str | None) -> VerifierSettings:
    from pydantic import ValidationError

    from kvwatch.verify import VerifierSettings

    try:
        return VerifierSettings(deployment_id=deployment) if deployment else VerifierSettings()
    except ValidationError as exc:
        for e in exc.errors():
            name = "KVWATCH_" + "_".join(str(p) for p in e["loc"]).upper()
            if name == "KVWATCH_DEPLOYMENT_ID" and deployment:
                name = "--deployment"
            err.print(f"[red]error:[/] {name}: {escape(str(e['msg']))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None


verify_app = KvwatchTyper()
schedule_app = KvwatchTyper(
    help="Verifications the collector runs by itself: every --every, and again at once when "
    "the deployment's config drifts.",
    no_args_is_help=True,
)
verify_app.add_typer(schedule_app, name="schedule")


@verify_app.callback(invoke_without_command=True)
def verify(
    ctx: typer.Context,
    endpoint: Annotated[
        str | None,
        typer.Option(help="The OpenAI-compatible base URL, e.g. http://host:8000/v1."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="The model to verify (as the endpoint names it).")
    ] = None,
    tenant_key: Annotated[
        list[str] | None,
        typer.Option(
            "--tenant-key",
            envvar="KVWATCH_VERIFY_TENANT_KEYS",
            show_envvar=False,
            help="NAME=KEY of one tenant, repeated: at least two tenants with their own keys "
            "(also KVWATCH_VERIFY_TENANT_KEYS, space-separated, to keep keys out of `ps`). "
            "Reports name tenants, never keys.",
        ),
    ] = None,
    max_context: Annotated[
        int | None,
        typer.Option(
            help="Stop growing prompts at this many tokens (as the endpoint counts them); "
            "the verified safe context never exceeds it."
        ),
    ] = None,
    budget: Annotated[
        int, typer.Option(min=1, help="The most requests sent, retries included.")
    ] = 200,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Write the full JSON report here.")
    ] = None,
    deployment: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_DEPLOYMENT_ID",
            help="The deployment the verification is recorded for (default: 'default').",
        ),
    ] = None,
    canary_min_fragment: Annotated[
        int,
        typer.Option(
            help="Characters of a canary that count as a leak when another tenant gets them back."
        ),
    ] = 12,
    timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds to wait for each answer.")
    ] = 120.0,
    route: Annotated[
        RouteChoice, typer.Option(help="Which API to send prompts to.")
    ] = RouteChoice.chat,
    no_prefix_cache_check: Annotated[
        bool,
        typer.Option(
            "--no-prefix-cache-check",
            help="Skip the prefix-cache phase (does tenant B get tenant A's cached prefix?).",
        ),
    ] = False,
    prefix_evict_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="Add an eviction round to the prefix-cache phase: this many tokens of "
            "filler push the shared prefix out of the engine's KV pool, so it must come back "
            "from an offload tier (vLLM's CPU offloading, LMCache, SGLang's HiCache) - a "
            "tier that drops the salt is caught. Give at least the pool's size. 0: none.",
        ),
    ] = 0,
    no_upload: Annotated[
        bool,
        typer.Option(
            "--no-upload",
            help="Do not send the result to the collector (KVWATCH_COLLECTOR_URL, "
            "KVWATCH_INGEST_TOKEN).",
        ),
    ] = False,
) -> None:
    """Find an endpoint's verified safe context: prompts grown to the rejection point and
    bisected, clean-refusal checks, cross-tenant canaries under load; then whether tenants
    share cached prefixes (paired: a control that must hit). Only synthetic text, at most
    --budget requests. Exit 0 pass, 1 leak or finding, 2 could not run. `kvwatch
    verify schedule` has the collector run it by itself."""
    if ctx.invoked_subcommand is not None:
        return
    missing = [flag for flag, v in (("--endpoint", endpoint), ("--model", model)) if not v]
    if missing:
        err.print(f"[red]error:[/] kvwatch verify needs {' and '.join(missing)}")
        raise typer.Exit(EXIT_COULD_NOT_RUN)
    assert endpoint is not None and model is not None
    from kvwatch.verify import VerifyOptions
    from kvwatch.verify.client import redact_url
    from kvwatch.verify.crosstenant import (
        BACKGROUND_PARALLEL,
        READ_PARALLEL,
        reader_max_tokens,
    )

    keys = _keys(tenant_key or [])
    if json_file is not None and not json_file.parent.is_dir():
        err.print(f"[red]error:[/] --json {escape(str(json_file))}: no such directory")
        raise typer.Exit(EXIT_COULD_NOT_RUN)
    settings = _settings(deployment)
    uploading = not no_upload and settings.collector_url is not None
    if uploading and settings.ingest_token is None:
        err.print(
            "[red]error:[/] KVWATCH_COLLECTOR_URL is set but KVWATCH_INGEST_TOKEN is not "
            "(set it, or pass --no-upload)"
        )
        raise typer.Exit(EXIT_COULD_NOT_RUN)
    options = VerifyOptions(
        endpoint=endpoint,
        model=model,
        tenant_keys=keys,
        max_context=max_context,
        budget=budget,
        canary_min_fragment=canary_min_fragment,
        timeout_s=timeout,
        route=route.value,
        prefix_cache_check=not no_prefix_cache_check,
        prefix_evict_tokens=prefix_evict_tokens,
    )
    try:
        options.check()
    except ValueError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None

    answer = reader_max_tokens(canary_min_fragment)
    parallel = READ_PARALLEL + BACKGROUND_PARALLEL
    limit = f"{max_context} tokens" if max_context else "the endpoint's own limit"
    err.print(
        f"kvwatch verify: [bold]{escape(redact_url(endpoint))}[/], model {escape(model)}, "
        f"tenants {escape(', '.join(keys))}.\nIt sends only synthetic text (random canaries, "
        f"no real data) and at most [bold]{budget} requests[/] (retries included): prompts up "
        f"to {limit}, answers of at most {answer} tokens, at most {parallel} requests in "
        "flight at once.",
        highlight=False,
    )
    if not uploading:
        why = "--no-upload" if no_upload else "KVWATCH_COLLECTOR_URL is not set"
        err.print(f"The result stays here ({why}).")

    run_id: int | None = None
    if uploading:
        from kvwatch.verify.upload import announce

        run_id, why = announce(settings, sorted(keys))
        if run_id is None:
            err.print(
                f"[yellow]warning:[/] the run could not announce itself ({escape(why)}): its "
                "prompts count as the endpoint's own traffic and may raise its alerts",
                highlight=False,
            )

    report = _run_with_progress(options)

    for line in report.summary_lines():
        typer.echo(line)
    upload_result: UploadResult | None = None
    if uploading and report.result != "error":
        from kvwatch.verify import upload

        upload_result = upload(report, settings, run_id=run_id)
        if upload_result.ok:
            err.print(
                f"uploaded: {escape(upload_result.detail)} (deployment {settings.deployment_id})"
            )
        else:
            err.print(f"[red]upload failed:[/] {escape(upload_result.detail)}")
    if run_id is not None and (upload_result is None or not upload_result.ok):
        from kvwatch.verify.upload import end_run

        end_run(settings, run_id)
    if json_file is not None:
        _write_json(json_file, report, upload_result, settings.deployment_id, uploading)

    if report.result == "fail":
        raise typer.Exit(EXIT_FINDING)
    if report.result == "error" or (upload_result is not None and not upload_result.ok):
        raise typer.Exit(EXIT_COULD_NOT_RUN)
    raise typer.Exit(EXIT_PASS)


def _run_with_progress(options: VerifyOptions) -> Report:
    from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, Task, TextColumn
    from rich.progress import Progress as Bar
    from rich.text import Text

    from kvwatch.verify import verify as run_verification
    from policies.durations import human_duration

    class Elapsed(ProgressColumn):
        """The time the run has taken, as every kvwatch output prints one (``1m 5s``)."""

        def render(self, task: Task) -> Text:
            elapsed = task.finished_time if task.finished else task.elapsed
            return Text(human_duration(elapsed or 0), style="progress.elapsed")

    bar = Bar(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        Elapsed(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    task = bar.add_task("preflight", total=options.budget)

    def on_progress(p: VerifyProgress) -> None:
        size = f" {p.prompt_tokens} tokens" if p.prompt_tokens is not None else ""
        bar.update(task, completed=p.sent, description=f"{p.phase}{size}: {p.outcome.value}")

    with bar:
        return run_verification(options, on_progress)


def _write_json(
    path: Path,
    report: Report,
    upload_result: UploadResult | None,
    deployment_id: str,
    uploading: bool,
) -> None:
    doc = report.to_json()
    doc["upload"] = (
        None
        if not uploading
        else {
            "deployment_id": deployment_id,
            "ok": None if upload_result is None else upload_result.ok,
            "detail": "not sent: the run did not complete"
            if upload_result is None
            else upload_result.detail,
            "verification_id": None
            if upload_result is None or upload_result.record is None
            else upload_result.record.get("id"),
        }
    )
    try:
        path.write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        err.print(f"[red]error:[/] cannot write {escape(str(path))}: {escape(str(exc))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None


# -- kvwatch verify schedule -----------------------------------------------------------


def _schedules(database_url: str | None) -> Iterator[tuple[VerifyScheduleService, str]]:
    from collector.alerting.service import AlertingService
    from collector.verify_schedules import Reach, VerifyScheduleService
    from kvwatch.cli_common import database
    from policies import RuleSet

    with database(database_url) as (db, s):
        reach = Reach.from_settings(s)
        yield VerifyScheduleService(db, AlertingService(db, RuleSet()), reach=reach), "cli"


@schedule_app.command("add")
def schedule_add(
    endpoint: Annotated[str, typer.Option(help="The OpenAI-compatible base URL.")],
    model: Annotated[str, typer.Option(help="The model to verify.")],
    deployment: Annotated[str, typer.Option(help="The deployment it is recorded for.")],
    every: Annotated[str, typer.Option(help="How often, e.g. 6h (1m to 366d).")],
    keys_from: Annotated[
        str,
        typer.Option(
            help="Where the collector reads the tenant keys at each run: env:VARIABLE (named "
            "with KVWATCH_VERIFY_KEYS_ENV_PREFIX, default VERIFY_KEYS_) or file:NAME (in "
            "KVWATCH_VERIFY_KEYS_DIR), holding NAME=KEY pairs (space- or newline-separated). "
            "The keys are never stored nor printed; the reference must resolve here too.",
        ),
    ],
    budget: Annotated[int, typer.Option(min=1, help="The most requests a run sends.")] = 200,
    max_context: Annotated[
        int | None, typer.Option(help="Stop growing prompts at this many tokens.")
    ] = None,
    timeout: Annotated[float, typer.Option(min=0.001, help="Seconds per answer.")] = 120.0,
    database_url: DbUrl = None,
) -> None:
    """Schedule a verification: the collector (kvwatch serve) runs it at once, then every
    --every, and again at once after a config_drift alert of the deployment. Results are
    recorded and alerted on exactly like kvwatch verify's uploads."""
    from collector.verify_schedules import every_seconds

    try:
        every_s = every_seconds(every)
    except ValueError as exc:
        err.print(f"[red]error:[/] --every: {escape(str(exc))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    with contextmanager(_schedules)(database_url) as (service, by):
        doc = service.add(
            {
                "endpoint": endpoint,
                "model_id": model,
                "deployment_id": deployment,
                "every_s": every_s,
                "keys_from": keys_from,
                "budget": budget,
                "max_context": max_context,
                "timeout_s": timeout,
            },
            by,
            datetime.now(UTC),
        )
    err.print(
        f"scheduled verification {doc['id']}: {escape(doc['endpoint'])} model "
        f"{escape(doc['model_id'])} for {escape(doc['deployment_id'])}, every {every}; the "
        "collector runs it at its next pass"
    )
    typer.echo(doc["id"])


@schedule_app.command("list")
def schedule_list(
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    wide: WideOpt = False,
    database_url: DbUrl = None,
) -> None:
    """The scheduled verifications, with each one's last run (at 80 columns without the
    model, the deployment and where keys come from: --wide)."""
    from kvwatch.cli_common import Col, moment, stdout_console, table
    from policies.durations import format_duration

    with contextmanager(_schedules)(database_url) as (service, _):
        docs = service.list()
    if as_json:
        for d in docs:
            typer.echo(json.dumps(d, sort_keys=True))
        return
    now = datetime.now(UTC)
    # every: the schedule's period as configured (format_duration's exact form)
    t = table(
        Col("id", nowrap=True), "endpoint", Col("model", wide=True),
        Col("deployment", wide=True), Col("every", nowrap=True), Col("keys from", wide=True),
        "next", "last", wide=wide,
    )  # fmt: skip
    for d in docs:
        last = "never"
        if d["last_finished_at"]:
            last = f"{d['last_result']} ({d['last_trigger']}) {d['last_finished_at']}"
            if d["last_verification_id"]:
                last += f", verification {d['last_verification_id']}"
            if d["last_error"]:
                last += f": {d['last_error']}"
        t.add_row(
            str(d["id"]),
            d["endpoint"],
            d["model_id"],
            d["deployment_id"],
            format_duration(d["every_s"]),
            d["keys_from"],
            "running" if d["running"] else moment(d["next_at"], now),
            last,
        )
    stdout_console().print(t)


@schedule_app.command("remove")
def schedule_remove(
    schedule_id: Annotated[int, typer.Argument(help="The schedule's id (see list).", min=1)],
    database_url: DbUrl = None,
) -> None:
    """Stop a scheduled verification (its recorded verifications stay)."""
    with contextmanager(_schedules)(database_url) as (service, by):
        doc = service.remove(schedule_id, by, datetime.now(UTC))
    err.print(f"removed scheduled verification {doc['id']} ({escape(doc['endpoint'])})")
