"""The scheduled scraper: engine ``/metrics`` targets (``KVWATCH_SCRAPE_TARGETS``) scraped
into ``engine.config`` and ``pool.sample`` events, ingested as if POSTed to /v1/events.

Several replicas share the database; per target and interval exactly one scrapes:

1. claim: ``UPDATE scrape_targets SET next_at = now + interval WHERE next_at <= now``; the
   replica whose update hit the row owns this interval (the row lock settles a race).
   ``now`` is the database's clock on PostgreSQL (replicas' clocks may disagree: one running
   ahead would otherwise claim early, two scrapes less than an interval apart), the
   collector's own on SQLite (one host). The claimed instant stamps the scrape's events. A
   target without a row (its replica could not insert it at start: the database was down)
   gets it here;
2. scrape the target over HTTP, outside any transaction;
3. reserve seqs: ``seq = seq + n`` in one statement, so the batch's seqs are contiguous and
   never handed out twice, whoever scrapes next;
4. ingest through :class:`IngestService` (token, validation, idempotency, gap tracking and
   policies exactly as for POST /v1/events), under the target's fixed probe id; a database
   that is briefly unavailable gets the same batch again (idempotent on (probe_id, seq)).

A target that is down, answers something else, or whose batch cannot be stored is logged
and counted in ``kvwatch_scrapes{result}``; it never stops the collector. A batch whose seqs
were reserved but that could not be stored leaves a gap the probe bookkeeping reports, as
for any producer that lost events. ``engine.config`` events go out only when a target's
figures changed: the hash of the figures last stored is kept in the row (so replicas
agree), written only once the batch carrying them is stored. Two replicas may therefore
both send a changed config (the collector stores identical configs once); none is lost.

How a target is read is not the collector's: whoever builds the app hands in a
:class:`Scraper` (``create_app(settings, scraper=...)``; ``kvwatch serve`` hands in
:mod:`kvwatch.scheduled_scrape`, which drives ``kvwatch scrape``'s translation). The
collector owns the schedule, the storage and this module's protocol: what a scrape returns,
in the wire contract's terms, and how it fails. A target's URL and node are the scraper's to
read: :func:`open_targets` asks it about every target at startup, so a target it cannot use
stops the collector from starting, as a bad setting does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import BigInteger, ColumnElement, Connection, cast, extract, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from collector import models as m
from collector.db import Database
from collector.errors import CollectorError, InvalidInput, Unavailable
from collector.ingest import IngestService
from collector.settings import ScrapeTarget, Settings
from collector.timefmt import from_micros, to_micros
from collector.tokens import Principal, create_token
from engine_probe import events as ev

log = logging.getLogger("kvwatch.scrape")

_ACTOR: Final = "collector.scraper"
_INGEST_ATTEMPTS: Final = 4
_RESULTS: Final = ("ok", "target_down", "not_that_engine", "malformed", "not_stored")
Failure = Literal["target_down", "not_that_engine", "malformed"]


class ScrapedNode(Protocol):
    """One engine node as one scrape found it, in the wire contract's terms."""

    def config_fields(self) -> dict[str, Any]:
        """The keyword arguments of ``events.EngineConfig`` but those the collector stamps
        (``schema_version``, ``probe_id``, ``seq``, ``ts``, ``deployment_id``)."""
        ...

    def pool_fields(self) -> dict[str, Any]:
        """The keyword arguments of ``events.PoolSample``, stamped fields apart likewise."""
        ...


class TargetScrape(Protocol):
    """One target's scraper: made once per target at startup, then called once per interval
    this replica claims, by one thread at a time (it may keep state between calls)."""

    @property
    def shown(self) -> str:
        """The URL it reads, without credentials: the target's row and log lines name it."""
        ...

    def __call__(self) -> Sequence[ScrapedNode]:
        """Every node the target serves; raises :class:`ScrapeFailed` when it cannot say."""
        ...


