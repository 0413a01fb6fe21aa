"""Alerts, incidents, silences and verifications as JSON documents: the API's shape and the
notification contract's (see ``collector.notify``)."""

from __future__ import annotations

import json
from typing import Any

from collector.deployment_facts import verification_fact
from collector.notify.payloads import label_string
from collector.timefmt import as_micros, iso
from policies.verdict import verdict


def alert_doc(r: Any, *, silenced: bool = False) -> dict[str, Any]:
    return {
        "id": r.id,
        "fingerprint": r.fingerprint,
        "rule": r.rule,
        "kind": r.kind,
        "severity": r.severity,
        "state": r.state,
        "mode": r.mode,
        "deployment_id": r.deployment_id,
        "labels": json.loads(r.labels),
        "annotations": json.loads(r.annotations),
        "value": r.value,
        "occurrences": r.occurrences,
        "starts_at": iso(r.active_since),
        "fired_at": iso(r.fired_at),
        "ends_at": iso(r.resolved_at) if r.state == "resolved" else None,
        "last_seen_at": iso(r.last_seen_at),
        "acked": r.acked_at is not None,
        "acked_by": r.acked_by,
        "acked_at": iso(r.acked_at),
        "ack_comment": r.ack_comment,
        "incident_id": r.incident_id,
        "silenced": silenced,
    }


def notification_alert(doc: dict[str, Any]) -> dict[str, Any]:
    """The contract's AlertDoc: the fields a receiver gets."""
    keys = (
        "id",
        "fingerprint",
        "rule",
        "kind",
        "severity",
        "state",
        "labels",
        "annotations",
        "value",
        "occurrences",
        "starts_at",
        "ends_at",
        "acked",
    )
    return {k: doc[k] for k in keys}


def incident_doc(r: Any, remind_before_s: int | None = None) -> dict[str, Any]:
    return {
        "id": r.id,
        "deployment_id": r.deployment_id,
        "title": r.title,
        "state": r.state,
        "cause_rule": r.cause_rule,
        "first_alert_id": r.first_alert_id,
        "opened_at": iso(r.opened_at),
        "awareness_at": iso(r.awareness_at),
        "deadline_at": iso(r.deadline_at),
        "reminders_sent": json.loads(r.reminders_sent),
        "remind_before_s": remind_before_s,
        "closed_at": iso(r.closed_at),
        "closed_by": r.closed_by,
        "close_reason": r.close_reason,
        "acked_at": iso(r.acked_at),
        "acked_by": r.acked_by,
        "owner": r.owner,
    }


def group_key(labels: dict[str, str], group_by: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """Alertmanager's way of naming a group: ``{a="x",b="y"}`` over the group-by labels."""
    chosen = {k: labels.get(k, "") for k in group_by}
    return label_string(chosen), chosen


def verification_run_doc(r: Any) -> dict[str, Any]:
    return {
        "id": r.id,
        "deployment_id": r.deployment_id,
        "tenants": json.loads(r.tenants),
        "started_at": iso(r.started_at),
        "ends_at": iso(r.ends_at),
        "finished_at": iso(r.finished_at),
        "verification_id": r.verification_id,
    }


def verification_doc(v: Any, *, evidence: bool = True) -> dict[str, Any]:
    """``result``: pass, fail (found unsafe) or error (no verdict); ``verdict``: the limits
    card's words for this record alone. Without ``evidence`` it is the summary lists give:
    the evidence (which names tenants and can be large) stays on the record's own path, and
    the one figure a gateway needs from it, the shortest leaking prompt, comes up front."""
    fact = verification_fact(v, None)
    if not evidence:
        return {
            **_verification_fields(v, fact),
            "smallest_leaking_prompt_tokens": fact.smallest_leaking_prompt,
            "evidence_bytes": len(v.evidence.encode()),
            "links": {"self": f"/v1/verifications/{v.id}"},
        }
    return {
        **_verification_fields(v, fact),
        "smallest_leaking_prompt_tokens": fact.smallest_leaking_prompt,
        "evidence": json.loads(v.evidence),
    }


def _verification_fields(v: Any, fact: Any) -> dict[str, Any]:
    return {
        "id": v.id,
        "deployment_id": v.deployment_id,
        "model_id": v.model_id,
        "passed": bool(v.passed),
        "result": fact.verdict,
        "verdict": verdict(fact, fact if fact.passed else None).text,
        "verified_safe_context": v.verified_safe_context,
        "engine_version": v.engine_version,
        "pool_capacity_tokens": v.pool_capacity_tokens,
        "quantization": v.quantization,
        "tp_size": v.tp_size,
        "cuda_graphs": v.cuda_graphs,
        "verified_at": iso(v.verified_at),
        "created_at": iso(v.created_at),
        "created_by": v.created_by,
    }


def silence_doc(s: Any, now_us: int) -> dict[str, Any]:
    """A silence; its ``ends_at`` is when it stops (or stopped) holding notifications back:
    for one expired before its end, the moment it was expired (``expired_at``), as
    Alertmanager does, not the end it was created with."""
    ends_us = as_micros(s.ends_at)
    expired_us = as_micros(s.expired_at)
    active = expired_us is None and as_micros(s.starts_at) <= now_us < ends_us
    return {
        "id": s.id,
        "matchers": json.loads(s.matchers),
        "starts_at": iso(s.starts_at),
        "ends_at": iso(ends_us if expired_us is None else min(ends_us, expired_us)),
        "created_by": s.created_by,
        "comment": s.comment,
        "created_at": iso(s.created_at),
        "expired_at": iso(s.expired_at),
        "active": active,
    }
