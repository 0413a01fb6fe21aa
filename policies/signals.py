"""What rules produce: signals, each naming the alert it feeds by a fingerprint of its labels."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
Mode = Literal["state", "event"]


def severity_rank(severity: Severity) -> int:
    return SEVERITIES.index(severity)


def fingerprint(labels: Mapping[str, str]) -> str:
    """The alert's identity: a hash of its labels, independent of their order (as
    Prometheus/Alertmanager identify alerts by label set). 32 hex digits."""
    h = hashlib.sha256()
    for key in sorted(labels):
        # NUL cannot occur in a label (the wire contract refuses control characters), so it
        # separates keys and values unambiguously.
        h.update(key.encode())
        h.update(b"\0")
        h.update(labels[key].encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Signal:
    """One rule's finding about one subject in one evaluation.

    ``mode``: ``event`` signals are occurrences (a stale read, an over-threshold prompt): the
    alert fires with them and resolves once none has come for the rule's ``resolve_after``.
    ``state`` signals report a condition evaluated now (pool smaller than advertised): with
    ``firing=False`` they resolve the alert of the same labels.

    ``labels`` include ``alertname`` (the rule) and ``severity``; the fingerprint is theirs.
    ``opens_incident``: a critical isolation finding that must open (or join) an incident.
    ``occurred_at``: for an event signal, when its latest occurrence happened (the events'
    own ``ts``), which can be long before the evaluation when a probe replays its spool or a
    history is loaded; ``resolve_after`` counts from it. None: at the evaluation.
    """

    rule: str
    kind: str
    severity: Severity
    mode: Mode
    labels: Mapping[str, str]
    firing: bool = True
    annotations: Mapping[str, str] = field(default_factory=dict)
    value: float | None = None
    count: int = 1
    deployment_id: str | None = None
    opens_incident: bool = False
    occurred_at: datetime | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)

    def merge(self, other: Signal) -> Signal:
        """Two signals of one fingerprint in one evaluation: one, firing if either is, with
        the larger value, the counts added, the later annotations and occurrence."""
        values = [v for v in (self.value, other.value) if v is not None]
        times = [t for t in (self.occurred_at, other.occurred_at) if t is not None]
        return Signal(
            rule=self.rule,
            kind=self.kind,
            severity=self.severity,
            mode=self.mode,
            labels=self.labels,
            firing=self.firing or other.firing,
            annotations={**self.annotations, **other.annotations},
            value=max(values) if values else None,
            count=self.count + other.count,
            deployment_id=self.deployment_id,
            opens_incident=self.opens_incident or other.opens_incident,
            occurred_at=max(times) if times else None,
        )
