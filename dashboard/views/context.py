"""Context pressure: prompt sizes per model and route against the 80% and 100% lines of the
verified safe context, over time, and the requests nearest the threshold."""

from __future__ import annotations

import functools
from datetime import datetime

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient
from dashboard.incidents import Marker, incident_markers

_TOKENS = st.column_config.NumberColumn(format="localized")


def _route(value: str | None) -> str:
    return ui.label(value, "(no route)")


def timeline_frame(series: list[JSON]) -> pd.DataFrame:
    rows = [
        {
            "time": s["bucket_start_us"],
            "route": _route(s["route"]),
            "stat": stat,
            "tokens": s[stat],
            "requests": s["requests"],
        }
        for s in series
        for stat in ("max", "p99")
        if s[stat] is not None
    ]
    df = pd.DataFrame(rows, columns=["time", "route", "stat", "tokens", "requests"])
    df["time"] = ui.us_to_time(df["time"])
    return df


def routes_frame(routes: list[JSON], lines: dict[str, JSON]) -> pd.DataFrame:
    rows = []
    for r in routes:
        safe = lines.get(r["model_id"], {}).get("safe_context")
        rows.append(
            {
                "model": r["model_id"],
                "route": _route(r["route"]),
                "requests": r["requests"],
                "prompts": r["prompts"],
                "prompt tokens": r["prompt_tokens"],
                "rejected": r["rejected"],
                "largest prompt": r["max"],
                "p99": r["p99"],
                "p50": r["p50"],
                "largest / safe": None if not safe or r["max"] is None else r["max"] / safe,
                "≥ 80%": r["at_or_above_warn"],
                "≥ 100%": r["at_or_above_critical"],
                "no token count": r["unknown_prompt"],
            }
        )
    return pd.DataFrame(rows)


def nearest_frame(items: list[JSON]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "request": x["request_id"],
                "tenant": x["tenant"],
                "deployment": x["deployment_id"],
                "model": x["model_id"],
                "route": _route(x["route"]),
                "prompt tokens": x["prompt_tokens"],
                "safe context": x["safe_context"],
                "share of safe context": x["ratio"],
                "status": ui.request_status(x),
                "first seen": ui.when(x["first_ts_us"]),
            }
            for x in items
        ]
    )


def _stats_of(
    c: CollectorClient, model: str, deployment: str | None, since: datetime, until: datetime
) -> JSON:
    return c.prompt_stats(
        since=since, until=until, model_id=model, deployment_id=deployment, max_points=200
    )


def model_section(
    model: str,
    series: list[JSON],
    hist: list[JSON],
    line: JSON | None,
    window: tuple[datetime, datetime],
    bucket_s: float,
    markers: list[Marker],
) -> None:
    st.subheader(model)
    if line is None:
        st.warning(
            f"No safe context is known for {model}: no verification and no pool reported. "
            "The 80% and 100% lines cannot be drawn.",
            icon=":material/help:",
        )
        warn = crit = None
    else:
        # 0: a failed verification refuses every prompt; there is no line to draw
        warn, crit = (
            (line["warn_line"], line["critical_line"]) if line["safe_context"] else (None, None)
        )
        # the collector's words for the limit in force (policies.limits): never re-worded
        st.caption(
            f"Limit in force on {line['deployment_id']}: **{line['limit']}** · "
            f"80% line **{ui.tokens(warn)}** · 100% line **{ui.tokens(crit)}**"
        )
    left, right = st.columns([3, 2])
    with left:
        st.markdown("**Largest and p99 prompt per route over time**")
        chart = charts.prompt_timeline(
            timeline_frame(series),
            warn,
            crit,
            window,
            bucket_s,
            # this model's deployments' incidents and stale reads, not another model's
            charts.markers_frame(
                [x for x in markers if line is None or x[3] in (*line["deployments"], None)],
                window,
            ),
        )
        st.altair_chart(chart, width="stretch")
    with right:
        st.markdown("**Prompt-size distribution**")
        df = pd.DataFrame(hist, columns=["model_id", "bin_low", "bin_high", "requests"])
        df["bin_low"] = df["bin_low"].clip(lower=1)  # log scale: the first bin starts at 0
        st.altair_chart(charts.prompt_histogram(df, warn, crit), width="stretch")


