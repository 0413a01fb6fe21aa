"""``kvwatch kv-events``: an engine's own KV-cache events (vLLM's ``--kv-events-config`` ZMQ
publisher) → ``kv.turnover`` events every interval and, with ``--target`` (the engine's HTTP
root, for its figures), an ``engine.config`` saying prefix caching is on and unsalted once
blocks stored without a cache salt are seen; sent through the probe's exporter like ``kvwatch
scrape``'s. An interval it could not observe (``kvwatch.kv_events.silence``: not connected,
another topic, the engine down or serving without a single event, for ``--silent-after``) is
sent as a ``source.gap``, never as zeros. Exit 0 done, 2 could not run (bad endpoint, target
down, collector settings missing, events not delivered)."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from kvwatch.cli_common import err
from kvwatch.cli_scrape import EXIT_SENT, _fail, _probe_settings

if TYPE_CHECKING:
    from engine_probe.probe import BaseProbe
    from kvwatch.kv_events import Mirror, Stream
    from kvwatch.kv_events.silence import EngineReading, Gap, Silence
    from kvwatch.scrape import NodeFigures, TargetScraper


def _node_from(endpoint: str) -> str:
    """The default node id: the publisher's host:port (``ipc://`` paths: ``kv-events``)."""
    from kvwatch.scrape.figures import id_from

    if endpoint.startswith("tcp://"):
        return id_from(endpoint.removeprefix("tcp://").strip("[]"), "kv-events")
    return "kv-events"


