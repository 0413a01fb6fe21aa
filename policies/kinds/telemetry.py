"""``telemetry_gap``: what kvwatch cannot see. Lost events (seq gaps), requests without token
counts or model ID (the incident's fourth link: nobody could say afterwards which requests
crossed the threshold), probes that went silent, probes that went away with requests open
(``lost_requests``: the collector closed them as lost, ``collector.lost``), and sources a live
producer watches that went silent (``source.gap``: ``kvwatch kv-events`` subscribed to an
engine's KV events that never come while the engine serves, ``kvwatch scrape`` whose target
stopped answering).

A probe that sends nothing may be *silent* (it should be sending and is not: a crashed
engine, a lost network) or *idle* (nothing happens to report: a gateway nobody calls, an
engine without traffic). Only a silent probe fires; what tells them apart is evidence that
it should be sending (:func:`evidence`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import msgspec

from engine_probe import events as ev
from policies.durations import human_duration, parse_duration
from policies.facts import BatchFacts, ProbeFact, SeqGapFact, TimerFacts, superseded
from policies.kinds.base import RuleKind
from policies.rule import Rule
from policies.signals import Signal


class TelemetryParams(msgspec.Struct, forbid_unknown_fields=True):
    seq_gaps: bool = True
    missing_fields: bool = True
    source_gaps: bool = True
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
        "ID, sources a producer watches that went silent (source.gap: a state, until the "
        "producer's next figures or its clean stop), and probes silent for longer than "
        "silent_after (forgotten after forget_after): "
        "quiet while something says they should be sending (another probe of the deployment "
        "sent since, requests were in flight, it sampled on a clock, its scrape fails). A "
        "quiet probe without such evidence is idle, and does not fire; nor does one that "
        "stopped cleanly or was replaced by its restarted engine's new probe, unless it went "
        "away with requests open (problem lost_requests: the collector closed them as lost)."
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
            # A probe first heard from past seq 1 lost its start (or was never a probe):
            # one alert per deployment for all of them, never one per probe id, so a flood
            # of made-up probe ids cannot raise an alert (and a page) each.
            at_start: dict[str, list[SeqGapFact]] = {}
            for g in facts.seq_gaps:
                if g.first_seq == 1:
                    at_start.setdefault(g.deployment_id, []).append(g)
                    continue
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
            for dep, gaps in at_start.items():
                lost = sum(g.last_seq for g in gaps)
                names = sorted({g.probe_id for g in gaps})
                shown = ", ".join(names[:5]) + (
                    f" and {len(names) - 5} more" if len(names) > 5 else ""
                )
                yield rule.signal(
                    "event",
                    {"deployment_id": dep, "problem": "seq_gap_at_start"},
                    value=float(lost),
                    count=len(names),
                    annotations={
                        "summary": f"{len(names)} probe(s) first heard from past seq 1 "
                        f"({lost} event(s) before their first batch not received): {shown}"
                    },
                )
        if p.source_gaps:
            yield from _source_gaps(rule, facts)
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
        by_deployment: dict[str, list[ProbeFact]] = {}
        for probe in facts.probes:
            by_deployment.setdefault(probe.deployment_id, []).append(probe)
        for probe in facts.probes:
            quiet = (now - probe.last_seen).total_seconds()
            name = f"probe {probe.probe_id} of {probe.deployment_id}"
            # A probe that said it stopped, or whose engine came back under a new probe, is
            # not silent: it left no events behind that kvwatch could be missing.
            successor = successors.get(probe.probe_id)
            why = None
            if probe.stopped_at is not None:
                state = "stopped"
                summary = f"{name} quiet for {human_duration(quiet)}; stopped cleanly"
            elif successor is not None:
                state = "replaced"
                summary = f"{name} quiet for {human_duration(quiet)}; replaced by probe {successor}"
            elif quiet <= p.silent_after_s:
                state, summary = "sending", f"{name} heard from {human_duration(quiet)} ago"
            else:
                why = evidence(probe, by_deployment[probe.deployment_id], p.silent_after_s, now)
                state = "idle" if why is None else "silent"
                summary = (
                    f"{name} silent for {human_duration(quiet)} (limit "
                    f"{human_duration(p.silent_after_s)}): {why}"
                    if why is not None
                    else f"{name} idle for {human_duration(quiet)}: nothing says it should be "
                    "sending (no other probe of the deployment heard from since, no request "
                    "in flight, no sampling on a clock)"
                )
            yield rule.signal(
                "state",
                {
                    "deployment_id": probe.deployment_id,
                    "probe_id": probe.probe_id,
                    "problem": "silent",
                },
                firing=why is not None and quiet <= p.forget_after_s,
                value=round(quiet, 1),
                annotations={"summary": summary, "state": state},
            )
            if probe.lost:
                # A probe that went away with requests open (an engine killed or restarted
                # mid-request: vLLM's SIGTERM sends no probe.stopped): how they ended is what
                # kvwatch cannot see. Not twice: a silent probe's alert already says so.
                yield rule.signal(
                    "state",
                    {
                        "deployment_id": probe.deployment_id,
                        "probe_id": probe.probe_id,
                        "problem": "lost_requests",
                    },
                    firing=why is None and quiet <= p.forget_after_s,
                    value=float(probe.lost),
                    annotations={
                        "summary": f"{name} went away ({probe.gone_reason or state}) with "
                        f"{probe.lost} request(s) it admitted still open: closed as lost, "
                        "their outcome unknown",
                        "state": state,
                    },
                )


# What a producer sends when its source gives figures again: an interval of data (the
# KV-events consumer's kv.turnover, the scraper's pool.sample) ends its gap, as does its
# clean stop (it watches nothing any more).
_SOURCE_BACK = (ev.KvTurnover, ev.PoolSample, ev.ProbeStopped)


def _source_gaps(rule: Rule, facts: BatchFacts) -> Iterable[Signal]:
    """A state per producer (probe) whose batch holds a ``source.gap``, or figures after
    one: firing while its latest word (by seq) is a gap, resolved by the first figures or
    its clean stop. One signal per probe, from its latest event: the state of a gap followed
    by data in one batch is the data's."""
    latest: dict[str, ev.Event] = {}
    for e in facts.of(ev.SourceGap, *_SOURCE_BACK):
        if e.probe_id not in latest or e.seq > latest[e.probe_id].seq:
            latest[e.probe_id] = e
    for probe_id, e in latest.items():
        labels = {
            "deployment_id": e.deployment_id,
            "probe_id": probe_id,
            "problem": "source_silent",
        }
        if isinstance(e, ev.SourceGap):
            what = "KV events" if e.source == "kv_events" else "metrics"
            yield rule.signal(
                "state",
                labels,
                value=e.silent_s,
                annotations={
                    "summary": f"{what} of node {e.node} ({e.deployment_id}) silent for "
                    f"{human_duration(e.silent_s)}, reported by {probe_id}: {e.reason}",
                    "node": e.node,
                    "source": e.source,
                    "cause": e.cause,
                },
            )
        else:
            yield rule.signal(
                "state",
                labels,
                firing=False,
                annotations={
                    "summary": f"{probe_id} of {e.deployment_id}: "
                    + ("stopped cleanly" if isinstance(e, ev.ProbeStopped) else "figures again")
                },
            )


