"""Sending the result to the collector: ``POST {collector}/v1/verifications``.

Only what a sweep can know is sent (deployment, model, verdict, safe context, evidence); the
collector ties the record to the deployment's current engine config (engine version, pool,
quantization, TP, CUDA graphs) and clamps the safe context to the prefill pool itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from collector.timefmt import iso
from engine_probe.settings import ProducerSettings
from kvwatch.verify.report import Report

# kvwatch verify reads exactly what every producer reads.
VerifierSettings = ProducerSettings


@dataclass(frozen=True)
class UploadResult:
    ok: bool
    detail: str
    record: dict[str, Any] | None = None


def verification_body(report: Report, deployment_id: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "deployment_id": deployment_id,
        "model_id": report.model,
        # the context verdict; the prefix-cache verdict travels in the evidence
        "passed": report.context_passed,
        "evidence": report.evidence(),
    }
    if report.finished_at is not None:
        body["verified_at"] = iso(report.finished_at)
    safe = report.verified_safe_context
    if safe is not None:
        body["verified_safe_context"] = safe
    return body


def upload(report: Report, settings: VerifierSettings, *, timeout_s: float = 30.0) -> UploadResult:
    """POST the verification; never raises for what the network or the collector does."""
    if settings.collector_url is None:
        return UploadResult(False, "KVWATCH_COLLECTOR_URL is not set")
    url = f"{settings.collector_url}/v1/verifications"
    headers = {"Authorization": f"Bearer {settings.ingest_token or ''}"}
    try:
        r = httpx.post(
            url,
            json=verification_body(report, settings.deployment_id),
            headers=headers,
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        return UploadResult(False, f"{url}: {exc or type(exc).__name__}")
    if r.status_code != 201:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        return UploadResult(False, f"{url} answered {r.status_code}: {message}")
    try:
        record: Any = r.json()
    except ValueError:  # not JSON, or not text at all
        record = None
    if not isinstance(record, dict):
        kind = r.headers.get("content-type") or "no content type"
        return UploadResult(
            False,
            f"{url} answered 201 with a body that is not a JSON object "
            f"({len(r.content)} bytes of {kind}): the verification may or may not be recorded",
        )
    return UploadResult(True, f"verification {record.get('id')} recorded at {url}", record)