def render(c: CollectorClient) -> None:
    since, until = ui.window()
    f1, f2, f3 = st.columns(3)
    deployments = sorted(d["deployment_id"] for d in c.deployments())
    deployment = ui.choice(deployments, "cp_deployment", "Deployment", f3)
    stats = c.prompt_stats(since=since, until=until, deployment_id=deployment, max_points=200)
    models = sorted({r["model_id"] for r in stats["routes"] if r["model_id"] is not None})
    model = ui.choice(models, "cp_model", "Model", f1)
    routes = sorted(
        {_route(r["route"]) for r in stats["routes"] if model is None or r["model_id"] == model}
    )
    route_label = ui.choice(routes, "cp_route", "Route", f2)
    if not stats["routes"]:
        st.info(
            f"**No requests in the {ui.window_label()}.** Prompt sizes appear once requests "
            "are ingested (the charts trail ingest by up to the collector's rollup interval, "
            "KVWATCH_ROLLUP_INTERVAL_S). Try a longer window in the sidebar.",
            icon=":material/inbox:",
        )
        return

    def keep(x: JSON) -> bool:
        return (model is None or x["model_id"] == model) and (
            route_label is None or _route(x["route"]) == route_label
        )

    lines = {t["model_id"]: t for t in stats["thresholds"]}
    series = [s for s in stats["series"] if keep(s)]
    summary = [r for r in stats["routes"] if keep(r)]
    a, b, cc, d = st.columns(4)
    a.metric("Requests", f"{sum(r['requests'] for r in summary):,}")
    largest = max((r["max"] for r in summary if r["max"] is not None), default=None)
    b.metric("Largest prompt", ui.tokens(largest))
    cc.metric(
        "At or above 80%",
        f"{sum(r['at_or_above_warn'] or 0 for r in summary):,}",
        help="Requests in bins whose largest prompt reached 80% of the model's safe context "
        "(an upper bound: bins are 9% wide).",
    )
    d.metric("At or above 100%", f"{sum(r['at_or_above_critical'] or 0 for r in summary):,}")
    markers = incident_markers(c, (since, until), deployment)
    for m in sorted({s["model_id"] for s in series if s["model_id"] is not None}):
        # Each model's chart zooms to its own data, in finer buckets; the figures stay the
        # window's.
        zoomed, own = ui.zoomed(
            (since, until),
            functools.partial(_stats_of, c, m, deployment),
            lambda doc: doc["series"],
            first={**stats, "series": [s for s in series if s["model_id"] == m]},
        )
        model_section(
            m,
            [s for s in own["series"] if keep(s) and s["model_id"] == m],
            [h for h in stats["histogram"] if h["model_id"] == m],
            lines.get(m),
            zoomed or (since, until),
            own["bucket_seconds"],
            markers,
        )
        if zoomed is not None:
            ui.zoom_caption(zoomed)

    st.subheader("Per model and route")
    st.dataframe(
        routes_frame(summary, lines),
        hide_index=True,
        column_config={
            "prompt tokens": _TOKENS,
            "largest prompt": _TOKENS,
            "p99": _TOKENS,
            "p50": _TOKENS,
            "largest / safe": st.column_config.ProgressColumn(
                format="percent", min_value=0.0, max_value=1.0
            ),
        },
    )
    st.caption(
        f"{ui.window_label().capitalize()}, {ui.bucket_width(stats['bucket_seconds'])} buckets. "
        "p50 and p99 are upper bounds of 9%-wide bins; the largest prompt is exact. Prompts "
        "and prompt tokens count a prompt that several requests share (parallel sampling, "
        "n > 1) once; the other figures count every request."
    )

    st.subheader("Nearest the threshold")
    route_param = None
    if route_label is not None and route_label != "(no route)":
        route_param = route_label
    top = c.top_prompts(
        since=since, until=until, model_id=model, route=route_param, deployment_id=deployment
    )
    if route_label == "(no route)":
        top = [x for x in top if x["route"] is None]
    if not top:
        st.info("No requests with a prompt token count in this window.")
        return
    st.dataframe(
        nearest_frame(top),
        hide_index=True,
        column_config={
            "prompt tokens": _TOKENS,
            "safe context": _TOKENS,
            "share of safe context": st.column_config.ProgressColumn(
                format="percent", min_value=0.0, max_value=1.0
            ),
        },
    )


ui.page_header(
    "Context pressure",
    "Prompt tokens per model and route against 80% and 100% of the limit in force (the "
    "verified safe context while one holds).",
)
ui.live(render)
