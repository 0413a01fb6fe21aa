"""One OTLP/HTTP trace export request, stored whole or not at all.

What ``POST /v1/events`` guarantees holds here: the ingest token (its deployment scope
included), one transaction for everything the request adds, the token's new-name limits,
the policies evaluated over the new requests in that transaction, and idempotency, so an
exporter's retry of the same spans stores nothing twice.

Spans carry no per-producer sequence number, so the collector numbers them: each
(token lineage, deployment) has a probe of its own (:func:`probe_id`), whose row is locked
while the request's spans for it are numbered above its high-water mark. Under that lock a
span already stored (``otlp_spans``, by trace and span id) is a duplicate: an exporter's
retry stores nothing twice, and replicas receiving the same retry serialise on the lock.
A new span naming a request id the deployment already stores is a request of its own that
shares that request's prompt (vLLM sends one span per parallel-sampling child, every one
under the parent's id; see :meth:`SpanRequest.as_sibling`).

What is not stored: spans that are not GenAI spans (counted, never stored: an
application's HTTP or database spans may hold anything), and GenAI spans that cannot be
stored, each refused with a reason, as OTLP's partial success reports (``rejected_spans``
and the first reasons in ``error_message``). A request whose every span is refused that
way is still a success (HTTP 200), as OTLP specifies; a body that is not an export request
at all is a 400.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import msgspec
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import Connection

from collector.errors import CollectorError, Forbidden
from collector.ingest import IngestService
from collector.otlp import wire
from collector.otlp.genai import Mapper, SpanRefused, SpanRequest, is_genai, read_attributes
from collector.settings import Settings
from collector.store import WriteResult, micros, shape_rows
from collector.tokens import Principal
from engine_probe import events as ev

log = logging.getLogger("kvwatch.otlp")

_MESSAGES = 3  # refusal reasons quoted in error_message; the rest are counted


def probe_id(lineage: int, deployment_id: str) -> str:
    """The probe the collector stores a token lineage's spans of one deployment under."""
    pid = f"otlp.{lineage}.{deployment_id}"
    if len(pid) <= ev.ID_MAX:
        return pid
    digest = hashlib.sha256(deployment_id.encode()).hexdigest()[:24]
    return f"otlp.{lineage}.{digest}"


@dataclass(slots=True)
class ExportResult:
    """What one export request did, in spans."""

    accepted: int = 0
    duplicates: int = 0
    not_genai: int = 0
    refused: list[str] = field(default_factory=list)

    @property
    def error_message(self) -> str:
        if not self.refused:
            return ""
        quoted = "; ".join(self.refused[:_MESSAGES])
        more = len(self.refused) - _MESSAGES
        return f"{len(self.refused)} spans rejected: {quoted}" + (
            f" (and {more} more)" if more > 0 else ""
        )


