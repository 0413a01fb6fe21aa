"""One verification run's shared state: the request budget, every probe's record, the
findings and leaks, and the bytes -> tokens calibration.

:meth:`Session.probe` is the one way a request is sent: it takes a unit of budget, sends,
checks the answer for other tenants' canaries, records it, and turns what it means into a
finding where it is one. It is thread-safe (the cross-tenant phase calls it from several
threads at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvwatch.errors import KvwatchError
from kvwatch.verify.canaries import LeakMatcher, TenantText
from kvwatch.verify.client import (
    EndpointClient,
    Outcome,
    Reply,
    prompt_tokens_in_message,
)

Phase = Literal["preflight", "sweep", "plant", "read", "background", "prefix"]
TokensSource = Literal["usage", "error_message", "estimate"]

#: A 429 is retried this many times (each try takes budget), then the run gives up.
MAX_THROTTLE_RETRIES: Final = 3
MAX_RETRY_WAIT_S: Final = 30.0

# Outcomes that are findings whenever they happen after the preflight.
_FINDING_KINDS: Final = {
    Outcome.UNCLEAN_REJECTION,
    Outcome.SERVER_ERROR,
    Outcome.TIMEOUT,
    Outcome.TRANSPORT_ERROR,
    Outcome.MALFORMED,
    Outcome.UNREACHABLE,
}


# The verifier's errors end a run early; verify() records each as the report's error.


class CouldNotRun(KvwatchError):
    """The verification cannot be carried out (unreachable, key refused, rate limited)."""


class EndpointGone(KvwatchError):
    """The endpoint stopped accepting connections mid-run (recorded as a finding)."""


class BudgetExhausted(KvwatchError):
    """Every request of the budget has been sent."""


@dataclass
class ProbeRecord:
    """One request as the report shows it (never its text)."""

    seq: int
    phase: Phase
    tenant: str
    prompt_bytes: int
    max_tokens: int
    outcome: Outcome
    status: int | None
    prompt_tokens: int | None
    tokens_source: TokensSource | None
    completion_tokens: int | None
    completion_chars: int
    error_code: str | None
    error_message: str | None
    detail: str | None
    request_id: str | None
    started_s: float
    elapsed_s: float
    #: the prompt tokens the endpoint says a prefix cache served (usage.prompt_tokens_details)
    cached_tokens: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "phase": self.phase,
            "tenant": self.tenant,
            "prompt_bytes": self.prompt_bytes,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_source": self.tokens_source,
            "max_tokens": self.max_tokens,
            "outcome": self.outcome.value,
            "status": self.status,
            "error_code": self.error_code,
            "error_message": self.error_message,
            "detail": self.detail,
            "completion_tokens": self.completion_tokens,
            "completion_chars": self.completion_chars,
            "request_id": self.request_id,
            "started_s": round(self.started_s, 4),
            "elapsed_s": round(self.elapsed_s, 4),
            "cached_tokens": self.cached_tokens,
        }


@dataclass(frozen=True)
class Finding:
    kind: str
    detail: str
    phase: Phase
    tenant: str
    prompt_bytes: int
    prompt_tokens: int | None
    status: int | None
    request_id: str | None
    probe: int

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "detail": self.detail,
            "phase": self.phase,
            "tenant": self.tenant,
            "prompt_bytes": self.prompt_bytes,
            "prompt_tokens": self.prompt_tokens,
            "status": self.status,
            "request_id": self.request_id,
            "probe": self.probe,
        }


@dataclass(frozen=True)
class Leak:
    canary: str
    fragment: str
    owner: str
    reader: str
    reader_prompt_tokens: int | None
    reader_prompt_bytes: int
    phase: Phase
    status: int | None
    request_id: str | None
    probe: int

    def to_json(self) -> dict[str, object]:
        return {
            "canary": self.canary,
            "fragment": self.fragment,
            "owner": self.owner,
            "reader": self.reader,
            "reader_prompt_tokens": self.reader_prompt_tokens,
            "reader_prompt_bytes": self.reader_prompt_bytes,
            "phase": self.phase,
            "status": self.status,
            "request_id": self.request_id,
            "probe": self.probe,
        }


class Calibration:
    """Prompt tokens as the endpoint counts them, from the bytes sent: a least-squares line
    ``tokens = a * bytes + b`` over every accepted answer's ``usage.prompt_tokens`` (``b`` is
    the chat template's overhead). Exact for refengine (byte-level: ``a`` = 1)."""

    def __init__(self) -> None:
        self._points: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, n_bytes: int, tokens: int) -> None:
        with self._lock:
            self._points[n_bytes] = tokens

    @property
    def points(self) -> int:
        return len(self._points)

    def fit(self) -> tuple[float, float]:
        with self._lock:
            pts = list(self._points.items())
        if not pts:
            return 1.0, 0.0
        if len(pts) == 1:
            (x, y) = pts[0]
            return max(y / x, 1e-6), 0.0
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        sxy = sum((x - mx) * (y - my) for x, y in pts)
        a = sxy / sxx if sxx else my / mx
        if a <= 0:
            a = max(my / mx, 1e-6)
        return a, my - a * mx

    def tokens(self, n_bytes: int) -> int:
        with self._lock:
            exact = self._points.get(n_bytes)
        if exact is not None:
            return exact
        a, b = self.fit()
        return max(1, round(a * n_bytes + b))

    def bytes_for(self, tokens: float) -> int:
        """The most bytes whose estimated token count does not exceed ``tokens`` (>= 1)."""
        a, b = self.fit()
        return max(1, int((tokens - b) / a + 1e-9))


