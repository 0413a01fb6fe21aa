"""The prefix-cache phase: does the endpoint serve one tenant KV that another tenant's
prompt computed?

A test of isolation must be paired: "B's request reused nothing of A's" also holds when
caching is simply off. So every comparison has a control:

- **control**: tenant A sends a random prefix, then sends it again: the second must hit,
  or caching is not demonstrably on and isolation is not demonstrated either;
- **cross**: tenant B sends the same prefix after A: a hit is a finding (B was served KV
  A's prompt computed, the side channel PromptPeek-style attacks read);
- **salted** (where the endpoint takes ``cache_salt``): the same pair with each tenant's
  own random salt: the same salt must hit, a different one must not.

Each request is the shared prefix plus a short suffix of its own (so no two answers are
for the same prompt). Evidence, per request:

- ``usage.prompt_tokens_details.cached_tokens`` where the endpoint reports it (vLLM with
  ``--enable-prompt-tokens-details``, the reference engine): a hit is at least half the
  prefix's tokens cached. Exact, so one round is enough (:data:`CACHED_ROUNDS`);
- otherwise the answer's time (one token asked for: close to time to first token), over
  :data:`TIMING_ROUNDS` rounds, each with its own fresh prefix and a baseline (B sending a
  never-seen prefix of the same length), the round's three requests in random order.
  A one-sided exact Mann-Whitney U test (scipy) at :data:`ALPHA` compares control and cross
  against the baselines: the stated false-positive rate of each verdict is ``ALPHA``. Never
  one sample. Timing can show a hit but never prove there was none, so by timing a control
  that is not measurably faster makes the verdict ``inconclusive``, never ``caching_off``.

**Eviction round** (``evict_bytes``, by cached tokens only): the same salted pair (unsalted
where the endpoint refuses ``cache_salt``) with filler between: A warms a fresh prefix, A
sends never-seen prompts of ``evict_bytes`` in all (filler that pushes the prefix out of
the engine's KV pool), A's control must hit again, now served from the offload tier the
pool evicted to (else the tier is ``not_reached``), more filler, then each B with its own
salt: a hit is a finding from the tier (a tier that drops the salt, as LMCache's SGLang
path did). Its comparisons say ``after_eviction``; ``tier_verdict`` sums them up.

Verdict per model: ``isolated`` (A's control hits, no B ever does), ``shared_across_tenants``
(a B hit A's prefix: names the pair), ``caching_off`` (no control hit: isolation not
demonstrated), ``inconclusive`` (timing too noisy to tell: the report says what would
settle it).
"""

from __future__ import annotations

import random
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kvwatch.errors import KvwatchError
from kvwatch.verify.client import Outcome
from kvwatch.verify.session import BudgetExhausted, ProbeRecord, Session

Verdict = Literal["isolated", "shared_across_tenants", "caching_off", "inconclusive"]
TierVerdict = Literal["isolated", "shared_across_tenants", "not_reached", "skipped"]
Method = Literal["cached_tokens", "timing"]

#: One-sided significance of each timing comparison: its false-positive rate.
ALPHA: Final = 0.01
CACHED_ROUNDS: Final = 1
TIMING_ROUNDS: Final = 6
#: Fewer rounds could never reach ALPHA: the exact test's smallest p with 4 and 4 samples
#: is 1/70.
MIN_TIMING_ROUNDS: Final = 5
#: A request hits when at least this share of the prefix's tokens were cached.
HIT_SHARE: Final = 0.5
#: The prefix, in tokens as the endpoint counts them: several cache blocks of any engine
#: (vLLM 16, SGLang 1..64 tokens a page), and under half the largest prompt accepted.
PREFIX_TOKENS: Final = 1024
SUFFIX_CHARS: Final = 12
#: Readers checked against the owner, at most (the first tenant owns the prefixes).
MAX_READERS: Final = 3
_ALPHABET = string.ascii_lowercase + " "


