"""``kvwatch writer``: stores what the collectors published to the ingest bus.

Each writer pulls every partition it serves (all, by default) from its durable consumer, one
batch at a time, and stores it through the collector's own ingest path
(:class:`collector.ingest.IngestService`, :class:`collector.otlp.service.TraceIngest`): one
transaction with its policies, idempotent on ``(probe_id, seq)``, under the token and the
receive time the collector decided. The batch is acknowledged only after that transaction
committed. What follows:

- a writer killed mid-batch loses nothing: the stream hands the batch to a writer again
  after ``KVWATCH_BUS_ACK_WAIT_S``, and the store drops what the dead writer had committed
  (at-least-once delivery plus an idempotent store: each event stored once);
- a partition is stored in order (one batch in flight per partition, whichever writer holds
  it), so a deployment's events are stored in the order they were accepted;
- a database outage is waited out: the batch is handed back with a delay
  (``nak``) and tried again; the stream holds the rest, and the probes never see it while it
  has room;
- a batch the store refuses for good (a token's new-name limit, say) is dropped and counted
  (``kvwatch_writer_batches_total{result="refused"}``), logged with its probe and seq range;
  its seq range then shows as a gap, which the ``telemetry_gap`` rule alerts on.

N writers on N partitions store N batches at once; more writers than partitions stand by.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Histogram

from collector.bus import connection
from collector.bus.envelope import Envelope, EnvelopeError
from collector.bus.layout import Layout
from collector.db import Database
from collector.errors import CollectorError, Unavailable
from collector.ingest import IngestService
from collector.otlp.service import TraceIngest
from collector.settings import Settings

log = logging.getLogger("kvwatch.writer")

_BACKOFF_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class Stored:
    accepted: int
    duplicates: int


class Writer:
    """Invariant: a message is acknowledged only after its batch's transaction committed
    (or, refused for good, terminated after it was counted and logged); every other outcome
    leaves it on the stream."""

    def __init__(
        self,
        settings: Settings,
        ingest: IngestService,
        traces: TraceIngest,
        registry: CollectorRegistry,
        partitions: Sequence[int] | None = None,
    ):
        self.settings = settings
        self.ingest = ingest
        self.traces = traces
        self.layout = Layout.of(settings)
        self.partitions = (
            list(range(self.layout.partitions)) if partitions is None else list(partitions)
        )
        bad = [p for p in self.partitions if not 0 <= p < self.layout.partitions]
        if bad:
            raise ValueError(
                f"partition(s) {bad} do not exist: the stream has {self.layout.partitions} "
                f"(0 to {self.layout.partitions - 1}; KVWATCH_BUS_PARTITIONS)"
            )
        self.batches = Counter(
            "kvwatch_writer_batches",
            "Batches taken from the ingest bus, by outcome: stored (committed, then "
            "acknowledged), duplicate (all already stored: a redelivery or a retry), retried "
            "(handed back: the database was unavailable), refused (dropped for good: logged, "
            "and a seq gap to the telemetry_gap rule)",
            ["result"],
            registry=registry,
        )
        for result in ("stored", "duplicate", "retried", "refused"):
            self.batches.labels(result)
        self.redelivered = Counter(
            "kvwatch_writer_redelivered_batches",
            "Batches this writer received that had been delivered before (a writer died "
            "holding them, or the database was down)",
            registry=registry,
        )
        self.store_seconds = Histogram(
            "kvwatch_writer_store_seconds",
            "Time to store one batch from the bus (its transaction, policies included)",
            registry=registry,
        )
        self._stop = asyncio.Event()
        self.registry = registry
        self.db: Database | None = None  # create_writer's own, closed by close()

    def close(self) -> None:
        if self.db is not None:
            self.db.dispose()

    def stop(self) -> None:
        """Finish the batches in hand, then return from :meth:`run` (SIGTERM)."""
        self._stop.set()

    async def run(self) -> None:
        nc = await connection.connect(self.settings, "kvwatch-writer")
        try:
            js = nc.jetstream(timeout=self.settings.bus_publish_timeout_s)
            await connection.ensure(js, self.settings, self.layout)
            log.info(
                "writer: stream %s on %s, partitions %s",
                self.layout.stream,
                connection.servers_shown(self.settings),
                ",".join(map(str, self.partitions)),
            )
            await asyncio.gather(*(self._serve(js, p) for p in self.partitions))
        finally:
            # close, not drain: every batch in hand was acknowledged or handed back, and a
            # drain waits on the pull subscriptions' pending fetches
            with contextlib.suppress(Exception):
                await nc.close()

    async def _serve(self, js: JetStreamContext, partition: int) -> None:
        sub = None
        while not self._stop.is_set():
            try:
                if sub is None:
                    sub = await js.pull_subscribe_bind(
                        durable=self.layout.consumer(partition), stream=self.layout.stream
                    )
                msgs = await sub.fetch(1, timeout=1.0)
            except nats.errors.TimeoutError:
                continue  # nothing to write (or a fetch lost in an election): ask again
            except Exception as exc:  # the connection reconnects by itself; so do we
                log.warning("writer: partition %d: %s", partition, connection.describe(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._handle(msg, partition)

    async def _handle(self, msg: Msg, partition: int) -> None:
        meta = msg.metadata
        if meta.num_delivered > 1:
            self.redelivered.inc()
        try:
            envelope = Envelope.from_headers(msg.headers)
        except EnvelopeError as exc:
            self._refused(partition, meta.sequence.stream, exc.message)
            await msg.term()
            return
        started = time.perf_counter()
        # Told "still working" while the transaction runs: a slow database must not hand the
        # batch to another writer as if this one had died.
        beat = asyncio.get_running_loop().create_task(self._in_progress(msg))
        try:
            stored = await asyncio.to_thread(self._store, envelope, msg.data)
        except Unavailable as exc:
            delay = min(_BACKOFF_MAX_S, 0.2 * 2 ** min(meta.num_delivered - 1, 8))
            log.warning(
                "writer: partition %d: %s; batch %s handed back, again in %.1f s",
                partition,
                exc.message,
                envelope.msg_id,
                delay,
            )
            self.batches.labels("retried").inc()
            await msg.nak(delay=delay)
            return
        except CollectorError as exc:
            self._refused(partition, meta.sequence.stream, f"{envelope.msg_id}: {exc.message}")
            await msg.term()
            return
        except Exception:
            # a bug, not the batch's fault: keep it, say so loudly, try again later
            log.exception("writer: partition %d: storing %s failed", partition, envelope.msg_id)
            self.batches.labels("retried").inc()
            await msg.nak(delay=_BACKOFF_MAX_S)
            return
        finally:
            beat.cancel()
        self.store_seconds.observe(time.perf_counter() - started)
        self.batches.labels("stored" if stored.accepted else "duplicate").inc()
        try:
            await msg.ack_sync(timeout=self.settings.bus_publish_timeout_s)
        except Exception as exc:
            # stored: its redelivery will be all duplicates
            log.warning("writer: acknowledging %s: %s", envelope.msg_id, connection.describe(exc))

    def _store(self, envelope: Envelope, body: bytes) -> Stored:
        who, now = envelope.principal, envelope.received
        if envelope.kind == "events":
            res = self.ingest.ingest(who, body, envelope.content_type, now)
            return Stored(res.accepted, res.duplicates)
        spans = self.traces.export(who, body, envelope.content_type, envelope.content_encoding, now)
        return Stored(spans.accepted, spans.duplicates)

    async def _in_progress(self, msg: Msg) -> None:
        every = self.settings.bus_ack_wait_s / 3
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    def _refused(self, partition: int, stream_seq: int, why: str) -> None:
        self.batches.labels("refused").inc()
        log.error(
            "writer: partition %d: message %d dropped, it cannot be stored: %s",
            partition,
            stream_seq,
            why,
        )


def create_writer(settings: Settings, partitions: Sequence[int] | None = None) -> Writer:
    """A writer with its own database connections and the collector's ingest path, policies
    included (as ``create_app`` wires them; nothing is built at import). Its metrics are on
    ``writer.registry``."""
    from collector.alerting.service import AlertingService
    from collector.installation import Identity
    from collector.limits import Limits
    from collector.metrics import CollectorMetrics
    from collector.tokens import Authenticator
    from policies import RuleSet, load_ruleset

    db = Database(settings.database_url, pool_size=settings.db_pool_size)
    rules = load_ruleset(settings.policy_packs_dir) if settings.policies_enabled else RuleSet()
    metrics = CollectorMetrics(db, limits=Limits.for_rules(db, rules))
    alerting = (
        AlertingService(db, rules, identity=Identity.of(settings))
        if settings.policies_enabled
        else None
    )
    # the writer never authenticates (the collector did, and the envelope says who)
    ingest = IngestService(db, settings, metrics, Authenticator(db), alerting)
    traces = TraceIngest(ingest, settings, metrics.registry)
    writer = Writer(settings, ingest, traces, metrics.registry, partitions)
    writer.db = db
    return writer
