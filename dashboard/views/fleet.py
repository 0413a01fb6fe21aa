"""Fleet: every deployment's advertised context, pool, verified safe context and status."""

from __future__ import annotations

from collections import defaultdict

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient
from dashboard.errors import TokenRejected

_BADGE = {"red": ("RED", "red"), "amber": ("AMBER", "orange"), "green": ("GREEN", "green")}
# Streamlit's bundled icon font, not emoji: they render on machines without an emoji font.
_ICON = {
    "red": ":red[:material/error:]",
    "amber": ":orange[:material/warning:]",
    "green": ":green[:material/check_circle:]",
}


def firing_alerts(c: CollectorClient) -> dict[str, list[JSON]] | None:
    """Firing alerts per deployment, or None where the token may not list alerts."""
    try:
        alerts = c.alerts(state="firing", limit=1000)
    except TokenRejected as exc:
        if exc.forbidden:
            return None
        raise
    out: dict[str, list[JSON]] = defaultdict(list)
    for a in alerts:
        out[a.get("deployment_id") or ""].append(a)
    return out


def limits_frame(deps: list[JSON]) -> pd.DataFrame:
    rows = []
    for d in deps:
        for mod in d["models"]:
            target = f"{d['deployment_id']} · {mod['model_id']}"
            for measure, key in (
                ("Advertised context", "advertised_context"),
                ("Prefill pool", "pool_capacity_tokens"),
                ("Verified safe context", "verified_safe_context"),
            ):
                if mod.get(key) is not None:
                    rows.append({"target": target, "measure": measure, "tokens": mod[key]})
            limit = (mod.get("limit_in_force") or {}).get("tokens")
            if limit is not None:
                rows.append({"target": target, "measure": "Limit in force", "tokens": limit})
    return pd.DataFrame(rows, columns=["target", "measure", "tokens"])


def _verification(mod: JSON) -> str:
    if mod["latest_verification_failed"]:
        return "failed"
    if mod["verified_safe_context"] is None:
        return "not verified"
    return "stale (config changed)" if mod["verification_stale"] else "current"


def models_frame(models: list[JSON]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "model": m["model_id"],
                "advertised context": m["advertised_context"],
                "prefill pool": m["pool_capacity_tokens"],
                "pool / advertised": (
                    m["pool_capacity_tokens"] / m["advertised_context"]
                    if m["pool_capacity_tokens"] and m["advertised_context"]
                    else None
                ),
                "verified safe context": m["verified_safe_context"],
                "verified at": ui.when(m["verified_at"]) if m["verified_at"] else "—",
                "age (days)": m["verification_age_days"],
                "verified on engine": m["engine_version"],
                "verification": _verification(m),
                # last: a long text, and the grid draws only the columns in view
                "limit in force": (m.get("limit_in_force") or {}).get("text", "—"),
            }
            for m in models
        ]
    )


_TOKENS = st.column_config.NumberColumn(format="localized")


def nodes_frame(nodes: list[JSON]) -> pd.DataFrame:
    """One row per node: its id, role and the config replicas must agree on first."""
    return pd.DataFrame(
        [
            {
                "node": n["node"],
                "role": n["role"],
                "model": n["model_id"],
                "state": "running" if n.get("running", True) else "stopped",
                "prefix cache": n["prefix_cache"],
                "KV dtype": n.get("dtype"),
                "KV past the pool": n["kv_offload"],
                "pool (tokens)": n["pool_capacity_tokens"],
                "advertised context": n["advertised_context"],
                "engine": f"{n['engine']} {n['engine_version']}",
                "config since": ui.when(n["config_since"]),
            }
            for n in nodes
        ]
    )


