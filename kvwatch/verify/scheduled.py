"""The verifier the collector's scheduled verifications run (``create_app(settings,
verifier=run_scheduled)``, wired by ``kvwatch serve``): the same run as ``kvwatch verify``,
with the schedule's budget and timeout, and the same record as its upload, checked by the
same schema the ``POST /v1/verifications`` route applies."""

from __future__ import annotations

from pydantic import ValidationError

from collector.api.alerts import VerificationIn
from collector.verify_schedules import RunOutcome, ScheduledRun
from kvwatch.verify.run import VerifyOptions, verify
from kvwatch.verify.upload import verification_body


def run_scheduled(run: ScheduledRun, keys: dict[str, str]) -> RunOutcome:
    options = VerifyOptions(
        endpoint=run.endpoint,
        model=run.model_id,
        tenant_keys=keys,
        max_context=run.max_context,
        budget=run.budget,
        timeout_s=run.timeout_s,
    )
    try:
        report = verify(options)
    except ValueError as exc:
        return RunOutcome(None, f"bad schedule: {exc}")
    if report.result == "error":
        # kvwatch verify uploads nothing when it reached no verdict; neither does this
        return RunOutcome(None, report.error or "the run reached no verdict")
    try:
        body = VerificationIn.model_validate(verification_body(report, run.deployment_id))
    except ValidationError as exc:
        return RunOutcome(None, f"the result does not fit a verification record: {exc}")
    values = body.model_dump()
    values["verified_at"] = report.finished_at
    return RunOutcome(values)
