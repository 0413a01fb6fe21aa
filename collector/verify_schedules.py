"""Scheduled verifications: the collector runs ``kvwatch verify`` against registered
endpoints every so often, and at once when the deployment's config drifts.

The collector owns the schedules (the table, their checks, who may change them, when each
is due, one run at a time per endpoint across replicas, recording the verdict exactly as a
manual upload is recorded); how a verification runs is the verifier's, handed in by whoever
builds the app (``create_app(settings, verifier=...)``: ``kvwatch serve`` hands in
``kvwatch.verify``). Without one, schedules are stored and listed but nothing runs them.

Tenant keys are never stored nor printed: a schedule names where they are read at run time
(``env:NAME``, a variable of the collector's environment, or ``file:PATH``, a file readable
by the collector), holding space- or newline-separated ``NAME=KEY`` pairs.

A run is claimed by moving ``claimed_until`` to now + the run's time bound; a replica that
dies mid-run leaves the claim to expire, and the schedule runs again then. A run that could
not reach a verdict records nothing (as ``kvwatch verify`` uploads nothing then) and keeps
its error on the schedule.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from sqlalchemy import Connection, delete, insert, or_, select, text, update

from collector import audit
from collector import models as m
from collector.alerting.service import AlertingService
from collector.db import Database
from collector.deployment_facts import MAX_RUN_S
from collector.errors import InvalidInput, NotFound
from collector.timefmt import iso, to_micros
from engine_probe.events import is_valid_id
from policies.durations import parse_duration

log = logging.getLogger("kvwatch.verify_schedules")

# How often a schedule may run: at least a minute apart (a run costs up to `budget` requests
# to the endpoint) and at most a leap year apart (a verdict older than that says nothing of
# today's engine, and a longer period only risks overflowing next_at's microseconds).
MIN_EVERY_S: Final = 60
MAX_EVERY_S: Final = 366 * 86400
EVERY_RANGE: Final = "1m to 366d"
MAX_BUDGET: Final = 1000
Trigger = Literal["schedule", "drift", "added"]


def every_seconds(text: str) -> int:
    """The period ``every`` names (``6h``, ``30d``), in whole seconds, if it lies in
    ``MIN_EVERY_S`` .. ``MAX_EVERY_S``; else ``ValueError`` saying the range. The one check
    the API, the CLI and :meth:`VerifyScheduleService.add` share."""
    seconds = parse_duration(text)  # ValueError on what is no duration
    if not MIN_EVERY_S <= seconds <= MAX_EVERY_S:  # also false for an infinite float
        shown = text if len(text) <= 32 else f"{text[:29]}..."
        raise ValueError(f"{shown!r} is outside {EVERY_RANGE} between runs")
    return int(seconds)


class KeysUnavailable(InvalidInput):
    """The tenant keys a schedule names cannot be read (the message never holds a key)."""


def read_keys(ref: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """NAME -> KEY from ``env:NAME`` or ``file:PATH``; raises :class:`KeysUnavailable`."""
    kind, _, where = ref.partition(":")
    if kind == "env" and where:
        value = (environ if environ is not None else os.environ).get(where)
        if value is None:
            raise KeysUnavailable(f"{ref}: the collector's environment has no {where}")
    elif kind == "file" and where:
        try:
            value = Path(where).read_text(encoding="utf-8")
        except OSError as exc:
            raise KeysUnavailable(f"{ref}: cannot read it ({exc.strerror or exc})") from None
    else:
        raise KeysUnavailable(f"{ref!r}: write env:VARIABLE or file:PATH")
    keys: dict[str, str] = {}
    for n, pair in enumerate(value.split(), 1):
        name, sep, key = pair.partition("=")
        if not sep or not name or not key:
            raise KeysUnavailable(f"{ref}: entry {n} is not NAME=KEY")
        if name in keys:
            raise KeysUnavailable(f"{ref}: tenant {name!r} appears twice")
        keys[name] = key
    if len(keys) < 2:
        raise KeysUnavailable(f"{ref}: needs at least two tenants' keys, found {len(keys)}")
    return keys


@dataclass(frozen=True)
class ScheduledRun:
    """What a verifier is asked to run (keys apart)."""

    schedule_id: int
    endpoint: str
    model_id: str
    deployment_id: str
    budget: int
    max_context: int | None
    timeout_s: float
    trigger: Trigger


@dataclass(frozen=True)
class RunOutcome:
    """A verdict to record (the body of ``POST /v1/verifications``), or why there is none."""

    verification: dict[str, Any] | None
    error: str | None = None


class Verifier(Protocol):
    def __call__(self, run: ScheduledRun, keys: dict[str, str]) -> RunOutcome: ...


def _bad_endpoint(url: str) -> str | None:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest or rest[0] == "/":
        return "must be an http:// or https:// URL"
    if "@" in rest.split("/", 1)[0]:
        return "must not carry credentials (tenant keys come from keys_from)"
    return None


def schedule_doc(r: Any) -> dict[str, Any]:
    return {
        "id": r.id,
        "endpoint": r.endpoint,
        "model_id": r.model_id,
        "deployment_id": r.deployment_id,
        "every_s": r.every_s,
        "keys_from": r.keys_ref,
        "budget": r.budget,
        "max_context": r.max_context,
        "timeout_s": r.timeout_s,
        "created_at": iso(r.created_at),
        "created_by": r.created_by,
        "next_at": iso(r.next_at),
        "running": r.claimed_until is not None,
        "last_started_at": iso(r.last_started_at),
        "last_finished_at": iso(r.last_finished_at),
        "last_trigger": r.last_trigger,
        "last_result": r.last_result,
        "last_verification_id": r.last_verification_id,
        "last_error": r.last_error,
        "runs": r.runs,
    }


class VerifyScheduleService:
    def __init__(
        self,
        db: Database,
        alerting: AlertingService,
        verifier: Verifier | None = None,
        *,
        environ: Callable[[], dict[str, str]] = lambda: dict(os.environ),
    ):
        self.db = db
        self.alerting = alerting
        self.verifier = verifier
        self._environ = environ

    # ---------------------------------------------------------------- operators

    def add(self, values: dict[str, Any], by: str, now: datetime) -> dict[str, Any]:
        """Register a schedule (due at once). Raises :class:`InvalidInput` naming the field."""
        endpoint = str(values["endpoint"]).strip().rstrip("/")
        if (why := _bad_endpoint(endpoint)) is not None:
            raise InvalidInput(f"endpoint: {why}", {"field": "endpoint"})
        dep = values["deployment_id"]
        if not is_valid_id(dep):
            raise InvalidInput(
                f"deployment_id: {dep!r} is not a valid id", {"field": "deployment_id"}
            )
        every = int(values["every_s"])
        if not MIN_EVERY_S <= every <= MAX_EVERY_S:
            raise InvalidInput(
                f"every: {every} s is outside {EVERY_RANGE} between runs", {"field": "every"}
            )
        budget = int(values.get("budget") or 200)
        if not 1 <= budget <= MAX_BUDGET:
            raise InvalidInput(f"budget: 1 to {MAX_BUDGET} requests", {"field": "budget"})
        ref = str(values["keys_from"]).strip()
        try:
            read_keys(ref, self._environ())  # readable now, or it would fail every run
        except KeysUnavailable as exc:
            raise InvalidInput(f"keys_from: {exc}", {"field": "keys_from"}) from None
        now_us = to_micros(now)
        row = {
            "endpoint": endpoint,
            "model_id": values["model_id"],
            "deployment_id": dep,
            "every_s": every,
            "keys_ref": ref,
            "budget": budget,
            "max_context": values.get("max_context"),
            "timeout_s": float(values.get("timeout_s") or 120.0),
            "created_at": now_us,
            "created_by": by,
            "next_at": now_us,
            "runs": 0,
        }
        t = m.VerifySchedule.__table__
        with self.db.write() as conn:
            sid = conn.execute(insert(m.VerifySchedule).values(row).returning(t.c.id)).scalar_one()
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="verify_schedule.add",
                subject=f"verify_schedule:{sid}",
                detail={k: row[k] for k in ("endpoint", "model_id", "deployment_id", "every_s")},
            )
            return schedule_doc(self._get(conn, sid))

    def list(self) -> list[dict[str, Any]]:
        t = m.VerifySchedule.__table__
        with self.db.read() as conn:
            return [schedule_doc(r) for r in conn.execute(select(t).order_by(t.c.id))]

    def remove(self, schedule_id: int, by: str, now: datetime) -> dict[str, Any]:
        t = m.VerifySchedule.__table__
        with self.db.write() as conn:
            doc = schedule_doc(self._get(conn, schedule_id))
            conn.execute(delete(m.VerifySchedule).where(t.c.id == schedule_id))
            audit.append(
                conn,
                now_us=to_micros(now),
                actor=by,
                action="verify_schedule.remove",
                subject=f"verify_schedule:{schedule_id}",
                detail={"endpoint": doc["endpoint"], "deployment_id": doc["deployment_id"]},
            )
            return doc

    @staticmethod
    def _get(conn: Connection, schedule_id: int) -> Any:
        t = m.VerifySchedule.__table__
        r = conn.execute(select(t).where(t.c.id == schedule_id)).one_or_none()
        if r is None:
            raise NotFound(f"no verify schedule {schedule_id}", {"id": schedule_id})
        return r

    # ---------------------------------------------------------------- the runner

    def run_due(self, now: datetime | None = None) -> int:
        """Run every schedule that is due now, one after another; returns how many ran."""
        if self.verifier is None:
            return 0
        ran = 0
        while (claimed := self._claim(now or datetime.now(UTC))) is not None:
            self._run(*claimed)
            ran += 1
        return ran

    def _claim(self, now: datetime) -> tuple[Any, Trigger] | None:
        t = m.VerifySchedule.__table__
        a = m.Alert.__table__
        now_us = to_micros(now)
        with self.db.write() as conn:
            rows = conn.execute(
                select(t).where(or_(t.c.claimed_until.is_(None), t.c.claimed_until < now_us))
            ).all()
            for r in sorted(rows, key=lambda r: (r.next_at, r.id)):
                trigger: Trigger | None = None
                if to_micros(r.next_at) <= now_us:
                    trigger = "added" if r.runs == 0 else "schedule"
                elif r.last_started_at is not None:
                    drifted = conn.execute(
                        select(a.c.id)
                        .where(
                            a.c.kind == "config_drift",
                            a.c.deployment_id == r.deployment_id,
                            a.c.last_seen_at > to_micros(r.last_started_at),
                        )
                        .limit(1)
                    ).first()
                    trigger = "drift" if drifted is not None else None
                if trigger is None:
                    continue
                if conn.dialect.name == "postgresql":
                    # one run per endpoint across replicas: the claim below is checked under
                    # this lock, held until the claim commits
                    key = zlib.crc32(r.endpoint.encode())
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
                busy = conn.execute(
                    select(t.c.id).where(
                        t.c.endpoint == r.endpoint,
                        t.c.id != r.id,
                        t.c.claimed_until.is_not(None),
                        t.c.claimed_until >= now_us,
                    )
                ).first()
                if busy is not None:
                    continue
                # generous: a run is bounded by its budget and its per-request timeout
                lease = now + timedelta(seconds=r.budget * r.timeout_s / 4 + 300)
                claimed = conn.execute(
                    update(m.VerifySchedule)
                    .where(
                        t.c.id == r.id,
                        or_(t.c.claimed_until.is_(None), t.c.claimed_until < now_us),
                    )
                    .values(claimed_until=to_micros(lease), last_started_at=now_us)
                ).rowcount
                if claimed:
                    return r, trigger
        return None

    def _run(self, r: Any, trigger: Trigger) -> None:
        assert self.verifier is not None
        run = ScheduledRun(
            schedule_id=r.id,
            endpoint=r.endpoint,
            model_id=r.model_id,
            deployment_id=r.deployment_id,
            budget=r.budget,
            max_context=r.max_context,
            timeout_s=r.timeout_s,
            trigger=trigger,
        )
        vid: int | None = None
        result: str | None = None
        announced: dict[str, Any] | None = None
        by = f"schedule:{r.id}"
        try:
            keys = read_keys(r.keys_ref, self._environ())
            # its prompts are the run's own, not the endpoint's traffic, for as long as its
            # claim lasts (the run is recorded, or the announcement ended, before that)
            announced = self.alerting.announce_verification_run(
                {
                    "deployment_id": r.deployment_id,
                    "tenants": sorted(keys),
                    "max_duration_s": min(MAX_RUN_S, r.budget * r.timeout_s / 4 + 300),
                },
                by,
                datetime.now(UTC),
            )
            outcome = self.verifier(run, keys)
        except KeysUnavailable as exc:
            outcome = RunOutcome(None, str(exc))
        except Exception as exc:  # a verifier bug must not stop the other schedules
            log.exception("verify schedule %s failed", r.id)
            outcome = RunOutcome(None, f"{type(exc).__name__}: {exc}")
        now = datetime.now(UTC)
        if announced is not None and outcome.verification is None:
            self.alerting.end_verification_run(announced["id"], None, now)
        if outcome.verification is not None:
            values = dict(outcome.verification)
            if announced is not None:
                values["run_id"] = announced["id"]
            values["evidence"] = {
                **(values.get("evidence") or {}),
                "schedule_id": r.id,
                "trigger": trigger,
            }
            doc = self.alerting.add_verification(values, by, now)
            vid, result = doc["id"], doc["result"]
        else:
            result = "error"
            log.warning(
                "verify schedule %s (%s) reached no verdict: %s", r.id, r.endpoint, outcome.error
            )
        t = m.VerifySchedule.__table__
        with self.db.write() as conn:
            conn.execute(
                update(m.VerifySchedule)
                .where(t.c.id == r.id)
                .values(
                    claimed_until=None,
                    last_finished_at=to_micros(now),
                    next_at=to_micros(now) + r.every_s * 1_000_000,
                    last_trigger=trigger,
                    last_result=result,
                    last_verification_id=vid if vid is not None else r.last_verification_id,
                    last_error=outcome.error,
                    runs=r.runs + 1,
                )
            )
