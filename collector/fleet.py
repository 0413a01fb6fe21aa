"""The fleet: every deployment's limits at a glance, with a status a person can act on.

Status is ``red`` when a pool is smaller than the advertised context (the incident's
precondition; ``amber`` where ``policies.limits.small_pool_mitigated`` says a verified limit
that fits the pool makes it an overstated context, as the rule says), the latest
verification found the endpoint unsafe, a verification is stale
against the running config, or a critical alert fires; ``amber`` when a model has no passing
verification, a source a producer watches is silent (``telemetry_gap``'s ``source_silent``:
listed in ``silent_sources``, its reason a line of its own), or a warning fires; ``green``
otherwise. ``reasons`` says which, in the limits
card's words, an open incident first. A deployment known only from its verifications (an
endpoint watched from outside) is listed with what they say.

Deployments come in the order a person should look at them: those with an open incident,
then red, amber, green (more critical alerts first), then by name. Each lists its open
incidents for as long as they are open.
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
from collector.timefmt import as_datetime, parse_iso, to_micros
from policies.limits import from_json, small_pool_mitigated

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
            incidents: dict[str, list[dict[str, Any]]] = {}
            for r in conn.execute(
                select(
                    i.id, i.deployment_id, i.title, i.opened_at, i.deadline_at, i.acked_by, i.owner
                )
                .where(i.state == "open")
                .order_by(i.id)
            ):
                incidents.setdefault(r.deployment_id, []).append(
                    {
                        "id": r.id,
                        "title": r.title,
                        "opened_at": r.opened_at,
                        "deadline_at": r.deadline_at,
                        "acked_by": r.acked_by,
                        "owner": r.owner,
                    }
                )
            lost_recently = lost.recent(conn, to_micros(now) - lost.RECENT_S * 1_000_000)
        out = []
        for dep, last_seen in deps:
            card = self.limits.card(dep, now)
            models = []
            open_here = incidents.get(dep, [])
            # an open incident is why a deployment is red before anything else is
            reasons: list[tuple[str, str]] = [
                (
                    "red",
                    f"open incident #{x['id']}: {x['title']}, opened "
                    f"{as_datetime(x['opened_at']):%Y-%m-%d %H:%M:%S} UTC",
                )
                for x in open_here
            ]
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
                    small = f"{name}: pool {pool:,} tokens < advertised context {adv:,}"
                    lim = from_json(mod["limit_in_force"])
                    if small_pool_mitigated(lim, pool, bool(open_here)):
                        # the rule's own answer (a warning then): one decision, both places
                        reasons.append(("amber", f"{small}, refused past it (verified)"))
                    else:
                        reasons.append(("red", small))
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
                    "open_incidents": len(open_here),
                    # linked for as long as they are open (not only while an alert fires)
                    "incidents": open_here,
                    "silent_sources": sources,
                    # requests closed as lost (their probe gone) in the last RECENT_S
                    "lost_requests": {
                        "window_s": lost.RECENT_S,
                        **lost_recently.get(dep, {"count": 0, "by_reason": {}, "latest_at": None}),
                    },
                }
            )
        # What needs a person first: an open incident, then red, amber, green; more critical
        # alerts first within a colour; then by name.
        out.sort(
            key=lambda d: (
                not d["open_incidents"],
                -_RANK[d["status"]],
                -d["critical_alerts"],
                d["deployment_id"],
            )
        )
        return {"generated_at": now, "deployments": out}
