"""Request bodies, rendered from a notification document (see ``collector.notify``).

Pure functions of the document and the endpoint: no clock, no database. A webhook retry must
be byte-identical to the first try (same ``webhook-id``, same body, a fresh signature), so
JSON goes out compact with sorted keys.

Four shapes:

* ``kvwatch``: the document itself plus ``"version": 1``.
* Alertmanager's webhook body, version 4 (what Alertmanager's own ``webhook_config`` sends),
  for receivers written against Alertmanager.
* Alertmanager API v2 postable alerts, the list a real Alertmanager takes on
  ``POST /api/v2/alerts``, so its routing (PagerDuty, Slack, e-mail) applies unchanged.
* PagerDuty's Events API v2 (``kind="pagerduty"``): one event per alert, or one for the
  incident, each a request of its own (the API takes one event per request): ``trigger``
  while firing or open, ``acknowledge`` when the incident is acknowledged, ``resolve`` when
  it ends. The ``dedup_key`` is the fingerprint of the labels as sent, installation
  included, so two installations never merge or resolve each other's pages.

An incident-only document becomes, in both Alertmanager shapes, one alert labelled
``alertname="KvwatchIncident"``, ``deployment_id``, ``severity="critical"``, ``incident_id``
and ``kvwatch_instance``. Links (``generatorURL``) go to the dashboard's page when the
document carries one (``url``), else to the API; a ``runbook_url`` becomes the annotation
of that name.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from collector.timefmt import iso, parse_iso

KINDS = ("webhook", "alertmanager", "pagerduty")
FORMATS = ("kvwatch", "alertmanager", "pagerduty")
KVWATCH_VERSION = 1
AM_WEBHOOK_VERSION = "4"
AM_ZERO_TIME = "0001-01-01T00:00:00Z"  # Go's zero time.Time: "not ended" in Alertmanager
INCIDENT_ALERTNAME = "KvwatchIncident"
# Alertmanager resolves an alert by itself once endsAt passes, so a firing alert is posted
# with endsAt this far ahead and must be re-posted (alert.repeat) before it runs out, as
# Prometheus does; a collector that dies thus leaves alerts that expire rather than linger.
AM_FIRING_HORIZON_S = 3600

_encoder = msgspec.json.Encoder(order="sorted")


def encode(obj: Any) -> bytes:
    """Compact JSON with sorted keys: the same object always gives the same bytes."""
    return _encoder.encode(obj)


def bodies(
    endpoint_kind: str,
    endpoint_format: str,
    doc: dict[str, Any],
    *,
    receiver_name: str,
    external_url: str,
    secret: str | None = None,
    now: float | None = None,
) -> list[bytes]:
    """The requests to POST, in order: one for every kind but PagerDuty, whose API takes one
    event per request (``secret`` is its routing key). Each is deterministic, so a retry of
    the message sends the same events (PagerDuty deduplicates them by their key)."""
    if endpoint_kind == "pagerduty":
        if not secret:
            raise ValueError("a pagerduty endpoint needs its routing key")
        return [encode(e) for e in pagerduty_events(doc, routing_key=secret)]
    return [
        render(
            endpoint_kind,
            endpoint_format,
            doc,
            receiver_name=receiver_name,
            external_url=external_url,
            now=now,
        )
    ]


_PD_SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}
_PD_RANK = {"info": 0, "warning": 1, "critical": 2}


def pagerduty_events(doc: dict[str, Any], *, routing_key: str) -> list[dict[str, Any]]:
    """PagerDuty Events API v2 events for a document (see the module's note)."""
    source = str(doc.get("instance") or "kvwatch")
    inc = doc.get("incident")
    if inc:
        closed = inc["state"] == "closed"
        action = (
            "resolve"
            if closed
            else "acknowledge"
            if doc.get("type") == "incident.acknowledged"
            else "trigger"
        )
        labels = incident_labels(inc)
        details = {
            k: inc[k]
            for k in ("id", "awareness_at", "deadline_at", "cause_rule", "acked_by", "owner")
            if inc.get(k) is not None
        }
        return [
            _pd_event(
                routing_key,
                action,
                str(inc.get("fingerprint") or am_fingerprint(labels)),
                summary=str(inc["title"]),
                source=source,
                severity="critical",
                timestamp=str(inc["opened_at"]),
                component=str(inc["deployment_id"]),
                klass=str(inc["cause_rule"]),
                details={**details, "labels": labels},
                links=_pd_links(inc, "The incident in kvwatch"),
            )
        ]
    if doc.get("type") == "alert.digest":
        # one event for the whole minute: the digest exists so that a storm is not a page each
        d = doc["digest"]
        alerts = doc.get("alerts") or []
        worst = max(
            (str(a.get("severity")) for a in alerts),
            key=lambda v: _PD_RANK.get(v, 0),
            default="info",
        )
        return [
            _pd_event(
                routing_key,
                "trigger",
                str(doc["group_key"]),
                summary=f"{d['notifications']} kvwatch notification(s) held back in one minute "
                f"(over {d['limit_per_minute']} a minute), {len(alerts)} alert(s) listed",
                source=source,
                severity=_PD_SEVERITY.get(worst, "info"),
                timestamp=str(doc.get("created_at")),
                component="installation",
                klass="alert.digest",
                details={"digest": d, "alerts": [a.get("fingerprint") for a in alerts]},
                links=[],
            )
        ]
    out = []
    for a in doc.get("alerts") or []:
        annotations = a.get("annotations") or {}
        labels = a.get("labels") or {}
        out.append(
            _pd_event(
                routing_key,
                "resolve" if a["state"] == "resolved" else "trigger",
                str(a["fingerprint"]),
                summary=str(annotations.get("summary") or a["rule"]),
                source=source,
                severity=_PD_SEVERITY.get(str(a.get("severity")), "info"),
                timestamp=str(a["starts_at"]),
                component=str(labels.get("deployment_id") or "installation"),
                klass=str(a["rule"]),
                details={"labels": labels, "annotations": annotations, "value": a.get("value")},
                links=_pd_links(a, "The alert in kvwatch"),
            )
        )
    return out


def _pd_event(
    routing_key: str,
    action: str,
    dedup_key: str,
    *,
    summary: str,
    source: str,
    severity: str,
    timestamp: str,
    component: str,
    klass: str,
    details: dict[str, Any],
    links: list[dict[str, str]],
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": action,
        "dedup_key": dedup_key,
    }
    if action == "trigger":  # acknowledge and resolve take the key alone
        event["payload"] = {
            "summary": summary[:1024],  # the API's limit
            "source": source,
            "severity": severity,
            "timestamp": timestamp,
            "component": component,
            "group": component,
            "class": klass,
            "custom_details": details,
        }
        event["links"] = links
        event["client"] = "kvwatch"
    return event


def _pd_links(item: dict[str, Any], text: str) -> list[dict[str, str]]:
    links = [{"href": str(item["url"]), "text": text}] if item.get("url") else []
    if item.get("runbook_url"):
        links.append({"href": str(item["runbook_url"]), "text": "Runbook"})
    return links


def render(
    endpoint_kind: str,
    endpoint_format: str,
    doc: dict[str, Any],
    *,
    receiver_name: str,
    external_url: str,
    now: float | None = None,
) -> bytes:
    """The body to POST to an endpoint of this kind and format.

    ``now`` only matters for the Alertmanager API (``kind="alertmanager"``): a firing alert
    delivered late still gets a full horizon ahead of the send time. Webhook bodies never
    depend on it, so their retries stay byte-identical.
    """
    if endpoint_kind == "alertmanager":
        return encode(am_postable_alerts(doc, external_url=external_url, now=now))
    if endpoint_kind != "webhook":
        raise ValueError(f"unknown endpoint kind {endpoint_kind!r}")
    if endpoint_format == "kvwatch":
        return encode({**doc, "version": KVWATCH_VERSION})
    if endpoint_format == "alertmanager":
        return encode(am_webhook_v4(doc, receiver_name=receiver_name, external_url=external_url))
    raise ValueError(f"unknown endpoint format {endpoint_format!r}")


def am_webhook_v4(doc: dict[str, Any], *, receiver_name: str, external_url: str) -> dict[str, Any]:
    """Alertmanager's webhook body (``version: "4"``), field for field."""
    alerts = _alerts(doc, external_url)
    group_labels = _group_labels(doc)
    return {
        "version": AM_WEBHOOK_VERSION,
        "groupKey": doc.get("group_key") or label_string(group_labels),
        # a digest lists at most DIGEST_ALERTS alerts: the rest, as Alertmanager counts them
        "truncatedAlerts": int((doc.get("digest") or {}).get("alerts_omitted", 0)),
        # As Alertmanager does: the group fires while any of its alerts does.
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "receiver": receiver_name,
        "groupLabels": group_labels,
        "commonLabels": _common([a["labels"] for a in alerts]),
        "commonAnnotations": _common([a["annotations"] for a in alerts]),
        "externalURL": external_url,
        "alerts": [
            {
                "status": a["status"],
                "labels": a["labels"],
                "annotations": a["annotations"],
                "startsAt": a["startsAt"],
                "endsAt": a["endsAt"] or AM_ZERO_TIME,
                "generatorURL": a["generatorURL"],
                "fingerprint": a["fingerprint"],
            }
            for a in alerts
        ],
    }


def am_postable_alerts(
    doc: dict[str, Any], *, external_url: str, now: float | None = None
) -> list[dict[str, Any]]:
    """The body of ``POST /api/v2/alerts``: firing alerts end a horizon ahead, resolved
    alerts at their ``ends_at`` (in the past, which is how Alertmanager learns they ended)."""
    base = parse_iso(doc["created_at"])
    if now is not None:
        base = max(base, datetime.fromtimestamp(now, UTC))
    horizon = iso(base + timedelta(seconds=AM_FIRING_HORIZON_S))
    out = []
    for a in _alerts(doc, external_url):
        alert: dict[str, Any] = {
            "labels": a["labels"],
            "annotations": a["annotations"],
            "startsAt": a["startsAt"],
            "endsAt": a["endsAt"] if a["status"] == "resolved" and a["endsAt"] else horizon,
        }
        if a["generatorURL"]:
            alert["generatorURL"] = a["generatorURL"]  # the API wants a URI or nothing
        out.append(alert)
    return out


def am_fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager's fingerprint of a label set (Prometheus ``LabelSet.Fingerprint``: FNV-1a
    64 over the sorted names and values, each followed by a 0xff byte), as 16 hex digits. An
    incident alert has no kvwatch fingerprint; this one matches what Alertmanager shows."""
    h = 0xCBF29CE484222325
    for name in sorted(labels):
        for part in (name, labels[name]):
            for byte in part.encode() + b"\xff":
                h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# ---------------------------------------------------------------------------- helpers


def _alerts(doc: dict[str, Any], external_url: str) -> list[dict[str, Any]]:
    """The document's alerts in Alertmanager's terms (``endsAt`` None while not ended).

    A notice about an incident is the incident's own alert (``alertname=KvwatchIncident``):
    its linked alerts reach Alertmanager through their own notifications, and the incident,
    with its deadline, would otherwise never be seen there. Fingerprints are Alertmanager's
    own (kvwatch's 32-hex alert hash stays in kvwatch's format)."""
    base = external_url.rstrip("/")
    inc = doc.get("incident")
    if inc:
        return [_incident_alert(inc, doc.get("alerts") or [], base)]
    return [
        {
            "status": "resolved" if a["state"] == "resolved" else "firing",
            "labels": (labels := {str(k): str(v) for k, v in a["labels"].items()}),
            "annotations": _with_links(a.get("annotations", {}), a),
            "startsAt": a["starts_at"],
            "endsAt": a.get("ends_at"),
            "generatorURL": _link(a, f"{base}/v1/alerts/{a['id']}" if base else ""),
            "fingerprint": am_fingerprint(labels),
        }
        for a in doc.get("alerts") or []
    ]


def _link(item: dict[str, Any], api_url: str) -> str:
    """Where a person opens it: the dashboard's page when the document names one (a
    ``KVWATCH_DASHBOARD_URL`` was set), else the API's (token-protected) resource."""
    return str(item.get("url") or api_url)


