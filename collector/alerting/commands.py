"""Operator actions on alerting, from the HTTP API and the CLI: acknowledge an alert, create
or expire a silence, close an incident, record a verification. Each runs in a write
transaction of its own and is written to the hash-chained audit log (:mod:`collector.audit`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from collector import audit
from collector import deployment_facts as F
from collector.alerting import docs
from collector.alerting import repository as repo
from collector.alerting.facts_cache import FactsCache
from collector.alerting.notifications import Notifier
from collector.alerting.queries import incident_with_alerts
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.store import deployment_upsert_sql
from collector.timefmt import iso, to_micros
from policies.facts import VERIFIED_SETTINGS
from policies.limits import recordable_safe_context

LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class OperatorCommands:
    def __init__(self, db: Database, facts: FactsCache, notifier: Notifier):
        self.db = db
        self.facts = facts
        self.notifier = notifier

    def ack(self, alert_id: int, by: str, comment: str | None, now: datetime) -> dict[str, Any]:
        now_us = to_micros(now)
        with self.db.write() as conn:
            a = repo.get_alert(conn, alert_id, lock=True)
            if a is None:
                raise NotFound(f"no alert {alert_id}")
            if a.state == "resolved":
                raise Conflict(f"alert {alert_id} is resolved; there is nothing to acknowledge")
            if a.acked_at is not None:
                # Done already: as closing a closed incident or expiring an expired silence,
                # nothing changes and the first acknowledgement stands (said by the caller).
                return docs.alert_doc(a)
            repo.update_alert(
                conn,
                alert_id,
                {"acked_at": now_us, "acked_by": by, "ack_comment": comment, "updated_at": now_us},
            )
            repo.add_transition(
                conn,
                alert_id,
                now_us,
                a.state,
                a.state,
                a.value,
                actor=by,
                detail={"ack": True, "comment": comment},
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="alert.ack",
                subject=f"alert:{alert_id}",
                detail={"comment": comment},
            )
            return docs.alert_doc(repo.get_alert(conn, alert_id))

    def silence(
        self,
        matchers: list[dict[str, Any]],
        starts_at: datetime,
        ends_at: datetime,
        by: str,
        comment: str,
        now: datetime,
    ) -> dict[str, Any]:
        if not matchers:
            raise InvalidInput("a silence needs at least one matcher", {"field": "matchers"})
        for i, mt in enumerate(matchers):
            if not LABEL_NAME.match(str(mt.get("name", ""))):
                raise InvalidInput(
                    f"matchers[{i}].name is not a label name", {"field": f"matchers[{i}].name"}
                )
            if mt.get("regex"):
                try:
                    re.compile(mt["value"])
                except re.error as exc:
                    raise InvalidInput(
                        f"matchers[{i}].value is not a regular expression: {exc}",
                        {"field": f"matchers[{i}].value"},
                    ) from None
        if ends_at <= starts_at:
            raise InvalidInput("ends_at must be after starts_at", {"field": "ends_at"})
        now_us = to_micros(now)
        with self.db.write() as conn:
            sid = repo.insert_silence(
                conn,
                {
                    "matchers": json.dumps(matchers, sort_keys=True),
                    "starts_at": to_micros(starts_at),
                    "ends_at": to_micros(ends_at),
                    "created_by": by,
                    "comment": comment,
                    "created_at": now_us,
                },
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="silence.create",
                subject=f"silence:{sid}",
                detail={"matchers": matchers, "ends_at": iso(ends_at), "comment": comment},
            )
            return docs.silence_doc(repo.get_silence(conn, sid), now_us)

    def expire_silence(self, silence_id: int, by: str, now: datetime) -> dict[str, Any]:
        now_us = to_micros(now)
        with self.db.write() as conn:
            s = repo.get_silence(conn, silence_id)
            if s is None:
                raise NotFound(f"no silence {silence_id}")
            if s.expired_at is None:
                repo.expire_silence(conn, silence_id, now_us)
                audit.append(
                    conn,
                    now_us=now_us,
                    actor=by,
                    action="silence.expire",
                    subject=f"silence:{silence_id}",
                )
            return docs.silence_doc(repo.get_silence(conn, silence_id), now_us)

    def close_incident(
        self, incident_id: int, by: str, reason: str, now: datetime
    ) -> dict[str, Any]:
        if not reason.strip():
            raise InvalidInput("closing an incident needs a reason", {"field": "reason"})
        now_us = to_micros(now)
        with self.db.write() as conn:
            inc = repo.get_incident(conn, incident_id, lock=True)
            if inc is None:
                raise NotFound(f"no incident {incident_id}")
            if inc.state == "closed":
                # Closing twice changes nothing: the first close's person and reason stand.
                return incident_with_alerts(conn, incident_id)
            repo.update_incident(
                conn,
                incident_id,
                {"state": "closed", "closed_at": now_us, "closed_by": by, "close_reason": reason},
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="incident.close",
                subject=f"incident:{incident_id}",
                detail={"reason": reason},
            )
            self.notifier.incident(conn, incident_id, "incident.closed", now_us)
            return incident_with_alerts(conn, incident_id)

    def announce_verification_run(
        self, values: dict[str, Any], by: str, now: datetime
    ) -> dict[str, Any]:
        """A verification about to send its prompts: from now until it is recorded (with
        this run's id) or ``max_duration_s`` passes, the requests and page events of the
        deployment naming only its tenants are its own and the rules do not evaluate them
        (``collector.models.VerificationRun``). Audited: a window in which some traffic is
        not evaluated is an operator-visible decision."""
        now_us = to_micros(now)
        tenants = sorted(set(values["tenants"]))
        row = {
            "deployment_id": values["deployment_id"],
            "tenants": json.dumps(tenants),
            "started_at": now_us,
            "ends_at": now_us + int(values["max_duration_s"] * 1e6),
            "finished_at": None,
            "created_by": by,
            "verification_id": None,
        }
        with self.db.write() as conn:
            r = repo.insert_verification_run(conn, row)
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="verification.run",
                subject=f"verification-run:{r.id}",
                detail={
                    "deployment_id": r.deployment_id,
                    "tenants": tenants,
                    "ends_at": iso(r.ends_at),
                },
            )
        return docs.verification_run_doc(r)

    def end_verification_run(
        self, run_id: int, deployment_id: str | None, now: datetime
    ) -> dict[str, Any]:
        """End a run now (at most at its announced end); ending an ended one changes nothing.
        NotFound for no run of that id (of ``deployment_id``, where given)."""
        with self.db.write() as conn:
            r = repo.get_verification_run(conn, run_id)
            if r is None or deployment_id not in (None, r.deployment_id):
                raise NotFound(f"no verification run {run_id}")
            repo.finish_verification_run(conn, run_id, r.deployment_id, None, to_micros(now))
            return docs.verification_run_doc(repo.get_verification_run(conn, run_id))

    def add_verification(self, values: dict[str, Any], by: str, now: datetime) -> dict[str, Any]:
        """Record a verification (from ``kvwatch verify`` or an operator). The timer's next
        pass re-evaluates verification and context rules against it.

        A verification that does not say which engine settings it was measured under is tied
        to the deployment's current config of the nodes serving the model (a sweep against an
        endpoint cannot see them; the probes have reported them). Its safe context is clamped
        to the smallest prefill pool: a prompt longer than the pool is never safe, whatever a
        sweep saw (the evidence records the clamp)."""
        now_us = to_micros(now)
        row = dict(values)
        run_id = row.pop("run_id", None)
        row["verified_at"] = to_micros(row.get("verified_at") or now)
        evidence = dict(row.get("evidence") or {})
        row.update(created_at=now_us, created_by=by)
        try:
            return self._insert_verification(row, evidence, run_id, by, now_us)
        finally:
            # after the commit: a batch read in between must not keep the old verdicts
            self.facts.forget(row["deployment_id"])

    def _insert_verification(
        self, row: dict[str, Any], evidence: dict[str, Any], run_id: Any, by: str, now_us: int
    ) -> dict[str, Any]:
        with self.db.write() as conn:
            configs = [
                c
                for (d, _), c in F.node_configs(conn, {row["deployment_id"]}).items()
                if c.model_id == row["model_id"]
            ]
            if configs and all(row.get(k) is None for k in VERIFIED_SETTINGS):
                prefill = [c for c in configs if c.role != "decode"] or configs
                first = min(prefill, key=lambda c: c.pool_capacity_tokens)
                for k in VERIFIED_SETTINGS:
                    row[k] = getattr(first, k)
                evidence["settings_from"] = f"engine.config of node {first.node} at {iso(first.ts)}"
            measured = row.get("verified_safe_context")
            safe, pool = recordable_safe_context(measured, configs)
            if pool is not None:
                evidence["clamped_to_pool"] = {"measured": measured, "pool_capacity_tokens": pool}
                row["verified_safe_context"] = safe
            row["evidence"] = json.dumps(evidence, sort_keys=True)
            # An endpoint watched only from outside (verify + gateway) has no probe: its
            # verification makes it a deployment the fleet, the card and the rules know.
            conn.exec_driver_sql(
                deployment_upsert_sql(conn.dialect.name), [(row["deployment_id"], now_us, now_us)]
            )
            vid = repo.insert_verification(conn, row)
            if run_id is not None and not repo.finish_verification_run(
                conn, run_id, row["deployment_id"], vid, now_us
            ):
                raise InvalidInput(
                    f"run_id {run_id}: no unfinished verification run of deployment "
                    f"{row['deployment_id']!r} has that id",
                    {"field": "run_id"},
                )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="verification.add",
                subject=f"verification:{vid}",
                detail={
                    "deployment_id": row["deployment_id"],
                    "model_id": row["model_id"],
                    "passed": row["passed"],
                },
            )
            return docs.verification_doc(repo.get_verification(conn, vid))
