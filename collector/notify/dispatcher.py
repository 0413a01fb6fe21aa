"""Delivers outbox rows over HTTP: in order per endpoint, at least once, never dropped.

Per endpoint the outbox is a FIFO by id: only the oldest pending message (the head) is ever
sent, and the next one waits until it is delivered. That is what keeps an alert's
``firing`` ahead of its ``resolved`` everywhere, at the price of one failing message holding
up its endpoint (which is what an endpoint that is down does anyway).

Several collector replicas may run a dispatcher on one database. An endpoint is worked by
one of them at a time, under a lease: ``UPDATE notify_endpoints SET lease_owner, lease_until
WHERE id = ? AND (lease_until IS NULL OR lease_until < now)``. The UPDATE is the lock: on
PostgreSQL a second replica's UPDATE waits on the row and re-checks the WHERE after the first
commits (so it matches nothing); on SQLite writers are serialised outright. The lease is
renewed after every attempt and released when the endpoint has nothing due; a replica that
dies holding one stops blocking the endpoint once ``notify_lease_s`` has passed.

HTTP goes out with no transaction open. The outcome is written afterwards, so a crash
between a receiver's 2xx and that write sends the message again, under the same
``webhook-id`` and with the same body: receivers deduplicate on the id (Standard Webhooks'
at-least-once contract). Nothing is lost: a message leaves ``pending`` only on a 2xx.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import Connection, case, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import aliased

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import CollectorError
from collector.notify import payloads, signing
from collector.notify.outbox import (
    DIGEST,
    forget_replaced_secrets,
    previous_secret_in_force,
    replaced_secrets_due,
)
from collector.settings import Settings
from collector.timefmt import iso

log = logging.getLogger(__name__)

US = 1_000_000
_MAX_PER_CLAIM = 100  # messages sent per endpoint per claim before others get a turn
_ERROR_MAX = 500  # characters of a receiver's answer kept in last_error


@dataclass(frozen=True, slots=True)
class _Endpoint:
    id: int
    name: str
    kind: str
    url: str
    format: str
    secret: str | None
    previous_secret: str | None  # a rotation's replaced secret, while its grace lasts

    @property
    def signing_secrets(self) -> list[str]:
        return [s for s in (self.secret, self.previous_secret) if s]


@dataclass(frozen=True, slots=True)
class _Head:
    id: int
    msg_id: str
    data: str
    attempts: int
    next_attempt_at: int


@dataclass(frozen=True, slots=True)
class _Outcome:
    status_code: int | None
    error: str | None
    duration_ms: float
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


class DispatchMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.deliveries = Counter(
            "kvwatch_notify_deliveries",
            "Delivery attempts, by endpoint and result (delivered, failed, gone).",
            ["endpoint", "result"],
            registry=registry,
        )


class Dispatcher:
    """Sends due outbox rows. ``run_once`` does one pass; ``start`` runs passes every
    ``notify_poll_s`` in a daemon thread. ``clock`` (unix seconds) drives every time this
    writes (attempts, backoff, leases, ``webhook-timestamp``) so tests can move time."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        transport: httpx.BaseTransport | None = None,
        owner: str | None = None,
        registry: CollectorRegistry | None = None,
        rng: random.Random | None = None,
        max_workers: int = 4,
    ):
        self.db = db
        self.settings = settings
        self.clock = clock
        self.owner = (owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}")[:64]
        self.metrics = DispatchMetrics(registry) if registry is not None else None
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._http = httpx.Client(
            transport=transport,
            timeout=settings.notify_timeout_s,
            # A redirect is a failure (Standard Webhooks): following it would re-send a
            # signed body to a URL nobody configured.
            follow_redirects=False,
            headers={"user-agent": "kvwatch-notify/1"},
        )
        # Endpoints are worked in parallel so one receiver that hangs until the timeout does
        # not hold up the others; each endpoint itself stays strictly sequential.
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvw-notify")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if settings.notify_lease_s <= settings.notify_timeout_s:
            log.warning(
                "notify_lease_s (%s) should exceed notify_timeout_s (%s): a lease running out "
                "during a slow attempt lets another replica send the same message meanwhile",
                settings.notify_lease_s,
                settings.notify_timeout_s,
            )

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kvwatch-notify", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except CollectorError as exc:  # database outage: try again next poll
                log.warning("notification dispatch: %s", exc.message)
            except Exception:  # never let one bad pass end delivery for good
                log.exception("notification dispatch failed")
            self._stop.wait(self.settings.notify_poll_s)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait up to ``timeout`` for an attempt in flight. A message cut
        off here stays pending and goes out again (same id) after its lease runs out."""
        self._stop.set()
        in_flight = False
        if self._thread is not None:
            self._thread.join(timeout)
            in_flight = self._thread.is_alive()
            self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not in_flight:
            # Closing the client under a request in flight would fail it for nothing: the
            # daemon thread ends with the process.
            self._http.close()

    def force_flush(self, timeout: float = 10.0) -> bool:
        """Run passes until nothing is due or ``timeout`` seconds passed; True if nothing is
        due. Messages backing off into the future are not due and are not waited for."""
        deadline = time.monotonic() + timeout
        while True:
            self.run_once()
            if not self._due_endpoints(self._now_us(None)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self.settings.notify_poll_s, max(deadline - time.monotonic(), 0)))

    # ------------------------------------------------------------------- passes

    def run_once(self, now: float | None = None) -> int:
        """One pass over every endpoint with a due head message; returns attempts made.
        ``now`` fixes the time of the whole pass (tests); by default the clock is read for
        every attempt."""
        now_us = self._now_us(now)
        self._forget_replaced_secrets(now_us)
        due = self._due_endpoints(now_us)
        if not due:
            return 0
        futures = [self._pool.submit(self._work_endpoint, eid, now) for eid in due]
        return sum(f.result() for f in futures)

    def _forget_replaced_secrets(self, now_us: int) -> None:
        """Delete the rotations' replaced secrets whose grace has ended (checked with a read
        first: most passes have none, and take no write lock)."""
        try:
            with self.db.read() as conn:
                if not replaced_secrets_due(conn, now_us):
                    return
            with self.db.write() as conn:
                forget_replaced_secrets(conn, now_us)
        except CollectorError as exc:
            # the next pass tries again; a kept secret past its grace signs nothing
            log.warning("could not delete replaced webhook secrets: %s", exc)

    def _now_us(self, fixed: float | None) -> int:
        return int((self.clock() if fixed is None else fixed) * US)

    def _due_endpoints(self, now_us: int) -> list[int]:
        """Enabled, unleased endpoints whose head message is due. One index seek per
        endpoint (endpoint_id, status, id): the delivered history is never scanned."""
        e, o, inner = m.NotifyEndpoint, m.OutboxMessage, aliased(m.OutboxMessage)
        head_id = (
            select(inner.id)
            .where(inner.endpoint_id == e.id, inner.status == "pending", _in_line(inner, now_us))
            .order_by(inner.id)
            .limit(1)
            .correlate(e)
            .scalar_subquery()
        )
        with self.db.read() as conn:
            rows = conn.execute(
                select(e.id, o.next_attempt_at)
                .join(o, o.id == head_id)
                .where(
                    e.enabled.is_(True),
                    or_(e.lease_until.is_(None), e.lease_until < now_us),
                )
            ).all()
        return [r.id for r in rows if r.next_attempt_at <= now_us]

    def _work_endpoint(self, endpoint_id: int, fixed: float | None) -> int:
        lease_us = int(self.settings.notify_lease_s * US)
        with self.db.write() as conn:
            now_us = self._now_us(fixed)
            claimed = conn.execute(
                update(m.NotifyEndpoint)
                .where(
                    m.NotifyEndpoint.id == endpoint_id,
                    m.NotifyEndpoint.enabled.is_(True),
                    or_(
                        m.NotifyEndpoint.lease_until.is_(None),
                        m.NotifyEndpoint.lease_until < now_us,
                    ),
                )
                .values(lease_owner=self.owner, lease_until=now_us + lease_us)
            ).rowcount
        if claimed != 1:
            return 0  # another replica has it
        attempts = 0
        try:
            for _ in range(_MAX_PER_CLAIM):
                now_us = self._now_us(fixed)
                with self.db.read() as conn:
                    endpoint, head = self._head(conn, endpoint_id, now_us)
                if endpoint is None or head is None or head.next_attempt_at > now_us:
                    break
                attempts += 1
                delivered, keep_lease = self._attempt(endpoint, head, now_us, lease_us)
                if not delivered or not keep_lease:
                    break
        finally:
            self._release(endpoint_id)
        return attempts

    def _head(
        self, conn: Connection, endpoint_id: int, now_us: int
    ) -> tuple[_Endpoint | None, _Head | None]:
        e, o = m.NotifyEndpoint, m.OutboxMessage
        ep = conn.execute(
            select(
                e.id,
                e.name,
                e.kind,
                e.url,
                e.format,
                e.secret,
                # the replaced secret signs too until its grace ends
                case((previous_secret_in_force(now_us), e.previous_secret), else_=None),
            ).where(e.id == endpoint_id, e.enabled.is_(True))
        ).first()
        if ep is None:
            return None, None  # removed or disabled meanwhile
        head = conn.execute(
            select(o.id, o.msg_id, o.data, o.attempts, o.next_attempt_at)
            .where(o.endpoint_id == endpoint_id, o.status == "pending", _in_line(o, now_us))
            .order_by(o.id)
            .limit(1)
        ).first()
        return _Endpoint(*ep), (_Head(*head) if head else None)

    def _release(self, endpoint_id: int) -> None:
        try:
            with self.db.write() as conn:
                conn.execute(
                    update(m.NotifyEndpoint)
                    .where(
                        m.NotifyEndpoint.id == endpoint_id,
                        m.NotifyEndpoint.lease_owner == self.owner,
                    )
                    .values(lease_owner=None, lease_until=None)
                )
        except CollectorError as exc:
            # The lease then simply runs out; nothing is lost.
            log.warning("could not release the lease on endpoint %s: %s", endpoint_id, exc)

    # ------------------------------------------------------------------ one try

    def _attempt(
        self, endpoint: _Endpoint, head: _Head, now_us: int, lease_us: int
    ) -> tuple[bool, bool]:
        """Send the head message and record the outcome. Returns (delivered, lease kept)."""
        now_s = now_us / US
        try:
            requests = payloads.bodies(
                endpoint.kind,
                endpoint.format,
                json.loads(head.data),
                receiver_name=endpoint.name,
                external_url=self.settings.public_url,
                secret=endpoint.secret,
                now=now_s,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # A document that cannot be rendered is a bug upstream. It is recorded and
            # retried like any failure (never dropped, visible in last_error) instead of
            # raising on every pass.
            error = f"cannot render the notification: {type(exc).__name__}: {exc}"
            failed = _Outcome(None, error[:_ERROR_MAX], 0.0)
            return False, self._record(endpoint, head, failed, False, now_us, lease_us)
        timestamp = int(now_s)
        headers = {
            "content-type": "application/json",
            signing.HEADER_ID: head.msg_id,
            signing.HEADER_TIMESTAMP: str(timestamp),
        }
        url = endpoint.url
        if endpoint.kind == "alertmanager":
            url = url.rstrip("/") + "/api/v2/alerts"
        # Several requests (PagerDuty's one event each) stop at the first failure; the
        # message is retried whole, which the receiver deduplicates by each event's key.
        outcome = _Outcome(200, None, 0.0)  # nothing for this receiver: done
        for body in requests:
            if endpoint.kind == "webhook" and endpoint.signing_secrets:
                headers[signing.HEADER_SIGNATURE] = signing.sign_all(
                    endpoint.signing_secrets, head.msg_id, timestamp, body
                )
            outcome = self._post(url, body, headers)
            if not outcome.ok:
                break
        gone = outcome.status_code == 410
        keep = self._record(endpoint, head, outcome, gone, now_us, lease_us)
        if self.metrics is not None:
            result = "delivered" if outcome.ok else "gone" if gone else "failed"
            self.metrics.deliveries.labels(endpoint.name, result).inc()
        return outcome.ok, keep

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> _Outcome:
        started = time.perf_counter()
        try:
            resp = self._http.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            ms = (time.perf_counter() - started) * 1000
            return _Outcome(None, f"{type(exc).__name__}: {exc}"[:_ERROR_MAX], ms)
        ms = (time.perf_counter() - started) * 1000
        if 200 <= resp.status_code < 300:
            return _Outcome(resp.status_code, None, ms)
        text = resp.text.strip().replace("\n", " ")
        error = f"HTTP {resp.status_code} {resp.reason_phrase}: {text}"[:_ERROR_MAX]
        return _Outcome(resp.status_code, error, ms, _retry_after(resp))

    def _record(
        self,
        endpoint: _Endpoint,
        head: _Head,
        outcome: _Outcome,
        gone: bool,
        now_us: int,
        lease_us: int,
    ) -> bool:
        """Write the attempt and its consequence in one transaction; renew the lease.
        Returns whether this dispatcher still holds the endpoint."""
        o = m.OutboxMessage
        try:
            with self.db.write() as conn:
                # The outbox row is updated first: on PostgreSQL that locks it, so a removal
                # of its endpoint running now waits, and the attempt's foreign key holds.
                if outcome.ok:
                    values: dict[str, Any] = {
                        "status": "delivered",
                        # first delivery wins if a replica that lost its lease got there too
                        "delivered_at": func.coalesce(o.delivered_at, now_us),
                        "last_error": None,
                    }
                    where = [o.id == head.id]
                else:
                    values = {"attempts": head.attempts + 1, "last_error": outcome.error}
                    if not gone:
                        # A 410 leaves the message due: it goes out as soon as the endpoint
                        # is enabled again.
                        values["next_attempt_at"] = now_us + self._backoff_us(
                            head.attempts + 1, outcome.retry_after_s
                        )
                    where = [o.id == head.id, o.status == "pending"]
                exists = conn.execute(update(o).where(*where).values(**values)).rowcount
                if exists:
                    conn.execute(
                        insert(m.DeliveryAttempt).values(
                            outbox_id=head.id,
                            endpoint_id=endpoint.id,
                            at=now_us,
                            status_code=outcome.status_code,
                            error=outcome.error,
                            duration_ms=outcome.duration_ms,
                        )
                    )
                if gone:
                    self._disable_gone(conn, endpoint, now_us)
                kept = conn.execute(
                    update(m.NotifyEndpoint)
                    .where(
                        m.NotifyEndpoint.id == endpoint.id,
                        m.NotifyEndpoint.lease_owner == self.owner,
                    )
                    .values(lease_until=now_us + lease_us)
                ).rowcount
        except IntegrityError:
            # The endpoint and its messages were removed while we were sending.
            return False
        if not kept:
            log.warning("lost the lease on endpoint %s; another replica took over", endpoint.name)
        return bool(kept)

    def _disable_gone(self, conn: Connection, endpoint: _Endpoint, now_us: int) -> None:
        reason = (
            f"the receiver answered 410 Gone at {iso(now_us)}; `kvwatch webhooks enable` to resume"
        )
        conn.execute(
            update(m.NotifyEndpoint)
            .where(m.NotifyEndpoint.id == endpoint.id)
            .values(enabled=False, disabled_reason=reason)
        )
        audit.append(
            conn,
            now_us=now_us,
            actor="dispatcher",
            action="notify.endpoint.disable",
            subject=f"endpoint:{endpoint.name}",
            detail={"reason": "410 Gone"},
        )

    def _backoff_us(self, attempts: int, retry_after_s: float | None) -> int:
        """Exponential backoff with *equal* jitter: a uniform draw from the upper half of the
        nominal delay. Full jitter (0..delay) may retry at once and hammer a receiver that is
        down; no jitter lets endpoints (and replicas) that failed together retry together."""
        s = self.settings
        # The exponent is capped: 2**n for a message failing for weeks would overflow a float.
        doubling = 2.0 ** min(attempts - 1, 60)
        nominal = min(s.notify_backoff_max_s, s.notify_backoff_base_s * doubling)
        with self._rng_lock:
            delay = nominal * self._rng.uniform(0.5, 1.0)
        if retry_after_s is not None:
            # Honour a receiver's Retry-After (429, 503), within our own ceiling.
            delay = max(delay, min(retry_after_s, s.notify_backoff_max_s))
        return int(delay * US)


def _in_line(o: Any, now_us: int) -> Any:
    """Whether a pending message is in its endpoint's line: all are but a digest whose
    minute has not ended, which the messages behind it pass (collector.notify.outbox). Once
    due, or once tried, it keeps its place like any other."""
    return or_(o.event_type != DIGEST, o.attempts > 0, o.next_attempt_at <= now_us)


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    if not value:
        return None
    if value.strip().isdigit():
        return float(value)
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None