def planned_requests(n_tenants: int, filler_requests: int = 0) -> int:
    """The most requests the phase sends: timing's rounds of four (warm-up, control,
    cross, baseline), or by cached tokens, unsalted and salted, a warm-up, a control and
    one cross per reader, and with eviction (``filler_requests`` per filling) its round.
    The run reserves them when its budget allows; otherwise the phase makes do with what is
    left (fewer readers; at least MIN_TIMING_ROUNDS rounds)."""
    readers = min(MAX_READERS, n_tenants - 1)
    evict = 2 + readers + 2 * filler_requests if filler_requests else 0
    return max(2 * (2 + readers) + evict, TIMING_ROUNDS * 4)


def filler_requests(prefix_bytes: int, evict_bytes: int) -> int:
    """Filler prompts per filling: ``evict_bytes`` in prompts of ``prefix_bytes`` each,
    plus one (the pool's own prefix pages are part of what must be pushed out)."""
    if evict_bytes <= 0:
        return 0
    return -(-evict_bytes // max(1, prefix_bytes)) + 1


@dataclass
class Comparison:
    """One comparison's evidence: which tenant read whose prefix, salted or not, and what
    each request showed (cached tokens, or seconds), with the timing test's p-value."""

    kind: Literal["control", "cross"]
    owner: str
    reader: str
    salted: bool
    hit: bool | None  # None: timing could not tell
    cached_tokens: list[int | None] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    baseline_seconds: list[float] = field(default_factory=list)
    p_value: float | None = None
    probes: list[int] = field(default_factory=list)
    #: the eviction round: filler pushed the prefix out of the pool before this request
    after_eviction: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "owner": self.owner,
            "reader": self.reader,
            "salted": self.salted,
            "hit": self.hit,
            "probes": self.probes,
            "after_eviction": self.after_eviction,
        }
        if self.cached_tokens:
            out["cached_tokens"] = self.cached_tokens
        if self.seconds:
            out["seconds"] = [round(x, 5) for x in self.seconds]
            out["baseline_seconds"] = [round(x, 5) for x in self.baseline_seconds]
            out["p_value"] = None if self.p_value is None else round(self.p_value, 6)
        return out


@dataclass
class PrefixResult:
    verdict: Verdict
    method: Method
    prefix_tokens: int
    salt_accepted: bool | None
    comparisons: list[Comparison]
    requests: int
    #: what the verdict does not show, and what would settle an inconclusive one
    note: str = ""
    #: the eviction round's verdict: ``isolated`` (the prefix came back to its owner after
    #: eviction, to no other tenant), ``shared_across_tenants`` (it came back to another),
    #: ``not_reached`` (it did not come back to its owner either: no offload tier, or too
    #: little filler), ``skipped`` (asked for, but the budget or the method did not allow
    #: it: the note says which); None: not asked for
    tier_verdict: TierVerdict | None = None

    @property
    def shared_pairs(self) -> list[tuple[str, str, bool]]:
        """(owner, reader, salted) of every cross comparison that hit."""
        return [
            (c.owner, c.reader, c.salted) for c in self.comparisons if c.kind == "cross" and c.hit
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "method": self.method,
            "alpha": ALPHA if self.method == "timing" else None,
            "hit_share": HIT_SHARE if self.method == "cached_tokens" else None,
            "prefix_tokens": self.prefix_tokens,
            "salt_accepted": self.salt_accepted,
            "requests": self.requests,
            "shared_pairs": [
                {"owner": o, "reader": r, "salted": s} for o, r, s in self.shared_pairs
            ],
            "note": self.note,
            "tier_verdict": self.tier_verdict,
            "comparisons": [c.to_json() for c in self.comparisons],
        }


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(n))


class _Phase:
    def __init__(self, session: Session, tenants: list[str], prefix_bytes: int, seed: int):
        self.session = session
        self.owner = tenants[0]
        self.readers = tenants[1 : 1 + MAX_READERS]
        self.prefix_bytes = prefix_bytes
        self.rng = random.Random(seed)
        self.salts = {t: secrets.token_hex(16) for t in tenants}
        self.sent = 0
        self.evict_bytes = 0

    def send(self, tenant: str, prefix: str, *, salted: bool) -> ProbeRecord:
        text = prefix + " " + _text(self.rng, SUFFIX_CHARS)
        extra = {"cache_salt": self.salts[tenant]} if salted else None
        self.sent += 1
        return self.session.probe(tenant, len(text), 1, "prefix", text=text, extra=extra)

    def fresh(self) -> str:
        return _text(self.rng, self.prefix_bytes)


