"""The verification's result: the JSON report, the evidence sent to the collector, and the
short human summary.

The report names tenants, never their keys; the endpoint without credentials; and never
the text of an answer (a leaking endpoint may return other people's data): only which
canary fragment was found where.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from collector.timefmt import iso
from kvwatch.verify.prefix import ALPHA, PrefixResult
from kvwatch.verify.session import Finding, Leak, ProbeRecord
from kvwatch.verify.sweep import SWEEP_MAX_TOKENS, SweepResult

Result = Literal["pass", "fail", "error"]
REPORT_VERSION = 1
_SHOWN = 5


@dataclass
class Report:
    endpoint: str
    model: str
    route: str
    tenants: list[str]
    canaries: dict[str, str]
    budget: int
    max_context: int | None
    canary_min_fragment: int
    timeout_s: float
    started_at: datetime
    finished_at: datetime | None = None
    requests: int = 0
    durations_s: dict[str, float] = field(default_factory=dict)
    sweep: SweepResult | None = None
    cross_tenant_checked: bool = False
    records: list[ProbeRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    calibration: tuple[float, float, int] | None = None
    error: str | None = None
    prefix_cache: PrefixResult | None = None
    prefix_cache_error: str | None = None

    # -- verdict ------------------------------------------------------------------------

    @property
    def result(self) -> Result:
        if self.findings or self.leaks or self.prefix_shared:
            return "fail"
        if self.error is not None or self.sweep is None or not self.cross_tenant_checked:
            return "error"
        return "pass"

    @property
    def passed(self) -> bool:
        return self.result == "pass"

    @property
    def prefix_shared(self) -> bool:
        return (
            self.prefix_cache is not None and self.prefix_cache.verdict == "shared_across_tenants"
        )

    @property
    def context_passed(self) -> bool:
        """The context verdict alone (no leak, no finding, run whole): what the verified
        safe context and the collector's ``passed`` stand for. A prefix cache shared across
        tenants fails the run (exit 1) and has its own alert, but leaks no answer text, so
        it neither lowers the safe context nor turns the gateway's limit to zero."""
        return not (self.findings or self.leaks) and self.result != "error"

    @property
    def tokens_measured(self) -> bool:
        """Some answer stated its ``usage.prompt_tokens``; otherwise every token count is
        the byte count standing in."""
        return self.calibration is not None and self.calibration[2] > 0

    @property
    def largest_accepted_tokens(self) -> int | None:
        return None if self.sweep is None else self.sweep.largest_accepted_tokens

    @property
    def rejection_point(self) -> int | None:
        return None if self.sweep is None else self.sweep.rejection_tokens

    @property
    def verified_safe_context(self) -> int | None:
        """The largest prompt verified clean with no leak: the largest accepted, never at or
        above the rejection point nor above --max-context; None unless the context verdict
        passed (:attr:`context_passed`)."""
        if not self.context_passed or self.sweep is None:
            return None
        safe = self.sweep.largest_accepted_tokens
        if self.rejection_point is not None:
            safe = min(safe, self.rejection_point - 1)
        if self.max_context is not None:
            safe = min(safe, self.max_context)
        return safe if safe >= 1 else None

    @property
    def smallest_leaking_prompt(self) -> int | None:
        lengths = [x.reader_prompt_tokens for x in self.leaks if x.reader_prompt_tokens]
        return min(lengths) if lengths else None

    # -- outputs ------------------------------------------------------------------------

    def _rejection(self, *, message: bool = True) -> dict[str, Any] | None:
        """The rejection point's request; ``message=False`` leaves out the endpoint's own
        words (the upload carries none of them)."""
        rec = None if self.sweep is None else self.sweep.rejected
        if rec is None:
            return None
        out: dict[str, Any] = {
            "prompt_tokens": self.rejection_point,
            "prompt_bytes": rec.prompt_bytes,
            "status": rec.status,
            "outcome": rec.outcome.value,
            "error_code": rec.error_code,
        }
        if message:
            out["error_message"] = rec.error_message
        return out

    def to_json(self) -> dict[str, Any]:
        s = self.sweep
        duration = sum(self.durations_s.values())
        return {
            "report_version": REPORT_VERSION,
            "tool": "kvwatch verify",
            "result": self.result,
            "passed": self.passed,
            "error": self.error,
            "endpoint": self.endpoint,
            "model": self.model,
            "route": self.route,
            "tenants": list(self.tenants),
            "canaries": dict(self.canaries),
            "canary_min_fragment": self.canary_min_fragment,
            "budget": self.budget,
            "requests": self.requests,
            "max_context": self.max_context,
            "timeout_s": self.timeout_s,
            "sweep_max_tokens": SWEEP_MAX_TOKENS,
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "duration_s": round(duration, 3),
            "durations_s": {k: round(v, 3) for k, v in self.durations_s.items()},
            "largest_accepted_tokens": self.largest_accepted_tokens,
            "largest_accepted_bytes": None if s is None else s.largest_accepted_bytes,
            "rejection_point": self.rejection_point,
            "rejection": self._rejection(),
            "reported_limit": None if s is None else s.reported_limit,
            "sweep_stopped_by": None if s is None else s.ceiling,
            "bisection_complete": None if s is None else s.complete,
            "cross_tenant_checked": self.cross_tenant_checked,
            "verified_safe_context": self.verified_safe_context,
            "smallest_leaking_prompt_tokens": self.smallest_leaking_prompt,
            "calibration": None
            if self.calibration is None
            else {
                "tokens_per_byte": round(self.calibration[0], 6),
                "overhead_tokens": round(self.calibration[1], 3),
                "points": self.calibration[2],
            },
            "findings": [f.to_json() for f in self.findings],
            "leaks": [x.to_json() for x in self.leaks],
            "prefix_cache": self._prefix_json(),
            "probes": [r.to_json() for r in self.records],
        }

    def _prefix_json(self) -> dict[str, Any]:
        if self.prefix_cache is not None:
            return self.prefix_cache.to_json()
        if self.prefix_cache_error is not None:
            return {"verdict": None, "error": self.prefix_cache_error}
        return {"verdict": None, "error": "not checked"}

    def evidence(self) -> dict[str, Any]:
        """The report's key figures, for the collector's verification record."""
        s = self.sweep
        return {
            "tool": "kvwatch verify",
            "report_version": REPORT_VERSION,
            "result": self.result,
            "endpoint": self.endpoint,
            "route": self.route,
            "tenants": list(self.tenants),
            "requests": self.requests,
            "budget": self.budget,
            "duration_s": round(sum(self.durations_s.values()), 3),
            "max_context": self.max_context,
            "sweep_max_tokens": SWEEP_MAX_TOKENS,
            "largest_accepted_tokens": self.largest_accepted_tokens,
            "rejection_point": self.rejection_point,
            "rejection": self._rejection(message=False),
            "reported_limit": None if s is None else s.reported_limit,
            "bisection_complete": None if s is None else s.complete,
            "measured_safe_context": self.verified_safe_context,
            "canary_min_fragment": self.canary_min_fragment,
            "findings": len(self.findings),
            "findings_by_kind": dict(Counter(f.kind for f in self.findings)),
            "leaks": len(self.leaks),
            "leak_pairs": sorted({f"{x.owner}->{x.reader}" for x in self.leaks}),
            "smallest_leaking_prompt_tokens": self.smallest_leaking_prompt,
            "first_leaks": [
                {k: v for k, v in x.to_json().items() if k != "fragment"} for x in self.leaks[:10]
            ],
            "first_findings": [f.to_json() for f in self.findings[:10]],
            "prefix_cache": self._prefix_evidence(),
        }

    def _prefix_evidence(self) -> dict[str, Any]:
        """The prefix-cache verdict for the collector: the verdict, how it was measured, the
        pairs that shared (tenant names, as the evidence already holds), no timings."""
        p = self.prefix_cache
        if p is None:
            return {"verdict": None, "error": self.prefix_cache_error or "not checked"}
        doc = p.to_json()
        doc.pop("comparisons")
        return doc

    def summary_lines(self) -> list[str]:
        verdict = {"pass": "PASS", "fail": "FAIL", "error": "COULD NOT RUN"}[self.result]
        head = f"kvwatch verify: {verdict}"
        if self.result == "fail":
            head += f" ({_n(len(self.leaks), 'leak')}, {_n(len(self.findings), 'other finding')}"
            head += ", a prefix cache shared across tenants)" if self.prefix_shared else ")"
        lines = [head]

        def row(name: str, value: str) -> None:
            lines.append(f"  {name:<22} {value}")

        row("endpoint", f"{self.endpoint} ({self.route}), model {self.model}")
        row("tenants", ", ".join(self.tenants))
        if self.error is not None:
            row("error", self.error)
        s = self.sweep
        if s is not None:
            measured = self.tokens_measured
            largest = s.largest_accepted_tokens if measured else s.largest_accepted_bytes
            unit = "prompt tokens" if measured else "bytes (tokens unknown)"
            row("largest accepted", f"{largest} {unit}")
            rej = s.rejected
            if rej is not None:
                what = f"HTTP {rej.status}" + (f" {rej.error_code}" if rej.error_code else "")
                point = self.rejection_point if measured else rej.prompt_bytes
                row("rejection point", f"{point} {unit} ({what})")
            else:
                row("rejection point", f"none seen (sweep stopped by {s.ceiling})")
            if not s.complete:
                row("bisection", "not finished within the budget: the limit may be higher")
        safe = self.verified_safe_context
        if safe is not None:
            row("verified safe context", f"{safe} prompt tokens")
        else:
            row("verified safe context", "none (the run did not pass)")
        if self.smallest_leaking_prompt is not None:
            row("smallest leaking", f"{self.smallest_leaking_prompt} prompt tokens")
        for x in self.leaks[:_SHOWN]:
            size = f"{x.reader_prompt_tokens}-token" if x.reader_prompt_tokens else "a"
            row(
                "LEAK",
                f"{x.owner}'s canary {x.canary} in {x.reader}'s answer to a {size} prompt "
                f"(request {x.request_id or '?'}, {len(x.fragment)} characters matched)",
            )
        if len(self.leaks) > _SHOWN:
            row("", f"... and {len(self.leaks) - _SHOWN} more leaks (see --json)")
        for f in self.findings[:_SHOWN]:
            size = f"{f.prompt_tokens} tokens" if f.prompt_tokens else f"{f.prompt_bytes} bytes"
            row("FINDING", f"{f.kind} at {size} ({f.phase}, tenant {f.tenant}): {f.detail}")
        if len(self.findings) > _SHOWN:
            row("", f"... and {len(self.findings) - _SHOWN} more findings (see --json)")
        p = self.prefix_cache
        if p is not None:
            how = "cached_tokens" if p.method == "cached_tokens" else f"timing, alpha {ALPHA}"
            row("prefix cache", f"{p.verdict} (by {how}, {p.requests} requests)")
            if p.tier_verdict is not None:
                row("offload tier", f"{p.tier_verdict} (the eviction round)")
            if p.verdict == "shared_across_tenants":
                for c in p.comparisons:
                    if c.kind != "cross" or not c.hit:
                        continue
                    how = " with its own cache_salt" if c.salted else ""
                    where = " after it left the pool (from an offload tier)" * c.after_eviction
                    row("PREFIX SHARED", f"{c.reader} was served {c.owner}'s cached prefix"
                        f"{how}{where}")  # fmt: skip
                if p.salt_accepted and not any(salted for _, _, salted in p.shared_pairs):
                    row("", "with each tenant's own cache_salt nothing was shared: salting "
                        "isolates, clients that send none share")  # fmt: skip
            elif p.note:
                # caching off is no risk, only no evidence: a note, not a warning that every
                # run against an engine without a prefix cache would print
                lead = {"isolated": "", "caching_off": "note: "}.get(p.verdict, "WARNING: ")
                row("", lead + p.note)
        elif self.prefix_cache_error is not None:
            row("prefix cache", f"not checked: {self.prefix_cache_error}")
        duration = sum(self.durations_s.values())
        row("requests", f"{self.requests} of a {self.budget} budget, {duration:.1f} s")
        return lines


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
