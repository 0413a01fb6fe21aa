"""Pure evaluation: rules over a batch or the timer's view, ``now`` passed in.

A rule that raises is reported unhealthy (with its error) and yields nothing; the others
still run: one broken rule never breaks ingest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from policies.facts import BatchFacts, TimerFacts
from policies.kinds import KINDS
from policies.pack import RuleSet
from policies.rule import Rule
from policies.signals import Signal

_MAX_ERROR = 2000


@dataclass(frozen=True, slots=True)
class RuleHealth:
    rule: str
    kind: str
    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Signals, one per fingerprint (merged), in the order rules produced them; and each
    evaluated rule's health."""

    signals: list[Signal] = field(default_factory=list)
    health: list[RuleHealth] = field(default_factory=list)


def _run(rules: Iterable[Rule], call: Callable[[Rule], Iterable[Signal]]) -> Evaluation:
    merged: dict[str, Signal] = {}
    health = []
    for rule in rules:
        try:
            produced = list(call(rule))
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR]
            health.append(RuleHealth(rule.name, rule.kind, False, text))
            continue
        health.append(RuleHealth(rule.name, rule.kind, True))
        for s in produced:
            fp = s.fingerprint
            merged[fp] = merged[fp].merge(s) if fp in merged else s
    return Evaluation(list(merged.values()), health)


def evaluate_batch(rules: RuleSet, facts: BatchFacts, now: datetime) -> Evaluation:
    """Every enabled rule over a batch of new events."""
    return _run(rules.enabled(), lambda r: KINDS[r.kind].on_batch(r, facts, now))


def evaluate_timer(rules: RuleSet, facts: TimerFacts, now: datetime) -> Evaluation:
    """Every enabled rule's absence and state checks."""
    return _run(rules.enabled(), lambda r: KINDS[r.kind].on_timer(r, facts, now))
