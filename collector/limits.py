"""The limit in force, served: :func:`policies.limits.limit_in_force` over the facts
:mod:`collector.deployment_facts` loads, for every part of the collector that shows or
measures against it (the limits card, the fleet, the breach report, the quarterly review,
the dashboard's lines, ``/metrics``) and for the gateway (``GET /v1/limits``).

The collector decides nothing itself: this module only loads the facts, with the rule
pack's maximum verification age, and asks ``policies``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Connection

from collector import deployment_facts as F
from collector.db import Database
from collector.settings import Settings
from policies import DeploymentFacts, RuleSet, load_ruleset
from policies.limits import LimitInForce, limits_in_force, verification_max_age_s


class Limits:
    """Decides the limits in force from the database. ``max_verification_age_s``: the rule
    pack's (:func:`policies.limits.verification_max_age_s`), fixed when the app is built,
    as the pack is."""

    def __init__(self, db: Database, max_verification_age_s: float | None = None):
        self.db = db
        self.max_verification_age_s = max_verification_age_s

    @classmethod
    def for_rules(cls, db: Database, rules: RuleSet) -> Limits:
        return cls(db, verification_max_age_s(rules.enabled()))

    @classmethod
    def for_settings(cls, db: Database, settings: Settings) -> Limits:
        """As the collector built from ``settings`` decides them (its packs loaded): what
        the CLI's reports use, so they say what the running collector says."""
        rules = load_ruleset(settings.policy_packs_dir) if settings.policies_enabled else None
        return cls.for_rules(db, rules) if rules is not None else cls(db)

    def facts_and_limits(
        self, conn: Connection, deployments: Iterable[str] | None, now: datetime
    ) -> tuple[dict[str, DeploymentFacts], dict[tuple[str, str], LimitInForce]]:
        """The facts the limits were decided from (for a view that also shows them), and
        the limits: (deployment, model) -> its limit in force."""
        facts = F.load(conn, deployments, self.max_verification_age_s)
        limits = {
            (dep, model): limit
            for dep, d in sorted(facts.items())
            for model, limit in limits_in_force(d, now).items()
        }
        return facts, limits

    def in_conn(
        self, conn: Connection, deployments: Iterable[str] | None, now: datetime
    ) -> dict[tuple[str, str], LimitInForce]:
        """(deployment, model) -> its limit in force, for every model these deployments
        serve or have verified (every deployment: ``None``), in ``conn``'s transaction."""
        return self.facts_and_limits(conn, deployments, now)[1]

    def of(self, deployments: Iterable[str] | None, now: datetime) -> list[LimitInForce]:
        """The limits in force of these deployments, by deployment and model."""
        with self.db.read() as conn:
            return list(self.in_conn(conn, deployments, now).values())
