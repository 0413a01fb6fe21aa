"""``kvwatch scrape``: an engine's Prometheus ``/metrics`` → ``engine.config`` and
``pool.sample`` events (``kvwatch.scrape``), sent through the probe's exporter (retries,
spool). With ``--every``, a target that stops answering for ``--silent-after`` is a warning
and a ``source.gap`` per node and failed scrape (a gap, not a pause the collector must
infer), until it answers again. Exit 0 sent, 2 could not run (bad target, target down, not
that engine's metrics, collector settings missing, events not delivered)."""

from __future__ import annotations

import json
import signal
import threading
import time
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from kvwatch.cli_common import err

if TYPE_CHECKING:
    from engine_probe.probe import Probe
    from engine_probe.settings import ProbeSettings
    from kvwatch.scrape import Scrape

EXIT_SENT, EXIT_COULD_NOT_RUN = 0, 2


class EngineChoice(StrEnum):
    vllm = "vllm"
    sglang = "sglang"


class RoleChoice(StrEnum):
    prefill = "prefill"
    decode = "decode"
    both = "both"


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(EXIT_COULD_NOT_RUN)


def _probe_settings(deployment: str | None, root: str = "scrape") -> ProbeSettings:
    """The producer settings from the environment; the probe id root defaults to
    ``<root>-<deployment>`` (each run still sends under its own id, see ProbeSettings)."""
    import os

    from pydantic import ValidationError

    from engine_probe.settings import ProbeSettings

    overrides: dict[str, Any] = {}
    if deployment:
        overrides["deployment_id"] = deployment
    try:
        s = ProbeSettings(**overrides)
        if not os.environ.get("KVWATCH_PROBE_ID", "").strip():
            s = ProbeSettings(**overrides, probe_id=f"{root}-{s.deployment_id}"[:100])
    except ValidationError as exc:
        for e in exc.errors():
            name = "KVWATCH_" + "_".join(str(p) for p in e["loc"]).upper()
            if name == "KVWATCH_DEPLOYMENT_ID" and deployment:
                name = "--deployment"
            err.print(f"[red]error:[/] {name}: {escape(str(e['msg']))}", highlight=False)
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    return s


def _describe(result: Scrape) -> None:
    for n in result.nodes:
        share = n.used_tokens / n.pool_capacity_tokens if n.pool_capacity_tokens else 0.0
        below = n.pool_capacity_tokens < n.advertised_context
        mark = "[red]<[/]" if below else ">="
        err.print(
            f"{escape(n.node)} ({n.role}, {escape(n.model_id)}): pool "
            f"{n.pool_capacity_tokens} tokens {mark} advertised context {n.advertised_context}; "
            f"used {n.used_tokens} ({share:.1%})",
            highlight=False,
        )


def scrape(
    target: Annotated[
        str,
        typer.Option(help="The engine server's root URL (http://host:8000) or its /metrics URL."),
    ],
    engine: Annotated[EngineChoice, typer.Option(help="Which engine serves there.")],
    deployment: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_DEPLOYMENT_ID",
            help="The deployment the events belong to [KVWATCH_DEPLOYMENT_ID; default].",
        ),
    ] = None,
    every: Annotated[
        float | None,
        typer.Option(
            min=0.05,
            help="Scrape every this many seconds until SIGTERM or SIGINT (default: once).",
        ),
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_NODE_ID",
            help="Node id (default: the id the engine's own probe reports, where kvwatch's "
            "vLLM plugin publishes kvwatch:node_info, else the target's host:port, a "
            "loopback host being this machine's name; see engine_probe/node.py); "
            "data-parallel ranks 1 and up are NODE/dpN [KVWATCH_NODE_ID].",
        ),
    ] = None,
    role: Annotated[
        RoleChoice | None,
        typer.Option(
            help="The nodes' role, when the metrics do not say it (SGLang's engine_type does)."
        ),
    ] = None,
    silent_after: Annotated[
        float,
        typer.Option(
            min=0.05,
            envvar="KVWATCH_SCRAPE_SILENT_AFTER",
            help="With --every: seconds of failed scrapes after which a warning is printed "
            "and each failed scrape sends a source.gap per node, until the target answers "
            "[KVWATCH_SCRAPE_SILENT_AFTER].",
        ),
    ] = 60.0,
    timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds to wait for each HTTP answer.")
    ] = 10.0,
    flush_timeout: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds to wait at exit for the collector to take the events."),
    ] = 15.0,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_SCRAPE_API_KEY",
            show_envvar=False,
            help="Bearer key for the engine's API endpoints (vLLM's /v1/models behind "
            "--api-key) [KVWATCH_SCRAPE_API_KEY; prefer the variable].",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what was found; send nothing."),
    ] = False,
) -> None:
    """Scrape an engine's Prometheus /metrics into engine.config and pool.sample events:
    pool capacity, page size, advertised context and occupancy per node. Prompt-token
    counters are summarised on stdout (JSON), never turned into request events."""
    from kvwatch.scrape import ScrapeError, TargetScraper, make_target

    try:
        scraper = TargetScraper(
            make_target(
                target,
                engine.value,
                node=node,
                role=role.value if role else None,
                api_key=api_key,
            ),
            timeout_s=timeout,
        )
    except ScrapeError as exc:
        raise _fail(str(exc)) from None
    settings = _probe_settings(deployment)
    if not dry_run:
        if settings.collector_url is None:
            raise _fail("KVWATCH_COLLECTOR_URL is not set: nowhere to send (or pass --dry-run)")
        if settings.ingest_token is None:
            raise _fail("KVWATCH_COLLECTOR_URL is set but KVWATCH_INGEST_TOKEN is not")

    # The first scrape decides whether this can run at all: a wrong URL, a wrong engine or
    # a target that is down is exit 2 before anything is sent.
    try:
        first = scraper.scrape()
    except ScrapeError as exc:
        raise _fail(str(exc)) from None
    _describe(first)
    if dry_run:
        typer.echo(json.dumps({"scrapes": 1, "failed": 0, "events": 0, "last": first.summary()}))
        raise typer.Exit(EXIT_SENT)

    from engine_probe.probe import Probe

    probe = Probe(settings)
    loop = _Loop(scraper, probe, silent_after)
    loop.emit(first)
    if every is not None:
        loop.run(every)
    flushed = probe.force_flush(flush_timeout)
    clean = probe.shutdown(max(flush_timeout, 1.0) if not flushed else 2.0)
    stats = probe.stats()
    lost = sum(stats["dropped"].values())
    typer.echo(
        json.dumps(
            {
                "scrapes": loop.scrapes,
                "failed": loop.failed,
                "gaps": loop.gaps,
                "events": loop.events,
                "probe_id": probe.probe_id,
                "delivered": stats["sent"],
                "spooled": stats["spooled"]["events"],
                "lost": lost,
                "last": loop.last.summary(),
            }
        )
    )
    if lost or not clean:
        why = stats.get("last_error") or "the collector did not take them in time"
        raise _fail(f"{lost} events were not delivered: {why}")
    raise typer.Exit(EXIT_SENT)


