"""What a rule kind is: parameters, a default severity and mode, and pure evaluation."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from policies.facts import BatchFacts, TimerFacts
from policies.rule import Rule
from policies.signals import Mode, Severity, Signal


class NoParams(msgspec.Struct, forbid_unknown_fields=True):
    pass


class RuleKind:
    """A kind of rule. Subclasses set the class attributes and override one or both
    evaluators; both are pure (``now`` is passed in) and may raise: the evaluator records
    that as the rule's health.

    ``on_batch`` sees only a batch's new events: its cost must grow with the batch, never
    with history. ``on_timer`` runs every few seconds for absence and state rules.
    """

    name: ClassVar[str]
    params: ClassVar[type[msgspec.Struct]] = NoParams
    default_severity: ClassVar[Severity] = "warning"
    mode: ClassVar[Mode] = "event"
    default_resolve_after_s: ClassVar[float] = 3600.0
    description: ClassVar[str] = ""

    def prepare(self, params: Any, base_dir: Path) -> Any:
        """Load what the parameters refer to (files, relative to the pack's directory);
        raise ``ValueError("name: message")``. Runs once, at load."""
        return params

    def check(self, params: Any) -> None:
        """Cross-field checks of the parameters, after their types; raise ``ValueError``
        naming the parameter (``"name: message"``)."""

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        return ()

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return ()
