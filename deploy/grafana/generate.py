"""kvwatch's Grafana dashboards, as code.

``python -m deploy.grafana.generate`` (or ``python deploy/grafana/generate.py``) writes
``kvwatch-operator.json`` and ``kvwatch-engines.json`` beside this file; ``--check`` writes
nothing and exits 1 if the committed files differ from what this script generates (the test
``tests/test_grafana_dashboards.py`` fails the same way). Edit this script, never the JSON.

Built with the Grafana Foundation SDK (``grafana-foundation-sdk``, pinned in pyproject.toml:
a new release may change the JSON it writes, so it is bumped on purpose and the files
regenerated). Every panel reads the Prometheus data source picked in the ``datasource``
variable; kvwatch's series come from the collector's ``/metrics``, the engines' from vLLM's
or SGLang's own ``/metrics`` and the gateway's, joined on the ``deployment`` and model labels
(see docs/grafana.md for the scrape configuration that gives engine targets a ``deployment``
label).

Several collector replicas report the same database-backed gauges, so those are folded with
``max``/``min`` by their labels, never summed; the in-process ingest counters are summed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

HERE = Path(__file__).resolve().parent
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"  # Grafana's: at least four scrape intervals, whatever the zoom
DEP = 'deployment=~"$deployment"'
# Engine and gateway series: model_name is vLLM's and SGLang's label, model the gateway's.
ENGINE = f'model_name=~"$model", {DEP}'
GATEWAY = f'model=~"$model", {DEP}'
KV_MODEL = f'model=~"$model", {DEP}'
WARN_RATIO = 0.8  # the default pack's context_pressure warn_ratio (policies/packs/default.yaml)
# Label values the panels' descriptions name, as the servers publish them (the test checks
# them against a real Prometheus scraping the reference engine and the gateway): vLLM's
# finished_reason, and the gateway's outcome, limit source and refusal reasons (the wire
# contract's reject reasons, engine_probe.events.RejectReason).
VLLM_FINISHED_REASONS = ("stop", "length", "abort")
GATEWAY_OUTCOMES = ("forwarded", "refused", "error")
GATEWAY_LIMIT_SOURCES = ("verified", "configured", "pool", "failed-verification", "none")
GATEWAY_REFUSAL_REASONS = (
    "context_length_exceeded",
    "pool_exhausted",
    "invalid_request",
    "rate_limited",
    "other",
)


@dataclass(frozen=True)
class Q:
    """One PromQL query of a panel and its legend."""

    expr: str
    legend: str = ""


def _target(q: Q, ref: str, *, instant: bool = False) -> prometheus.Dataquery:
    t = prometheus.Dataquery().expr(q.expr).ref_id(ref).datasource(DS)
    if q.legend:
        t = t.legend_format(q.legend)
    if instant:
        t = t.instant().format(pm.PromQueryFormat.TABLE)
    return t


def _refs(n: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(n)]


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in steps])
    )


def series(
    title: str,
    description: str,
    queries: Iterable[Q],
    *,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    lines: tuple[tuple[float, str], ...] = (),
    min_val: float | None = 0,
    max_val: float | None = None,
) -> timeseries.Panel:
    """A time series panel; ``lines``: threshold lines drawn dashed across it."""
    qs = list(queries)
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            cb.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.LIST)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)
        )
        .targets([_target(q, r) for q, r in zip(qs, _refs(len(qs)), strict=True)])
    )
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if lines:
        p = p.thresholds(_thresholds((None, "transparent"), *lines)).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    return p


def single(
    title: str,
    description: str,
    q: Q,
    *,
    bad_at: float = 1,
    color: str = "red",
    width: int = 4,
) -> stat.Panel:
    """A stat: green, turning ``color`` at ``bad_at``. No series at all reads as 0 (a labelled
    series exists only once something happened), never as "No data"."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit("short")
        .decimals(0)
        .no_value("0")
        .span(width)
        .height(4)
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(_thresholds((None, "green"), (bad_at, color)))
        .with_target(_target(q, "A"))
    )


