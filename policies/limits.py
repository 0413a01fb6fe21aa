"""The limit in force: the one decision of how large a prompt a deployment may serve a model.

Every part of kvwatch that measures or enforces prompt sizes reads this decision and never
re-derives it: the ``context_pressure`` rule, the fleet, the limits card, the breach report,
the quarterly review, the dashboard's lines, ``/metrics`` and the gateway (which reads it
from the collector, ``GET /v1/limits``). ``tests/test_architecture.py`` checks that no other
module decides one.

How it is decided (:func:`limit_in_force`), for one model of one deployment:

1. **The structural bound**: min(advertised context, smallest prefill pool), what the
   incident lacked; source ``pool``. None when no node reports.
2. **A passing verification** (the latest one) gives its verified safe context; source
   ``verified``. It is *stale* when the engine settings it was measured under changed on a
   node serving the model (drift), when the prefill pool is now smaller than the context it
   verified, or when it is older than the pack's maximum age. A stale verification can only
   lower the limit, never raise it: the limit is then the smaller of it and the structural
   bound (``pool`` when that is smaller), and ``stale`` says why.
3. **A configured limit** (a gateway's ``MODEL=N``) tightens whatever holds; source
   ``configured`` when it is the smallest.
4. **A failed verification** (the latest verification with a verdict found the endpoint
   unsafe) overrides: prompts are held below the shortest one that leaked, and where
   nothing was measured clean or configured every prompt is refused (0 tokens); source
   ``failed-verification``. ``without_failure`` keeps what would hold otherwise, for a
   guard told to only warn about failures. A run that reached no verdict changes nothing.

Invariants: ``tokens`` is None only with source ``none``; ``tokens == 0`` only with source
``failed-verification``; ``stale`` is non-empty only when a passing verification exists;
``verified`` is True only with source ``verified`` and nothing stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Literal, cast

import msgspec

from policies.durations import human_duration
from policies.facts import DeploymentFacts, NodeConfig, VerificationFact, verified_nodes
from policies.verdict import Verdict, limit_text, verdict

LimitSource = Literal["verified", "configured", "pool", "failed-verification", "none"]
LIMIT_SOURCES: tuple[LimitSource, ...] = (
    "verified",
    "configured",
    "pool",
    "failed-verification",
    "none",
)
StaleKind = Literal["drift", "pool_below_verified", "too_old"]


class Change(msgspec.Struct, frozen=True):
    """A verified setting that differs on a node now."""

    node: str
    setting: str
    verified: Any
    now: Any


class Stale(msgspec.Struct, frozen=True):
    """One reason a passing verification no longer holds, in words (and, for drift, the
    settings that changed on each node)."""

    kind: StaleKind
    text: str
    changes: tuple[Change, ...] = ()


class Bound(msgspec.Struct, frozen=True):
    """A limit without the failure that overrides it: what a guard told to only warn
    about failed verifications applies."""

    tokens: int | None
    source: LimitSource


class LimitInForce(msgspec.Struct, frozen=True, kw_only=True):
    """The limit in force for one model of one deployment (see the module's docstring).

    ``tokens``: the largest prompt allowed (0: every prompt is refused; None: nothing is
    known). ``verification_id``, ``verified_safe_context``, ``verified_at``: the passing
    verification it rests on or was measured against (None: never passed). ``verdict``: the
    latest verification's verdict in words (:mod:`policies.verdict`). ``warning``: what a
    guard passes on with every answer. ``structural``, ``leaked_at`` and ``configured`` are
    the decision's other inputs, kept so that a guard can add its own configured limit by
    the same rule (:func:`with_configured`).

    A msgspec struct: the collector serves it as JSON (``GET /v1/limits``, :meth:`as_json`)
    and the gateway decodes it back (:func:`from_json`), so both hold the same value.
    """

    deployment_id: str
    model_id: str
    tokens: int | None
    source: LimitSource
    stale_reasons: tuple[Stale, ...] = ()
    verification_id: int | None = None
    verified_safe_context: int | None = None
    verified_at: datetime | None = None
    verdict: Verdict = Verdict("not_verified", "not verified")
    warning: str | None = None
    without_failure: Bound | None = None
    advertised_context: int | None = None
    prefill_pool_tokens: int | None = None
    structural: int | None = None
    leaked_at: int | None = None
    configured: int | None = None

    @property
    def stale(self) -> bool:
        """A passing verification exists and no longer holds (``stale_reasons`` say why)."""
        return bool(self.stale_reasons)

    @property
    def verified(self) -> bool:
        """Measured clean, and still holding."""
        return self.source == "verified" and not self.stale

    @property
    def stale_text(self) -> str | None:
        return "; ".join(s.text for s in self.stale_reasons) or None

    @property
    def text(self) -> str:
        """The limit in words, as every view shows it (:func:`policies.verdict.limit_text`)."""
        return limit_text(
            self.tokens,
            self.source,
            self.verified_safe_context,
            self.verified_at,
            self.verification_id,
            self.stale_text,
        )

    def as_json(self) -> dict[str, Any]:
        """The served form: the fields, plus ``verified`` and ``text`` for readers."""
        doc = msgspec.to_builtins(self)
        doc["stale"] = self.stale
        doc["verified"] = self.verified
        doc["text"] = self.text
        return cast(dict[str, Any], doc)


def from_json(doc: object) -> LimitInForce:
    """A served limit back (unknown keys ignored); ``msgspec.ValidationError`` if it is not
    one."""
    return msgspec.convert(doc, LimitInForce)


def _n(tokens: int) -> str:
    return f"{tokens:,}"


def _stale(
    d: DeploymentFacts,
    model_id: str,
    passing: VerificationFact,
    pool: int | None,
    now: datetime,
) -> tuple[Stale, ...]:
    out: list[Stale] = []
    changed = [
        Change(c.node, name, then, now_value)
        for c in verified_nodes(d.configs.values(), model_id) or d.configs.values()
        for name, (then, now_value) in passing.stale_against(c).items()
    ]
    if changed:
        words = ", ".join(f"{c.setting}: {c.verified} -> {c.now} on {c.node}" for c in changed)
        out.append(Stale("drift", f"changed since the verification: {words}", tuple(changed)))
    vsc = passing.verified_safe_context
    if pool is not None and vsc is not None and pool < vsc:
        out.append(
            Stale(
                "pool_below_verified",
                f"prefill pool {_n(pool)} tokens < verified safe context {_n(vsc)}",
            )
        )
    max_age = d.max_verification_age_s
    if max_age is not None:
        age = (now - passing.verified_at).total_seconds()
        if age > max_age:
            out.append(
                Stale(
                    "too_old",
                    f"verified {human_duration(age)} ago (maximum age {human_duration(max_age)})",
                )
            )
    return tuple(out)


def _decide(
    verified: int | None,
    stale: bool,
    structural: int | None,
    configured: int | None,
    leaked_at: int | None,
    failed: bool,
) -> tuple[int | None, LimitSource, Bound | None]:
    """(tokens, source, without_failure): the one rule, over the decision's inputs."""
    candidates: list[tuple[int, LimitSource]] = []
    if verified:
        candidates.append((verified, "verified"))
    if (not verified or stale) and structural is not None:
        candidates.append((structural, "pool"))
    if configured:
        candidates.append((configured, "configured"))
    # Ties go to the earlier candidate: a configured limit is the source only where it is
    # strictly smaller (a guard that holds prompts to the served limit reports it as its
    # configured one, and changes nothing).
    best: tuple[int | None, LimitSource] = (None, "none")
    for n, s in candidates:
        if best[0] is None or n < best[0]:
            best = (n, s)
    if not failed:
        return best[0], best[1], None
    # Nothing measured clean or configured: nothing is known safe (the sweep tries a few
    # lengths, so its shortest leak only bounds where leaks start).
    known = [n for n, s in candidates if s in ("verified", "configured")]
    if known and leaked_at:
        known.append(leaked_at - 1)
    return (min(known) if known else 0), "failed-verification", Bound(*best)


def limit_in_force(
    d: DeploymentFacts, model_id: str, now: datetime, *, configured: int | None = None
) -> LimitInForce:
    """The limit in force for ``model_id`` on ``d`` at ``now`` (pure; see the module)."""
    latest = d.verifications.get(model_id)
    passing = d.passing.get(model_id)
    if passing is None and latest is not None and latest.verdict == "pass":
        passing = latest
    decided = d.decided.get(model_id)
    if decided is None and latest is not None and latest.verdict != "error":
        decided = latest
    advertised = d.advertised_context(model_id)
    pool = d.prefill_pool_tokens()
    bounds = [b for b in (advertised, pool) if b]
    structural = min(bounds) if bounds else None
    vsc = passing.verified_safe_context if passing is not None else None
    stale = _stale(d, model_id, passing, pool, now) if passing is not None and vsc else ()
    failed = decided is not None and decided.verdict == "fail"
    leaked_at = decided.smallest_leaking_prompt if failed and decided is not None else None
    tokens, source, without_failure = _decide(
        vsc, bool(stale), structural, configured, leaked_at, failed
    )
    said = verdict(decided if failed else latest, passing, stale=bool(stale))
    warning = None
    if failed:
        warning = f"the latest verification of {model_id} failed: {said.text}"
    elif stale:
        warning = f"the verification of {model_id} is stale: " + "; ".join(s.text for s in stale)
    return LimitInForce(
        deployment_id=d.deployment_id,
        model_id=model_id,
        tokens=tokens,
        source=source,
        stale_reasons=stale,
        verification_id=None if passing is None else passing.verification_id,
        verified_safe_context=vsc,
        verified_at=None if passing is None else passing.verified_at,
        verdict=said,
        warning=warning,
        without_failure=without_failure,
        advertised_context=advertised,
        prefill_pool_tokens=pool,
        structural=structural,
        leaked_at=leaked_at,
        configured=configured,
    )


def limits_in_force(d: DeploymentFacts, now: datetime) -> dict[str, LimitInForce]:
    """Every model ``d`` serves or has verified: model id -> its limit in force."""
    models = sorted({c.model_id for c in d.configs.values()} | set(d.verifications))
    return {model: limit_in_force(d, model, now) for model in models}


def with_configured(limit: LimitInForce, configured: int | None) -> LimitInForce:
    """``limit`` decided again with a configured limit (a gateway's ``MODEL=N``) among its
    inputs, by the same rule as :func:`limit_in_force`: a configured limit never loosens
    anything, and under a failed verification it counts as known safe."""
    if not configured or configured == limit.configured:
        return limit
    tokens, source, without_failure = _decide(
        limit.verified_safe_context,
        bool(limit.stale),
        limit.structural,
        min(configured, limit.configured) if limit.configured else configured,
        limit.leaked_at,
        limit.source == "failed-verification",
    )
    return msgspec.structs.replace(
        limit,
        tokens=tokens,
        source=source,
        without_failure=without_failure,
        configured=configured,
    )


def strictest(limits: Iterable[LimitInForce]) -> LimitInForce | None:
    """The smallest of these limits (a model a guard knows no limit for gets it: naming an
    alias, or no model, never bypasses the guard)."""
    known = [lim for lim in limits if lim.tokens is not None]
    return min(known, key=lambda lim: lim.tokens or 0) if known else None


def configured_only(
    deployment_id: str, model_id: str, configured: int | None
) -> LimitInForce | None:
    """A guard's own limit where the collector's decision is not known (no collector)."""
    if not configured:
        return None
    return LimitInForce(
        deployment_id=deployment_id,
        model_id=model_id,
        tokens=configured,
        source="configured",
        configured=configured,
    )


def recordable_safe_context(
    measured: int | None, configs: Iterable[NodeConfig]
) -> tuple[int | None, int | None]:
    """(the safe context a verification is recorded with, the pool it was clamped to or
    None): a prompt longer than the smallest prefill pool serving the model is never safe,
    whatever a sweep saw, so a measurement above it is recorded as the pool (the evidence
    keeps what was measured). ``configs``: the nodes serving the verified model."""
    pools = [c.pool_capacity_tokens for c in configs if c.role != "decode"]
    if measured is None or not pools or measured <= min(pools):
        return measured, None
    return min(pools), min(pools)


def verification_max_age_s(rules: Iterable[Any]) -> float | None:
    """The pack's maximum verification age: the smallest ``max_age`` of the enabled
    ``verification_missing_or_stale`` rules (None: no maximum)."""
    ages = [
        r.params.max_age_s
        for r in rules
        if r.enabled
        and r.kind == "verification_missing_or_stale"
        and getattr(r.params, "max_age_s", None) is not None
    ]
    return min(ages) if ages else None


def by_model(limits: Iterable[LimitInForce]) -> Mapping[str, LimitInForce]:
    return {lim.model_id: lim for lim in limits}


def small_pool_mitigated(limit: LimitInForce | None, pool_tokens: int, open_incident: bool) -> bool:
    """Whether a pool smaller than the advertised context is only an overstated context, not
    the incident's first link: the limit in force is verified (a passing, current
    verification showed prompts past it refused cleanly), fits the pool, and no incident of
    the deployment is open (a leak seen since says otherwise, whatever the verification
    said). The rule ``pool_below_advertised`` (warning instead of critical) and the fleet's
    status (amber instead of red) both ask this."""
    return (
        not open_incident
        and limit is not None
        and limit.verified
        and limit.tokens is not None
        and limit.tokens <= pool_tokens
    )
