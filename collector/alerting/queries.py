"""Reads of alerting state, for the HTTP API and the CLI: alerts (with whether a silence
holds them back, and one alert's history), silences, incidents with their alerts,
verifications, and the health of the rules in force. Each in one read transaction.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from collector.alerting import docs
from collector.alerting import repository as repo
from collector.db import Database
from collector.errors import NotFound
from collector.timefmt import iso, to_micros
from policies import RuleSet


def incident_with_alerts(conn: Connection, incident_id: int) -> dict[str, Any]:
    """One incident's document with its alerts' (also what closing one answers)."""
    r = repo.get_incident(conn, incident_id)
    if r is None:
        raise NotFound(f"no incident {incident_id}")
    out = docs.incident_doc(r)
    out["alerts"] = [docs.alert_doc(a) for a in repo.incident_alerts(conn, incident_id)]
    return out


class AlertQueries:
    def __init__(self, db: Database, rules: RuleSet):
        self.db = db
        self.rules = rules

    def list_alerts(
        self,
        *,
        state: str | None = None,
        severity: str | None = None,
        rule: str | None = None,
        deployment_id: str | None = None,
        after_id: int | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            now_us = to_micros(datetime.now().astimezone())
            silences = repo.active_silences(conn, now_us)
            rows = repo.list_alerts(
                conn,
                state=state,
                severity=severity,
                rule=rule,
                deployment_id=deployment_id,
                after_id=after_id,
                limit=limit,
            )
            return [
                docs.alert_doc(r, silenced=repo.silenced(json.loads(r.labels), silences))
                for r in rows
            ]

    def alert(self, alert_id: int) -> dict[str, Any]:
        with self.db.read() as conn:
            r = repo.get_alert(conn, alert_id)
            if r is None:
                raise NotFound(f"no alert {alert_id}")
            out = docs.alert_doc(r)
            out["history"] = [
                {
                    "at": iso(t.at),
                    "from": t.from_state,
                    "to": t.to_state,
                    "value": t.value,
                    "actor": t.actor,
                    "detail": json.loads(t.detail),
                }
                for t in repo.transitions(conn, alert_id)
            ]
            return out

    def list_silences(self) -> list[dict[str, Any]]:
        now_us = to_micros(datetime.now().astimezone())
        with self.db.read() as conn:
            return [docs.silence_doc(s, now_us) for s in repo.list_silences(conn)]

    def list_incidents(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return [docs.incident_doc(r) for r in repo.list_incidents(conn, state, limit)]

    def incident(self, incident_id: int) -> dict[str, Any]:
        with self.db.read() as conn:
            return incident_with_alerts(conn, incident_id)

    def list_verifications(
        self, deployment_id: str | None, limit: int = 100
    ) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return [
                docs.verification_doc(v, evidence=False)
                for v in repo.list_verifications(conn, deployment_id, limit)
            ]

    def verification(self, verification_id: int) -> dict[str, Any]:
        with self.db.read() as conn:
            v = repo.get_verification(conn, verification_id)
        if v is None:
            raise NotFound(f"no verification {verification_id}")
        return docs.verification_doc(v)

    def rules_health(self) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            health = repo.health(conn)
        out = []
        for r in self.rules.rules:
            h = health.get(r.name)
            out.append(
                {
                    "name": r.name,
                    "kind": r.kind,
                    "severity": r.severity,
                    "enabled": r.enabled,
                    "pack": r.pack,
                    "source": r.source,
                    "health": h.health if h else "unknown",
                    "last_error": h.last_error if h else None,
                    "last_error_at": iso(h.last_error_at) if h else None,
                    "last_evaluated_at": iso(h.last_evaluated_at) if h else None,
                    "errors": h.errors if h else 0,
                }
            )
        return out
