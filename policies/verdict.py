"""The verdict on one model of one deployment, in words a person can act on: the one
wording the limits card, the fleet, the alert and the gateway share.

- ``unsafe``: the latest verification found a cross-tenant leak;
- ``failed``: it found the endpoint unsafe otherwise (an acceptance above an earlier
  rejection, a 5xx, partial text);
- ``verified``: a passing verification is in force (``stale`` when the engine settings
  changed since it);
- ``not_verified``: nothing has passed (the latest run may have been unable to reach a
  verdict: that is said too).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from policies.facts import VerificationFact

Status = Literal["unsafe", "failed", "verified", "stale", "not_verified"]


def _day(at: datetime) -> str:
    return at.strftime("%Y-%m-%d")


def _n(tokens: int) -> str:
    return f"{tokens:,}"


@dataclass(frozen=True, slots=True)
class Verdict:
    status: Status
    text: str
    verification_id: int | None = None

    @property
    def failing(self) -> bool:
        return self.status in ("unsafe", "failed")


def failure_text(v: VerificationFact) -> str:
    """What a failed verification found: ``UNSAFE: cross-tenant leak at ≥ N tokens on DATE,
    verification ID`` or ``FAILED: …``."""
    ref = f"on {_day(v.verified_at)}, verification {v.verification_id}"
    if v.leaks or v.leak_pairs:
        at = (
            f" at ≥ {_n(v.smallest_leaking_prompt)} tokens"
            if v.smallest_leaking_prompt is not None
            else ""
        )
        return f"UNSAFE: cross-tenant leak{at} {ref}"
    kinds = ", ".join(k.replace("_", " ") for k in sorted(v.findings_by_kind))
    if not kinds:
        return f"FAILED {ref} (no findings recorded)"
    return f"FAILED: {kinds} {ref}"


def verdict(
    latest: VerificationFact | None, passing: VerificationFact | None, *, stale: bool = False
) -> Verdict:
    """``latest``: the latest verification of any result; ``passing``: the latest passing
    one; ``stale``: the engine settings changed since ``passing``."""
    if latest is not None and latest.verdict == "fail":
        kind: Status = "unsafe" if latest.leaks or latest.leak_pairs else "failed"
        return Verdict(kind, failure_text(latest), latest.verification_id)
    if passing is not None and passing.verified_safe_context is not None:
        text = (
            f"verified safe context {_n(passing.verified_safe_context)} tokens "
            f"on {_day(passing.verified_at)}, verification {passing.verification_id}"
        )
        if stale:
            return Verdict("stale", f"STALE: {text}; the engine settings changed since")
        if latest is not None and latest.verdict == "error":
            text += (
                f" (a later run could not reach a verdict: verification {latest.verification_id})"
            )
        return Verdict("verified", text, passing.verification_id)
    if latest is not None and latest.verdict == "error":
        return Verdict(
            "not_verified",
            f"not verified: the latest run could not reach a verdict "
            f"(verification {latest.verification_id}, {_day(latest.verified_at)})",
            latest.verification_id,
        )
    return Verdict("not_verified", "not verified")


_SOURCE_WORDS = {
    "verified": "verified safe context",
    "configured": "configured safe context",
    "pool": "not verified: min(advertised context, prefill pool)",
    "failed-verification": "held by a failed verification",
}


def limit_text(
    tokens: int | None,
    source: str,
    verified_safe_context: int | None,
    verified_at: datetime | None,
    verification_id: int | None,
    stale: str | None,
) -> str:
    """The limit in force in words (``policies.limits.LimitInForce.text``), the same in the
    rule's alert, the limits card, the fleet, the reports, the dashboard and the gateway's
    log: ``8,000 tokens (verified safe context on DATE, verification ID)``, ``4,096 tokens
    (not verified: min(advertised context, prefill pool); STALE: …)``, ``every prompt
    refused (held by a failed verification)``, ``no limit known``."""
    if tokens is None:
        return "no limit known (no node reports its pool and nothing passed verification)"
    head = "every prompt refused" if tokens == 0 else f"{_n(tokens)} tokens"
    why = _SOURCE_WORDS.get(source, source)
    if source == "verified" and verified_at is not None:
        why += f" on {_day(verified_at)}, verification {verification_id}"
    if stale:
        ref = (
            f"verified safe context {_n(verified_safe_context)} tokens on "
            f"{_day(verified_at)}, verification {verification_id}"
            if verified_safe_context is not None and verified_at is not None
            else "the verification"
        )
        why += f"; STALE: {ref}: {stale}"
    return f"{head} ({why})"