def _variables(d: db.Dashboard, *, with_model: bool) -> db.Dashboard:
    d = d.with_variable(
        db.DatasourceVariable("datasource")
        .label("Prometheus")
        .type("prometheus")
        .description("The Prometheus that scrapes kvwatch's collector (and the engines).")
    ).with_variable(
        db.QueryVariable("deployment")
        .label("Deployment")
        .datasource(DS)
        # every deployment /metrics publishes (with zeros), even one only verified from outside
        .query("label_values(kvwatch_deployment_stale_reads_1h, deployment)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    if with_model:
        d = d.with_variable(
            db.QueryVariable("model")
            .label("Model")
            .datasource(DS)
            .description(
                "kvwatch's model id; the engines' model_name and the gateway's model must "
                "be the same name to join."
            )
            .query(f"label_values(kvwatch_deployment_safe_context_tokens{{{DEP}}}, model)")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    return d


def _dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kvwatch"])
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink("kvwatch dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["kvwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


# --------------------------------------------------------------------------- the operator's


def _fleet_table() -> table.Panel:
    by = f"by (deployment, model) ({{q}}{{{DEP}{{extra}}}})"

    def agg(fn: str, metric: str, extra: str = "") -> str:
        return f"{fn} " + by.replace("{q}", metric).replace("{extra}", extra)

    queries = [
        (agg("max", "kvwatch_deployment_advertised_context_tokens"), "Advertised context"),
        (
            agg("min", "kvwatch_deployment_pool_capacity_tokens", ', role!="decode"'),
            "Prefill pool",
        ),
        (agg("min", "kvwatch_deployment_safe_context_tokens"), "Safe context"),
        (agg("min", "kvwatch_deployment_verified_safe_context_tokens"), "Verified safe context"),
        (
            "time() - "
            + agg("max", "kvwatch_deployment_last_passed_verification_timestamp_seconds"),
            "Since last verified",
        ),
    ]
    refs = _refs(len(queries))
    p = (
        table.Panel()
        .title("Context per deployment: advertised vs pool vs verified safe context")
        .description(
            "The incident in one row: a model advertised a longer context than its prefill "
            "pool holds. Safe context is what kvwatch measures prompts against (the verified "
            "safe context while a passing verification still matches every node, else "
            "min(advertised, prefill pool)); Verified safe context is empty when no current "
            "verification backs it (`kvwatch verify`)."
        )
        .datasource(DS)
        .unit("short")
        .span(24)
        .height(8)
        .targets([_target(Q(e), r, instant=True) for (e, _), r in zip(queries, refs, strict=True)])
        # one row per (deployment, model): the queries' tables merged on their labels
        .with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "indexByName": {
                        "deployment": 0,
                        "model": 1,
                        **{f"Value #{r}": i + 2 for i, r in enumerate(refs)},
                    },
                    "renameByName": {
                        "deployment": "Deployment",
                        "model": "Model",
                        **{f"Value #{r}": name for (_, name), r in zip(queries, refs, strict=True)},
                    },
                },
            )
        )
        .override_by_name("Since last verified", [dm.DynamicConfigValue(id_val="unit", value="s")])
    )
    return p


def operator() -> db.Dashboard:
    d = _dashboard(
        "kvwatch-operator",
        "kvwatch: fleet",
        "kvwatch's view of the fleet: advertised context vs KV pool vs verified safe context, "
        "context pressure, pool occupancy, stale reads and canary hits, alerts and incidents, "
        "ingest health and probe gaps. Series from the collector's /metrics.",
    )
    d = _variables(d, with_model=False)

    d = d.with_row(db.Row("Now"))
    d = d.with_panel(
        single(
            "Open incidents",
            "Incidents open now (a cross-tenant stale read, a failed verification).",
            Q("max(kvwatch_incidents_open)"),
        )
    )
    d = d.with_panel(
        single(
            "Critical alerts firing",
            "kvwatch's own alerts, by the default pack or yours.",
            Q('sum(max by (rule) (kvwatch_alerts_firing{severity="critical"}))'),
        )
    )
    d = d.with_panel(
        single(
            "Stale reads, last hour",
            "A request reading KV pages another request left behind (page.stale_read), canary "
            "hits included, as the stale_page_read rule counts them.",
            Q(
                "sum(max by (deployment, cross_tenant) "
                f"(kvwatch_deployment_stale_reads_1h{{{DEP}}}))"
            ),
        )
    )
    d = d.with_panel(
        single(
            "Canary hits, last hour",
            "A painted page or planted text found where it must not be (canary.hit).",
            Q(f"sum(max by (deployment) (kvwatch_deployment_canary_hits_1h{{{DEP}}}))"),
        )
    )
    d = d.with_panel(
        single(
            "Events lost (probe gaps)",
            "Events a probe's sequence numbers show as never received (open gaps).",
            Q(f"sum(max by (probe) (kvwatch_probe_missing_events{{{DEP}}}))"),
            color="orange",
        )
    )
    d = d.with_panel(
        single(
            "Deployments left off /metrics",
            "Deployments over KVWATCH_METRICS_MAX_DEPLOYMENTS: their series are not here.",
            Q("max(kvwatch_metrics_deployments_omitted)"),
            color="orange",
        )
    )

    d = d.with_row(db.Row("Context and KV pool"))
    d = d.with_panel(_fleet_table())
    d = d.with_panel(
        series(
            "Advertised context vs prefill pool vs safe context",
            "Over time, per deployment and model (tokens). A pool below the advertised context "
            "is the incident's precondition (pool_below_advertised).",
            [
                Q(
                    "max by (deployment, model) "
                    f"(kvwatch_deployment_advertised_context_tokens{{{DEP}}})",
                    "{{deployment}} {{model}} advertised",
                ),
                Q(
                    "min by (deployment, model) "
                    f'(kvwatch_deployment_pool_capacity_tokens{{{DEP}, role!="decode"}})',
                    "{{deployment}} {{model}} prefill pool",
                ),
                Q(
                    f"min by (deployment, model) (kvwatch_deployment_safe_context_tokens{{{DEP}}})",
                    "{{deployment}} {{model}} safe context",
                ),
                Q(
                    "min by (deployment, model) "
                    f"(kvwatch_deployment_verified_safe_context_tokens{{{DEP}}})",
                    "{{deployment}} {{model}} verified",
                ),
            ],
        )
    )
    d = d.with_panel(
        series(
            "Context pressure: largest prompt of the hour / safe context",
            f"The context_pressure rule warns at {WARN_RATIO:.0%} and is critical at 100%. "
            "The largest prompt is published rounded up to its 9%-wide size bin, and only "
            "with at least KVWATCH_METRICS_MIN_REQUESTS requests in the hour, so this reads "
            "up to 9% high and is empty for a quiet deployment.",
            [
                Q(
                    f"max by (deployment) (kvwatch_deployment_max_prompt_tokens_1h{{{DEP}}})"
                    " / on (deployment) "
                    f"min by (deployment) (kvwatch_deployment_safe_context_tokens{{{DEP}}})",
                    "{{deployment}}",
                )
            ],
            unit="percentunit",
            lines=((WARN_RATIO, "orange"), (1.0, "red")),
        )
    )
    d = d.with_panel(
        series(
            "KV pool occupancy",
            "used / capacity at each node's last pool sample.",
            [
                Q(
                    "max by (deployment, node, role) "
                    f"(kvwatch_deployment_pool_occupancy_ratio{{{DEP}}})",
                    "{{deployment}} {{node}} ({{role}})",
                )
            ],
            unit="percentunit",
            max_val=1,
        )
    )
    d = d.with_panel(
        series(
            "KV pool tokens in use",
            "Tokens in use at each node's last pool sample.",
            [
                Q(
                    "max by (deployment, node, role) "
                    f"(kvwatch_deployment_pool_used_tokens{{{DEP}}})",
                    "{{deployment}} {{node}} ({{role}})",
                )
            ],
        )
    )

    d = d.with_row(db.Row("Leaks"))
    d = d.with_panel(
        series(
            "Stale reads and canary hits, last hour",
            "Counted over the hour before each point, by event time. Any is an incident "
            "when it crosses tenants (stale_page_read).",
            [
                Q(
                    "max by (deployment, cross_tenant) "
                    f"(kvwatch_deployment_stale_reads_1h{{{DEP}}})",
                    "{{deployment}} stale reads (cross-tenant: {{cross_tenant}})",
                ),
                Q(
                    f"max by (deployment) (kvwatch_deployment_canary_hits_1h{{{DEP}}})",
                    "{{deployment}} canary hits",
                ),
            ],
            width=24,
            lines=((1, "red"),),
        )
    )

    d = d.with_row(db.Row("Alerts and incidents"))
    d = d.with_panel(
        series(
            "Alerts by rule",
            "Firing and pending (a rule with `for:` waits before it fires).",
            [
                Q(
                    "max by (rule, severity) (kvwatch_alerts_firing)",
                    "{{rule}} ({{severity}}) firing",
                ),
                Q(
                    "max by (rule, severity) (kvwatch_alerts_pending)",
                    "{{rule}} ({{severity}}) pending",
                ),
            ],
        )
    )
    d = d.with_panel(
        series(
            "Open incidents and unhealthy rules",
            "A rule whose last evaluation raised is unhealthy (see the collector's logs and "
            "GET /v1/rules).",
            [
                Q("max(kvwatch_incidents_open)", "open incidents"),
                Q("sum(1 - min by (rule, kind) (kvwatch_rule_healthy))", "unhealthy rules"),
            ],
        )
    )

    d = d.with_row(db.Row("Ingest health"))
    d = d.with_panel(
        series(
            "Events ingested",
            "Per second, summed over collector replicas; duplicates are retries the "
            "collector recognised (idempotent on probe and seq).",
            [
                Q(
                    f"sum by (result) (rate(kvwatch_ingest_events_total[{RATE}]))",
                    "{{result}}",
                )
            ],
            unit="ops",
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Batches and events refused",
            "Per second, by reason (invalid, too large, unauthorised, database down...). "
            "Policy evaluation failures: batches stored without evaluation.",
            [
                Q(
                    f"sum by (reason) (rate(kvwatch_ingest_rejected_batches_total[{RATE}]))",
                    "batches: {{reason}}",
                ),
                Q(
                    f"sum by (reason) (rate(kvwatch_ingest_rejected_events_total[{RATE}]))",
                    "events: {{reason}}",
                ),
                Q(
                    f"sum(rate(kvwatch_policy_evaluation_failures_total[{RATE}]))",
                    "policy evaluation failures",
                ),
            ],
            unit="ops",
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Batch latency",
            "Decode, validate and store one batch.",
            [
                Q(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kvwatch_ingest_batch_seconds_bucket[{RATE}])))",
                    "p50",
                ),
                Q(
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(kvwatch_ingest_batch_seconds_bucket[{RATE}])))",
                    "p99",
                ),
            ],
            unit="s",
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Events lost per probe (sequence gaps)",
            "Open gaps in each probe's sequence numbers; filled if the events arrive late.",
            [
                Q(
                    f"max by (deployment, probe) (kvwatch_probe_missing_events{{{DEP}}})",
                    "{{deployment}} {{probe}}",
                )
            ],
            width=24,
        )
    )
    return d


