"""kvwatch's policy engine: rule packs (YAML, validated on load) and rule kinds (code), evaluated
purely over a batch of events or the timer's view, with ``now`` passed in.

Imports only ``engine_probe.events`` of kvwatch, and no web or database framework: the
collector loads the facts, calls :func:`evaluate_batch` / :func:`evaluate_timer`, and stores
what the :mod:`policies.lifecycle` functions return.
"""

from __future__ import annotations

from policies.errors import PackError, PackErrors, PolicyError, RuleError
from policies.evaluate import Evaluation, RuleHealth, evaluate_batch, evaluate_timer
from policies.facts import (
    BatchFacts,
    BusFact,
    BusPartitionFact,
    DeploymentFacts,
    NodeConfig,
    PrefixHitFact,
    ProbeFact,
    SeqGapFact,
    TimerFacts,
    VerificationFact,
)
from policies.kinds import KINDS
from policies.lifecycle import AlertState, Step, on_signal, on_tick
from policies.pack import RulePack, RuleSet, default_pack, load_pack, load_ruleset
from policies.rule import Rule
from policies.signals import SEVERITIES, Signal, fingerprint, severity_rank

__all__ = [
    "KINDS",
    "SEVERITIES",
    "AlertState",
    "BatchFacts",
    "BusFact",
    "BusPartitionFact",
    "DeploymentFacts",
    "Evaluation",
    "NodeConfig",
    "PackError",
    "PackErrors",
    "PolicyError",
    "PrefixHitFact",
    "ProbeFact",
    "Rule",
    "RuleError",
    "RuleHealth",
    "RulePack",
    "RuleSet",
    "SeqGapFact",
    "Signal",
    "Step",
    "TimerFacts",
    "VerificationFact",
    "default_pack",
    "evaluate_batch",
    "evaluate_timer",
    "fingerprint",
    "load_pack",
    "load_ruleset",
    "on_signal",
    "on_tick",
    "severity_rank",
]