def _with_links(annotations: dict[str, Any], item: dict[str, Any]) -> dict[str, str]:
    out = {str(k): str(v) for k, v in annotations.items()}
    # Prometheus's conventional annotation: Alertmanager's templates and pagers show it.
    if item.get("runbook_url"):
        out.setdefault("runbook_url", str(item["runbook_url"]))
    return out


def _incident_alert(inc: dict[str, Any], alerts: list[dict[str, Any]], base: str) -> dict[str, Any]:
    labels = incident_labels(inc)
    tenants = {
        str(a["labels"][k])
        for a in alerts
        for k in ("reader_tenant", "previous_tenant")
        if a.get("labels", {}).get(k) not in (None, "none", "unknown")
    }
    annotations = {
        "summary": inc["title"],
        "cause_rule": inc["cause_rule"],
        "awareness_at": inc["awareness_at"],
        "deadline_at": inc["deadline_at"],
        "affected_tenants": str(len(tenants)),
    }
    optional = ("remind_before_s", "closed_by", "close_reason", "acked_by", "owner")
    annotations.update({k: str(inc[k]) for k in optional if inc.get(k) is not None})
    annotations = _with_links(annotations, inc)
    closed = inc["state"] == "closed"
    return {
        "status": "resolved" if closed else "firing",
        "labels": labels,
        "annotations": annotations,
        "startsAt": inc["opened_at"],
        "endsAt": inc.get("closed_at") if closed else None,
        "generatorURL": _link(inc, f"{base}/v1/incidents/{inc['id']}" if base else ""),
        "fingerprint": am_fingerprint(labels),
    }


