"""``telemetry_gap``: what kvwatch cannot see. Lost events (seq gaps), requests without token
counts or model ID (the incident's fourth link: nobody could say afterwards which requests
crossed the threshold), and probes that went silent."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import msgspec

from engine_probe import events as ev
from policies.durations import format_duration, parse_duration
from policies.facts import BatchFacts, TimerFacts, superseded
from policies.kinds.base import RuleKind
from policies.rule import Rule
from policies.signals import Signal


class TelemetryParams(msgspec.Struct, forbid_unknown_fields=True):
    seq_gaps: bool = True
    missing_fields: bool = True
    silent_after: Any = "5m"
    forget_after: Any = "24h"
    silent_after_s: float = 300.0
    forget_after_s: float = 86400.0


class TelemetryGap(RuleKind):
    name = "telemetry_gap"
    params = TelemetryParams
    default_severity = "warning"
    mode = "event"
    default_resolve_after_s = 3600.0
    description = (
        "Seq gaps (events lost), requests without prompt/completion token counts or model "
        "ID, and probes silent for longer than silent_after (forgotten after forget_after); "
        "a probe that stopped cleanly, or was replaced by its restarted engine's new probe, "
        "is not silent."
    )

    def check(self, params: TelemetryParams) -> None:
        for name in ("silent_after", "forget_after"):
            try:
                parse_duration(getattr(params, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None

    def prepare(self, params: TelemetryParams, base_dir: Any) -> TelemetryParams:
        silent = parse_duration(params.silent_after)
        forget = parse_duration(params.forget_after)
        if forget <= silent:
            raise ValueError("forget_after: must be longer than silent_after")
        return msgspec.structs.replace(params, silent_after_s=silent, forget_after_s=forget)

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        p: TelemetryParams = rule.params
        if p.seq_gaps:
            for g in facts.seq_gaps:
                lost = g.last_seq - g.first_seq + 1
                yield rule.signal(
                    "event",
                    {
                        "deployment_id": g.deployment_id,
                        "probe_id": g.probe_id,
                        "problem": "seq_gap",
                    },
                    value=float(lost),
                    annotations={
                        "summary": f"probe {g.probe_id} skipped seq {g.first_seq}..{g.last_seq} "
                        f"({lost} event(s) not received)"
                    },
                )
        if not p.missing_fields:
            return
        missing: dict[tuple[str, str], set[str]] = {}
        for e in facts.of(ev.RequestAdmitted, ev.RequestFinished):
            problems = []
            if isinstance(e, ev.RequestAdmitted):
                if e.prompt_tokens is None:
                    problems.append("missing_token_counts")
                if e.model_id is None:
                    problems.append("missing_model_id")
            elif isinstance(e, ev.RequestFinished) and e.completion_tokens is None:
                problems.append("missing_token_counts")
            for problem in problems:
                missing.setdefault((e.deployment_id, problem), set()).add(e.request_id)  # type: ignore[attr-defined]
        for (dep, problem), requests in missing.items():
            what = "token counts" if problem == "missing_token_counts" else "a model ID"
            yield rule.signal(
                "event",
                {"deployment_id": dep, "problem": problem},
                value=float(len(requests)),
                count=len(requests),
                annotations={
                    "summary": f"{len(requests)} request(s) on {dep} reported without {what}"
                },
            )

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        p: TelemetryParams = rule.params
        successors = superseded(facts.probes)
        for probe in facts.probes:
            quiet = (now - probe.last_seen).total_seconds()
            # A probe that said it stopped, or whose engine came back under a new probe, is
            # not silent: it left no events behind that kvwatch could be missing.
            successor = successors.get(probe.probe_id)
            if probe.stopped_at is not None:
                why = "stopped cleanly"
            elif successor is not None:
                why = f"replaced by probe {successor}"
            else:
                why = None
            summary = (
                f"probe {probe.probe_id} of {probe.deployment_id} silent for "
                f"{format_duration(round(quiet))} (limit {format_duration(p.silent_after_s)})"
            )
            yield rule.signal(
                "state",
                {
                    "deployment_id": probe.deployment_id,
                    "probe_id": probe.probe_id,
                    "problem": "silent",
                },
                firing=why is None and p.silent_after_s < quiet <= p.forget_after_s,
                value=round(quiet, 1),
                annotations={"summary": summary if why is None else f"{summary}; {why}"},
            )
