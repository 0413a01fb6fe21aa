"""Notifications: a durable outbox, a dispatcher, Standard Webhooks signing, payload shapes.

The contract between the alerting side (``collector.alerting``) and this package is one
*notification document*, a JSON object stored in ``outbox.data`` (one row per endpoint),
written in the same transaction as the alert or incident change that caused it::

    {
      "type": "alert.firing" | "alert.resolved" | "alert.repeat"
              | "incident.opened" | "incident.reminder" | "incident.closed",
      "created_at": "2026-11-29T18:00:00.000000Z",     # when the change happened (UTC)
      "group_key": "{alertname=\\"stale_page_read\\",deployment_id=\\"d1\\"}" | null,
      "group_labels": {"alertname": "...", "deployment_id": "..."},
      "alerts": [AlertDoc, ...],          # [] for incident-only notifications
      "incident": IncidentDoc | null
    }

    AlertDoc = {
      "id": int, "fingerprint": str, "rule": str, "kind": str, "severity": str,
      "state": "pending" | "firing" | "resolved",
      "labels": {str: str},                # includes "alertname" and "severity"
      "annotations": {str: str},
      "value": float | null, "occurrences": int,
      "starts_at": iso, "ends_at": iso | null,   # ends_at set once resolved
      "acked": bool
    }

    IncidentDoc = {
      "id": int, "deployment_id": str, "title": str, "state": "open" | "closed",
      "cause_rule": str, "opened_at": iso, "awareness_at": iso, "deadline_at": iso,
      "remind_before_s": int | null,       # for incident.reminder: which reminder this is
      "closed_at": iso | null, "closed_by": str | null, "close_reason": str | null
    }

Every document is rendered per endpoint at send time, deterministically (a retry sends the
same body under the same ``webhook-id``).
"""