class TraceIngest:
    def __init__(self, ingest: IngestService, settings: Settings, registry: CollectorRegistry):
        self.ingest = ingest
        self.settings = settings
        self.spans = Counter(
            "kvwatch_otlp_spans",
            "Spans received on POST /v1/traces, by what became of them: accepted (stored as "
            "a request), duplicate (that request was stored already), not_genai (no gen_ai.* "
            "attribute: dropped, never stored), rejected (a GenAI span that cannot be "
            "stored; answered in OTLP's partial success)",
            ["result"],
            registry=registry,
        )
        for result in ("accepted", "duplicate", "not_genai", "rejected"):
            self.spans.labels(result)
        self._keep = read_attributes(
            settings.otlp_tenant_attributes, settings.otlp_deployment_attributes
        )

    def authenticate(self, authorization: str | None) -> Principal:
        return self.ingest.authenticate(authorization)

    def export(
        self,
        principal: Principal,
        body: bytes,
        content_type: str,
        content_encoding: str,
        now: datetime,
    ) -> ExportResult:
        started = time.perf_counter()
        metrics = self.ingest.metrics
        result, requests = self.prepare(principal, body, content_type, content_encoding, now)
        try:
            if requests:
                self._store(principal, requests, now, result)
        except CollectorError as exc:
            metrics.rejected.labels(exc.code).inc()
            raise
        self.spans.labels("accepted").inc(result.accepted)
        self.spans.labels("duplicate").inc(result.duplicates)
        self.spans.labels("not_genai").inc(result.not_genai)
        self.spans.labels("rejected").inc(len(result.refused))
        metrics.batch_seconds.observe(time.perf_counter() - started)
        return result

    def prepare(
        self,
        principal: Principal,
        body: bytes,
        content_type: str,
        content_encoding: str,
        now: datetime,
    ) -> tuple[ExportResult, list[SpanRequest]]:
        """Inflate, decode and map an export request: what would be stored, and the spans
        refused with their reasons. Pure CPU work, touching no database (the ingest bus
        publishes what this accepts before any is stored)."""
        try:
            raw = wire.inflate(body, content_encoding, self.settings.max_body_bytes)
            spans = wire.decode(raw, content_type, self.settings.max_batch_events, self._keep)
            return self._map(principal, spans, now)
        except CollectorError as exc:
            self.ingest.metrics.rejected.labels(exc.code).inc()
            raise

    def _map(
        self, principal: Principal, spans: Sequence[wire.Span], now: datetime
    ) -> tuple[ExportResult, list[SpanRequest]]:
        lineage = principal.lineage
        mapper = Mapper(
            tenant_attributes=self.settings.otlp_tenant_attributes,
            deployment_attributes=self.settings.otlp_deployment_attributes,
            scope=principal.deployment_id,
            probe_id=lambda dep: probe_id(lineage, dep),
            now=now,
            max_clock_skew=timedelta(seconds=self.settings.max_clock_skew_s),
        )
        result = ExportResult()
        requests: list[SpanRequest] = []
        for i, span in enumerate(spans):
            if not is_genai(span):
                result.not_genai += 1
                continue
            try:
                req = mapper.request(span)
            except SpanRefused as exc:
                result.refused.append(f"span {i} ({span.name or 'unnamed'}): {exc}")
                continue
            if principal.deployment_id is not None and req.deployment_id != principal.deployment_id:
                # The scope is the token's, as on /v1/events: refuse the request, not a span.
                raise Forbidden(
                    f"this ingest token may only write deployment {principal.deployment_id!r}; "
                    f"span {i} names {req.deployment_id!r}",
                    [{"index": i, "field": "deployment_id", "message": "outside the scope"}],
                )
            requests.append(req)
        return result, requests

    def _store(
        self,
        principal: Principal,
        requests: list[SpanRequest],
        now: datetime,
        result: ExportResult,
    ) -> None:
        # One probe per deployment; probes locked in id order, so two replicas storing
        # requests for the same deployments cannot deadlock.
        by_probe: dict[str, list[SpanRequest]] = {}
        for r in requests:
            by_probe.setdefault(r.events[0].probe_id, []).append(r)
        every = [e for r in requests for e in r.events]
        store = self.ingest.store
        now_us = micros(now)
        # Shaping is pure, so it is done before the write lock, as /v1/events does; a group
        # that turns out to hold a retried span or a sibling is shaped again under it. (A
        # request row holds no seq: the placeholder seqs shape the same rows.)
        shaped = {
            pid: shape_rows(e for r in group for e in r.events) for pid, group in by_probe.items()
        }

        def write(conn: Connection) -> WriteResult:
            total = WriteResult(0, 0)
            accepted = duplicates = 0
            for pid in sorted(by_probe):
                group = by_probe[pid]
                dep = group[0].deployment_id
                high = store.high_water(
                    conn, pid, principal.token_id, dep, now_us, lineage_id=principal.lineage
                )
                seen = store.stored_spans(conn, dep, [r.span_key for r in group])
                taken = store.stored_requests(conn, dep, [r.request_id for r in group])
                # whose each taken id is: a span naming another tenant's request id is a
                # collision, stored apart and never linked to it
                owners = store.request_tenants(conn, dep, sorted(taken)) if taken else {}
                fresh: list[ev.Event] = []
                remembered: list[tuple[str, str]] = []
                seq = high
                as_shaped = True
                for r in group:
                    if r.span_key in seen:
                        duplicates += 1  # this span was stored: a retry
                        as_shaped = False
                        continue
                    seen.add(r.span_key)
                    if r.request_id in taken:
                        as_shaped = False
                        same = owners.get(r.request_id) == r.tenant
                        r = r.as_sibling(shares_prompt=same)
                        if r.request_id in taken:  # pragma: no cover - a span id repeated
                            duplicates += 1
                            continue
                    taken.add(r.request_id)
                    owners[r.request_id] = r.tenant
                    remembered.append((r.span_key, r.request_id))
                    accepted += 1
                    for e in r.events:
                        seq += 1
                        fresh.append(msgspec.structs.replace(e, seq=seq))
                if remembered:
                    store.remember_spans(conn, dep, remembered, now_us)
                if not fresh:
                    continue
                res = store.write_batch(
                    conn,
                    probe_id=pid,
                    token_id=principal.token_id,
                    lineage_id=principal.lineage,
                    events=fresh,
                    now_us=now_us,
                    rows=shaped[pid] if as_shaped else None,
                )
                total.accepted += res.accepted
                total.new_events.extend(res.new_events)
                total.deployments |= res.deployments
            # Set last: a retried transaction counts afresh.
            result.accepted, result.duplicates = accepted, duplicates
            return total

        res = self.ingest.commit(principal, every, now, write)
        metrics = self.ingest.metrics
        metrics.events.labels("accepted").inc(res.accepted)
