"""``kvwatch writer`` and ``kvwatch bus status``: the ingest bus's processes and its state
(docs/scaling.md). ``kvwatch serve --bus`` is the publishing side."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvwatch.cli_common import (
    EXIT_COULD_NOT_RUN,
    DbUrl,
    KvwatchTyper,
    err,
    settings,
    stdout_console,
    table,
)

if TYPE_CHECKING:
    from collector.bus.monitor import BusStatus
    from collector.settings import Settings

bus_app = KvwatchTyper(help="The ingest bus (NATS JetStream): its state.", no_args_is_help=True)

BusUrl = Annotated[
    str | None,
    typer.Option(
        "--bus",
        envvar="KVWATCH_BUS_URL",
        show_envvar=False,
        help="NATS server(s) of the ingest bus, comma-separated [KVWATCH_BUS_URL].",
    ),
]


def bus_settings(bus: str | None, database_url: str | None = None) -> Settings:
    """The settings with ``--bus`` applied; no bus at all is an error naming the setting."""
    from pydantic import SecretStr

    s = settings(database_url)
    if bus:
        s = s.model_copy(update={"bus_url": SecretStr(bus)})
    if s.bus_url is None:
        err.print(
            "[red]error:[/] no ingest bus: give --bus nats://HOST:PORT or set KVWATCH_BUS_URL"
        )
        raise typer.Exit(EXIT_COULD_NOT_RUN)
    return s


def check_bus(s: Settings) -> int:
    """Connect, make sure the stream and its consumers exist, disconnect: a bus that cannot be
    used ends the command here with one line (before a server starts). Returns the stream's
    replicas."""
    from collector.bus import connection
    from collector.bus.layout import Layout
    from collector.errors import BusUnavailable

    async def check() -> int:
        nc = await connection.connect(s, "kvwatch-check")
        try:
            return await connection.ensure(nc.jetstream(timeout=5), s, Layout.of(s))
        finally:
            await nc.close()

    try:
        return asyncio.run(check())
    except BusUnavailable as exc:
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None


@bus_app.command("status")
def bus_status(
    bus: BusUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False,
) -> None:
    """The stream (backlog against its limits, replicas, leader) and each partition: batches
    waiting and in flight, redelivered, lag (how long the oldest batch not yet stored has
    waited) and the writers pulling it. Exit 1 when the bus_lag rule fires (a partition
    lags; the bus cannot be read) or the stream is over 90% full."""
    from nats.js.errors import NotFoundError

    from collector.bus import connection
    from collector.bus.monitor import read_status
    from collector.errors import BusUnavailable

    s = bus_settings(bus)

    async def read() -> BusStatus:
        nc = await connection.connect(s, "kvwatch-status")
        try:
            return await read_status(nc.jetstream(timeout=5), s)
        finally:
            await nc.close()

    try:
        status = asyncio.run(read())
    except BusUnavailable as exc:
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    except NotFoundError:
        err.print(
            f"[red]error:[/] no stream {escape(s.bus_stream)} on "
            f"{escape(connection.servers_shown(s))} yet: a collector (kvwatch serve --bus) or a "
            "writer makes it when it starts"
        )
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    except Exception as exc:
        err.print(
            f"[red]error:[/] the stream {escape(s.bus_stream)} on "
            f"{escape(connection.servers_shown(s))} cannot be read: "
            f"{escape(connection.describe(exc))}"
        )
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    firing = _bus_lag_findings(s, status)
    full = status.bytes / status.max_bytes if status.max_bytes > 0 else 0.0
    if as_json:
        typer.echo(json.dumps(status.as_dict(), indent=2))
    else:
        out = stdout_console()
        peers = ", ".join(
            f"{p['name']} ({'current' if p['current'] else 'behind'})" for p in status.peers
        )
        out.print(
            f"stream {status.stream} on {status.servers}: {status.messages} batch(es), "
            f"{status.bytes:,} of {status.max_bytes:,} bytes ({full:.0%}); "
            f"{status.replicas} replica(s), leader {status.leader or '-'}"
            + (f"; followers {peers}" if peers else ""),
            markup=False,
            highlight=False,
        )
        t = table("partition", "consumer", "waiting", "in flight", "redelivered", "lag", "writers")
        for p in status.partitions:
            t.add_row(
                str(p.partition),
                p.consumer,
                str(p.waiting),
                str(p.in_flight),
                str(p.redelivered),
                f"{p.lag_s:.1f} s",
                str(p.writers),
            )
        out.print(t)
    for summary in firing:
        err.print(f"bus_lag: {summary}", markup=False)
    if full > 0.9:
        err.print(
            f"the stream is {full:.0%} full: at 100% ingest answers 503 and probes spool",
            markup=False,
        )
    if firing or full > 0.9:
        raise typer.Exit(1)


def _bus_lag_findings(s: Settings, status: BusStatus) -> list[str]:
    """What the loaded rule packs' ``bus_lag`` rules say of this reading (the rule decides,
    here as in the collector's timer): the summary of each firing signal."""
    from collector.bus.monitor import fact
    from policies import KINDS, TimerFacts, load_ruleset

    rules = [r for r in load_ruleset(s.policy_packs_dir).enabled() if r.kind == "bus_lag"]
    facts = TimerFacts(bus=fact(status))
    return [
        sig.annotations.get("summary", sig.rule)
        for r in rules
        for sig in KINDS[r.kind].on_timer(r, facts, status.read_at)
        if sig.firing
    ]


