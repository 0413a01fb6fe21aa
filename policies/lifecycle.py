"""The alert state machine, pure: what a signal or the passing of time does to an alert.

States: ``pending`` (the condition holds, not yet for the rule's ``for``) → ``firing`` →
``resolved``. A resolved alert that fires again starts over at pending (or firing, with no
``for``): the same alert (same fingerprint), a new episode; its acknowledgement is cleared.

Event-mode alerts resolve once no occurrence has come for the rule's ``resolve_after``,
counted from the occurrences' own time (``last_seen_at``; never later than the evaluation),
so events that arrive late (a probe's spool replayed after an outage, a loaded history) fire
their alert and let it resolve as their time says, not hours after they happened;
state-mode alerts resolve when a signal says the condition no longer holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

from policies.rule import Rule
from policies.signals import Signal

State = Literal["pending", "firing", "resolved"]
#: an incident's states: open until a person closes it (the API's, the CLI's and the
#: dashboard's filters take these)
IncidentState = Literal["open", "closed"]


@dataclass(frozen=True, slots=True)
class AlertState:
    """What the lifecycle needs of a stored alert."""

    fingerprint: str
    state: State
    mode: str
    active_since: datetime
    last_seen_at: datetime
    fired_at: datetime | None = None
    resolved_at: datetime | None = None
    occurrences: int = 0
    value: float | None = None
    acked: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """An alert after a step, and the transition it made (``None``: no state change)."""

    alert: AlertState
    transition: State | None


def on_signal(prev: AlertState | None, signal: Signal, rule: Rule, now: datetime) -> Step | None:
    """Apply one signal. ``None`` when there is nothing to store (a condition that does not
    hold, for an alert that does not exist or is already resolved)."""
    if not signal.firing:
        if prev is None or prev.state == "resolved":
            return None
        return Step(
            replace(prev, state="resolved", resolved_at=now, value=signal.value, acked=False),
            "resolved",
        )
    seen_at = now
    if signal.mode == "event" and signal.occurred_at is not None:
        seen_at = min(now, signal.occurred_at)
    if prev is None or prev.state == "resolved":
        start = AlertState(
            fingerprint=signal.fingerprint,
            state="pending",
            mode=signal.mode,
            active_since=now,
            last_seen_at=seen_at,
            occurrences=signal.count,
            value=signal.value,
        )
        if rule.for_s <= 0:
            return Step(replace(start, state="firing", fired_at=now), "firing")
        return Step(start, "pending")
    seen = replace(
        prev,
        last_seen_at=max(prev.last_seen_at, seen_at),
        occurrences=prev.occurrences + signal.count,
        value=signal.value,
    )
    if prev.state == "pending" and now - prev.active_since >= timedelta(seconds=rule.for_s):
        return Step(replace(seen, state="firing", fired_at=now), "firing")
    return Step(seen, None)


def on_tick(prev: AlertState, rule: Rule | None, now: datetime) -> Step | None:
    """The passing of time: an event alert with no occurrence for ``resolve_after`` resolves
    (so does any alert whose rule is gone); a pending alert whose ``for`` has elapsed fires
    (state alerts while their condition still holds: a signal would have resolved them).
    ``None`` when nothing changes."""
    if prev.state == "resolved":
        return None
    if rule is None or not rule.enabled:
        return Step(replace(prev, state="resolved", resolved_at=now, acked=False), "resolved")
    quiet = now - prev.last_seen_at
    if prev.mode == "event" and quiet >= timedelta(seconds=rule.resolve_after_s):
        return Step(replace(prev, state="resolved", resolved_at=now, acked=False), "resolved")
    if prev.state == "pending" and now - prev.active_since >= timedelta(seconds=rule.for_s):
        return Step(replace(prev, state="firing", fired_at=now), "firing")
    return None