def kv_events(
    endpoint: Annotated[
        str,
        typer.Option(
            envvar="KVWATCH_KV_EVENTS_ENDPOINT",
            help="The engine's KV-events PUB socket to connect to, tcp://HOST:PORT "
            "(vLLM's --kv-events-config endpoint) [KVWATCH_KV_EVENTS_ENDPOINT].",
        ),
    ],
    replay_endpoint: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_KV_EVENTS_REPLAY_ENDPOINT",
            help="Its ROUTER replay socket (vLLM's replay_endpoint): gaps in the sequence "
            "are filled from it; without it they are counted as lost "
            "[KVWATCH_KV_EVENTS_REPLAY_ENDPOINT].",
        ),
    ] = None,
    topic: Annotated[
        str,
        typer.Option(
            envvar="KVWATCH_KV_EVENTS_TOPIC",
            help="The publisher's topic (vLLM's default: empty) [KVWATCH_KV_EVENTS_TOPIC].",
        ),
    ] = "",
    deployment: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_DEPLOYMENT_ID",
            help="The deployment the events belong to: the one its other producers (probe, "
            "gateway, OTLP) report its tenants under [KVWATCH_DEPLOYMENT_ID; default].",
        ),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            help="The engine's HTTP root (http://host:8000): its /metrics, /v1/models and "
            "/version give the figures of the engine.config sent once unsalted blocks are "
            "seen (without it none is sent)."
        ),
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(
            envvar="KVWATCH_NODE_ID",
            help="Node id (default: with --target, the id the engine's own probe reports, "
            "as kvwatch:node_info publishes it, else the rule of engine_probe.node applied "
            "to the --target's host:port; without --target, the endpoint's host:port) "
            "[KVWATCH_NODE_ID].",
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds per kv.turnover event.")
    ] = 10.0,
    silent_after: Annotated[
        float,
        typer.Option(
            min=0.05,
            envvar="KVWATCH_KV_EVENTS_SILENT_AFTER",
            help="Seconds without a KV event, while something says events should come (no "
            "connection to a publisher, messages on another topic, the --target down or "
            "serving), after which a warning is printed and source.gap events are sent "
            "instead of kv.turnover until events come back [KVWATCH_KV_EVENTS_SILENT_AFTER].",
        ),
    ] = 60.0,
    duration: Annotated[
        float | None,
        typer.Option(min=0.0, help="Stop after this many seconds (default: at SIGTERM or SIGINT)."),
    ] = None,
    backfill: Annotated[
        bool,
        typer.Option(
            "--backfill",
            help="At the first batch, replay what the publisher still buffers (blocks stored "
            "before this started); needs --replay-endpoint.",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds to wait for each HTTP or replay answer.")
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
            help="Bearer key for the --target's API endpoints [KVWATCH_SCRAPE_API_KEY; "
            "prefer the variable].",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what was found; send nothing.")
    ] = False,
) -> None:
    """Subscribe to an engine's KV-cache events (vLLM's --kv-events-config): blocks stored,
    evicted and cleared, with their cache salts and sessions. Every interval sends a
    kv.turnover event; once blocks without a cache salt are seen, an engine.config with
    prefix caching on and unsalted (so prefix_cache_unsalted fires when the deployment
    serves 2+ tenants). The events carry no tenant: see docs/vllm.md."""
    from engine_probe.events import is_valid_id
    from kvwatch.kv_events import KvEventsError, Mirror, Stream, check_endpoint

    try:  # before anything reaches out: an endpoint that cannot work is refused at once
        check_endpoint(endpoint)
        if replay_endpoint:
            check_endpoint(replay_endpoint, "--replay-endpoint")
    except KvEventsError as exc:
        raise _fail(str(exc)) from None
    if backfill and not replay_endpoint:
        raise _fail("--backfill needs --replay-endpoint (the publisher's buffer is read there)")
    figures: NodeFigures | None = None
    scraper: TargetScraper | None = None
    if target is not None:
        from kvwatch.scrape import ScrapeError, TargetScraper, make_target

        try:
            scraper = TargetScraper(
                make_target(target, "vllm", node=node, api_key=api_key), timeout_s=timeout
            )
            scraped = scraper.scrape()
        except ScrapeError as exc:
            raise _fail(str(exc)) from None
        if len(scraped.nodes) != 1:
            raise _fail(
                f"{target} has {len(scraped.nodes)} engine cores; each publishes on its own "
                "port (endpoint + rank): run one kvwatch kv-events per core with --node"
            )
        figures = scraped.nodes[0]
    node_id = node or (figures.node if figures else _node_from(endpoint))
    if not is_valid_id(node_id):
        raise _fail(f"--node {node_id!r} does not follow the id rule")
    settings = _probe_settings(deployment, "kv-events")
    if not dry_run:
        if settings.collector_url is None:
            raise _fail("KVWATCH_COLLECTOR_URL is not set: nowhere to send (or pass --dry-run)")
        if settings.ingest_token is None:
            raise _fail("KVWATCH_COLLECTOR_URL is set but KVWATCH_INGEST_TOKEN is not")
    try:
        stream = Stream(
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            backfill=backfill,
            replay_timeout_s=timeout,
        )
    except KvEventsError as exc:
        raise _fail(str(exc)) from None

    from engine_probe.probe import NoopProbe, Probe

    probe: BaseProbe = NoopProbe() if dry_run else Probe(settings)
    from kvwatch.kv_events.silence import Silence

    silence = Silence(
        endpoint=stream.endpoint,
        topic=topic,
        silent_after_s=silent_after,
        now=time.monotonic(),
        block_tokens=figures.page_size if figures else None,
    )
    loop = _Loop(stream, Mirror(), probe, node_id, figures, silence, scraper)
    silence.baseline(loop.read_engine())
    err.print(
        f"subscribed to {escape(stream.endpoint)}"
        + (f" (replay {escape(stream.replay_endpoint)})" if stream.replay_endpoint else "")
        + f" as node {escape(node_id)}",
        highlight=False,
    )
    try:
        loop.run(interval, duration)
    finally:
        stream.close()
    flushed = probe.force_flush(flush_timeout)
    clean = probe.shutdown(max(flush_timeout, 1.0) if not flushed else 2.0)
    stats = probe.stats()
    lost = sum(stats.get("dropped", {}).values())
    typer.echo(
        json.dumps(
            {
                "intervals": loop.intervals,
                "events": loop.events,
                "config_sent": loop.config_sent,
                "gaps": loop.gaps,
                "probe_id": stats.get("probe_id"),
                "delivered": stats.get("sent", 0),
                "lost": lost,
                "node": node_id,
                "stream": stream.stats.as_dict(),
                "blocks": loop.mirror.totals.summary(),
                "cached_blocks": len(loop.mirror),
            }
        )
    )
    if lost or not clean:
        why = stats.get("last_error") or "the collector did not take them in time"
        raise _fail(f"{lost} events were not delivered: {why}")
    raise typer.Exit(EXIT_SENT)


