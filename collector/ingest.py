"""The ingest service: authenticate, decode, validate, store one batch atomically."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError

from collector.alerting.evaluation import PassResult
from collector.alerting.service import AlertingService
from collector.cardinality import Limits, Name, NewNames, names_of
from collector.db import DRIVER_ERRORS, Database
from collector.errors import (
    CollectorError,
    Forbidden,
    InvalidInput,
    PayloadTooLarge,
    TooManyNewNames,
    TransientConflict,
    Unavailable,
    UnsupportedMediaType,
)
from collector.metrics import CollectorMetrics
from collector.settings import Settings
from collector.store import IngestStore, Rows, WriteResult, micros, shape_rows
from collector.timefmt import iso
from collector.tokens import Authenticator, Principal
from engine_probe import events as ev
from policies import NodeConfig, SeqGapFact

log = logging.getLogger("kvwatch.ingest")

_CONFLICT_RETRIES = 3
_DB_ERRORS: tuple[type[Exception], ...] = (DBAPIError, *DRIVER_ERRORS)
_EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
JSON_TYPES = ("application/json", "")
NDJSON_TYPES = ("application/x-ndjson", "application/ndjson", "application/jsonl")


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicates: int
    gaps: list[tuple[int, int]]

    def as_dict(self) -> dict[str, object]:
        return {
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "gaps": [list(g) for g in self.gaps],
        }


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """A decoded, validated batch: its events (one probe's), their rows when the batch is
    in seq order (see :func:`collector.store.shape_rows`), and when its handling began."""

    events: list[ev.Event]
    rows: Rows | None
    names: set[Name]
    started: float


class IngestService:
    def __init__(
        self,
        db: Database,
        settings: Settings,
        metrics: CollectorMetrics,
        authenticator: Authenticator,
        alerting: AlertingService | None = None,
    ):
        self.db = db
        self.alerting = alerting
        self._authenticate = authenticator
        self.settings = settings
        self.metrics = metrics
        self.store = IngestStore(db.dialect, replaced_quiet_s=settings.probe_replaced_quiet_s)
        self.names = NewNames(
            Limits(
                deployment=settings.max_new_deployments_per_hour,
                node=settings.max_new_nodes_per_hour,
                model=settings.max_new_models_per_hour,
                route=settings.max_new_routes_per_hour,
                probe=settings.max_new_probes_per_hour,
            )
        )

    def authenticate(self, authorization: str | None) -> Principal:
        try:
            principal = self._authenticate(authorization)
            principal.require("ingest")
        except CollectorError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        return principal

    def ingest(
        self, principal: Principal, body: bytes, content_type: str, now: datetime
    ) -> IngestResult:
        """Decode, validate and store one batch (``prepare``, then ``store_batch``)."""
        return self.store_batch(principal, self.prepare(principal, body, content_type, now), now)

    def prepare(
        self, principal: Principal, body: bytes, content_type: str, now: datetime
    ) -> PreparedBatch:
        """Decode and validate a batch and shape its rows. Pure CPU work touching no database,
        so the HTTP route runs it outside the write limiter: the transaction holds only the
        database work (on SQLite the GIL still serialises decoding with the write's Python
        side; overlapping them measured no gain there)."""
        started = time.perf_counter()
        try:
            events = self._decode(body, content_type)
            self._validate(principal, events, now)
        except CollectorError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        # The store re-shapes only when the batch turns out to hold duplicates or is out of
        # order (then only its new events are written).
        ordered = all(a.seq < b.seq for a, b in pairwise(events))
        rows = shape_rows(events) if ordered else None
        return PreparedBatch(events, rows, names_of(events), started)

    def check_names(self, principal: Principal, batch: PreparedBatch, now: datetime) -> None:
        """Would storing ``batch`` pass the token's new-name limits? Raises
        :class:`TooManyNewNames` (429) if not; records nothing. For the ingest bus, which
        answers before anything is stored: a database it cannot read skips the check (the
        writer's transaction enforces the limits all the same)."""
        if not self.names.unknown(batch.names):
            return  # every name already stored: nothing to look up
        try:
            with self.db.read() as conn:
                self.names.check(conn, principal.lineage, batch.names, micros(now))
        except TooManyNewNames as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        except Unavailable:
            return

    def store_batch(
        self, principal: Principal, batch: PreparedBatch, now: datetime
    ) -> IngestResult:
        """Store a prepared batch in one transaction (with its policies), or nothing."""
        events = batch.events
        try:
            res = self.commit(
                principal,
                events,
                now,
                lambda conn: self.store.write_batch(
                    conn,
                    probe_id=events[0].probe_id,
                    token_id=principal.token_id,
                    lineage_id=principal.lineage,
                    events=events,
                    now_us=micros(now),
                    rows=batch.rows,
                ),
                names=batch.names,
            )
        except CollectorError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        self.metrics.events.labels("accepted").inc(res.accepted)
        for reason, n in res.lost.items():
            self.metrics.lost.labels(reason).inc(n)
        self.metrics.events.labels("duplicate").inc(res.duplicates)
        self.metrics.batch_seconds.observe(time.perf_counter() - batch.started)
        return IngestResult(res.accepted, res.duplicates, res.new_gaps)

    def commit(
        self,
        principal: Principal,
        events: Sequence[ev.Event],
        now: datetime,
        write: Callable[[Connection], WriteResult],
        names: set[Name] | None = None,
    ) -> WriteResult:
        """One transaction: the token's new-name limits over ``events``, ``write`` (which
        stores them, or the part of them that is new), and the policies over what it wrote;
        all committed together or not at all. Retried whole on a conflict between replicas.
        """
        for attempt in range(_CONFLICT_RETRIES + 1):
            try:
                with self.db.write() as conn:
                    prior = (
                        self.alerting.prior_configs(conn, events)
                        if self.alerting is not None
                        else {}
                    )
                    self.names.admit(conn, principal.lineage, events, micros(now), names)
                    res = write(conn)
                    outcome = (
                        self._evaluate(conn, res, prior, now)
                        if self.alerting is not None and (res.new_events or res.new_gaps)
                        else None
                    )
                if outcome is not None and self.alerting is not None:
                    self.alerting.committed(outcome)
                return res
            except TransientConflict:
                # The transaction rolled back whole; a retry sees the winner's rows.
                if attempt == _CONFLICT_RETRIES:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    def _evaluate(
        self,
        conn: Connection,
        res: WriteResult,
        prior: dict[tuple[str, str], NodeConfig],
        now: datetime,
    ) -> PassResult | None:
        """Policies over the batch's new events, in its transaction (alerts, incidents and
        their notifications commit with the events or not at all), behind a savepoint: a
        failure here is logged and counted, and never fails ingest."""
        assert self.alerting is not None
        dep = res.new_events[0].deployment_id if res.new_events else ""
        probe = res.new_events[0].probe_id if res.new_events else ""
        gaps = [SeqGapFact(probe, dep, a, b) for a, b in res.new_gaps]
        try:
            with conn.begin_nested():
                outcome = self.alerting.on_batch(conn, res.new_events, prior, gaps, now)
        except IntegrityError as exc:
            # another replica created the same alert or incident first: retrying the whole
            # batch sees its row (dropping the evaluation would lose the occurrence)
            raise TransientConflict(f"concurrent alert update, retry: {exc.orig}") from exc
        except _DB_ERRORS:
            raise  # an outage or a conflict: the whole batch fails and is retried
        except Exception:
            log.exception("policy evaluation failed; the batch is stored without it")
            self.metrics.policy_failures.inc()
            return None
        for h in outcome.errors:
            self.metrics.rule_errors.labels(h.rule).inc()
        return outcome

    def _decode(self, body: bytes, content_type: str) -> list[ev.Event]:
        mime = content_type.split(";", 1)[0].strip().lower()
        limit = self.settings.max_batch_events
        try:
            if mime in JSON_TYPES:
                events = ev.decode_json_batch(body, max_events=limit)
            elif mime in NDJSON_TYPES:
                events = ev.decode_ndjson_batch(body, max_events=limit)
            else:
                raise UnsupportedMediaType(
                    f"Content-Type {mime!r} is not accepted; send application/json (an array "
                    "of events) or application/x-ndjson (one event per line)"
                )
        except ev.BatchTooLarge as exc:
            raise PayloadTooLarge(str(exc), {"limit_events": exc.limit}) from None
        except ev.DecodeError as exc:
            self.metrics.rejected_events.labels("invalid_input").inc(len(exc.errors))
            raise InvalidInput(str(exc), [e.as_dict() for e in exc.errors]) from None
        if not events:
            raise InvalidInput("the batch holds no events", [])
        return events

    def _validate(self, principal: Principal, events: list[ev.Event], now: datetime) -> None:
        errors = []
        probe_id = events[0].probe_id
        latest = now + timedelta(seconds=self.settings.max_clock_skew_s)
        scope = principal.deployment_id
        for i, e in enumerate(events):
            if e.probe_id != probe_id:
                errors.append(
                    ev.FieldError(
                        i, "probe_id", f"a batch comes from one probe; expected {probe_id!r}"
                    )
                )
            if e.ts < _EARLIEST:
                errors.append(ev.FieldError(i, "ts", f"{iso(e.ts)} is before 2000"))
            elif e.ts > latest:
                errors.append(
                    ev.FieldError(i, "ts", f"{iso(e.ts)} is in the future (now {iso(now)})")
                )
            if scope is not None and e.deployment_id != scope:
                raise Forbidden(
                    f"this ingest token may only write deployment {scope!r}",
                    [ev.FieldError(i, "deployment_id", "outside the token's scope").as_dict()],
                )
        if errors:
            raise InvalidInput(str(ev.DecodeError(errors)), [e.as_dict() for e in errors])