def run_prefix_check(
    session: Session,
    tenants: list[str],
    *,
    prefix_bytes: int,
    seed: int | None = None,
    evict_bytes: int = 0,
) -> PrefixResult:
    """The phase (see the module's docstring). ``prefix_bytes``: the shared prefix's length;
    ``evict_bytes``: the filler of the eviction round (0: no such round). Raises what
    :meth:`Session.probe` raises."""
    ph = _Phase(session, tenants, prefix_bytes, secrets.randbits(64) if seed is None else seed)
    ph.evict_bytes = evict_bytes
    if session.remaining < 3:
        raise PrefixPhaseFailed(
            f"{session.remaining} requests were left of the budget; the phase needs 3 to 24 "
            "(raise --budget)"
        )
    prefix_tokens = session.calibration.tokens(prefix_bytes)
    prefix = ph.fresh()
    warm = ph.send(ph.owner, prefix, salted=False)
    control = ph.send(ph.owner, prefix, salted=False)
    if warm.outcome is not Outcome.ACCEPTED or control.outcome is not Outcome.ACCEPTED:
        raise _refused(warm if warm.outcome is not Outcome.ACCEPTED else control)
    if control.cached_tokens is not None:
        result = _by_cached_tokens(ph, prefix, prefix_tokens, warm, control)
        if evict_bytes > 0:
            try:
                _eviction_round(ph, prefix_tokens, result)
            except (PrefixPhaseFailed, BudgetExhausted) as exc:
                # the rounds before stand: a failure here only leaves the tier unjudged
                result.tier_verdict = "skipped"
                result.requests = ph.sent
                why = str(exc) if isinstance(exc, PrefixPhaseFailed) else "the budget ran out"
                _also(result, f"the eviction round could not finish: {why}")
        return result
    result = _by_timing(ph, prefix, prefix_tokens, [warm, control])
    if evict_bytes > 0:
        result.tier_verdict = "skipped"
        _also(
            result,
            "the eviction round was skipped: it needs an endpoint that reports "
            "usage.prompt_tokens_details.cached_tokens",
        )
    return result


def _eviction_round(ph: _Phase, prefix_tokens: int, result: PrefixResult) -> None:
    """The eviction round (see the module's docstring), added to ``result``: its
    comparisons, ``tier_verdict``, and the overall verdict when a tier served another
    tenant."""
    fillers = filler_requests(ph.prefix_bytes, ph.evict_bytes)
    needed = 2 + len(ph.readers) + 2 * fillers
    if ph.session.remaining < needed:
        result.tier_verdict = "skipped"
        _also(
            result,
            f"the eviction round was skipped: it needs {needed} requests, "
            f"{ph.session.remaining} were left of the budget (raise --budget)",
        )
        return
    salted = result.salt_accepted is True
    owner, prefix = ph.owner, ph.fresh()
    warm = ph.send(owner, prefix, salted=salted)
    if warm.outcome is not Outcome.ACCEPTED:
        raise _refused(warm)
    _fill(ph, fillers)
    control_rec = ph.send(owner, prefix, salted=salted)
    control = _cached("control", owner, owner, salted, [warm, control_rec], prefix_tokens)
    control.after_eviction = True
    crosses = []
    _fill(ph, fillers)
    for reader in ph.readers:
        rec = ph.send(reader, prefix, salted=salted)
        cross = _cached("cross", owner, reader, salted, [rec], prefix_tokens)
        cross.after_eviction = True
        crosses.append(cross)
    result.comparisons += [control, *crosses]
    result.requests = ph.sent
    how = "with each tenant's own salt" if salted else "unsalted"
    if any(c.hit for c in crosses):
        result.tier_verdict = "shared_across_tenants"
        pairs = ", ".join(
            f"{c.reader} was served {c.owner}'s prefix after it left the pool ({how}): "
            "from an offload tier"
            for c in crosses
            if c.hit
        )
        if result.verdict == "shared_across_tenants":
            _also(result, pairs)
        else:
            result.verdict, result.note = "shared_across_tenants", pairs
    elif control.hit:
        result.tier_verdict = "isolated"
        _also(
            result,
            f"after {ph.evict_bytes} bytes of filler the owner's prefix came back, from an "
            f"offload tier (or from the pool, if the filler was smaller than it), and no "
            f"other tenant's request ({how}) was served it",
        )
    else:
        result.tier_verdict = "not_reached"
        _also(
            result,
            f"after eviction ({ph.evict_bytes} bytes of filler) the owner's prefix did not "
            "come back: the endpoint has no offload tier this round reached (or the filler "
            "did not push the prefix out of the pool; raise --prefix-evict-tokens)",
        )


