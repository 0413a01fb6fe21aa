"""Ingest through the bus (the collector's side): everything ``POST /v1/events`` and
``POST /v1/traces`` do before storage (the token, the size limits, decoding and validation,
the same 4xx answers), then the batch is published to its deployment's partition and the
answer waits for the stream's acknowledgement. Nothing here touches the database but the
token lookup, which survives a database outage for tokens already known
(``KVWATCH_BUS_AUTH_GRACE_S``)."""

from __future__ import annotations

from datetime import datetime

import anyio

from collector.bus.envelope import Envelope, events_msg_id, traces_msg_id
from collector.bus.publisher import BusPublisher
from collector.ingest import IngestResult, IngestService
from collector.otlp.service import ExportResult, TraceIngest
from collector.tokens import Principal


class BusIngest:
    def __init__(self, ingest: IngestService, traces: TraceIngest, publisher: BusPublisher):
        self.ingest = ingest
        self.traces = traces
        self.publisher = publisher

    async def events(
        self, who: Principal, body: bytes, content_type: str, now: datetime
    ) -> IngestResult:
        """Validate as direct ingest does, publish, answer once on the stream. The answer
        counts the batch as accepted (or as duplicates, when the stream had it already);
        seq gaps are found by the writer that stores it."""
        batch = await anyio.to_thread.run_sync(self.ingest.prepare, who, body, content_type, now)
        # over the token's new-name limits: 429 now, as direct ingest answers (the probe
        # keeps the batch), not a batch the writer would have to drop
        await anyio.to_thread.run_sync(self.ingest.check_names, who, batch, now)
        events = batch.events
        seqs = [e.seq for e in events]
        envelope = Envelope(
            kind="events",
            principal=who,
            received=now,
            content_type=content_type,
            content_encoding="",
            msg_id=events_msg_id(events[0].probe_id, min(seqs), max(seqs), len(events)),
        )
        published = await self.publisher.publish(events[0].deployment_id, envelope, body)
        n = len(events)
        return IngestResult(0 if published.duplicate else n, n if published.duplicate else 0, [])

    async def spans(
        self,
        who: Principal,
        body: bytes,
        content_type: str,
        content_encoding: str,
        now: datetime,
    ) -> ExportResult:
        """Map the spans as direct ingest does (refusals answered now, in OTLP's partial
        success), then publish the request whole; a writer stores it with
        :meth:`TraceIngest.export`, which maps it again the same way (same time, same
        token). Its partition is its first request's deployment's."""
        result, requests = await anyio.to_thread.run_sync(
            self.traces.prepare, who, body, content_type, content_encoding, now
        )
        self.traces.spans.labels("not_genai").inc(result.not_genai)
        self.traces.spans.labels("rejected").inc(len(result.refused))
        if not requests:
            return result  # nothing to store
        envelope = Envelope(
            kind="traces",
            principal=who,
            received=now,
            content_type=content_type,
            content_encoding=content_encoding,
            msg_id=traces_msg_id(who.lineage, body),
        )
        await self.publisher.publish(requests[0].deployment_id, envelope, body)
        result.accepted = len(requests)
        return result