class Scraper(Protocol):
    def __call__(self, target: ScrapeTarget, timeout_s: float) -> TargetScrape:
        """``target``'s scraper, each request bounded by ``timeout_s``; ``ValueError`` (its
        message naming the target without credentials) for a target it cannot read."""
        ...


class ScrapeFailed(CollectorError):
    """A scrape that found nothing to store: the target is down (``target_down``), is not
    the engine it was said to be (``not_that_engine``), or answered what that engine does
    not write (``malformed``). Raised by a :class:`TargetScrape`; counted and recorded as the
    target's last error, never the pass's."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure: Failure = failure


class UnusableScrapeTargets(InvalidInput):
    """``KVWATCH_SCRAPE_TARGETS`` cannot be scraped as set: a target its scraper cannot
    read, or no scraper at all. Raised at startup, before anything is served."""


@dataclass(slots=True)
class _Target:
    config: ScrapeTarget
    key: str
    probe_id: str
    interval_us: int
    scrape: TargetScrape


def open_targets(settings: Settings, scraper: Scraper | None) -> list[TargetScrape]:
    """Each of ``settings.scrape_targets``' scrapers, made by ``scraper``; raises
    :class:`UnusableScrapeTargets` naming the first it cannot read, or saying targets are
    set but nothing would scrape them (silence would look like engines that are down)."""
    if not settings.scrape_targets:
        return []
    if scraper is None:
        n = len(settings.scrape_targets)
        raise UnusableScrapeTargets(
            f"KVWATCH_SCRAPE_TARGETS lists {n} target{'s' * (n != 1)}, but this collector "
            "has no scraper to read them: build it with create_app(settings, scraper=...) "
            "(kvwatch serve hands in kvwatch's), or unset KVWATCH_SCRAPE_TARGETS"
        )
    opened = []
    for i, t in enumerate(settings.scrape_targets):
        try:
            opened.append(scraper(t, settings.scrape_timeout_s))
        except ValueError as exc:
            raise UnusableScrapeTargets(
                f"KVWATCH_SCRAPE_TARGETS: entry {i} (deployment {t.deployment_id}): {exc}"
            ) from None
    return opened


def target_key(t: ScrapeTarget) -> str:
    """A target's identity: engine, URL, deployment, and whether its own token is used
    (a probe id belongs to one ingest token, so changing tokens starts a new one)."""
    token = hashlib.sha256(t.token.encode()).hexdigest() if t.token else "collector"
    raw = json.dumps([t.engine, t.url, t.deployment_id, token])
    return hashlib.sha256(raw.encode()).hexdigest()


def probe_id_of(t: ScrapeTarget, key: str) -> str:
    return f"scrape-{t.deployment_id}"[: ev.ID_MAX - 9] + f"-{key[:8]}"


def config_hash(nodes: Sequence[ScrapedNode]) -> str:
    payload = json.dumps([n.config_fields() for n in nodes], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


class ScheduledScraper:
    """Scrapes every configured target when it is due; see the module docstring."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        ingest: IngestService,
        registry: CollectorRegistry,
        scraper: Scraper | None,
        *,
        replica: str | None = None,
        clock: Callable[[], datetime] = ev.utcnow,
    ) -> None:
        self.db = db
        self.ingest = ingest
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        # this replica's clock: claims on SQLite (PostgreSQL claims use the database's)
        self._clock = clock
        self.targets: list[_Target] = []
        opened = open_targets(settings, scraper)
        for t, scrape in zip(settings.scrape_targets, opened, strict=True):
            key = target_key(t)
            interval = t.interval_s or settings.scrape_interval_s
            self.targets.append(
                _Target(t, key, probe_id_of(t, key), round(interval * 1_000_000), scrape)
            )
        shortest = min((t.interval_us for t in self.targets), default=1_000_000) / 1e6
        # Due targets are noticed within half their interval (at most a second late).
        self.tick_s = min(1.0, max(0.05, shortest / 2))
        self.scrapes = Counter(
            "kvwatch_scrapes",
            "Scheduled scrapes this replica ran, by deployment and result (ok, target_down, "
            "not_that_engine, malformed, not_stored).",
            ["deployment_id", "result"],
            registry=registry,
        )
        for target in self.targets:  # every series from the start, at 0
            for r in _RESULTS:
                self.scrapes.labels(target.config.deployment_id, r)

    def start(self) -> None:
        """Register the targets (a row each, if missing) and run the first pass. A database
        that is down now costs nothing: the first claim that finds no row inserts it."""
        with self.db.write() as conn:
            for t in self.targets:
                self._insert_row(conn, t)
        self.run_due()

    def _insert_row(self, conn: Connection, t: _Target) -> int:
        """Insert ``t``'s row, due at once, unless it exists; 1 if inserted, else 0."""
        dialect = postgresql if self.db.dialect == "postgresql" else sqlite
        inserted: int = conn.execute(
            dialect.insert(m.ScrapeTarget)
            .values(
                target_key=t.key,
                probe_id=t.probe_id,
                deployment_id=t.config.deployment_id,
                engine=t.config.engine,
                url=t.scrape.shown,
                next_at=0,
                seq=0,
                failures=0,
            )
            .on_conflict_do_nothing(index_elements=["target_key"])
        ).rowcount
        return inserted

    def run_due(self) -> None:
        """One pass: scrape each target whose interval this replica claims."""
        for t in self.targets:
            claimed = self._claim(t)
            if claimed is not None:
                self._scrape(t, *claimed)

    # -- steps -----------------------------------------------------------------------------

    def _now_us(self) -> ColumnElement[int] | int:
        """What a claim calls now, in microseconds: on PostgreSQL the server's clock (one
        clock for every replica), evaluated in the claiming statement."""
        if self.db.dialect == "postgresql":
            epoch = extract("epoch", func.statement_timestamp())
            return cast(func.floor(epoch * 1_000_000), BigInteger)
        return to_micros(self._clock())

    def _claim(self, t: _Target) -> tuple[Principal, datetime] | None:
        """Claim ``t`` for one interval: the principal its events are stored under and the
        claimed instant, or None when another replica has it (or its token cannot write)."""
        with self.db.write() as conn:
            clock = self._now_us()
            claim = (
                update(m.ScrapeTarget)
                .where(m.ScrapeTarget.target_key == t.key, m.ScrapeTarget.next_at <= clock)
                .values(next_at=clock + t.interval_us, claimed_by=self.replica)
                .returning(m.ScrapeTarget.next_at, m.ScrapeTarget.token_id)
            )
            row = conn.execute(claim).first()
            if row is None and self._insert_row(conn, t):
                row = conn.execute(claim).first()  # the database was down at start
            if row is None:
                return None
            now_us = int(row.next_at) - t.interval_us
            token_id: int | None = row.token_id
            if t.config.token is not None:
                token_id = None
            elif token_id is None:
                # The collector's own ingest token for this target, scoped to its
                # deployment; its secret is never kept (nothing outside needs it).
                token_id, _ = create_token(
                    conn,
                    kind="ingest",
                    now_us=now_us,
                    deployment_id=t.config.deployment_id,
                    name=f"scraper {t.probe_id}",
                    actor=_ACTOR,
                )
                conn.execute(
                    update(m.ScrapeTarget)
                    .where(m.ScrapeTarget.target_key == t.key)
                    .values(token_id=token_id)
                )
            if token_id is not None:
                revoked = conn.execute(
                    select(m.ApiToken.revoked_at).where(m.ApiToken.id == token_id)
                ).scalar_one()
                if revoked is not None:
                    self._failed(t, "not_stored", f"its ingest token {token_id} is revoked")
                    return None
        claimed = from_micros(now_us)
        if token_id is not None:
            return Principal(token_id, "ingest", None, t.config.deployment_id, _ACTOR), claimed
        try:
            return self.ingest.authenticate(f"Bearer {t.config.token}"), claimed
        except CollectorError as exc:
            self._failed(t, "not_stored", f"its token cannot ingest: {exc.message}")
            return None

    def _scrape(self, t: _Target, principal: Principal, now: datetime) -> None:
        try:
            nodes = t.scrape()
        except ScrapeFailed as exc:
            self._failed(t, exc.failure, exc.message, record=True)
            return
        digest = config_hash(nodes)
        with self.db.write() as conn:
            previous = conn.execute(
                select(m.ScrapeTarget.config_hash).where(m.ScrapeTarget.target_key == t.key)
            ).scalar_one()
            with_config = previous != digest
            n = len(nodes) * (2 if with_config else 1)
            # One statement: the row lock makes the reservation atomic across replicas.
            last = conn.execute(
                update(m.ScrapeTarget)
                .where(m.ScrapeTarget.target_key == t.key)
                .values(seq=m.ScrapeTarget.seq + n)
                .returning(m.ScrapeTarget.seq)
            ).scalar_one()
        events = self._events(t, nodes, now, first_seq=last - n + 1, with_config=with_config)
        body = ev.encode_batch(events)
        try:
            for attempt in range(_INGEST_ATTEMPTS):
                try:
                    self.ingest.ingest(principal, body, "application/json", now)
                    break
                except Unavailable:
                    # Ingest is idempotent on (probe_id, seq): the same batch again is safe.
                    if attempt == _INGEST_ATTEMPTS - 1:
                        raise
                    time.sleep(0.1 * 2**attempt)
        except CollectorError as exc:
            # Its seqs stay a gap (events lost, as the probe bookkeeping says); the config
            # goes out again with the next scrape (its hash was not saved).
            self._failed(t, "not_stored", exc.message, record=True)
            return
        except Exception as exc:
            # A bug, not an outage: still one target's failure, not the pass's.
            log.exception("storing the scrape of %s failed", t.probe_id)
            self._failed(t, "not_stored", f"{type(exc).__name__}: {exc}", record=True)
            return
        saved = {"config_hash": digest} if with_config else {}
        with self.db.write() as conn:
            conn.execute(
                update(m.ScrapeTarget)
                .where(m.ScrapeTarget.target_key == t.key)
                .values(last_ok_at=to_micros(now), last_error=None, failures=0, **saved)
            )
        self.scrapes.labels(t.config.deployment_id, "ok").inc()

    def _events(
        self,
        t: _Target,
        nodes: Sequence[ScrapedNode],
        now: datetime,
        *,
        first_seq: int,
        with_config: bool,
    ) -> list[ev.Event]:
        common: dict[str, Any] = {
            "schema_version": ev.SCHEMA_VERSION,
            "probe_id": t.probe_id,
            "ts": now,
            "deployment_id": t.config.deployment_id,
        }
        out: list[ev.Event] = []
        seq = first_seq
        for node in nodes:
            if with_config:
                out.append(ev.EngineConfig(**common, seq=seq, **node.config_fields()))
                seq += 1
            out.append(ev.PoolSample(**common, seq=seq, **node.pool_fields()))
            seq += 1
        return out

    def _failed(
        self,
        t: _Target,
        result: str,
        why: str,
        *,
        record: bool = False,
    ) -> None:
        self.scrapes.labels(t.config.deployment_id, result).inc()
        log.warning("scrape of %s (%s) failed: %s", t.scrape.shown, t.probe_id, why)
        if not record:
            return
        try:
            with self.db.write() as conn:
                conn.execute(
                    update(m.ScrapeTarget)
                    .where(m.ScrapeTarget.target_key == t.key)
                    .values(last_error=why[:2000], failures=m.ScrapeTarget.failures + 1)
                )
        except CollectorError as exc:  # the database is down too: the log line is it
            log.warning("could not record the failure of %s: %s", t.probe_id, exc.message)