def evidence(
    probe: ProbeFact, deployment: Sequence[ProbeFact], silent_after_s: float, now: datetime
) -> str | None:
    """Why a quiet probe should be sending (then it is *silent*), or None (it is *idle*):

    - another probe of its deployment was heard from after this one had been quiet for
      ``silent_after`` (the deployment is alive; a probe that samples on a clock, such as the
      collector's scraper, proves no traffic and does not count);
    - requests admitted before it went quiet never finished (``ProbeFact.in_flight``);
    - it sampled its pool on a clock and has missed at least one beat
      (``ProbeFact.sample_period_s``);
    - the collector's own scrape of its engine fails (``ProbeFact.scrape_error``).
    """
    quiet = (now - probe.last_seen).total_seconds()
    heard = [
        other
        for other in deployment
        if other.probe_id != probe.probe_id
        and other.sample_period_s is None
        and (other.last_seen - probe.last_seen).total_seconds() >= silent_after_s
    ]
    if heard:
        latest = max(heard, key=lambda o: o.last_seen)
        ago = human_duration((now - latest.last_seen).total_seconds())
        return f"probe {latest.probe_id} of the same deployment was heard from {ago} ago"
    if probe.in_flight:
        return f"{probe.in_flight} request(s) admitted before it went quiet never finished"
    period = probe.sample_period_s
    if period is not None and quiet >= 2 * period:
        return f"it sampled its pool every {human_duration(period)} and stopped"
    if probe.scrape_error:
        return f"the collector's scrape of its engine fails: {probe.scrape_error}"
    return None


def probe_evidence_after(rules: Iterable[Rule]) -> float | None:
    """How long a probe must have been quiet before the timer's facts need its evidence (the
    shortest ``silent_after`` of these rules' ``telemetry_gap`` ones); None when none is
    among them, and the collector loads no evidence."""
    after = [r.params.silent_after_s for r in rules if r.kind == TelemetryGap.name]
    return min(after) if after else None
