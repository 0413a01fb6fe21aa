"""``kvwatch verify``: establish an OpenAI-compatible endpoint's verified safe context.

A bounded number of requests of synthetic text only: prompts grow geometrically to the
rejection point and are bisected there; every refusal must be clean (a 4xx in OpenAI's
error shape, no completion text); then each tenant plants random canaries while the others
send prompts near and over the limit under background load, and any canary in another
tenant's answer is a leak. docs/verify.md shows it used.

Modules: ``canaries`` (prompt text, canaries, leak matcher), ``client`` (HTTP and outcome
classification), ``session`` (budget, records, findings, calibration), ``sweep`` (growth
and bisection), ``crosstenant`` (the canary phase), ``report`` (JSON, evidence, summary),
``upload`` (the collector), ``run`` (one verification end to end).
"""

from kvwatch.verify.report import Report
from kvwatch.verify.run import DEFAULT_BUDGET, VerifyOptions, minimum_budget, verify
from kvwatch.verify.session import Progress
from kvwatch.verify.upload import UploadResult, VerifierSettings, upload

__all__ = [
    "DEFAULT_BUDGET",
    "Progress",
    "Report",
    "UploadResult",
    "VerifierSettings",
    "VerifyOptions",
    "minimum_budget",
    "upload",
    "verify",
]
