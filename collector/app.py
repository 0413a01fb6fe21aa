"""``create_app(settings)``: the collector's FastAPI application, wired. Nothing is built at
import: the services, the background workers and the routers (:mod:`collector.api`) are made
here, per app."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime

import anyio
from fastapi import FastAPI

from collector import migrate, partitions
from collector.alerting.service import AlertingService
from collector.api import (
    alerts,
    breach,
    dashboard,
    errors,
    health,
    ingest,
    openapi,
    reads,
    reports,
    traces,
)
from collector.api import cases as cases_api
from collector.api import runbooks as runbooks_api
from collector.api import schedules as schedules_api
from collector.api import tokens as tokens_api
from collector.api.bodies import LimitBody
from collector.bus.ingest import BusIngest
from collector.bus.monitor import BusMonitor, bus_problem
from collector.bus.monitor import fact as bus_fact
from collector.bus.publisher import BusPublisher
from collector.db import Database
from collector.fleet import FleetService
from collector.ingest import IngestService
from collector.installation import Identity
from collector.limits import Limits
from collector.lost import LostRequests
from collector.metrics import CollectorMetrics
from collector.notify.dispatcher import Dispatcher
from collector.oidc import build_verifier
from collector.otlp.service import TraceIngest
from collector.periodic import Periodic
from collector.reads import ReadService
from collector.reports.audit import AuditLog
from collector.reports.breach import BreachService
from collector.reports.inventory import InventoryService
from collector.reports.limits import LimitsService
from collector.reports.notice import NoticeService
from collector.reports.review import ReviewService
from collector.reports.stored import ReportStore
from collector.rollups.refresh import RollupRefresher
from collector.rollups.stats import StatsService
from collector.scrape import ScheduledScraper, Scraper
from collector.settings import Settings
from collector.tokens import Authenticator, TokenService
from collector.verify_schedules import Reach, Verifier, VerifyScheduleService
from policies import RuleSet, load_ruleset


def create_app(
    settings: Settings | None = None,
    *,
    verifier: Verifier | None = None,
    scraper: Scraper | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """``verifier`` runs scheduled verifications (``kvwatch serve`` hands in
    ``kvwatch.verify``'s); without one, schedules are kept but not run. ``scraper`` reads the
    ``KVWATCH_SCRAPE_TARGETS`` (``kvwatch serve`` hands in ``kvwatch.scrape``'s); without
    one, targets set are refused here (:class:`collector.scrape.UnusableScrapeTargets`), as
    is a target it cannot read, rather than left unscraped in silence. ``freeze_heap``: the
    app owns its process (``kvwatch serve``), so what its startup built is moved out of the
    collector of cycles once it has started (a process that builds many apps, as the tests
    do, would keep each one's cycles forever)."""
    settings = settings or Settings()
    db = Database(settings.database_url, pool_size=settings.db_pool_size)
    rules = load_ruleset(settings.policy_packs_dir) if settings.policies_enabled else RuleSet()
    # The limit in force, decided by policies over the stored facts: every view reads it here
    limits = Limits.for_rules(db, rules)
    metrics = CollectorMetrics(
        db,
        limits=limits,
        max_deployments=settings.metrics_max_deployments,
        min_requests=settings.metrics_min_requests,
    )
    bus = BusPublisher(settings, metrics.registry) if settings.bus_url is not None else None
    monitor = BusMonitor(settings, metrics.registry) if bus is not None else None
    authenticator = Authenticator(
        db,
        ttl_s=settings.token_cache_s,
        use_audit_s=settings.token_use_audit_s,
        # with the bus, ingest must outlive a database outage: known tokens stay valid
        grace_s=settings.bus_auth_grace_s if bus is not None else 0.0,
        # people signed in at the organisation's identity provider (the dashboard forwards
        # their ID token); a bad role map stops the collector here, with its file named
        oidc=build_verifier(settings),
    )
    alerting = AlertingService(
        db,
        rules,
        identity=Identity.of(settings),
        notify_max_per_minute=settings.notify_max_per_minute,
    )
    if monitor is not None:
        alerting.evaluator.bus_facts = lambda: bus_fact(monitor.latest)
    ingester = IngestService(
        db, settings, metrics, authenticator, alerting if settings.policies_enabled else None
    )
    reviews = ReviewService(db, limits, settings.key_ring())
    cards = LimitsService(db, limits)

    scheduled = (
        ScheduledScraper(db, settings, ingester, metrics.registry, scraper)
        if settings.scrape_targets
        else None
    )
    scrapes = (
        None
        if scheduled is None
        else Periodic("scrape", scheduled.tick_s, scheduled.run_due, at_start=scheduled.start)
    )
    timer = (
        Periodic("policy", settings.policy_timer_s, lambda: alerting.tick(datetime.now(UTC)))
        if settings.policies_enabled
        else None
    )
    lost = LostRequests(
        db, settings.probe_lost_after_s, lambda reason, n: metrics.lost.labels(reason).inc(n)
    )
    lost_pass = Periodic(
        "lost-requests",
        min(60.0, settings.probe_lost_after_s / 10),
        lambda: lost.close_silent(datetime.now(UTC)),
    )
    refresher = RollupRefresher(db)
    # At start, everything marked: what was ingested before this collector started (a demo,
    # a restart, a migration's backfill) shows at once.
    rollups = Periodic(
        "rollups",
        settings.rollup_interval_s,
        refresher.refresh,
        at_start=lambda: refresher.refresh(everything=True),
    )

    def ensure_partitions() -> None:
        with db.write() as conn:
            partitions.ensure(conn, datetime.now(UTC))

    # Next months' partitions exist well before they are needed (PostgreSQL only).
    maintainer = None if db.is_sqlite else Periodic("partitions", 3600.0, ensure_partitions)
    dispatcher = (
        Dispatcher(db, settings, registry=metrics.registry) if settings.notify_enabled else None
    )
    schedules = VerifyScheduleService(db, alerting, verifier, reach=Reach.from_settings(settings))
    verifications = (
        None
        if verifier is None
        else Periodic("verify-schedules", settings.verify_schedule_tick_s, schedules.run_due)
    )
    audit_log = AuditLog(db, settings.key_ring(), settings.audit_checkpoint_s)
    # The audit chain's head signed every period: a chain rewritten without the key fails.
    checkpoints = Periodic(
        "audit-checkpoint",
        settings.audit_checkpoint_s,
        lambda: audit_log.checkpoint(actor="collector", now=datetime.now(UTC)),
    )
    workers = (
        timer,
        dispatcher,
        rollups,
        maintainer,
        scrapes,
        verifications,
        lost_pass,
        checkpoints,
    )

    # SQLite takes one writer at a time anyway: more ingest threads would only fight over
    # the GIL and the write lock. PostgreSQL writers run in parallel (the driver releases
    # the GIL while the server works), up to the connection pool.
    ingest_limiter = anyio.CapacityLimiter(1 if db.is_sqlite else settings.db_pool_size)

    app = FastAPI(
        title="kvwatch collector",
        version="1",
        description="Ingests probe events; serves deployments, requests, pool samples and "
        "page events. Every endpoint but /healthz, /readyz and /metrics needs a bearer token.",
        lifespan=_lifespan(
            settings, db, maintainer, workers, freeze_heap, bus, monitor, authenticator
        ),
    )
    errors.install(app)
    app.add_middleware(LimitBody, limit=settings.max_request_bytes)
    app.state.settings = settings
    app.state.db = db
    app.state.metrics = metrics
    app.state.authenticator = authenticator  # collector.api.caller resolves tokens with it
    app.state.alerting = alerting
    app.state.policy_timer = timer
    app.state.dispatcher = dispatcher
    app.state.rollups = rollups
    app.state.scrapes = scrapes
    app.state.verify_schedules = verifications
    app.state.lost_requests = lost  # its pass, with time passed in: close_silent(now)

    trace_ingest = TraceIngest(ingester, settings, metrics.registry)
    via_bus = None if bus is None else BusIngest(ingester, trace_ingest, bus)
    app.state.bus = bus
    app.state.bus_monitor = monitor
    app.include_router(
        ingest.build_router(ingester, settings.max_body_bytes, ingest_limiter, via_bus)
    )
    app.include_router(traces.build_router(trace_ingest, ingest_limiter, via_bus))
    app.include_router(reads.build_router(ReadService(db)))
    notices = NoticeService(db, settings)
    app.include_router(alerts.build_router(alerting, notices, settings.max_evidence_bytes))
    app.include_router(schedules_api.build_router(schedules))
    app.include_router(
        breach.build_router(BreachService(db, settings, limits), reviews, ReportStore(db), notices)
    )
    app.include_router(cases_api.build_router(db, settings))
    app.include_router(
        reports.build_router(InventoryService(db), cards, reviews, audit_log, limits)
    )
    app.include_router(dashboard.build_router(FleetService(db, cards), StatsService(db, limits)))
    app.include_router(tokens_api.build_router(TokenService(db)))
    app.include_router(runbooks_api.build_router())
    token = settings.metrics_token.get_secret_value() if settings.metrics_token else None
    app.include_router(
        health.build_router(
            metrics,
            db.ping,
            metrics_token=token,
            bus_problem=None if bus is None else lambda: bus_problem(bus, monitor),
        )
    )
    openapi.install(app)
    return app


def _lifespan(
    settings: Settings,
    db: Database,
    maintainer: Periodic | None,
    workers: tuple[Periodic | Dispatcher | None, ...],
    freeze_heap: bool,
    bus: BusPublisher | None,
    monitor: BusMonitor | None,
    authenticator: Authenticator,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Migrate (when told to) and make the partitions, connect to the ingest bus (when
    there is one), start the workers; at shutdown, stop them, close the bus connection
    (after in-flight publishes), the identity provider's and the database's connections."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.auto_migrate:
            await anyio.to_thread.run_sync(migrate.upgrade, settings.database_url)
        if maintainer is not None:
            await anyio.to_thread.run_sync(maintainer.run_once)
        if bus is not None:
            await bus.start()
            if monitor is not None:
                monitor.start(bus.js, lambda: bus.connected)
        for worker in workers:
            if worker is not None:
                worker.start()
        if freeze_heap:
            # What startup built lives as long as the process: out of the collector of
            # cycles with it (collected first, so no garbage is kept), else every full
            # collection, which ingest's allocations set off every few batches, walks it all.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            for worker in workers:
                if worker is not None:
                    await anyio.to_thread.run_sync(worker.shutdown, 10.0)
            if monitor is not None:
                await monitor.stop()
            if bus is not None:
                await bus.close()
            authenticator.close()
            db.dispose()

    return lifespan
