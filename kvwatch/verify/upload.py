"""Sending the result to the collector: ``POST {collector}/v1/verifications``.

Only what a sweep can know is sent (deployment, model, verdict, safe context, evidence); the
collector ties the record to the deployment's current engine config (engine version, pool,
quantization, TP, CUDA graphs) and clamps the safe context to the prefill pool itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import httpx

from collector.timefmt import iso
from engine_probe.settings import ProducerSettings
from kvwatch.verify.report import Report

# kvwatch verify reads exactly what every producer reads.
VerifierSettings = ProducerSettings
#: how long a run announces itself for: it ends sooner, when it is recorded
RUN_MAX_S = 900.0


@dataclass(frozen=True)
class UploadResult:
    ok: bool
    detail: str
    record: dict[str, Any] | None = None


def verification_body(
    report: Report, deployment_id: str, run_id: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "deployment_id": deployment_id,
        "model_id": report.model,
        # the context verdict; the prefix-cache verdict travels in the evidence
        "passed": report.context_passed,
        "evidence": report.evidence(),
    }
    if run_id is not None:
        body["run_id"] = run_id
    if report.finished_at is not None:
        body["verified_at"] = iso(report.finished_at)
    safe = report.verified_safe_context
    if safe is not None:
        body["verified_safe_context"] = safe
    return body


def announce(
    settings: VerifierSettings,
    tenants: list[str],
    *,
    max_duration_s: float = RUN_MAX_S,
    timeout_s: float = 30.0,
) -> tuple[int | None, str]:
    """Tell the collector a run is about to send prompts with these tenants' keys
    (``POST /v1/verification-runs``), so that their traffic on the deployment until the run
    is recorded counts as the run's own, never as the endpoint's: (its id, '') or (None, why
    not). Never raises: a run that could not announce itself still runs."""
    if settings.collector_url is None:
        return None, "KVWATCH_COLLECTOR_URL is not set"
    url = f"{settings.collector_url}/v1/verification-runs"
    body = {
        "deployment_id": settings.deployment_id,
        "tenants": tenants,
        "max_duration_s": max_duration_s,
    }
    try:
        r = httpx.post(
            url,
            json=body,
            headers={"Authorization": f"Bearer {settings.ingest_token or ''}"},
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        return None, f"{url}: {exc or type(exc).__name__}"
    try:
        doc: Any = r.json()
    except ValueError:
        doc = None
    if r.status_code != 201 or not isinstance(doc, dict) or not isinstance(doc.get("id"), int):
        return None, f"{url} answered {r.status_code}: {_message(r)}"
    return int(doc["id"]), ""


def end_run(settings: VerifierSettings, run_id: int, *, timeout_s: float = 30.0) -> None:
    """End an announced run that records nothing (no verdict, or its upload failed), so its
    tenants' traffic is evaluated again now rather than at the announced end. Best effort:
    that end bounds it either way."""
    url = f"{settings.collector_url}/v1/verification-runs/{run_id}/end"
    headers = {"Authorization": f"Bearer {settings.ingest_token or ''}"}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, headers=headers, timeout=timeout_s)


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def upload(
    report: Report,
    settings: VerifierSettings,
    *,
    run_id: int | None = None,
    timeout_s: float = 30.0,
) -> UploadResult:
    """POST the verification; never raises for what the network or the collector does."""
    if settings.collector_url is None:
        return UploadResult(False, "KVWATCH_COLLECTOR_URL is not set")
    url = f"{settings.collector_url}/v1/verifications"
    headers = {"Authorization": f"Bearer {settings.ingest_token or ''}"}
    try:
        r = httpx.post(
            url,
            json=verification_body(report, settings.deployment_id, run_id),
            headers=headers,
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        return UploadResult(False, f"{url}: {exc or type(exc).__name__}")
    if r.status_code != 201:
        return UploadResult(False, f"{url} answered {r.status_code}: {_message(r)}")
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