# ---------------------------------------------------------------------------- the engines'

ENGINE_BY = "deployment, model_name"
ENGINE_LEGEND = "{{deployment}} {{model_name}}"


def _quantile(q: float, metric: str, labels: str, by: str) -> str:
    inner = f"rate({metric}_bucket{{{labels}}}[{RATE}])"
    return f"histogram_quantile({q}, sum by (le, {by}) ({inner}))"


def _each_engine(
    vllm: str, sglang: str, *, agg: str = "sum", rate: bool = False, what: str = ""
) -> list[Q]:
    """One query per engine, so the panel works with either (or both) in the fleet."""
    out = []
    for engine, metric in (("vLLM", vllm), ("SGLang", sglang)):
        sel = f"{metric}{{{ENGINE}}}"
        if rate:
            sel = f"rate({sel}[{RATE}])"
        out.append(Q(f"{agg} by ({ENGINE_BY}) ({sel})", f"{engine} {what}{ENGINE_LEGEND}"))
    return out


def _each_engine_quantile(q: float, vllm: str, sglang: str) -> list[Q]:
    return [
        Q(_quantile(q, metric, ENGINE, ENGINE_BY), f"{engine} p{q * 100:g} {ENGINE_LEGEND}")
        for engine, metric in (("vLLM", vllm), ("SGLang", sglang))
    ]


