"""``bus_lag``: the ingest bus's writers are behind. With the bus, a probe's batch is answered
once it is on the stream; until a writer stores it, no rule sees its events. A partition whose
oldest batch has waited longer than ``lag_after`` is therefore a blind spot of every other
rule (and, left alone, a full stream and 503s at the probes). Fires per partition; also when
the bus cannot be read at all. Silent without a bus (no reading)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import msgspec

from policies.durations import human_duration, parse_duration
from policies.facts import TimerFacts
from policies.kinds.base import RuleKind
from policies.rule import Rule
from policies.signals import Signal


class BusLagParams(msgspec.Struct, forbid_unknown_fields=True):
    lag_after: Any = "60s"
    lag_after_s: float = 60.0


class BusLag(RuleKind):
    name = "bus_lag"
    params = BusLagParams
    default_severity = "warning"
    mode = "state"
    default_resolve_after_s = 0.0
    description = (
        "A partition of the ingest bus whose oldest batch not yet stored has waited longer "
        "than lag_after (writers stopped, too few, or the database slow), and a bus that "
        "cannot be read; its events are stored late, and no rule sees them until then."
    )

    def check(self, params: BusLagParams) -> None:
        try:
            parse_duration(params.lag_after)
        except ValueError as exc:
            raise ValueError(f"lag_after: {exc}") from None

    def prepare(self, params: BusLagParams, base_dir: Any) -> BusLagParams:
        return msgspec.structs.replace(params, lag_after_s=parse_duration(params.lag_after))

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        bus = facts.bus
        if bus is None:
            return
        p: BusLagParams = rule.params
        yield rule.signal(
            "state",
            {"stream": bus.stream, "partition": "", "problem": "unreadable"},
            firing=bus.error is not None,
            annotations={
                "summary": f"the ingest bus (stream {bus.stream}) cannot be read: {bus.error}"
                if bus.error
                else f"the ingest bus (stream {bus.stream}) answers"
            },
        )
        limit = human_duration(p.lag_after_s)
        for part in bus.partitions:
            late = part.lag_s > p.lag_after_s
            yield rule.signal(
                "state",
                {"stream": bus.stream, "partition": str(part.partition), "problem": "lag"},
                firing=late,
                value=round(part.lag_s, 1),
                annotations={
                    "summary": (
                        f"partition {part.partition} of {bus.stream}: its oldest batch not yet "
                        f"stored has waited {human_duration(part.lag_s)} (limit {limit}); "
                        f"{part.pending} batch(es) waiting, {part.redelivered} handed out "
                        "again. Are the writers (kvwatch writer) running, and the database?"
                    )
                    if late
                    else f"partition {part.partition} of {bus.stream} within {limit}"
                },
            )