def _also(result: PrefixResult, text: str) -> None:
    result.note = f"{result.note}; {text}" if result.note else text


def _fill(ph: _Phase, n: int) -> None:
    """``n`` never-seen prompts from the owner, unsalted: they push the pool's older pages
    out (into the offload tier, where there is one)."""
    for _ in range(n):
        rec = ph.send(ph.owner, ph.fresh(), salted=False)
        if rec.outcome is not Outcome.ACCEPTED:
            raise _refused(rec)


class PrefixPhaseFailed(KvwatchError):
    """A prefix request was not answered: the phase cannot say anything (the run records
    why and goes on)."""


def _refused(rec: ProbeRecord) -> PrefixPhaseFailed:
    why = rec.error_message or rec.detail or rec.outcome.value
    return PrefixPhaseFailed(
        f"a {rec.prompt_bytes}-byte prefix-cache probe from tenant {rec.tenant!r} was not "
        f"answered ({why})"
    )


def _hit(rec: ProbeRecord, prefix_tokens: int) -> bool:
    return (rec.cached_tokens or 0) >= HIT_SHARE * prefix_tokens


def _cached(
    kind: Literal["control", "cross"],
    owner: str,
    reader: str,
    salted: bool,
    probes: list[ProbeRecord],
    prefix_tokens: int,
) -> Comparison:
    """A comparison judged by ``cached_tokens``: the last of ``probes`` is the one judged
    (the others are its warm-up)."""
    judged = probes[-1]
    return Comparison(
        kind,
        owner,
        reader,
        salted,
        _hit(judged, prefix_tokens),
        cached_tokens=[judged.cached_tokens],
        probes=[r.seq for r in probes],
    )


def _by_cached_tokens(
    ph: _Phase, prefix: str, prefix_tokens: int, warm: ProbeRecord, control: ProbeRecord
) -> PrefixResult:
    owner = ph.owner
    comparisons = [_cached("control", owner, owner, False, [warm, control], prefix_tokens)]
    # as many readers as the budget leaves, then the salted pair if it still fits
    ph.readers = ph.readers[: max(1, ph.session.remaining)]
    for reader in ph.readers:
        rec = ph.send(reader, prefix, salted=False)
        comparisons.append(_cached("cross", owner, reader, False, [rec], prefix_tokens))
    # The salted pair, on a prefix of its own: the owner's salted warm-up first.
    if ph.session.remaining < 2 + len(ph.readers):
        return _verdict(ph, "cached_tokens", prefix_tokens, None, comparisons)
    salted_prefix = ph.fresh()
    s_warm = ph.send(owner, salted_prefix, salted=True)
    salt_accepted = s_warm.outcome is Outcome.ACCEPTED
    if salt_accepted:
        s_control = ph.send(owner, salted_prefix, salted=True)
        comparisons.append(
            _cached("control", owner, owner, True, [s_warm, s_control], prefix_tokens)
        )
        for reader in ph.readers:
            rec = ph.send(reader, salted_prefix, salted=True)
            comparisons.append(_cached("cross", owner, reader, True, [rec], prefix_tokens))
    return _verdict(ph, "cached_tokens", prefix_tokens, salt_accepted, comparisons)


