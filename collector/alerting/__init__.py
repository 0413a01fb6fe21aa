"""Alerting inside the collector: the policy pass over ingested batches and the timer, alert
lifecycle storage, silences, incidents, and the notifications they cause (written to the
outbox in the same transaction). :class:`~collector.alerting.service.AlertingService` is the
entry point; its module lists the parts. The facts it evaluates over are loaded by
:mod:`collector.deployment_facts`."""
