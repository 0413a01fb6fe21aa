"""Scheduled verifications: the collector runs ``kvwatch verify`` against registered
endpoints every so often, and at once when the deployment's config drifts.

The collector owns the schedules (the table, their checks, who may change them, when each
is due, one run at a time per endpoint across replicas, recording the verdict exactly as a
manual upload is recorded); how a verification runs is the verifier's, handed in by whoever
builds the app (``create_app(settings, verifier=...)``: ``kvwatch serve`` hands in
``kvwatch.verify``). Without one, schedules are stored and listed but nothing runs them.

Tenant keys are never stored nor printed: a schedule names where they are read at run time
(``env:NAME``, a variable of the collector's environment, or ``file:NAME``, a file in the
operator's keys directory), holding space- or newline-separated ``NAME=KEY`` pairs.

What a schedule may reach is the operator's, set when the collector starts (:class:`Reach`,
from the settings), never the caller's: an admin token could otherwise have the collector
read any file or variable it can (the database password) and send it, as a bearer key, to a
URL of the token holder's choosing. A variable must carry the configured prefix, a file must
lie directly in the keys directory, and the endpoint must be on an allowed origin; each is
checked when a schedule is added and again before each run (a schedule stored before the
operator narrowed them then records why it did not run).

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
from collector.settings import Settings, origin_of
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


@dataclass(frozen=True)
class Reach:
    """What the operator lets a schedule reach: the endpoints' origins (``*``: any), the
    directory of key files (None: no ``file:``) and the prefix of key variables."""

    endpoints: tuple[str, ...] = ()
    keys_dir: Path | None = None
    env_prefix: str = "VERIFY_KEYS_"

    @classmethod
    def from_settings(cls, s: Settings) -> Reach:
        return cls(tuple(s.verify_endpoints), s.verify_keys_dir, s.verify_keys_env_prefix)

    def endpoint_refused(self, url: str) -> str | None:
        """Why a schedule may not send keys to ``url``; None when it may."""
        if "*" in self.endpoints:
            return None
        origin = origin_of(url)
        if origin is not None and origin in self.endpoints:
            return None
        if not self.endpoints:
            return (
                "no endpoint is allowed: the collector's operator lists the origins "
                "scheduled verifications may send tenant keys to in KVWATCH_VERIFY_ENDPOINTS"
            )
        return f"{origin or url} is not among KVWATCH_VERIFY_ENDPOINTS"


def read_keys(ref: str, reach: Reach, environ: dict[str, str] | None = None) -> dict[str, str]:
    """NAME -> KEY from ``env:NAME`` or ``file:NAME``, within ``reach``; raises
    :class:`KeysUnavailable`."""
    kind, _, where = ref.partition(":")
    if kind == "env" and where:
        if not where.startswith(reach.env_prefix):
            raise KeysUnavailable(
                f"{ref}: only variables named {reach.env_prefix}... hold keys "
                "(KVWATCH_VERIFY_KEYS_ENV_PREFIX)"
            )
        value = (environ if environ is not None else os.environ).get(where)
        if value is None:
            raise KeysUnavailable(f"{ref}: the collector's environment has no {where}")
    elif kind == "file" and where:
        try:
            value = _key_file(ref, where, reach.keys_dir).read_text(encoding="utf-8")
        except OSError as exc:
            raise KeysUnavailable(f"{ref}: cannot read it ({exc.strerror or exc})") from None
    else:
        raise KeysUnavailable(f"{ref!r}: write env:VARIABLE or file:NAME")
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


def _key_file(ref: str, name: str, keys_dir: Path | None) -> Path:
    """The file ``file:NAME`` names: directly in ``keys_dir`` (a path in it, as written
    before the directory was required, is accepted too), after links are followed."""
    if keys_dir is None:
        raise KeysUnavailable(
            f"{ref}: key files are read only from KVWATCH_VERIFY_KEYS_DIR, which is not set"
        )
    try:
        home = keys_dir.resolve(strict=True)
    except OSError as exc:
        raise KeysUnavailable(
            f"{ref}: KVWATCH_VERIFY_KEYS_DIR ({keys_dir}) cannot be read ({exc.strerror or exc})"
        ) from None
    outside = f"{ref}: not a file directly in KVWATCH_VERIFY_KEYS_DIR ({keys_dir})"
    # judged on the name first, so that nothing outside the directory is even looked at
    # (whether a file exists elsewhere is not the caller's to learn)
    named = Path(os.path.normpath(home / name))  # an absolute name replaces home
    if named.parent != home and named.parent != Path(os.path.normpath(keys_dir.absolute())):
        raise KeysUnavailable(outside)
    try:
        path = (home / named.name).resolve(strict=True)
    except OSError as exc:
        raise KeysUnavailable(f"{ref}: cannot read it ({exc.strerror or exc})") from None
    if path.parent != home or not path.is_file():  # a link out of the directory
        raise KeysUnavailable(outside)
    return path


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
        reach: Reach | None = None,
    ):
        self.reach = reach if reach is not None else Reach()
        self.db = db
        self.alerting = alerting
        self.verifier = verifier
        self._environ = environ

    # ---------------------------------------------------------------- operators

    def add(self, values: dict[str, Any], by: str, now: datetime) -> dict[str, Any]:
        """Register a schedule (due at once). Raises :class:`InvalidInput` naming the field."""
        endpoint = str(values["endpoint"]).strip().rstrip("/")
        if (why := _bad_endpoint(endpoint) or self.reach.endpoint_refused(endpoint)) is not None:
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
            read_keys(ref, self.reach, self._environ())  # readable now, or it would fail every run
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
            if (why := self.reach.endpoint_refused(r.endpoint)) is not None:
                raise KeysUnavailable(f"endpoint: {why}")
            keys = read_keys(r.keys_ref, self.reach, self._environ())
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
