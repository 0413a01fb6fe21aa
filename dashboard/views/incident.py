"""One incident, for the person on call: the countdown to the notification deadline, what
crossed between which tenants and why (the cause chain, from the evidence), the stale reads,
the pool of the involved nodes over the incident's own minutes, and the buttons that write
the assessment and each tenant's notice. Opened from a fleet card (``/incident?id=N``) or the
incident list."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import streamlit as st

from dashboard import ui
from dashboard.client import JSON, CollectorClient
from dashboard.incidents import incident_card


def _choose(incidents: list[JSON]) -> JSON:
    wanted = st.query_params.get("id")
    ids = [i["id"] for i in incidents]
    index = ids.index(int(wanted)) if wanted and wanted.isdigit() and int(wanted) in ids else 0
    labels = {i["id"]: f"#{i['id']} {i['deployment_id']} ({i['state']})" for i in incidents}
    chosen = st.selectbox("Incident", ids, index=index, format_func=lambda i: labels[i])
    st.query_params["id"] = str(chosen)
    return next(i for i in incidents if i["id"] == chosen)


def _tenants(doc: JSON) -> None:
    t = doc["tenants"]
    a, b, c, d = st.columns(4)
    a.metric("Exposed tenants", t["exposed_count"], help="Their requests' KV was read.")
    b.metric("Exposed requests", t.get("exposed_requests", "-"))
    c.metric("Receiving tenants", t.get("receiving_count", t["victim_count"]))
    d.metric("Receiving requests", t.get("receiving_requests", "-"))
    e, f, g = st.columns(3)
    subjects = doc["data_categories"].get("data_subjects")
    e.metric("Data subjects", "unknown" if subjects is None else f"{subjects:,}")
    f.metric("Special categories", ", ".join(doc["data_categories"]["special"]) or "none declared")
    g.metric("Art. 34 high risk", doc["art34"].get("verdict", "-"))


def _cause(doc: JSON) -> None:
    st.subheader("Cause chain, from the evidence")
    steps = doc.get("cause") or []
    if not steps:
        st.info("No step of the chain is recorded in scope.")
        return
    st.dataframe(
        pd.DataFrame(
            [{"when": ui.when(x["at"]), "step": x["step"], "what": x["text"]} for x in steps]
        ),
        hide_index=True,
        use_container_width=True,
        column_config={"what": st.column_config.TextColumn(width="large")},
    )


def _reads(doc: JSON) -> None:
    st.subheader("Stale reads")
    items = doc["stale_reads"]["items"]
    if not items:
        st.info("No stale read in scope.")
        return
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "when": ui.when(s["ts"]),
                    "cross-tenant": s["cross_tenant"],
                    "reader tenant": s["reader_tenant"],
                    "reader request": s["reader_request_id"],
                    "previous tenant": s["previous_tenant"] or "no one",
                    "previous request": s["previous_request_id"] or "never written",
                    "pages": s["page_count"],
                    "node": s["node"],
                }
                for s in items
            ]
        ),
        hide_index=True,
        use_container_width=True,
    )


def _pool(doc: JSON) -> None:
    series = doc.get("series") or {}
    points = series.get("pool_occupancy_max") or []
    st.subheader("Pool occupancy over the incident")
    if not points:
        st.info("No pool sample in the incident's window.")
        return
    df = pd.DataFrame(
        [{"time": ui.parse_time(p["ts"]), "occupancy": p["value"], "full": 1.0} for p in points]
    )
    st.line_chart(df.set_index("time"), y=["occupancy", "full"], height=220)
    window = series.get("window") or {}
    st.caption(
        f"Max occupancy (used/capacity) per bucket, {ui.when(window.get('from'))} to "
        f"{ui.when(window.get('until'))}; 'full' is the capacity."
    )


def _actions(c: CollectorClient, inc: JSON, doc: JSON) -> None:
    st.subheader("Write it down")
    if ui.token_scope(c) != "admin":
        st.info("Generating the assessment and the notices needs an admin token.")
        return
    if st.button("Generate the breach assessment (stored, audited)", key="assess"):
        st.session_state["assessment"] = c.create_breach_report(incident_id=inc["id"])
    made = st.session_state.get("assessment")
    if made is not None:
        st.success(f"Assessment {made['report_id']}, evidence SHA-256 {made['evidence_sha256']}")
        st.download_button(
            "Download its PDF",
            c.report_file(made["report_id"], "pdf"),
            file_name=f"breach-{made['report_id']}.pdf",
            mime="application/pdf",
        )
    for n in doc.get("notices") or []:
        key = f"notice-{inc['id']}-{n['tenant']}"
        what = {"exposed": "its data was read", "received": "it received another's data"}.get(
            n["kind"], "both"
        )
        if st.button(f"Prepare the notice to {n['tenant']} ({what})", key=f"b-{key}"):
            st.session_state[key] = c.incident_notice(inc["id"], n["tenant"])
        if key in st.session_state:
            st.download_button(
                f"Download the notice to {n['tenant']}",
                st.session_state[key],
                file_name=f"{key}.pdf",
                mime="application/pdf",
                key=f"d-{key}",
            )


def render(c: CollectorClient) -> None:
    if ui.require_operator(c, "Incidents") is None:
        return
    incidents = c.incidents(limit=200)
    if not incidents:
        st.success("No incidents.", icon=":material/check_circle:")
        return
    inc = _choose(incidents)
    incident_card(inc, datetime.now(UTC))
    doc = c.incident_assessment(inc["id"])
    st.markdown(doc.get("account") or "")
    _tenants(doc)
    _cause(doc)
    _reads(doc)
    _pool(doc)
    _actions(c, inc, doc)


ui.page_header(
    "Incident",
    "One incident for the person on call: the deadline, who is affected, the cause chain, and "
    "the assessment and notices to write.",
)
ui.guarded(render)
