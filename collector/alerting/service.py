"""The alerting service: the one object the app, the ingest service and the CLI hold. It
evaluates the rule packs on ingest and on a timer, advances alerts, opens incidents and
writes the notifications they cause, all in the caller's transaction; operators acknowledge
alerts, silence them, close incidents and record verifications through it (audited); and it
answers the reads of all of these. The HTTP API and the CLI are thin layers over it.

It holds the parts and delegates; each part owns one concern, in its own module:

- :mod:`~collector.alerting.evaluation`: the pass over a batch or the timer;
- :mod:`~collector.alerting.notifications`: what is notified, grouped how, and when again;
- :mod:`~collector.alerting.incidents`: linking alerts to incidents, opening them;
- :mod:`~collector.alerting.commands`: operator actions, each audited;
- :mod:`~collector.alerting.queries`: reads;
- :mod:`~collector.alerting.facts_cache`: what the ingest path remembers between batches;
- :mod:`~collector.alerting.repository` (SQL) and :mod:`~collector.alerting.docs` (JSON
  documents) below them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from collector.alerting.commands import OperatorCommands
from collector.alerting.evaluation import Evaluator, PassResult
from collector.alerting.facts_cache import FACTS_TTL_S, FactsCache
from collector.alerting.incident_workflow import IncidentWorkflow
from collector.alerting.notifications import Notifier
from collector.alerting.queries import AlertQueries
from collector.alerting.timeline import incident_timeline
from collector.db import Database
from collector.installation import Identity
from collector.notify.outbox import DEFAULT_MAX_PER_MINUTE
from collector.timefmt import to_micros
from engine_probe import events as ev
from policies import NodeConfig, RuleSet, SeqGapFact


class AlertingService:
    def __init__(
        self,
        db: Database,
        rules: RuleSet,
        *,
        facts_ttl_s: float = FACTS_TTL_S,
        identity: Identity | None = None,
        notify_max_per_minute: int = DEFAULT_MAX_PER_MINUTE,
    ):
        self.db = db
        self.rules = rules
        self.facts = FactsCache(facts_ttl_s)
        self.notifier = Notifier(rules, identity, notify_max_per_minute)
        self.evaluator = Evaluator(db, rules, self.facts, self.notifier)
        self.commands = OperatorCommands(db, self.facts, self.notifier)
        self.workflow = IncidentWorkflow(db, self.notifier)
        self.queries = AlertQueries(db, rules)

    # ------------------------------------------------------------------ the ingest path

    def prior_configs(
        self, conn: Connection, events: Sequence[ev.Event]
    ) -> dict[tuple[str, str], NodeConfig]:
        """Each touched deployment's node configs before the batch (call before storing it)."""
        return self.facts.prior_configs(conn, events)

    def on_batch(
        self,
        conn: Connection,
        events: Sequence[ev.Event],
        prior: dict[tuple[str, str], NodeConfig],
        gaps: Sequence[SeqGapFact],
        now: datetime,
    ) -> PassResult:
        """Evaluate a batch's new events (already stored in ``conn``'s transaction)."""
        return self.evaluator.on_batch(conn, events, prior, gaps, now)

    def committed(self, result: PassResult) -> None:
        """The batch ``result`` came from has committed: remember what it stored (before
        that, a rolled-back and retried batch would find it remembered and skip it)."""
        self.facts.committed(result.new_tenants, result.configs)

    # ------------------------------------------------------------------ the timer

    def tick(self, now: datetime) -> PassResult | None:
        """The timer's pass; ``None`` when another replica is running its pass."""
        return self.evaluator.tick(now)

    # ------------------------------------------------------------------ operator actions

    def ack(self, alert_id: int, by: str, comment: str | None, now: datetime) -> dict[str, Any]:
        return self.commands.ack(alert_id, by, comment, now)

    def silence(
        self,
        matchers: list[dict[str, Any]],
        starts_at: datetime,
        ends_at: datetime,
        by: str,
        comment: str,
        now: datetime,
    ) -> dict[str, Any]:
        return self.commands.silence(matchers, starts_at, ends_at, by, comment, now)

    def expire_silence(self, silence_id: int, by: str, now: datetime) -> dict[str, Any]:
        return self.commands.expire_silence(silence_id, by, now)

    def close_incident(
        self, incident_id: int, by: str, reason: str, now: datetime
    ) -> dict[str, Any]:
        return self.commands.close_incident(incident_id, by, reason, now)

    def ack_incident(self, incident_id: int, by: str, now: datetime) -> dict[str, Any]:
        return self.workflow.ack(incident_id, by, now)

    def assign_incident(
        self, incident_id: int, owner: str, by: str, now: datetime
    ) -> dict[str, Any]:
        return self.workflow.assign(incident_id, owner, by, now)

    def note_incident(self, incident_id: int, text: str, by: str, now: datetime) -> dict[str, Any]:
        return self.workflow.note(incident_id, text, by, now)

    def link_alert(self, incident_id: int, alert_id: int, by: str, now: datetime) -> dict[str, Any]:
        return self.workflow.link(incident_id, alert_id, by, now)

    def unlink_alert(
        self, incident_id: int, alert_id: int, by: str, now: datetime
    ) -> dict[str, Any]:
        return self.workflow.unlink(incident_id, alert_id, by, now)

    def incident_timeline(self, incident_id: int, now: datetime) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return incident_timeline(conn, incident_id, to_micros(now))

    def announce_verification_run(
        self, values: dict[str, Any], by: str, now: datetime
    ) -> dict[str, Any]:
        return self.commands.announce_verification_run(values, by, now)

    def end_verification_run(
        self, run_id: int, deployment_id: str | None, now: datetime
    ) -> dict[str, Any]:
        """A run that records no verification (it reached no verdict, its upload failed)
        ends now all the same; ``deployment_id``: the caller's, where its token is bound to
        one (another deployment's run is not found)."""
        return self.commands.end_verification_run(run_id, deployment_id, now)

    def add_verification(self, values: dict[str, Any], by: str, now: datetime) -> dict[str, Any]:
        """Record a verification, then evaluate at once: a failed verdict alerts (and its
        webhook goes out) without waiting for the timer. When another replica's pass holds
        the timer, that pass or the next one sees it."""
        doc = self.commands.add_verification(values, by, now)
        self.evaluator.tick(now)
        return doc

    # ------------------------------------------------------------------ reads

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
        return self.queries.list_alerts(
            state=state,
            severity=severity,
            rule=rule,
            deployment_id=deployment_id,
            after_id=after_id,
            limit=limit,
        )

    def alert(self, alert_id: int) -> dict[str, Any]:
        return self.queries.alert(alert_id)

    def list_silences(self) -> list[dict[str, Any]]:
        return self.queries.list_silences()

    def list_incidents(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return self.queries.list_incidents(state, limit)

    def incident(self, incident_id: int) -> dict[str, Any]:
        return self.queries.incident(incident_id)

    def list_verifications(
        self, deployment_id: str | None, limit: int = 100
    ) -> list[dict[str, Any]]:
        return self.queries.list_verifications(deployment_id, limit)

    def verification(self, verification_id: int) -> dict[str, Any]:
        return self.queries.verification(verification_id)

    def rules_health(self) -> list[dict[str, Any]]:
        return self.queries.rules_health()
