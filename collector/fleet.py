"""The fleet: every deployment's limits at a glance, with a status a person can act on.

Status is ``red`` when a pool is smaller than the advertised context (the incident's
precondition), the latest verification found the endpoint unsafe, a verification is stale
against the running config, or a critical alert fires; ``amber`` when a model has no passing
verification, a source a producer watches is silent (``telemetry_gap``'s ``source_silent``:
listed in ``silent_sources``, its reason a line of its own), or a warning fires; ``green``
otherwise. ``reasons`` says which, in the limits
card's words. A deployment known only from its verifications (an endpoint watched from
outside) is listed with what they say.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select

from collector import lost_rows as lost
from collector import models as m
from collector.db import Database
from collector.reports.limits import LimitsService
from collector.timefmt import parse_iso, to_micros

_RANK = {"green": 0, "amber": 1, "red": 2}


class FleetService:
    def __init__(self, db: Database, cards: LimitsService):
        self.db = db
        self.limits = cards

    def fleet(self, now: datetime) -> dict[str, Any]:
        with self.db.read() as conn:
            deps = list(
                conn.execute(
                    select(m.Deployment.id, m.Deployment.last_seen).order_by(m.Deployment.id)
                )
            )
            a = m.Alert
            firing: dict[tuple[str | None, str], int] = {
                (dep, sev): int(n)
                for dep, sev, n in conn.execute(
                    select(a.deployment_id, a.severity, sa.func.count())
                    .where(a.state == "firing")
                    .group_by(a.deployment_id, a.severity)
                )
            }
            silent: dict[str | None, list[dict[str, Any]]] = {}
            for dep, labels, notes, since in conn.execute(
                select(a.deployment_id, a.labels, a.annotations, a.fired_at)
                .where(a.state == "firing", a.kind == "telemetry_gap")
                .order_by(a.deployment_id, a.id)
            ):
                lab, note = json.loads(labels), json.loads(notes)
                if lab.get("problem") == "source_silent":
                    silent.setdefault(dep, []).append(
                        {
                            "probe_id": lab.get("probe_id"),
                            "node": note.get("node"),
                            "source": note.get("source"),
                            "cause": note.get("cause"),
                            "since": since,
                            "summary": note.get("summary", ""),
                        }
                    )
            i = m.Incident
            incidents = dict(
                conn.execute(
                    select(i.deployment_id, sa.func.count())
                    .where(i.state == "open")
                    .group_by(i.deployment_id)
                ).all()
            )
            lost_recently = lost.recent(conn, to_micros(now) - lost.RECENT_S * 1_000_000)
        out = []
        for dep, last_seen in deps:
            card = self.limits.card(dep, now)
            models = []
            reasons: list[tuple[str, str]] = []
            for mod in card["models"]:
                v = mod["verified"]
                age = None
                if v is not None:
                    at = parse_iso(v["verified_at"])
                    age = round((now - at).total_seconds() / 86400, 1)
                pool, adv = mod["prefill_pool_tokens"], mod["advertised_context"]
                models.append(
                    {
                        "model_id": mod["model_id"],
                        "advertised_context": adv,
                        "pool_capacity_tokens": pool,
                        "verified_safe_context": None if v is None else v["safe_context"],
                        "verified_at": None if v is None else v["verified_at"],
                        "verification_age_days": age,
                        "engine_version": None if v is None else v["engine_version"],
                        "verification_stale": bool(mod["stale"]),
                        "latest_verification_failed": mod["latest_verification_failed"],
                        "verdict": mod["verdict"],
                        "limit_in_force": mod["limit_in_force"],
                    }
                )
                name = mod["model_id"]
                if pool is not None and adv is not None and pool < adv:
                    reasons.append(
                        ("red", f"{name}: pool {pool:,} tokens < advertised context {adv:,}")
                    )
                said = mod["verdict"]
                if said["status"] in ("unsafe", "failed", "stale"):
                    reasons.append(("red", f"{name}: {said['text']}"))
                elif said["status"] == "not_verified":
                    reasons.append(("amber", f"{name}: {said['text']}"))
            sources = silent.get(dep, [])
            for src in sources:
                reasons.append(("amber", f"source silent: {src['summary']}"))
            crit = firing.get((dep, "critical"), 0)
            warn = sum(n for (d, sev), n in firing.items() if d == dep and sev != "critical")
            if crit:
                reasons.append(("red", f"{crit} critical alert(s) firing"))
            if warn:
                reasons.append(("amber", f"{warn} other alert(s) firing"))
            status = max((lvl for lvl, _ in reasons), key=_RANK.__getitem__, default="green")
            out.append(
                {
                    "deployment_id": dep,
                    "status": status,
                    "reasons": [why for _, why in reasons],
                    "last_seen": last_seen,
                    "nodes": card["nodes"],
                    "models": models,
                    "firing_alerts": crit + warn,
                    "critical_alerts": crit,
                    "open_incidents": int(incidents.get(dep, 0)),
                    "silent_sources": sources,
                    # requests closed as lost (their probe gone) in the last RECENT_S
                    "lost_requests": {
                        "window_s": lost.RECENT_S,
                        **lost_recently.get(dep, {"count": 0, "by_reason": {}, "latest_at": None}),
                    },
                }
            )
        return {"generated_at": now, "deployments": out}
