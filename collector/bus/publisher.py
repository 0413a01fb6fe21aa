"""The collector's side of the bus: a batch it accepted (authenticated, within the limits,
decoded and validated, exactly as without the bus) is published to its deployment's
partition, and the probe is answered only once the stream acknowledged it (stored on a
majority of its replicas). What the stream refuses is a 503 with ``Retry-After``: the probe
keeps the batch (spools) and sends it again, as it does in a database outage."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError
from prometheus_client import CollectorRegistry, Counter

from collector.bus import connection
from collector.bus.envelope import Envelope
from collector.bus.layout import Layout
from collector.errors import BusFull, BusUnavailable, PayloadTooLarge
from collector.settings import Settings

log = logging.getLogger("kvwatch.bus")


@dataclass(frozen=True, slots=True)
class Published:
    """The stream's acknowledgement: the message's sequence, and whether the stream had it
    already (a retried batch within the de-duplication window)."""

    seq: int
    duplicate: bool


class BusPublisher:
    """Publishes on the app's event loop; :meth:`start` in the app's startup, :meth:`close`
    at shutdown. Invariant: :meth:`publish` returns only after the stream acknowledged the
    message, and raises :class:`BusUnavailable` (:class:`BusFull` when the stream is at its
    limits) otherwise; it never blocks longer than ``bus_publish_timeout_s``."""

    def __init__(self, settings: Settings, registry: CollectorRegistry):
        self.settings = settings
        self.layout = Layout.of(settings)
        self.replicas = 0
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self.published = Counter(
            "kvwatch_bus_published",
            "Batches published to the ingest bus, by what the stream answered: stored, "
            "duplicate (a retry it had already: dropped), full (at its limits: 503), "
            "unavailable (no answer in time, no leader: 503)",
            ["result"],
            registry=registry,
        )
        for result in ("stored", "duplicate", "full", "unavailable"):
            self.published.labels(result)

    async def start(self) -> None:
        self._nc = await connection.connect(self.settings, "kvwatch-collector")
        self._js = self._nc.jetstream(timeout=self.settings.bus_publish_timeout_s)
        self.replicas = await connection.ensure(self._js, self.settings, self.layout)
        log.info(
            "ingest bus: stream %s on %s (%d replicas, %d partitions)",
            self.layout.stream,
            connection.servers_shown(self.settings),
            self.replicas,
            self.layout.partitions,
        )

    @property
    def max_payload(self) -> int:
        """The largest message the connected server takes (its ``max_payload``); 0 unknown."""
        return int(self._nc.max_payload) if self._nc is not None else 0

    @property
    def servers(self) -> str:
        return connection.servers_shown(self.settings)

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise BusUnavailable("the ingest bus is not connected", self.settings.bus_retry_after_s)
        return self._js

    async def publish(self, deployment_id: str, envelope: Envelope, body: bytes) -> Published:
        subject = self.layout.subject(self.layout.partition_of(deployment_id))
        retry = self.settings.bus_retry_after_s
        headers = envelope.headers()
        limit = self.max_payload
        size = len(body) + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 16
        if limit and size > limit:
            # A 413 is what makes a probe split its batch in halves; a 503 would have it
            # send the same too-large batch for ever.
            raise PayloadTooLarge(
                f"this batch is {size:,} bytes on the ingest bus, which takes at most "
                f"{limit:,} (the NATS servers' max_payload): send smaller batches, or raise "
                "max_payload on the servers",
                {"limit_bytes": limit, "size_bytes": size},
            )
        try:
            ack = await self.js.publish(
                subject,
                body,
                timeout=self.settings.bus_publish_timeout_s,
                headers=headers,
            )
        except APIError as exc:
            text = (exc.description or "").lower()
            if "maximum" in text or "exceeded" in text or "resource" in text:
                self.published.labels("full").inc()
                raise BusFull(
                    f"the ingest stream {self.layout.stream} is full ({exc.description}): "
                    f"the writers are behind; retry after {retry} s",
                    retry,
                ) from None
            self.published.labels("unavailable").inc()
            raise BusUnavailable(
                f"the ingest bus refused the batch ({connection.describe(exc)}); retry "
                f"after {retry} s",
                retry,
            ) from None
        except Exception as exc:  # a timeout, a lost connection: not acknowledged
            self.published.labels("unavailable").inc()
            why = (
                f"did not acknowledge the batch in {self.settings.bus_publish_timeout_s:g} s"
                if isinstance(exc, TimeoutError)
                else f"could not take the batch ({connection.describe(exc)})"
            )
            raise BusUnavailable(f"the ingest bus {why}; retry after {retry} s", retry) from None
        self.published.labels("duplicate" if ack.duplicate else "stored").inc()
        return Published(ack.seq, bool(ack.duplicate))

    async def close(self) -> None:
        if self._nc is not None:
            try:
                await self._nc.drain()
            except Exception as exc:  # closing at shutdown: nothing is pending on our side
                log.warning("bus: closing the connection: %s", exc)
            self._nc = self._js = None
