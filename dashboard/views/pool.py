"""Pool and isolation: KV pool occupancy per deployment and node over time, page reuse and
transfers, and every stale read with the tenants on both sides."""

from __future__ import annotations

import functools
from datetime import datetime

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient
from dashboard.frames import occupancy_frame
from dashboard.incidents import incident_markers

_TOKENS = st.column_config.NumberColumn(format="localized")
_PAGE = 100  # stale reads listed; the breach report has them all


def peaks_frame(df: pd.DataFrame) -> pd.DataFrame:
    g = df.sort_values("time").groupby(["deployment_id", "node"], as_index=False)
    out = g.agg(
        capacity=("capacity", "max"),
        latest_used=("used_max", "last"),
        peak_used=("used_max", "max"),
        min_free=("free_min", "min"),
        samples=("samples", "sum"),
    )
    out["peak occupancy"] = out["peak_used"] / out["capacity"].where(out["capacity"] > 0)
    return out.rename(
        columns={
            "deployment_id": "deployment",
            "latest_used": "used (latest)",
            "peak_used": "used (peak)",
            "min_free": "free (min)",
        }
    )


def stale_frame(items: list[JSON]) -> pd.DataFrame:
    hidden = "(another tenant)"

    def previous(x: JSON, field: str) -> str:
        if x[field] is not None:
            return str(x[field])
        # Not cross-tenant and no one named: the pages had no earlier writer (a tenant's
        # token sees a cross-tenant party redacted instead).
        return hidden if x["cross_tenant"] else "no one (never written)"

    return pd.DataFrame(
        [
            {
                "time": ui.when(x["ts"]),
                "deployment": x["deployment_id"],
                "node": x["node"],
                "reader tenant": x["tenant"] or hidden,
                "reader request": x["request_id"] or hidden,
                "exposed tenant (previous writer)": previous(x, "other_tenant"),
                "exposed request": previous(x, "other_request_id"),
                "pages": x["page_count"],
                "cross-tenant": bool(x["cross_tenant"]),
                "zeroized": bool((x.get("detail") or {}).get("zeroized")),
            }
            for x in items
        ]
    )


def occupancy(c: CollectorClient, deployment: str | None) -> None:
    since, until = ui.window()
    st.subheader("KV pool occupancy")
    pool = c.pool_samples(since=since, until=until, deployment_id=deployment, max_points=200)
    if not pool["items"]:
        st.info(
            f"**No pool samples in the {ui.window_label()}.** Probes report `pool.sample` "
            "events; `kvwatch scrape` derives them from engine metrics.",
            icon=":material/inbox:",
        )
        return
    df = occupancy_frame(pool["items"])
    markers = incident_markers(c, (since, until), deployment)
    for dep in sorted(df["deployment_id"].unique()):
        own = {**pool, "items": [x for x in pool["items"] if x["deployment_id"] == dep]}
        zoomed, doc = ui.zoomed(
            (since, until),
            functools.partial(_pool_of, c, dep),
            lambda d: d["items"],
            first=own,
        )
        st.markdown(f"**{dep}**: tokens in use per node (line), capacity (dashed)")
        shown = zoomed or (since, until)
        own_markers = [x for x in markers if x[3] in (dep, None)]
        chart = charts.pool_occupancy(
            occupancy_frame(doc["items"]),
            shown,
            doc["bucket_seconds"],
            charts.markers_frame(own_markers, shown),
        )
        st.altair_chart(chart, width="stretch")
        if zoomed is not None:
            ui.zoom_caption(zoomed)
    st.dataframe(
        peaks_frame(df),
        hide_index=True,
        column_config={
            "capacity": _TOKENS,
            "used (latest)": _TOKENS,
            "used (peak)": _TOKENS,
            "free (min)": _TOKENS,
            "peak occupancy": st.column_config.ProgressColumn(
                format="percent", min_value=0.0, max_value=1.0
            ),
        },
    )
    st.caption(
        f"{ui.window_label().capitalize()}, {ui.bucket_width(pool['bucket_seconds'])} buckets: the "
        "mean and the max of each."
    )


