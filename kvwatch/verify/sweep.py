"""The length sweep: grow the prompt geometrically until the endpoint refuses it (or
``--max-context``), then bisect to the largest accepted prompt and the rejection point.

The search runs over bytes of the tenant's synthetic text (prefix-stable, so tokens grow
with bytes) and reads tokens from the answers' ``usage.prompt_tokens``; targets given in
tokens go through the session's calibration. Bisection stops when the bracket is one byte
wide or the sweep's share of the budget is spent. A rejection message that states the limit
("maximum context length is N tokens") steers the first bisection probes to it; the bracket
logic does not trust it, so a wrong hint only costs a request.

Anything but an acceptance within ``--max-context`` closes the bracket from above: a
refusal (the rejection point), and equally a 5xx or a timeout (a finding; nothing above it
can be called verified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from kvwatch.verify.client import Outcome, limit_in_message
from kvwatch.verify.session import ProbeRecord, Session

START_TOKENS: Final = 64
GROWTH: Final = 2
#: Prompts are never longer than this (64 MiB): the sweep stops growing there.
MAX_PROMPT_BYTES: Final = 1 << 26
#: The sweep asks for one token: it measures admission, not generation.
SWEEP_MAX_TOKENS: Final = 1
HINT_PROBES: Final = 2

Ceiling = Literal["rejection", "failure", "max_context", "prompt_size_cap", "budget"]


@dataclass
class SweepResult:
    largest_accepted_bytes: int
    largest_accepted_tokens: int
    #: The smallest refused prompt (clean or not); None if nothing was refused.
    rejected: ProbeRecord | None
    #: Smallest bytes not accepted within --max-context (refusal, failure, or over it).
    upper_bytes: int | None
    reported_limit: int | None
    #: What stopped the growth.
    ceiling: Ceiling
    #: The bracket is closed (one byte wide) or growth stopped at a cap without a refusal.
    complete: bool

    @property
    def rejection_tokens(self) -> int | None:
        """Prompt tokens of the smallest refused prompt, never below largest accepted + 1."""
        if self.rejected is None:
            return None
        t = self.rejected.prompt_tokens
        floor = self.largest_accepted_tokens + 1
        return floor if t is None or t < floor else t


def run_sweep(
    session: Session,
    tenant: str,
    start: ProbeRecord,
    *,
    max_context: int | None,
    stop_at_sent: int,
) -> SweepResult:
    """Sweep with ``tenant``'s text from ``start`` (an accepted preflight); sends no request
    once ``session.sent`` reaches ``stop_at_sent``."""
    cal = session.calibration
    lo_b = start.prompt_bytes
    lo_t = start.prompt_tokens if start.prompt_tokens is not None else cal.tokens(lo_b)
    upper: ProbeRecord | None = None  # the smallest prompt not accepted within max_context
    rejected: ProbeRecord | None = None
    reported: int | None = None
    cap: Ceiling | None = None

    def room() -> bool:
        return session.sent < stop_at_sent

    def send(n: int) -> None:
        nonlocal lo_b, lo_t, upper, rejected, reported
        rec = session.probe(tenant, n, SWEEP_MAX_TOKENS, "sweep")
        tokens = rec.prompt_tokens if rec.prompt_tokens is not None else cal.tokens(n)
        ok = rec.outcome is Outcome.ACCEPTED and (max_context is None or tokens <= max_context)
        if ok:
            if n > lo_b:
                lo_b, lo_t = n, tokens
            return
        if upper is None or n < upper.prompt_bytes:
            upper = rec
        if rec.outcome in (Outcome.REJECTED, Outcome.UNCLEAN_REJECTION) and (
            rejected is None or n < rejected.prompt_bytes
        ):
            rejected = rec
            reported = limit_in_message(rec.error_message) or reported

    # Growth: double the tokens of the largest accepted prompt.
    while upper is None and cap is None and room():
        target = max(START_TOKENS, lo_t * GROWTH)
        at_cap: Ceiling | None = None
        if max_context is not None and target >= max_context:
            target, at_cap = max_context, "max_context"
        n = max(cal.bytes_for(target), lo_b + 1)
        if n >= MAX_PROMPT_BYTES:
            n, at_cap = MAX_PROMPT_BYTES, "prompt_size_cap"
        if n <= lo_b:
            cap = at_cap or "prompt_size_cap"
            break
        send(n)
        if upper is None and at_cap is not None:
            cap = at_cap

    # Bisection between the largest accepted and the smallest not accepted.
    hints = 0
    while upper is not None and upper.prompt_bytes - lo_b > 1 and room():
        hi_b = upper.prompt_bytes
        mid = (lo_b + hi_b) // 2
        if reported is not None and hints < HINT_PROBES:
            hints += 1
            guess = cal.bytes_for(reported)
            mid = lo_b + 1 if guess <= lo_b else hi_b - 1 if guess >= hi_b else guess
        send(mid)

    ceiling: Ceiling
    if upper is None:
        ceiling = cap or "budget"
    elif upper.outcome in (Outcome.REJECTED, Outcome.UNCLEAN_REJECTION):
        ceiling = "rejection"
    elif upper.outcome is Outcome.ACCEPTED:
        ceiling = "max_context"
    else:
        ceiling = "failure"
    complete = upper.prompt_bytes - lo_b <= 1 if upper is not None else cap is not None
    return SweepResult(
        largest_accepted_bytes=lo_b,
        largest_accepted_tokens=lo_t,
        rejected=rejected,
        upper_bytes=None if upper is None else upper.prompt_bytes,
        reported_limit=reported,
        ceiling=ceiling,
        complete=complete,
    )