def writer(
    bus: BusUrl = None,
    partitions: Annotated[
        str | None,
        typer.Option(
            "--partitions",
            help="Partitions this writer stores, comma-separated (default: all of them; "
            "writers on the same partitions take turns, in order).",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Serve this writer's Prometheus metrics here."),
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Store what the collectors published to the ingest bus: fetch each partition's next
    batch, store it (one transaction, policies included), acknowledge it after the commit.
    Run as many as you need; SIGTERM finishes the batches in hand and stops."""
    from collector import migrate
    from collector.bus.writer import create_writer

    s = bus_settings(bus, database_url)
    chosen = None
    if partitions:
        try:
            chosen = sorted({int(p) for p in partitions.split(",") if p.strip()})
        except ValueError:
            err.print(f"[red]error:[/] --partitions {escape(partitions)!s}: not a list of numbers")
            raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    if s.auto_migrate:
        migrate.upgrade(s.database_url)
    check_bus(s)
    try:
        w = create_writer(s, chosen)
    except ValueError as exc:
        err.print(f"[red]error:[/] --partitions: {escape(str(exc))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=s.host, registry=w.registry)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.stop)
        await w.run()

    try:
        asyncio.run(main())
    finally:
        w.close()


@bus_app.command("cluster")
def bus_cluster(
    directory: Annotated[
        str, typer.Option("--dir", help="Where the nodes keep their stores, configs and logs.")
    ] = "kvwatch-bus",
    nodes: Annotated[int, typer.Option("--nodes", min=1, max=5, help="Nodes.")] = 3,
    port: Annotated[
        int,
        typer.Option(
            "--port",
            min=1024,
            max=60000,
            help="First client port: nodes listen on PORT, PORT+1, ...; their cluster routes "
            "on PORT+2000, ...",
        ),
    ] = 4301,
) -> None:
    """Run a local NATS JetStream cluster from the installed nats-server, on 127.0.0.1 (the
    example of docs/scaling.md; one machine is not a replicated deployment). Prints the URL
    for --bus / KVWATCH_BUS_URL; runs until stopped (Ctrl-C, SIGTERM)."""
    from pathlib import Path

    from kvwatch.bus_cluster import ClusterError, LocalCluster

    cluster = LocalCluster(
        Path(directory),
        nodes=nodes,
        client_ports=[port + i for i in range(nodes)],
        route_ports=[port + 2000 + i for i in range(nodes)],
    )
    stopped = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        cluster.start()
    except ClusterError as exc:
        cluster.stop()
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_COULD_NOT_RUN) from None
    typer.echo(cluster.url, err=False)
    err.print(f"{nodes} node(s) in {directory}; stop with Ctrl-C", markup=False)
    try:
        while not stopped:
            signal.pause()
    finally:
        cluster.stop()