def deployment_card(dep: JSON, alerts: list[JSON] | None) -> None:
    status = dep["status"]
    text, color = _BADGE.get(status, (status.upper(), "gray"))
    with st.container(border=True):
        head, badge = st.columns([5, 1])
        head.subheader(f"{_ICON.get(status, '')} {dep['deployment_id']}")
        with badge:
            st.badge(text, color=color)
        st.caption(
            f"last seen {ui.when(dep['last_seen'])} · {dep['firing_alerts']} firing alert(s), "
            f"{dep['critical_alerts']} critical · {dep['open_incidents']} open incident(s)"
        )
        lost = dep.get("lost_requests") or {}
        if lost.get("count"):
            why = ", ".join(f"{k} {n}" for k, n in sorted(lost["by_reason"].items()))
            st.warning(
                f"**{lost['count']} request(s) lost** in the last {lost['window_s'] // 3600} h: "
                f"their probe went away before they finished ({why}); latest "
                f"{ui.when(lost['latest_at'])}.",
                icon=":material/link_off:",
            )
        # from the incident itself, for as long as it is open (an alert that resolved no
        # longer names it)
        for inc in dep.get("incidents") or []:
            who = (
                f"acknowledged by {inc['acked_by']}" if inc["acked_by"] else "not acknowledged"
            ) + (f", owner {inc['owner']}" if inc["owner"] else ", no owner")
            st.markdown(
                f"[:material/emergency: **Open incident #{inc['id']}**](/incident?id={inc['id']})"
                f" — {inc['title']}; {who}"
            )
        if dep["reasons"]:
            lines = "\n".join(f"- {r}" for r in dep["reasons"])
            (st.error if status == "red" else st.warning)(f"**Why {status}:**\n{lines}")
        for src in dep.get("silent_sources") or []:
            # a producer alive and sending while what it watches is not: its intervals are
            # gaps, not zeros (telemetry_gap's source_silent)
            st.warning(
                f"**Source silent** ({src['source']}, node {src['node']}): {src['summary']}",
                icon=":material/signal_disconnected:",
            )
        if dep["models"]:
            st.dataframe(
                models_frame(dep["models"]),
                hide_index=True,
                column_config={
                    "advertised context": _TOKENS,
                    "prefill pool": _TOKENS,
                    "verified safe context": _TOKENS,
                    "pool / advertised": st.column_config.NumberColumn(format="%.2fx"),
                    "age (days)": st.column_config.NumberColumn(format="%.1f"),
                },
            )
        else:
            st.info("No engine configuration reported yet for this deployment.")
        if alerts:
            st.markdown("**Firing alerts**")
            for a in sorted(alerts, key=lambda a: (a["severity"] != "critical", a["rule"])):
                icon = _ICON["red" if a["severity"] == "critical" else "amber"]
                notes = a.get("annotations", {})
                action = f" **What to do:** {notes['action']}" if notes.get("action") else ""
                summary = notes.get("summary", "")
                st.markdown(f"{icon} `{a['rule']}` ({a['severity']}) — {summary}{action}")
        elif alerts is None and dep["firing_alerts"]:
            st.caption("Alert names are not shown to a tenant-scoped token.")
        # replicas are nodes of their own: with several, their configs side by side (a
        # disagreement is config_drift between them) are worth seeing without a click
        with st.expander(f"Nodes ({len(dep['nodes'])})", expanded=len(dep["nodes"]) > 1):
            if dep["nodes"]:
                st.dataframe(
                    nodes_frame(dep["nodes"]),
                    hide_index=True,
                    column_config={
                        "advertised context": _TOKENS,
                        "pool (tokens)": _TOKENS,
                    },
                )
            else:
                st.caption("No nodes reported.")


def render(c: CollectorClient) -> None:
    fleet = c.fleet()
    deps: list[JSON] = fleet["deployments"]
    alerts = firing_alerts(c)
    # Alerts about the installation itself rather than one deployment (the ingest bus's
    # bus_lag): no card would show them, and they hide events from every card.
    installation = [] if alerts is None else alerts.get("", [])
    for a in installation:
        box = st.error if a["severity"] == "critical" else st.warning
        summary = a["annotations"].get("summary", "")
        box(
            f"**{a['rule']}** ({a['severity']}, whole installation): {summary}",
            icon=":material/hub:",
        )
    if not deps:
        waiting = any(a["kind"] == "bus_lag" for a in installation)
        st.info(
            "**No deployments stored yet.** Events wait on the ingest bus (above) until a "
            "writer (`kvwatch writer`) stores them."
            if waiting
            else "**No deployments yet.** Deployments appear once a probe, the gateway or "
            "`kvwatch scrape` sends events to this collector.",
            icon=":material/inbox:",
        )
        return
    col1, col2, col3, col4 = st.columns(4)
    col1.metric("Deployments", len(deps))
    col2.metric(
        "Red",
        sum(1 for d in deps if d["status"] == "red"),
        help="Pool below advertised context, stale or failed verification, or a critical "
        "alert firing",
    )
    col3.metric("Firing alerts", sum(d["firing_alerts"] for d in deps) + len(installation))
    col4.metric("Open incidents", sum(d["open_incidents"] for d in deps))
    limits = limits_frame(deps)
    if not limits.empty:
        st.markdown(
            "**Advertised context, prefill pool, verified safe context and the limit in force**"
        )
        st.altair_chart(charts.fleet_limits(limits), width="stretch")
    for dep in deps:
        deployment_alerts = None if alerts is None else alerts.get(dep["deployment_id"], [])
        deployment_card(dep, deployment_alerts)
    st.caption(f"Generated {ui.when(fleet['generated_at'])}.")


ui.page_header(
    "Fleet",
    "Every deployment's limits at a glance, those with an open incident first. Red: an open "
    "incident, a pool smaller than the advertised context, a stale or failed verification, or "
    "a critical alert.",
)
ui.live(render)