def incident_labels(inc: dict[str, Any]) -> dict[str, str]:
    """The incident's identity as a receiver sees it: with the installation's name
    (``kvwatch_instance``) when the document carries one, so incident #1 of two
    installations are two alerts, and closing one resolves only it."""
    labels = {
        "alertname": INCIDENT_ALERTNAME,
        "deployment_id": str(inc["deployment_id"]),
        "severity": "critical",
        "incident_id": str(inc["id"]),
    }
    if inc.get("instance"):
        labels["kvwatch_instance"] = str(inc["instance"])
    return labels


def _group_labels(doc: dict[str, Any]) -> dict[str, str]:
    if not doc.get("incident"):
        return {str(k): str(v) for k, v in (doc.get("group_labels") or {}).items()}
    labels = incident_labels(doc["incident"])
    return {k: labels[k] for k in ("alertname", "deployment_id", "kvwatch_instance") if k in labels}


def label_string(labels: dict[str, str]) -> str:
    # The shape of the document's group_key: {name="value",...}, names sorted, Go-quoted.
    pairs = (f"{k}={json.dumps(labels[k], ensure_ascii=False)}" for k in sorted(labels))
    return "{" + ",".join(pairs) + "}"


def _common(maps: list[dict[str, str]]) -> dict[str, str]:
    """The pairs every map shares (Alertmanager's commonLabels / commonAnnotations)."""
    if not maps:
        return {}
    first, *rest = maps
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in rest)}