class _Loop:
    """Scrapes and emits; ``engine.config`` only at the start and when a node's figures
    change, ``pool.sample`` every time. A failed scrape is counted and reported, and the
    loop goes on: a target that is down for a while loses nothing already taken. Once
    scrapes have failed for ``silent_after`` seconds since the last that succeeded, each
    failed one sends a ``source.gap`` per node (``metrics``, ``engine_down``); the next
    ``pool.sample`` ends the gap (``telemetry_gap``'s ``source_silent`` resolves with it)."""

    def __init__(self, scraper: Any, probe: Probe, silent_after: float = 60.0) -> None:
        self.scraper = scraper
        self.probe = probe
        self.silent_after = silent_after
        self.scrapes = self.failed = self.events = self.gaps = 0
        self.last: Scrape
        self._configs: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._ok_at = self._sent_at = time.monotonic()
        self._silent = False

    def emit(self, result: Scrape) -> None:
        from engine_probe.events import EngineConfig, PoolSample, utcnow

        self.scrapes += 1
        self.last = result
        self._ok_at = self._sent_at = time.monotonic()
        if self._silent:
            err.print("the target answers again: pool samples resume", highlight=False)
            self._silent = False
        ts = utcnow()
        for n in result.nodes:
            fields = n.config_fields()
            if self._configs.get(n.node) != fields:
                self._configs[n.node] = fields
                self.events += self.probe.emit(EngineConfig, ts=ts, **fields)
            self.events += self.probe.emit(PoolSample, ts=ts, **n.pool_fields())

    def run(self, every: float) -> None:
        from kvwatch.scrape import ScrapeError

        def stop(signum: int, frame: object) -> None:
            self._stop.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        while not self._stop.wait(every):
            try:
                result = self.scraper.scrape()
            except ScrapeError as exc:
                self.failed += 1
                err.print(f"[yellow]scrape failed[/] ({self.failed}): {escape(str(exc))}")
                self._gap(str(exc))
                continue
            self.emit(result)

    def _gap(self, error: str) -> None:
        from engine_probe.events import SourceGap

        now = time.monotonic()
        silent = now - self._ok_at
        if silent < self.silent_after:
            return
        reason = f"no metrics for {silent:.0f} s: {error}"[:256]
        if not self._silent:
            err.print(
                f"[yellow]warning:[/] {escape(reason)}; sending source.gap until it answers",
                highlight=False,
            )
            self._silent = True
        for n in self.last.nodes:
            self.gaps += 1
            self.events += self.probe.emit(
                SourceGap,
                node=n.node,
                source="metrics",
                interval_s=round(max(now - self._sent_at, 1e-3), 3),
                silent_s=round(silent, 1),
                cause="engine_down",
                reason=reason,
            )
        self._sent_at = now
