"""A compiled rule: one entry of a rule pack, validated, with its kind's parameters."""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from policies.signals import Mode, Severity, Signal


class _Missing(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def render(template: str, labels: Mapping[str, str]) -> str:
    """``{label}`` placeholders in an annotation filled from the alert's labels (unknown
    ones are left as written: a typo shows, it does not fail the rule)."""
    try:
        return string.Formatter().vformat(template, (), _Missing(labels))
    except (ValueError, IndexError):
        return template


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of a pack. ``params`` is the kind's parameter struct; durations are seconds.

    ``for_s``: how long an alert stays pending before it fires. ``resolve_after_s``: for
    event rules, how long without an occurrence before the alert resolves. ``group_by``,
    ``repeat_interval_s``, ``incident_deadline_s`` and ``reminders_before_s`` come from the
    pack. ``source`` is ``file:line`` of the rule, for messages. ``runbook_url``: the pack's
    own runbook for this rule, overriding the kind's (``collector.runbooks.runbook_url``).
    """

    name: str
    kind: str
    severity: Severity
    params: Any
    for_s: float = 0.0
    resolve_after_s: float = 3600.0
    enabled: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    group_by: tuple[str, ...] = ("alertname", "deployment_id")
    repeat_interval_s: float = 4 * 3600.0
    incident_deadline_s: float = 72 * 3600.0
    reminders_before_s: tuple[float, ...] = ()
    pack: str = "default"
    source: str = ""
    runbook_url: str | None = None

    def signal(
        self,
        mode: Mode,
        labels: Mapping[str, str],
        *,
        firing: bool = True,
        severity: Severity | None = None,
        annotations: Mapping[str, str] | None = None,
        value: float | None = None,
        count: int = 1,
        deployment_id: str | None = None,
        opens_incident: bool = False,
        occurred_at: datetime | None = None,
    ) -> Signal:
        """A signal of this rule: the pack's labels, the finding's, then ``alertname`` and
        ``severity`` (which neither may override); the pack's annotations rendered with the
        labels, then the finding's own."""
        sev = severity or self.severity
        full = {**self.labels, **labels, "alertname": self.name, "severity": sev}
        notes = {k: render(v, full) for k, v in self.annotations.items()}
        if annotations:
            notes.update(annotations)
        return Signal(
            rule=self.name,
            kind=self.kind,
            severity=sev,
            mode=mode,
            labels=full,
            firing=firing,
            annotations=notes,
            value=value,
            count=count,
            deployment_id=deployment_id
            if deployment_id is not None
            else labels.get("deployment_id"),
            opens_incident=opens_incident,
            occurred_at=occurred_at,
        )