def _pool_of(c: CollectorClient, dep: str, since: datetime, until: datetime) -> JSON:
    return c.pool_samples(since=since, until=until, deployment_id=dep, max_points=200)


def page_activity(c: CollectorClient, deployment: str | None) -> None:
    since, until = ui.window()
    st.subheader("Page reuse, transfers and stale reads")
    zoomed, stats = ui.zoomed(
        (since, until),
        lambda lo, hi: c.page_event_stats(
            since=lo, until=hi, deployment_id=deployment, max_points=120
        ),
        lambda doc: doc["items"],
    )
    if zoomed is not None:
        since, until = zoomed
    items = stats["items"]
    by_kind: dict[str, dict[str, int]] = {}
    for x in items:
        k = by_kind.setdefault(x["kind"], {"events": 0, "pages": 0, "cross_tenant": 0})
        for f in ("events", "pages", "cross_tenant"):
            k[f] += x[f]
    zero = {"events": 0, "pages": 0, "cross_tenant": 0}
    reuse = by_kind.get("page.reuse", zero)
    stale = by_kind.get("page.stale_read", zero)
    a, b, cc, d = st.columns(4)
    a.metric("Page reuse events", f"{reuse['events']:,}", help="Allocator steps that reused pages")
    b.metric("Pages reused", f"{reuse['pages']:,}")
    cc.metric("Cross-tenant reuse events", f"{reuse['cross_tenant']:,}")
    d.metric(
        "Stale reads",
        f"{stale['events']:,}",
        help="Reads of pages the reader's request never wrote: another request's KV",
    )
    if not items:
        st.info(
            f"No page events in the {ui.window_label()}: no reuse, transfers or stale reads "
            "reported (the page ledger in the probe reports them).",
            icon=":material/inbox:",
        )
        return
    df = pd.DataFrame(items)
    df["time"] = ui.us_to_time(df["bucket_start_us"])
    df["end"] = df["time"] + pd.Timedelta(seconds=stats["bucket_seconds"])
    markers = charts.markers_frame(incident_markers(c, (since, until), deployment), (since, until))
    st.altair_chart(charts.page_events(df, (since, until), markers), width="stretch")
    st.caption(f"{ui.bucket_width(stats['bucket_seconds'])} buckets.")
    if zoomed is not None:
        ui.zoom_caption(zoomed)


def stale_reads(c: CollectorClient, deployment: str | None) -> None:
    since, until = ui.window()
    st.subheader("Stale reads")
    page = c.page_events(
        kind="page.stale_read", since=since, until=until, deployment_id=deployment, limit=_PAGE
    )
    if not page["items"]:
        st.success(f"No stale reads in the {ui.window_label()}.", icon=":material/check_circle:")
    else:
        st.dataframe(stale_frame(page["items"]), hide_index=True)
        if page["next_cursor"]:
            st.caption(
                f"The newest {_PAGE} are shown; a breach report (Reports page) lists them all."
            )
    canaries = c.page_events(
        kind="canary.hit", since=since, until=until, deployment_id=deployment, limit=_PAGE
    )["items"]
    if canaries:
        st.subheader("Canary hits")
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "time": ui.when(x["ts"]),
                        "deployment": x["deployment_id"],
                        "node": x["node"],
                        "reader tenant": x["tenant"] or "(another tenant)",
                        "canary tenant": x["other_tenant"] or "(another tenant)",
                        "detector": (x.get("detail") or {}).get("detector"),
                    }
                    for x in canaries
                ]
            ),
            hide_index=True,
        )


def render(c: CollectorClient) -> None:
    deployments = sorted(d["deployment_id"] for d in c.deployments())
    if not deployments:
        st.info(
            "**No deployments yet.** Pool samples and page events appear once a probe "
            "reports to this collector.",
            icon=":material/inbox:",
        )
        return
    deployment = ui.choice(deployments, "pool_deployment", "Deployment")
    occupancy(c, deployment)
    page_activity(c, deployment)
    stale_reads(c, deployment)


ui.page_header(
    "Pool and isolation",
    "Occupancy of each KV pool over time, page reuse across requests, and stale reads: "
    "one tenant's request reading pages another tenant's request wrote.",
)
ui.live(render)
