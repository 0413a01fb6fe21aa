"""Alerting inside the collector: facts for the policy engine, alert lifecycle storage,
silences, incidents, and the notifications they cause (written to the outbox in the same
transaction)."""