class _Loop:
    """Reads the stream into the mirror; every ``interval`` sends the interval's
    ``kv.turnover`` (also when nothing happened, if ``silence`` judges the cache idle: the
    probe is alive), or, for an interval it could not observe, nothing until ``silence``
    calls it a gap, then a ``source.gap`` per interval (an interval held back joins the next
    event sent: ``interval_s`` always covers the time since the previous one); and the first
    time an unsalted block is stored, the ``engine.config`` (with ``--target``)."""

    def __init__(
        self,
        stream: Stream,
        mirror: Mirror,
        probe: BaseProbe,
        node: str,
        figures: NodeFigures | None,
        silence: Silence,
        scraper: TargetScraper | None = None,
    ) -> None:
        self.stream = stream
        self.mirror = mirror
        self.probe = probe
        self.node = node
        self.figures = figures
        self.silence = silence
        self.scraper = scraper
        self.intervals = self.events = self.gaps = 0
        self.config_sent = False
        self.gap: Gap | None = None
        self._heard = False
        self._lost_before = 0
        self._stop = threading.Event()

    def run(self, interval: float, duration: float | None) -> None:
        from kvwatch.kv_events import Restarted

        def stop(signum: int, frame: object) -> None:
            self._stop.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
        start = last = sent = time.monotonic()
        end = None if duration is None else start + duration
        while not self._stop.is_set():
            now = time.monotonic()
            due = last + interval
            if end is not None:
                due = min(due, end)
            for item in self.stream.batches(max(due - now, 0.0)):
                self._heard = True
                if isinstance(item, Restarted):
                    self.mirror.reset()
                    continue
                self.mirror.apply(item.events, len(item.unknown))
                if not self.config_sent and self.mirror.totals.counts.unsalted_blocks:
                    self._send_config()
            now = time.monotonic()
            final = self._stop.is_set() or (end is not None and now >= end)
            if now >= last + interval or final:
                if self._close(now, max(now - sent, 1e-3), final=final):
                    sent = now
                last = now
            if end is not None and now >= end:
                break

    def _close(self, now: float, elapsed: float, *, final: bool = False) -> bool:
        """Send what the interval ending ``now`` was (``elapsed``: since the last event
        sent); False when it is held back (never the ``final`` one)."""
        engine = self.read_engine()
        if self._heard:
            self._heard = False
            self.stream.take_other_topic()
            self.silence.data(now, engine)
            if self.gap is not None:
                err.print(
                    f"KV events again after {now - self.gap.since:.0f} s of silence",
                    highlight=False,
                )
                self.gap = None
            self._send_turnover(elapsed)
            return True
        verdict = self.silence.judge(
            now,
            connected=self.stream.connected,
            other_topic=self.stream.other_topic,
            engine=engine,
            final=final,
        )
        if verdict == "hold":
            return False
        if verdict == "idle":
            if self.gap is not None:
                err.print("KV events: connected, and nothing says the engine is busy: idle")
                self.gap = None
            self._send_turnover(elapsed)
            return True
        if self.gap is None or self.gap.cause != verdict.cause:
            from kvwatch.kv_events.silence import advice

            err.print(
                f"[yellow]warning:[/] {escape(verdict.reason)}; sending source.gap, not "
                f"kv.turnover, until events come.\n  {escape(advice(verdict))}",
                highlight=False,
            )
        self.gap = verdict
        self._send_gap(verdict, elapsed)
        return True

    def read_engine(self) -> EngineReading | None:
        """The --target's counters now (None without one)."""
        if self.scraper is None:
            return None
        from kvwatch.kv_events.silence import EngineReading
        from kvwatch.scrape import ScrapeError, vllm

        try:
            done, computed = vllm.activity(self.scraper.exposition())
        except ScrapeError as exc:
            return EngineReading(False, error=str(exc)[:120])
        return EngineReading(True, done, computed)

    def _send_gap(self, gap: Gap, elapsed: float) -> None:
        from engine_probe.events import SourceGap

        self.gaps += 1
        self.events += self.probe.emit(
            SourceGap,
            node=self.node,
            source="kv_events",
            interval_s=round(elapsed, 3),
            silent_s=round(gap.silent_s, 1),
            cause=gap.cause,
            requests=gap.requests,
            reason=gap.reason,
        )

    def _send_config(self) -> None:
        from engine_probe.events import EngineConfig

        self.config_sent = True
        if self.figures is None:
            err.print(
                "[yellow]blocks without a cache salt were stored[/]: prefix caching is shared "
                "unsalted (no --target: no engine.config sent)",
                highlight=False,
            )
            return
        fields: dict[str, Any] = {
            **self.figures.config_fields(),
            "node": self.node,
            "prefix_caching": True,
            "prefix_cache_salting": False,
        }
        self.events += self.probe.emit(EngineConfig, **fields)

    def _send_turnover(self, elapsed: float) -> None:
        from engine_probe.events import KvTurnover

        counts = self.mirror.take()
        lost = self.stream.stats.lost - self._lost_before
        self._lost_before = self.stream.stats.lost
        self.intervals += 1
        self.events += self.probe.emit(
            KvTurnover,
            node=self.node,
            interval_s=round(elapsed, 3),
            lost_batches=lost,
            **counts.turnover_fields(),
        )