@dataclass
class Progress:
    sent: int
    budget: int
    phase: Phase
    tenant: str
    prompt_tokens: int | None
    outcome: Outcome


class Session:
    def __init__(
        self,
        client: EndpointClient,
        texts: dict[str, TenantText],
        matcher: LeakMatcher,
        budget: int,
        on_progress: Callable[[Progress], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.client = client
        self.texts = texts
        self.matcher = matcher
        self.budget = budget
        self.calibration = Calibration()
        self.records: list[ProbeRecord] = []
        self.findings: list[Finding] = []
        self.leaks: list[Leak] = []
        #: Smallest prompt (bytes) refused during the preflight or the sweep.
        self.min_rejected_bytes: int | None = None
        self._sent = 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._on_progress = on_progress
        self._sleep = sleep

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def remaining(self) -> int:
        return self.budget - self._sent

    def _take(self) -> None:
        with self._lock:
            if self._sent >= self.budget:
                raise BudgetExhausted(f"all {self.budget} requests of the budget were sent")
            self._sent += 1

    def probe(
        self,
        tenant: str,
        n_bytes: int,
        max_tokens: int,
        phase: Phase,
        *,
        text: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ProbeRecord:
        """Send ``n_bytes`` of ``tenant``'s text (or ``text``, with more body fields
        ``extra``); record it. Raises ``CouldNotRun`` (key refused, rate limited past the
        retries), ``EndpointGone`` (unreachable after the preflight; recorded as a finding
        first) or ``BudgetExhausted``."""
        if text is None:
            text = self.texts[tenant].text(n_bytes)
        attempt = 0
        while True:
            self._take()
            started = time.monotonic() - self._t0
            reply = self.client.send(tenant, text, max_tokens, extra)
            if reply.outcome is not Outcome.THROTTLED or attempt >= MAX_THROTTLE_RETRIES:
                break
            record = self._record(tenant, n_bytes, max_tokens, phase, reply, started)
            attempt += 1
            wait = reply.retry_after_s if reply.retry_after_s is not None else 2.0**attempt
            self._sleep(min(wait, MAX_RETRY_WAIT_S))
        record = self._record(tenant, n_bytes, max_tokens, phase, reply, started)
        self._check_leaks(record, reply)
        if reply.outcome is Outcome.AUTH_REFUSED:
            raise CouldNotRun(f"the endpoint refused tenant {tenant!r}'s key ({reply.error_line})")
        if reply.outcome is Outcome.THROTTLED:
            raise CouldNotRun(
                f"rate limited: {MAX_THROTTLE_RETRIES + 1} tries of a {n_bytes}-byte prompt "
                f"were all answered 429 ({reply.error_line})"
            )
        if phase == "preflight":
            return record  # the caller decides: nothing is verified yet, so no findings
        self._judge(record, reply)
        if reply.outcome is Outcome.UNREACHABLE:
            raise EndpointGone(reply.detail or "unreachable")
        return record

    def _record(
        self,
        tenant: str,
        n_bytes: int,
        max_tokens: int,
        phase: Phase,
        reply: Reply,
        started: float,
    ) -> ProbeRecord:
        tokens: int | None = reply.prompt_tokens
        source: TokensSource | None = "usage" if tokens is not None else None
        if reply.outcome is Outcome.ACCEPTED and tokens is not None:
            self.calibration.add(n_bytes, tokens)
        if tokens is None:
            tokens = prompt_tokens_in_message(reply.error_message)
            source = "error_message" if tokens is not None else None
        if tokens is None and self.calibration.points:
            tokens, source = self.calibration.tokens(n_bytes), "estimate"
        message = reply.error_message
        record = ProbeRecord(
            seq=0,
            phase=phase,
            tenant=tenant,
            prompt_bytes=n_bytes,
            max_tokens=max_tokens,
            outcome=reply.outcome,
            status=reply.status,
            prompt_tokens=tokens,
            tokens_source=source,
            completion_tokens=reply.completion_tokens,
            completion_chars=len(reply.text) if reply.outcome is Outcome.ACCEPTED else 0,
            error_code=reply.error_code,
            error_message=message[:500] if message else None,
            detail=reply.detail[:500] if reply.detail else None,
            request_id=reply.request_id,
            started_s=started,
            elapsed_s=reply.elapsed_s,
            cached_tokens=reply.cached_tokens,
        )
        with self._lock:
            record.seq = len(self.records) + 1
            self.records.append(record)
            sent = self._sent
        if self._on_progress is not None:
            self._on_progress(Progress(sent, self.budget, phase, tenant, tokens, reply.outcome))
        return record

    def _check_leaks(self, record: ProbeRecord, reply: Reply) -> None:
        seen = "\n".join(t for t in (reply.text, reply.error_message, reply.detail) if t)
        matches = self.matcher.find(record.tenant, seen)
        if not matches:
            return
        with self._lock:
            for m in matches:
                self.leaks.append(
                    Leak(
                        canary=m.canary,
                        fragment=m.fragment,
                        owner=m.owner,
                        reader=record.tenant,
                        reader_prompt_tokens=record.prompt_tokens,
                        reader_prompt_bytes=record.prompt_bytes,
                        phase=record.phase,
                        status=record.status,
                        request_id=record.request_id,
                        probe=record.seq,
                    )
                )

    def _judge(self, record: ProbeRecord, reply: Reply) -> None:
        outcome = reply.outcome
        refused = outcome in (Outcome.REJECTED, Outcome.UNCLEAN_REJECTION)
        if refused and record.phase == "sweep":
            with self._lock:
                if self.min_rejected_bytes is None or record.prompt_bytes < self.min_rejected_bytes:
                    self.min_rejected_bytes = record.prompt_bytes
        kind: str | None = None
        detail = reply.detail or reply.error_line
        if outcome in _FINDING_KINDS:
            kind = outcome.value
            if outcome is Outcome.TIMEOUT:
                detail = f"no answer within the timeout ({detail})"
        elif outcome is Outcome.ACCEPTED:
            rejected = self.min_rejected_bytes
            if rejected is not None and record.prompt_bytes >= rejected:
                kind = "accepted_above_rejection"
                detail = (
                    f"a {record.prompt_bytes}-byte prompt was answered {reply.status} although "
                    f"a {rejected}-byte prompt had been refused"
                )
        if kind is None:
            return
        with self._lock:
            self.findings.append(
                Finding(
                    kind=kind,
                    detail=detail,
                    phase=record.phase,
                    tenant=record.tenant,
                    prompt_bytes=record.prompt_bytes,
                    prompt_tokens=record.prompt_tokens,
                    status=record.status,
                    request_id=record.request_id,
                    probe=record.seq,
                )
            )

    def finalize(self) -> None:
        """Re-estimate the token counts of answers that did not state theirs, with the
        calibration as it stands at the end."""
        if not self.calibration.points:
            return
        for r in self.records:
            if r.tokens_source == "estimate":
                r.prompt_tokens = self.calibration.tokens(r.prompt_bytes)
