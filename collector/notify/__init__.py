"""Notifications: a durable outbox, a dispatcher, Standard Webhooks signing, payload shapes.

The contract between the alerting side (``collector.alerting``) and this package is one
*notification document*, a JSON object stored in ``outbox.data`` (one row per endpoint),
written in the same transaction as the alert or incident change that caused it::

    {
      "type": "alert.firing" | "alert.resolved" | "alert.repeat" | "alert.digest"
              | "incident.opened" | "incident.acknowledged" | "incident.reminder"
              | "incident.repeat" | "incident.closed",   # incident.repeat: to Alertmanager only
      "created_at": "2026-11-29T18:00:00.123456Z",     # when the change happened (UTC; see
                                                       # collector.timefmt)
      "instance": str,                    # the installation that sent it (KVWATCH_INSTANCE)
      "group_key": "{alertname=\\"stale_page_read\\",deployment_id=\\"d1\\"}" | null,
      "group_labels": {"alertname": "...", "deployment_id": "..."},
      "alerts": [AlertDoc, ...],          # [] for incident-only notifications
      "incident": IncidentDoc | null,
      "digest": {...}                     # alert.digest only: the minute's held-back
                                          # notifications (collector.notify.outbox)
    }

    AlertDoc = {
      "id": int, "fingerprint": str, "rule": str, "kind": str, "severity": str,
      "state": "pending" | "firing" | "resolved",
      "labels": {str: str},                # includes "alertname", "severity" and
                                           # "kvwatch_instance"
      "annotations": {str: str},
      "value": float | null, "occurrences": int,
      "starts_at": iso, "ends_at": iso | null,   # ends_at set once resolved
      "acked": bool,
      "url": str | null,                   # the dashboard's page (KVWATCH_DASHBOARD_URL)
      "runbook_url": str | null
    }

    IncidentDoc = {
      "id": int, "deployment_id": str, "title": str, "state": "open" | "closed",
      "cause_rule": str, "first_alert_id": int,   # the alert that opened it
      "opened_at": iso, "awareness_at": iso, "deadline_at": iso,
      "remind_before_s": int | null,       # for incident.reminder: which reminder this is
      "closed_at": iso | null, "closed_by": str | null, "close_reason": str | null,
      "acked_at": iso | null, "acked_by": str | null, "owner": str | null,
      "instance": str, "fingerprint": str, "url": str | null, "runbook_url": str | null
    }

An alert's ``fingerprint`` in a notification is the hash of the labels it is sent with
(``kvwatch_instance`` among them), the same function as the stored alert's, which hashes
the labels without it: two installations never send the same fingerprint, which is what a
receiver deduplicates by (a pager's dedup key). An incident's is the hash of its
Alertmanager labels (below). The API's alerts keep the stored fingerprint; correlate by
``id`` and ``instance``.

Every document is rendered per endpoint at send time, deterministically (a retry sends the
same body under the same ``webhook-id``). For Alertmanager (its API and its webhook format)
a document with an incident is the incident's own alert (``alertname=KvwatchIncident``,
deadline and affected-tenant count as annotations, resolved when closed); fingerprints are
Alertmanager's own.

The package:

* ``outbox``: ``enqueue(conn, doc, severity=..., now_us=...)`` writes one row per enabled
  endpoint whose ``min_severity`` (info < warning < critical) is at most ``severity``, each
  holding only the alerts at or above that endpoint's ``min_severity``;
  endpoint management (``add_endpoint``, ``list_endpoints``, ``enable_endpoint``,
  ``remove_endpoint``).
* ``payloads``: the bodies. ``kvwatch`` format: the document plus ``"version": 1``.
  Alertmanager webhook v4 format, and Alertmanager API v2 alerts for ``alertmanager``
  endpoints; there an incident-only document is one alert labelled
  ``alertname="KvwatchIncident"``, ``deployment_id``, ``severity="critical"``,
  ``incident_id``, ``kvwatch_instance``. A firing alert is posted with ``endsAt`` an hour ahead
  (``payloads.AM_FIRING_HORIZON_S``): the alerting side must send ``alert.repeat`` more often
  than that to Alertmanager endpoints, or Alertmanager resolves the alert by itself.
* ``signing``: Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
  ``webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>``, two space-separated
  entries during a rotation's grace, any one of which verifies); ``verify`` is the public
  function for receivers (also ``kvwatch webhooks verify``).
* ``dispatcher``: delivery, in outbox order per endpoint, at least once, retried with
  exponential backoff and jitter; a 410 disables the endpoint; every attempt is recorded in
  ``delivery_attempts``.
"""