def _safe_context(by: str = "model") -> Q:
    legend = "{{deployment}} {{model}}" if "deployment" in by else "{{model}}"
    return Q(
        f"min by ({by}) (kvwatch_deployment_safe_context_tokens{{{KV_MODEL}}})",
        f"kvwatch safe context {legend}",
    )


def engines() -> db.Dashboard:
    d = _dashboard(
        "kvwatch-engines",
        "kvwatch: engines and gateway",
        "vLLM's and SGLang's own /metrics beside kvwatch's: load, KV cache, prompt sizes "
        "against the safe context kvwatch measures them by, latency, and the kvwatch gateway. "
        "Each engine has its own query; a fleet running one engine leaves the other's empty. "
        "Engine and gateway targets need a `deployment` label in Prometheus (docs/grafana.md).",
    )
    d = _variables(d, with_model=True)

    d = d.with_row(db.Row("Load"))
    d = d.with_panel(
        series(
            "Requests running",
            "vllm:num_requests_running, sglang:num_running_reqs.",
            _each_engine("vllm:num_requests_running", "sglang:num_running_reqs"),
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Requests waiting",
            "vllm:num_requests_waiting, sglang:num_queue_reqs.",
            _each_engine("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Tokens per second",
            "Prompt (prefill) and generated tokens: vllm:prompt_tokens_total, "
            "vllm:generation_tokens_total, sglang:prompt_tokens_total, "
            "sglang:generation_tokens_total.",
            _each_engine(
                "vllm:prompt_tokens_total", "sglang:prompt_tokens_total", rate=True, what="prompt "
            )
            + _each_engine(
                "vllm:generation_tokens_total",
                "sglang:generation_tokens_total",
                rate=True,
                what="generated ",
            ),
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Requests finished",
            f"Per second. vLLM by finished_reason ({', '.join(VLLM_FINISHED_REASONS)}); "
            "SGLang counts finished and aborted requests apart.",
            [
                Q(
                    f"sum by ({ENGINE_BY}, finished_reason) "
                    f"(rate(vllm:request_success_total{{{ENGINE}}}[{RATE}]))",
                    "vLLM {{finished_reason}} " + ENGINE_LEGEND,
                ),
                *(
                    Q(
                        f"sum by ({ENGINE_BY}) (rate({metric}{{{ENGINE}}}[{RATE}]))",
                        f"SGLang {what} {ENGINE_LEGEND}",
                    )
                    for metric, what in (
                        ("sglang:num_requests_total", "finished"),
                        ("sglang:num_aborted_requests_total", "aborted"),
                    )
                ),
            ],
            unit="reqps",
            width=24,
        )
    )

    d = d.with_row(db.Row("KV cache: the engine's view beside kvwatch's"))
    d = d.with_panel(
        series(
            "KV cache usage",
            "The engine's own figure (vllm:kv_cache_usage_perc, sglang:token_usage, both "
            "0..1) beside the occupancy kvwatch's probe or scraper reported.",
            [
                *_each_engine("vllm:kv_cache_usage_perc", "sglang:token_usage", agg="max"),
                Q(
                    f"max by (deployment) (kvwatch_deployment_pool_occupancy_ratio{{{DEP}}})",
                    "kvwatch {{deployment}}",
                ),
            ],
            unit="percentunit",
            max_val=1,
        )
    )
    d = d.with_panel(
        series(
            "KV pool and context (tokens)",
            "SGLang publishes its pool (sglang:max_total_num_tokens) and context "
            "(sglang:context_len); vLLM's pool and context are what kvwatch's probe or "
            "scraper reported.",
            [
                Q(
                    f"max by ({ENGINE_BY}) (sglang:max_total_num_tokens{{{ENGINE}}})",
                    "SGLang pool " + ENGINE_LEGEND,
                ),
                Q(
                    f"max by ({ENGINE_BY}) (sglang:context_len{{{ENGINE}}})",
                    "SGLang context " + ENGINE_LEGEND,
                ),
                Q(
                    "min by (deployment, model) "
                    f'(kvwatch_deployment_pool_capacity_tokens{{{KV_MODEL}, role!="decode"}})',
                    "kvwatch prefill pool {{deployment}} {{model}}",
                ),
                Q(
                    "max by (deployment, model) "
                    f"(kvwatch_deployment_advertised_context_tokens{{{KV_MODEL}}})",
                    "kvwatch advertised {{deployment}} {{model}}",
                ),
                _safe_context("deployment, model"),
            ],
        )
    )

    d = d.with_row(db.Row("Prompts against the safe context"))
    d = d.with_panel(
        series(
            "Prompt tokens p99 vs the safe context",
            "The engines' prompt-size histograms (vllm:request_prompt_tokens; SGLang's "
            "sglang:prompt_tokens_histogram needs --collect-tokens-histogram) and the "
            "gateway's, against the safe context kvwatch measures prompts by, its "
            f"{WARN_RATIO:.0%} line (context_pressure warns there), and the limit the gateway "
            "enforces.",
            [
                *_each_engine_quantile(
                    0.99, "vllm:request_prompt_tokens", "sglang:prompt_tokens_histogram"
                ),
                Q(
                    _quantile(0.99, "kvwatch_gateway_prompt_tokens", GATEWAY, "deployment, model"),
                    "gateway p99 {{deployment}} {{model}}",
                ),
                _safe_context(),
                Q(
                    f"{WARN_RATIO} * min by (model) "
                    f"(kvwatch_deployment_safe_context_tokens{{{KV_MODEL}}})",
                    f"{WARN_RATIO:.0%} of safe context {{{{model}}}}",
                ),
                Q(
                    f"max by (model, source) (kvwatch_gateway_limit_tokens{{{GATEWAY}}})",
                    "gateway limit {{model}} ({{source}})",
                ),
            ],
            width=16,
        )
    )
    d = d.with_panel(
        series(
            "Generated tokens p99",
            "vllm:request_generation_tokens; SGLang's sglang:generation_tokens_histogram "
            "(--collect-tokens-histogram).",
            _each_engine_quantile(
                0.99, "vllm:request_generation_tokens", "sglang:generation_tokens_histogram"
            ),
            width=8,
        )
    )

    d = d.with_row(db.Row("Latency"))
    d = d.with_panel(
        series(
            "Time to first token p95",
            "vllm:time_to_first_token_seconds, sglang:time_to_first_token_seconds.",
            _each_engine_quantile(
                0.95, "vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"
            ),
            unit="s",
        )
    )
    d = d.with_panel(
        series(
            "End-to-end latency p95",
            "The engines' request latency, and the gateway's upstream latency (the engine "
            "as the gateway sees it).",
            [
                *_each_engine_quantile(
                    0.95, "vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"
                ),
                Q(
                    _quantile(
                        0.95,
                        "kvwatch_gateway_upstream_latency_seconds",
                        GATEWAY,
                        "deployment, model",
                    ),
                    "gateway upstream p95 {{deployment}} {{model}}",
                ),
            ],
            unit="s",
        )
    )

    d = d.with_row(db.Row("kvwatch gateway"))
    d = d.with_panel(
        series(
            "Gateway requests by outcome",
            "Per second, through `kvwatch gateway`, by outcome: "
            f"{GATEWAY_OUTCOMES[0]} (the upstream answered), {GATEWAY_OUTCOMES[1]} (by the "
            f"gateway's guard or by the upstream), {GATEWAY_OUTCOMES[2]} (the gateway or the "
            "upstream failed). Model names the gateway cannot vouch for are _other, a "
            "request naming none _none.",
            [
                Q(
                    "sum by (deployment, model, outcome) "
                    f"(rate(kvwatch_gateway_requests_total{{{GATEWAY}}}[{RATE}]))",
                    "{{outcome}} {{deployment}} {{model}}",
                )
            ],
            unit="reqps",
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Gateway refusals by reason",
            "Per second: requests refused, by the gateway before they reached the engine or "
            "by the upstream, by the wire contract's reason "
            f"({', '.join(GATEWAY_REFUSAL_REASONS)}). {GATEWAY_REFUSAL_REASONS[0]}: a prompt "
            "over the gateway's limit in force (or the upstream's context).",
            [
                Q(
                    "sum by (deployment, model, reason) "
                    f"(rate(kvwatch_gateway_refusals_total{{{GATEWAY}}}[{RATE}]))",
                    "{{reason}} {{deployment}} {{model}}",
                )
            ],
            unit="reqps",
            width=8,
        )
    )
    d = d.with_panel(
        series(
            "Gateway limit in force vs the safe context",
            "The prompt limit the gateway enforces: the collector's limit in force (read from "
            "GET /v1/limits), by its source: "
            f"{GATEWAY_LIMIT_SOURCES[0]} (a current passing verification), "
            f"{GATEWAY_LIMIT_SOURCES[1]} (--safe-context, smaller; model * is the default for "
            f"every model), {GATEWAY_LIMIT_SOURCES[2]} (no current verification: "
            f"min(advertised context, prefill pool)), {GATEWAY_LIMIT_SOURCES[3]} (the latest "
            "verification failed: below the smallest prompt that leaked, or 0, every prompt "
            f"refused) or {GATEWAY_LIMIT_SOURCES[4]} (the collector could not be read for too "
            "long: 0, every prompt refused). Beside it, kvwatch's limit for the model.",
            [
                Q(
                    f"max by (model, source) (kvwatch_gateway_limit_tokens{{{GATEWAY}}})",
                    "gateway limit {{model}} ({{source}})",
                ),
                _safe_context(),
            ],
            width=8,
        )
    )
    return d


# ------------------------------------------------------------------------------- writing

DASHBOARDS = {"kvwatch-operator.json": operator, "kvwatch-engines.json": engines}


def _number(panels: list[Any], start: int = 1) -> int:
    """Panel ids in layout order: stable, so the JSON is the same on every run."""
    n = start
    for p in panels:
        p["id"] = n
        n += 1
        n = _number(p.get("panels") or [], n)
    return n


def render() -> dict[str, str]:
    """File name -> the JSON text this script writes."""
    out = {}
    for name, build in DASHBOARDS.items():
        doc = json.loads(JSONEncoder().encode(build().build()))
        _number(doc["panels"])
        out[name] = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=HERE, help="where to write (default: here)")
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the files differ"
    )
    args = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    if stale:
        print(
            f"out of date: {', '.join(stale)} (run python -m deploy.grafana.generate)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