def _by_timing(
    ph: _Phase, prefix: str, prefix_tokens: int, first: list[ProbeRecord]
) -> PrefixResult:
    """Rounds of (A warms a fresh prefix; then control A, cross B and baseline B, in random
    order), with one reader (the budget). The first round's warm-up and control are the two
    requests already sent on ``prefix``."""
    rounds = min(TIMING_ROUNDS, 1 + (ph.session.remaining - 2) // 4)
    if rounds < MIN_TIMING_ROUNDS:
        raise PrefixPhaseFailed(
            f"the endpoint reports no cached_tokens, and timing needs {MIN_TIMING_ROUNDS} "
            f"rounds ({2 + 4 * MIN_TIMING_ROUNDS} requests): {ph.session.remaining + 2} were "
            "left of the budget (raise --budget)"
        )
    reader = ph.readers[0]
    control = Comparison("control", ph.owner, ph.owner, False, None, probes=[r.seq for r in first])
    cross = Comparison("cross", ph.owner, reader, False, None)
    baselines: list[float] = []
    for i in range(rounds):
        if i > 0:
            prefix = ph.fresh()
            warm = ph.send(ph.owner, prefix, salted=False)
            if warm.outcome is not Outcome.ACCEPTED:
                raise _refused(warm)
            control.probes.append(warm.seq)
        steps: list[tuple[str, str, str]] = [
            ("cross", reader, prefix),
            ("baseline", reader, ph.fresh()),
        ]
        if i > 0:
            steps.append(("control", ph.owner, prefix))
        ph.rng.shuffle(steps)
        for kind, tenant, text in steps:
            rec = ph.send(tenant, text, salted=False)
            if rec.outcome is not Outcome.ACCEPTED:
                raise _refused(rec)
            if kind == "baseline":
                baselines.append(rec.elapsed_s)
            else:
                target = control if kind == "control" else cross
                target.seconds.append(rec.elapsed_s)
                target.probes.append(rec.seq)
    control.seconds.insert(0, first[1].elapsed_s)
    for c in (control, cross):
        c.baseline_seconds = list(baselines)
        c.p_value = _faster_p(c.seconds, baselines)
    # Timing can show a hit, never the absence of one: a control that is not measurably
    # faster may be caching off or a saving below the noise, so it stays undecided (None)
    # and the verdict inconclusive, never caching_off.
    control.hit = True if control.p_value is not None and control.p_value < ALPHA else None
    cross.hit = cross.p_value is not None and cross.p_value < ALPHA
    return _verdict(ph, "timing", prefix_tokens, None, [control, cross])


def _faster_p(samples: list[float], baseline: list[float]) -> float | None:
    """One-sided exact Mann-Whitney U: p of ``samples`` being this much faster than
    ``baseline`` by chance."""
    if len(samples) < 2 or len(baseline) < 2:
        return None
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(samples, baseline, alternative="less", method="exact").pvalue)


def _verdict(
    ph: _Phase,
    method: Method,
    prefix_tokens: int,
    salt_accepted: bool | None,
    comparisons: list[Comparison],
) -> PrefixResult:
    controls = [c for c in comparisons if c.kind == "control"]
    crosses = [c for c in comparisons if c.kind == "cross"]
    note = ""
    if any(c.hit for c in crosses):
        verdict: Verdict = "shared_across_tenants"
        pairs = ", ".join(
            f"{c.reader} was served {c.owner}'s cached prefix" + (" (salted)" if c.salted else "")
            for c in crosses
            if c.hit
        )
        note = pairs
    elif any(c.hit for c in controls):
        verdict = "isolated"
        salted = [c for c in controls if c.salted]
        if method == "timing":
            note = (
                f"by timing: no cross-tenant request was faster than a fresh prefix at "
                f"alpha {ALPHA} (a hit smaller than the timing noise would go unseen)"
            )
        elif salted and not salted[0].hit:
            note = "salted requests did not hit even their own salt's prefix"
    elif any(c.hit is None for c in controls):
        verdict = "inconclusive"
        note = (
            "the owner's repeated prefix was not measurably faster than a fresh one: caching "
            "may be off, or what a hit saves may be below the timing noise. What would settle "
            "it: an endpoint that reports usage.prompt_tokens_details.cached_tokens (vLLM: "
            "--enable-prompt-tokens-details), a quieter endpoint, or a longer prefix"
        )
    else:
        verdict = "caching_off"
        note = (
            "the owner's repeated prefix was never served from a cache: caching is off (or "
            "keyed per request), so tenants share nothing through it now; isolation with "
            "caching on is not demonstrated by this run"
        )
    return PrefixResult(verdict, method, prefix_tokens, salt_accepted, comparisons, ph.sent, note)
