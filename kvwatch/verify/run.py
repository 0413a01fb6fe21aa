"""One verification, start to end: preflight, sweep, cross-tenant phase, prefix-cache phase,
report.

The request budget is a hard cap: the cross-tenant and prefix-cache phases' requests are
reserved before the sweep starts, the sweep stops bisecting when its share is spent, and 429
retries come out of the same budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from kvwatch.verify import prefix
from kvwatch.verify.canaries import (
    MIN_FRAGMENT_CEILING,
    MIN_FRAGMENT_FLOOR,
    LeakMatcher,
    TenantText,
    new_canaries,
)
from kvwatch.verify.client import EndpointClient, Outcome, Route, base_url, redact_url
from kvwatch.verify.crosstenant import make_plan, planned_requests, run_cross_tenant
from kvwatch.verify.report import Report
from kvwatch.verify.session import (
    BudgetExhausted,
    CouldNotRun,
    EndpointGone,
    ProbeRecord,
    Progress,
    Session,
)
from kvwatch.verify.sweep import run_sweep

#: The preflight prompt: one per tenant, checks reachability, keys and the model.
PREFLIGHT_BYTES: Final = 32
#: The fewest requests the sweep needs to be worth running.
MIN_SWEEP_REQUESTS: Final = 6
DEFAULT_BUDGET: Final = 200
#: The preflight prompt must fit under --max-context, chat template included.
MIN_MAX_CONTEXT: Final = 64
MAX_TENANTS: Final = 16
NO_USAGE: Final = (
    "the endpoint reports no usage.prompt_tokens, so prompt lengths in tokens are unknown"
)


def minimum_budget(n_tenants: int) -> int:
    """The prefix-cache phase is not counted: it reserves its requests only from a budget
    that has room for them (:func:`prefix_reserve`), and otherwise makes do with what the
    sweep leaves, or says it could not run."""
    return n_tenants + planned_requests(n_tenants) + MIN_SWEEP_REQUESTS


def prefix_reserve(options: VerifyOptions) -> int:
    if not options.prefix_cache_check:
        return 0
    n = len(options.tenant_keys)
    base = prefix.planned_requests(n)
    # with an eviction round: its filler counted for a prefix half the phase's largest (the
    # prefix shrinks to half the largest prompt answered), else the base phase alone
    fillers = prefix.filler_requests(prefix.PREFIX_TOKENS // 2, options.prefix_evict_tokens)
    for planned in (prefix.planned_requests(n, fillers), base):
        if options.budget >= minimum_budget(n) + planned:
            return planned
    return 0


@dataclass(frozen=True)
class VerifyOptions:
    endpoint: str
    model: str
    #: NAME -> KEY, in the order given; the first tenant runs the sweep.
    tenant_keys: dict[str, str] = field(repr=False)
    max_context: int | None = None
    budget: int = DEFAULT_BUDGET
    canary_min_fragment: int = 12
    timeout_s: float = 120.0
    route: Route = "chat"
    #: the paired prefix-cache isolation phase (``--no-prefix-cache-check`` skips it)
    prefix_cache_check: bool = True
    #: the prefix-cache phase's eviction round: tokens of filler that push the prefix out of
    #: the pool, so it must come back from an offload tier (0: no such round)
    prefix_evict_tokens: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        base_url(self.endpoint)
        if not self.model.strip():
            raise ValueError("--model must not be empty")
        keys = self.tenant_keys
        if len(keys) < 2:
            raise ValueError(
                "give at least two --tenant-key NAME=KEY of different tenants: the "
                "cross-tenant check needs one tenant to plant canaries and another to read"
            )
        if len(keys) > MAX_TENANTS:
            raise ValueError(f"at most {MAX_TENANTS} tenants")
        for name, key in keys.items():
            if not name or not key:
                raise ValueError(f"--tenant-key {name or '?'}=...: both NAME and KEY are needed")
        if len(set(keys.values())) != len(keys):
            raise ValueError("two tenants share one key: each --tenant-key needs its own key")
        if self.max_context is not None and self.max_context < MIN_MAX_CONTEXT:
            raise ValueError(f"--max-context must be at least {MIN_MAX_CONTEXT} tokens")
        if not MIN_FRAGMENT_FLOOR <= self.canary_min_fragment <= MIN_FRAGMENT_CEILING:
            raise ValueError(
                f"--canary-min-fragment must be between {MIN_FRAGMENT_FLOOR} and "
                f"{MIN_FRAGMENT_CEILING} characters"
            )
        if not self.timeout_s > 0:
            raise ValueError("--timeout must be positive")
        need = minimum_budget(len(keys))
        if self.budget < need:
            raise ValueError(f"--budget must be at least {need} requests for {len(keys)} tenants")


def verify(options: VerifyOptions, on_progress: Callable[[Progress], None] | None = None) -> Report:
    """Run the verification; never raises for what the endpoint does (see the report's
    ``result``/``error``). Raises ``ValueError`` for bad options, before sending anything."""
    options.check()
    tenants = list(options.tenant_keys)
    canaries = new_canaries(tenants, options.canary_min_fragment)
    texts = {t: TenantText(c) for t, c in canaries.items()}
    matcher = LeakMatcher(canaries, options.canary_min_fragment)
    client = EndpointClient(
        options.endpoint,
        options.model,
        options.tenant_keys,
        route=options.route,
        timeout_s=options.timeout_s,
    )
    session = Session(client, texts, matcher, options.budget, on_progress)
    report = Report(
        endpoint=redact_url(client.base),
        model=options.model,
        route=client.path,
        tenants=tenants,
        canaries=canaries,
        budget=options.budget,
        max_context=options.max_context,
        canary_min_fragment=options.canary_min_fragment,
        timeout_s=options.timeout_s,
        started_at=datetime.now(UTC),
    )
    phase_start = time.monotonic()

    def phase_done(name: str) -> None:
        nonlocal phase_start
        now = time.monotonic()
        report.durations_s[name] = now - phase_start
        phase_start = now

    try:
        first = _preflight(session, tenants, report.endpoint)
        phase_done("preflight")
        reserved = planned_requests(len(tenants)) + prefix_reserve(options)
        sweep = run_sweep(
            session,
            tenants[0],
            first,
            max_context=options.max_context,
            stop_at_sent=options.budget - reserved,
        )
        report.sweep = sweep
        phase_done("sweep")
        plan = make_plan(session, sweep, min_bytes=PREFLIGHT_BYTES, period=texts[tenants[0]].period)
        run_cross_tenant(session, tenants, plan)
        report.cross_tenant_checked = True
        phase_done("cross_tenant")
        if options.prefix_cache_check:
            _prefix_phase(session, tenants, report, options.prefix_evict_tokens)
            phase_done("prefix_cache")
    except CouldNotRun as exc:
        report.error = str(exc)
    except EndpointGone as exc:
        report.error = f"the endpoint stopped accepting connections: {exc}"
    except BudgetExhausted as exc:
        report.error = f"the run did not finish: {exc}"
    finally:
        client.close()
    if report.error is not None:
        phase_done("until_error")
    session.finalize()
    if report.error is None and not session.calibration.points:
        # every token count above is the byte count standing in: nothing is verified
        report.error = NO_USAGE
    report.finished_at = datetime.now(UTC)
    report.requests = session.sent
    report.records = list(session.records)
    report.findings = list(session.findings)
    report.leaks = list(session.leaks)
    a, b = session.calibration.fit()
    report.calibration = (a, b, session.calibration.points)
    return report


def _preflight(session: Session, tenants: list[str], endpoint: str) -> ProbeRecord:
    """A tiny prompt from each tenant: is the endpoint there, is each key accepted, does it
    serve the model? Returns the first tenant's answer (the sweep starts from it)."""
    first: ProbeRecord | None = None
    for tenant in tenants:
        rec = session.probe(tenant, PREFLIGHT_BYTES, 1, "preflight")
        what = rec.detail or rec.error_message or rec.outcome.value
        status = f"HTTP {rec.status}" if rec.status is not None else rec.outcome.value
        if rec.outcome is Outcome.UNREACHABLE:
            raise CouldNotRun(f"cannot reach {endpoint}: {what}")
        if rec.outcome in (Outcome.REJECTED, Outcome.UNCLEAN_REJECTION):
            raise CouldNotRun(
                f"the endpoint refused a {PREFLIGHT_BYTES}-byte prompt from tenant {tenant!r} "
                f"({status} {rec.error_code or ''}: {what})".replace("  ", " ")
            )
        if rec.outcome is not Outcome.ACCEPTED:
            raise CouldNotRun(
                f"the endpoint did not answer a {PREFLIGHT_BYTES}-byte prompt from tenant "
                f"{tenant!r} ({status}: {what})"
            )
        first = first or rec
    assert first is not None
    return first


def _prefix_phase(session: Session, tenants: list[str], report: Report, evict_tokens: int) -> None:
    """The prefix-cache phase on a prefix of :data:`prefix.PREFIX_TOKENS` tokens, or half
    the largest prompt answered when that is smaller. A prefix probe that is not answered
    ends only this phase (its reason is the report's ``prefix_cache_error``)."""
    largest = report.largest_accepted_tokens or prefix.PREFIX_TOKENS
    tokens = max(1, min(prefix.PREFIX_TOKENS, largest // 2))
    try:
        report.prefix_cache = prefix.run_prefix_check(
            session,
            tenants,
            prefix_bytes=session.calibration.bytes_for(tokens),
            evict_bytes=session.calibration.bytes_for(evict_tokens) if evict_tokens else 0,
        )
    except prefix.PrefixPhaseFailed as exc:
        report.prefix_cache_error = str(exc)
    except BudgetExhausted:  # a 429 retried past what was left: this phase only
        report.prefix_cache_error = "the budget ran out during the prefix-cache phase"
