"""Verifications: every `kvwatch verify` run (or operator record), its verdict, the safe
context it established, and its evidence."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient

_TOKENS = st.column_config.NumberColumn(format="localized")
# The evidence keys `kvwatch verify` sends that a person looks for first.
_KEY_FIGURES = {
    "result": "Result",
    "rejection_point": "Rejection point (tokens)",
    "measured_safe_context": "Measured safe context",
    "leaks": "Cross-tenant leaks",
    "findings": "Other findings",
}


def history_frame(items: list[JSON]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "id": v["id"],
                "verified at": ui.when(v["verified_at"]),
                "deployment": v["deployment_id"],
                "model": v["model_id"],
                "result": "passed" if v["passed"] else "FAILED",
                "verified safe context": v["verified_safe_context"],
                "engine version": v["engine_version"],
                "pool": v["pool_capacity_tokens"],
                "quantization": v["quantization"],
                "TP": v["tp_size"],
                "CUDA graphs": v["cuda_graphs"],
                "recorded by": v["created_by"],
            }
            for v in items
        ]
    )


def chart_frame(items: list[JSON]) -> pd.DataFrame:
    rows = [
        {
            "time": ui.parse_time(v["verified_at"]),
            "target": f"{v['deployment_id']} · {v['model_id']}",
            "safe_context": v["verified_safe_context"],
            "result": "passed" if v["passed"] else "failed",
        }
        for v in items
        if v["verified_safe_context"] is not None
    ]
    return pd.DataFrame(rows, columns=["time", "target", "safe_context", "result"])


def evidence(c: CollectorClient, items: list[JSON]) -> None:
    st.subheader("Evidence")
    by_id = {v["id"]: v for v in items}
    picked = st.selectbox(
        "Verification",
        list(by_id),
        format_func=lambda i: (
            f"#{i} {by_id[i]['deployment_id']} · {by_id[i]['model_id']} · "
            f"{ui.when(by_id[i]['verified_at'])}"
        ),
        key="evidence_for",
    )
    if not ui.may(c, "report"):
        st.info(
            "**The evidence needs an admin token (or a signed-in operator or auditor):** it "
            "names the tenants whose keys the "
            "verification used.",
            icon=":material/lock:",
        )
        return
    ev = c.verification(picked).get("evidence") or {}
    shown = [(label, ev[k]) for k, label in _KEY_FIGURES.items() if k in ev]
    if shown:
        for col, (label, value) in zip(st.columns(len(shown)), shown, strict=True):
            col.metric(label, f"{value:,}" if isinstance(value, int) else str(value))
    if "clamped_to_pool" in ev:
        clamp = ev["clamped_to_pool"]
        st.info(
            f"The measured safe context ({ui.tokens(clamp.get('measured'))}) was clamped to "
            f"the prefill pool ({ui.tokens(clamp.get('pool_capacity_tokens'))}): a prompt longer "
            "than the pool is never safe."
        )
    if ev:
        st.json(ev, expanded=2)
    else:
        st.caption("This verification carries no evidence.")


def render(c: CollectorClient) -> None:
    items = c.verifications(limit=500)
    if not items:
        st.info(
            "**No verifications yet.** Run `kvwatch verify --endpoint URL --model M "
            "--tenant-key NAME=KEY ...` with KVWATCH_COLLECTOR_URL and KVWATCH_INGEST_TOKEN "
            "set to record one.",
            icon=":material/inbox:",
        )
        return
    deployments = sorted({v["deployment_id"] for v in items})
    deployment = ui.choice(deployments, "ver_deployment", "Deployment")
    if deployment is not None:
        items = [v for v in items if v["deployment_id"] == deployment]
    failed = sum(1 for v in items if not v["passed"])
    a, b = st.columns(2)
    a.metric("Verifications", len(items))
    b.metric("Failed", failed)
    df = chart_frame(items)
    if not df.empty:
        st.altair_chart(charts.verification_history(df), width="stretch")
    st.dataframe(
        history_frame(items),
        hide_index=True,
        column_config={"verified safe context": _TOKENS, "pool": _TOKENS},
    )
    evidence(c, items)


ui.page_header(
    "Verifications",
    "History of verified safe context per deployment and model, newest first, with the "
    "evidence each run recorded.",
)
ui.live(render)
