"""Sending the result to the collector: ``POST {collector}/v1/verifications``.

Only what a sweep can know is sent (deployment, model, verdict, safe context, evidence); the
collector ties the record to the deployment's current engine config (engine version, pool,
quantization, TP, CUDA graphs) and clamps the safe context to the prefill pool itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine_probe.events import ID_MAX, is_valid_id
from engine_probe.verifier.report import Report


class VerifierSettings(BaseSettings):
    """``KVWATCH_COLLECTOR_URL``, ``KVWATCH_INGEST_TOKEN`` and ``KVWATCH_DEPLOYMENT_ID``: the
    names every producer reads (see ``engine_probe.settings``)."""

    model_config = SettingsConfigDict(env_prefix="KVWATCH_", extra="ignore", frozen=True)

    collector_url: str | None = None
    ingest_token: str | None = Field(default=None, repr=False)
    deployment_id: str = "default"

    @field_validator("collector_url", "ingest_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("collector_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().rstrip("/")
        scheme, sep, rest = value.partition("://")
        if not sep or scheme.lower() not in ("http", "https") or not rest or rest[0] == "/":
            raise ValueError(f"{value!r} must be an http:// or https:// URL")
        return value

    @field_validator("deployment_id")
    @classmethod
    def _check_deployment(cls, value: str) -> str:
        if not is_valid_id(value):
            raise ValueError(
                f"{value!r} is not a valid id: 1 to {ID_MAX} characters, starting with a "
                "letter or digit, then only letters, digits and ._:/@+=-"
            )
        return value


@dataclass(frozen=True)
class UploadResult:
    ok: bool
    detail: str
    record: dict[str, Any] | None = None


def verification_body(report: Report, deployment_id: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "deployment_id": deployment_id,
        "model_id": report.model,
        "passed": report.passed,
        "evidence": report.evidence(),
    }
    if report.finished_at is not None:
        body["verified_at"] = report.finished_at.isoformat()
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
