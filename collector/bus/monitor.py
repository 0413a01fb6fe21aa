"""The bus as a person sees it: the stream (backlog against its limits, replicas, leader)
and each partition's consumer (batches waiting, in flight, redelivered, and the lag: how
long the oldest batch not yet stored has waited). One reading, :func:`read_status`, serves
``kvwatch bus status``, the collector's ``/metrics`` and ``/readyz``, and the ``bus_lag``
rule (:class:`BusMonitor` keeps the latest)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Gauge

from collector.bus import connection
from collector.bus.layout import Layout
from collector.settings import Settings
from policies import BusFact, BusPartitionFact

if TYPE_CHECKING:
    from collector.bus.publisher import BusPublisher

log = logging.getLogger("kvwatch.bus")


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    partition: int
    consumer: str
    waiting: int  # batches in the stream, not yet fetched by a writer
    in_flight: int  # fetched, not yet acknowledged (stored and committed)
    redelivered: int  # batches handed out again (a writer died or failed to store them)
    lag_s: float  # how long the oldest batch not yet stored has waited; 0 when none waits
    writers: int  # fetch requests waiting on this partition (writers pulling it)


@dataclass(frozen=True, slots=True)
class BusStatus:
    read_at: datetime
    stream: str
    servers: str  # no credentials
    messages: int
    bytes: int
    max_bytes: int
    max_msgs: int | None
    replicas: int
    leader: str | None
    peers: list[dict[str, Any]]  # the other replicas: name, current, lag (operations)
    partitions: list[PartitionStatus] = field(default_factory=list)
    error: str | None = None  # the bus could not be read: why

    @property
    def lag_s(self) -> float:
        return max((p.lag_s for p in self.partitions), default=0.0)

    @property
    def pending(self) -> int:
        return sum(p.waiting + p.in_flight for p in self.partitions)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["read_at"] = self.read_at.isoformat().replace("+00:00", "Z")
        d["lag_s"] = self.lag_s
        d["pending"] = self.pending
        return d


def unreadable(settings: Settings, error: str, now: datetime) -> BusStatus:
    layout = Layout.of(settings)
    return BusStatus(
        read_at=now,
        stream=layout.stream,
        servers=connection.servers_shown(settings),
        messages=0,
        bytes=0,
        max_bytes=settings.bus_max_bytes,
        max_msgs=settings.bus_max_msgs,
        replicas=0,
        leader=None,
        peers=[],
        error=error,
    )


async def read_status(js: JetStreamContext, settings: Settings) -> BusStatus:
    """The stream and its partitions now; raises what NATS raises when it cannot be read."""
    layout = Layout.of(settings)
    info = await js.stream_info(layout.stream)
    now = datetime.now(UTC)
    cluster = info.cluster
    peers = [
        {"name": p.name, "current": bool(p.current), "lag": p.lag, "offline": bool(p.offline)}
        for p in (cluster.replicas or [] if cluster is not None else [])
    ]
    parts = []
    for p in range(layout.partitions):
        try:
            ci = await js.consumer_info(layout.stream, layout.consumer(p))
        except NotFoundError:
            continue
        waiting = ci.num_pending or 0
        in_flight = ci.num_ack_pending or 0
        lag = 0.0
        if waiting or in_flight:
            floor = ci.ack_floor.stream_seq if ci.ack_floor is not None else 0
            try:
                oldest = await js.get_msg(
                    layout.stream, seq=(floor or 0) + 1, subject=layout.subject(p), next=True
                )
                if oldest.time is not None:
                    lag = max(0.0, (now - oldest.time).total_seconds())
            except NotFoundError:
                pass  # written in the meantime
        parts.append(
            PartitionStatus(
                partition=p,
                consumer=layout.consumer(p),
                waiting=waiting,
                in_flight=in_flight,
                redelivered=ci.num_redelivered or 0,
                lag_s=round(lag, 3),
                writers=ci.num_waiting or 0,
            )
        )
    return BusStatus(
        read_at=now,
        stream=layout.stream,
        servers=connection.servers_shown(settings),
        messages=info.state.messages,
        bytes=info.state.bytes,
        max_bytes=info.config.max_bytes or -1,
        max_msgs=None if (info.config.max_msgs or -1) < 0 else info.config.max_msgs,
        replicas=info.config.num_replicas or 1,
        leader=cluster.leader if cluster is not None else None,
        peers=peers,
        partitions=parts,
    )


class BusMonitor:
    """Reads the bus every ``bus_status_interval_s`` on the app's loop and keeps the latest
    reading (:attr:`latest`), which ``/metrics`` exports and the policy timer hands to the
    ``bus_lag`` rule. A reading that fails is kept too, with its error (readiness says it)."""

    def __init__(self, settings: Settings, registry: CollectorRegistry):
        self.settings = settings
        self.latest: BusStatus | None = None
        self._task: asyncio.Task[None] | None = None
        labels = ["partition"]
        self.lag = Gauge(
            "kvwatch_bus_lag_seconds",
            "How long the oldest batch not yet stored has waited on the ingest bus, per partition",
            labels,
            registry=registry,
        )
        self.pending = Gauge(
            "kvwatch_bus_pending_batches",
            "Batches on the ingest bus not yet stored (waiting or in flight), per partition",
            labels,
            registry=registry,
        )
        self.redelivered = Gauge(
            "kvwatch_bus_redelivered_batches",
            "Batches the bus handed out again and not yet stored (a writer died or failed to "
            "store them), per partition",
            labels,
            registry=registry,
        )
        self.stream_bytes = Gauge(
            "kvwatch_bus_stream_bytes",
            "Bytes in the ingest stream (its limit: kvwatch_bus_stream_max_bytes)",
            registry=registry,
        )
        self.stream_max = Gauge(
            "kvwatch_bus_stream_max_bytes",
            "The ingest stream's byte limit; at it, ingest answers 503",
            registry=registry,
        )
        self.up = Gauge(
            "kvwatch_bus_up",
            "1 when the last reading of the ingest bus succeeded",
            registry=registry,
        )

    def observe(self, status: BusStatus) -> None:
        self.latest = status
        self.up.set(0 if status.error else 1)
        if status.error:
            return
        self.stream_bytes.set(status.bytes)
        self.stream_max.set(status.max_bytes)
        for p in status.partitions:
            key = str(p.partition)
            self.lag.labels(key).set(p.lag_s)
            self.pending.labels(key).set(p.waiting + p.in_flight)
            self.redelivered.labels(key).set(p.redelivered)

    async def sample(self, js: JetStreamContext) -> BusStatus:
        try:
            status = await read_status(js, self.settings)
        except Exception as exc:  # any failure to read is a reading too: the bus is not up
            status = unreadable(self.settings, connection.describe(exc), datetime.now(UTC))
        self.observe(status)
        return status

    def start(self, js: JetStreamContext, connected: Callable[[], bool] = lambda: True) -> None:
        """Read every ``bus_status_interval_s``; while ``connected()`` says the connection is
        down, the reading is that (at once, not after a request's timeout)."""

        async def loop() -> None:
            while True:
                if connected():
                    await self.sample(js)
                else:
                    now = datetime.now(UTC)
                    self.observe(unreadable(self.settings, "not connected to the bus", now))
                await asyncio.sleep(self.settings.bus_status_interval_s)

        self._task = asyncio.get_running_loop().create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def fact(status: BusStatus | None) -> BusFact | None:
    """The reading as the policies see it (``policies.BusFact``)."""
    if status is None:
        return None
    return BusFact(
        stream=status.stream,
        read_at=status.read_at,
        error=status.error,
        partitions=[
            BusPartitionFact(p.partition, p.lag_s, p.waiting + p.in_flight, p.redelivered)
            for p in status.partitions
        ],
    )


def bus_problem(publisher: BusPublisher, monitor: BusMonitor | None) -> str | None:
    """Why this collector cannot take batches now (readiness), or None: not connected, or
    the latest reading of the stream failed."""
    if not publisher.connected:
        return f"not connected to the ingest bus ({publisher.servers})"
    latest = monitor.latest if monitor is not None else None
    if latest is not None and latest.error is not None:
        return f"the ingest bus cannot be read: {latest.error}"
    return None
