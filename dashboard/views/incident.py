"""One incident, for the person on call: the countdown to the notification deadline, what
crossed between which tenants and why (the cause chain, from the evidence), the stale reads,
the pool of the involved nodes over the incident's own minutes, and the buttons that write
the assessment and each tenant's notice. Opened from a fleet card (``/incident?id=N``) or the
incident list."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient
from dashboard.frames import occupancy_frame
from dashboard.incidents import incident_card, incident_markers


def _choose(incidents: list[JSON]) -> JSON:
    """The incident a link names (``?id=N``), else the newest. An id that names none this
    token may see is said and stops the page: showing another incident under that link
    (silently the newest) would have a person act on the wrong one."""
    wanted = st.query_params.get("id")
    ids = [i["id"] for i in incidents]
    if wanted is not None and (not wanted.isdigit() or int(wanted) not in ids):
        st.error(
            f"No incident #{wanted} here: the link names an incident that does not exist, or "
            "one this token may not see. Choose one below, or open the [incident list](/alerts).",
            icon=":material/error:",
        )
        st.query_params.clear()
        if st.button("Show the newest incident"):
            st.rerun()
        st.stop()
    index = ids.index(int(wanted)) if wanted is not None else 0
    labels = {i["id"]: f"#{i['id']} {i['deployment_id']} ({i['state']})" for i in incidents}
    chosen = st.selectbox("Incident", ids, index=index, format_func=lambda i: labels[i])
    st.query_params["id"] = str(chosen)
    return next(i for i in incidents if i["id"] == chosen)


def _tenants(doc: JSON) -> None:
    t = doc["tenants"]
    a, b, c, d = st.columns(4)
    a.metric("Exposed tenants", t["exposed_count"], help="Their requests' KV was read.")
    b.metric("Exposed requests", t["exposed_requests"])
    c.metric("Receiving tenants", t["receiving_count"], help="Their requests read it.")
    d.metric("Receiving requests", t["receiving_requests"])
    e, f, g = st.columns(3)
    cats = doc["data_categories"]
    # a document written before the population was told apart carried it as data_subjects:
    # a population, never the persons concerned
    subjects = cats.get("data_subjects") if "population" in cats else None
    population = cats["population"] if "population" in cats else cats.get("data_subjects")
    e.metric(
        "Data subjects concerned",
        "unknown" if subjects is None else f"{subjects:,}",
        help="kvwatch stores no prompt text: the exposed tenant can say whom its prompts concern."
        + (
            f" Declared population behind the exposed requests: {population:,} persons "
            "(the data map), not the number concerned."
            if population is not None
            else ""
        ),
    )
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
    _requests_of_read(doc, items)


def _requests_of_read(doc: JSON, items: list[JSON]) -> None:
    """The click-through: one stale read's two requests, the one that read and the one whose
    KV it read, as the evidence records them."""
    requests = {(r["deployment_id"], r["request_id"]): r for r in doc["affected_requests"]["items"]}

    def label(i: int) -> str:
        s = items[i]
        return (
            f"{ui.when(s['ts'])}: {s['reader_request_id'] or '?'} read "
            f"{s['page_count']} pages of {s['previous_request_id'] or 'no earlier request'}"
        )

    chosen = st.selectbox(
        "The requests of a stale read",
        range(len(items)),
        index=None,
        format_func=label,
        placeholder="Choose a stale read to see the requests on both sides",
        key="stale_read_requests",
    )
    if chosen is None:
        return
    s = items[chosen]
    left, right = st.columns(2)
    for col, title, rid in (
        (left, "The request that read", s["reader_request_id"]),
        (right, "The request whose KV was read", s["previous_request_id"]),
    ):
        with col, st.container(border=True):
            st.markdown(f"**{title}**")
            r = requests.get((s["deployment_id"], rid)) if rid else None
            if r is None:
                st.caption(
                    "No earlier writer is recorded for these pages: they were read before any "
                    "request wrote them (zeroed or never used), so no one's data was exposed."
                    if not rid
                    else f"Request {rid} is not in the evidence (its record was not received)."
                )
                continue
            st.dataframe(
                pd.DataFrame(
                    [
                        ("request", r["request_id"]),
                        ("tenant", r["tenant"]),
                        ("route", r["route"] or "—"),
                        ("model", r["model_id"] or "—"),
                        ("prompt tokens", _num(r["prompt_tokens"])),
                        ("completion tokens", _num(r["completion_tokens"])),
                        ("status", ui.request_status({**r, "reject_reason": None})),
                        ("rejected because", r["reject_reason"] or "—"),
                        ("first seen", ui.when(r["first_ts"])),
                        ("last seen", ui.when(r["last_ts"])),
                    ],
                    columns=["field", "value"],
                ),
                hide_index=True,
                use_container_width=True,
            )


def _num(v: int | None) -> str:
    return "—" if v is None else f"{v:,}"


def _pool(c: CollectorClient, inc: JSON, doc: JSON) -> None:
    """Each involved deployment's pools, node by node, over the incident's own window (the
    assessment's time axis), with each node's capacity across the chart."""
    series = doc.get("series") or {}
    window = series.get("window") or {}
    lo, hi = ui.parse_time(window.get("from")), ui.parse_time(window.get("until"))
    st.subheader("Pool occupancy over the incident")
    if lo is None or hi is None:
        st.info("The incident has no events to place on a time axis.")
        return
    deployments = doc.get("involved_deployments") or [inc["deployment_id"]]
    markers = incident_markers(c, (lo, hi), None)
    drawn = 0
    for dep in deployments:
        pool = c.pool_samples(since=lo, until=hi, deployment_id=dep, max_points=200)
        if not pool["items"]:
            continue
        st.markdown(f"**{dep}**: tokens in use per node (line), capacity (dashed)")
        chart = charts.pool_occupancy(
            occupancy_frame(pool["items"]),
            (lo, hi),
            pool["bucket_seconds"],
            charts.markers_frame([x for x in markers if x[3] in (dep, None)], (lo, hi)),
        )
        st.altair_chart(chart, width="stretch")
        drawn += 1
    if not drawn:
        st.info(f"No pool sample of {', '.join(deployments)} in the incident's window.")
        return
    st.caption(
        f"{ui.when(window.get('from'))} to {ui.when(window.get('until'))}, the incident's own "
        "window: when a node's line reaches its dashed capacity, the pool is full and the next "
        "allocation must reuse pages."
    )


def _case(c: CollectorClient, inc: JSON) -> None:
    """Each party's notification (due, prepared, approved, sent, acknowledged, deletion
    confirmed, late) and the decision register, as the collector decides them
    (collector/cases/status.py): this page computes nothing of its own."""
    case = c.incident_case(inc["id"])
    st.subheader("Notification of each party")
    rows = [
        {
            # What a person checks first on the left (the grid draws the columns in view)
            "party": p["party"],
            "kind": p["party_kind"],
            "state": p["state"],
            "channel": p["channel"] or "-",
            "late": "late" if p["late"] else ("overdue" if p["overdue"] else "no"),
            "due": ui.when(p["due_at"]),
            "sent": ui.when(p["sent_at"]) if p["sent_at"] else "-",
            "hours from awareness": "-" if p["sent_after_h"] is None else f"{p['sent_after_h']:g}",
            "acknowledged": ui.when(p["acknowledged_at"]) if p["acknowledged_at"] else "-",
            "deletion confirmed": (
                ui.when(p["deletion_confirmed_at"])
                if p["deletion_confirmed_at"]
                else ("-" if p["party_kind"] in ("received", "both") else "n/a")
            ),
            "prepared": ui.when(p["prepared_at"]) if p["prepared_at"] else "-",
            "approved": ui.when(p["approved_at"]) if p["approved_at"] else "-",
            "notice": p["notice_id"] or "-",
        }
        for p in case["parties"]
    ]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, use_container_width=True)
        st.caption(
            "Due: "
            + "; ".join(sorted({p["due_rule"] for p in case["parties"]}))
            + ". Steps: `kvwatch incidents notify prepare|approve|send|ack|confirm-deletion`."
        )
    else:
        st.info("No party to notify: no cross-tenant read in this incident.")
    st.subheader("Decision register (Art. 33(5))")
    decisions = case["decisions"]
    if not decisions:
        st.info("No decision recorded yet: `kvwatch incidents decide`.")
        return
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "#": d["id"],
                    "when": ui.when(d["at"]),
                    "by": d["by"],
                    "kind": d["kind"],
                    "status": d["status"] + (" (superseded)" if d["superseded"] else ""),
                    "what": d["what"],
                    "why": d["why"],
                }
                for d in decisions
            ]
        ),
        hide_index=True,
        use_container_width=True,
        column_config={"what": st.column_config.TextColumn(width="large")},
    )


def _actions(c: CollectorClient, inc: JSON, doc: JSON) -> None:
    st.subheader("Write it down")
    if not ui.may(c, "report"):
        st.info(
            "Generating the assessment and the notices needs an admin token, or a signed-in "
            "operator or auditor."
        )
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


def _oncall(c: CollectorClient, inc: JSON) -> None:
    """Who is on it, what to do first (the runbook of the rule that opened it), the alerts
    linked to it, and what happened, in order: all as the collector records them."""
    full = c.incident(inc["id"])
    alerts = full.get("alerts") or []
    opener = next((a for a in alerts if a["id"] == full.get("first_alert_id")), None)
    st.subheader("On call")
    a, b, d = st.columns(3)
    a.metric(
        "Acknowledged",
        full["acked_by"] or "not yet",
        help=f"at {ui.when(full['acked_at'])}"
        if full["acked_at"]
        else "Nobody has said they are on it.",
    )
    b.metric("Owner", full["owner"] or "nobody")
    if opener is not None:
        kind = opener["kind"]
        d.markdown(f"**Runbook**: [containment first, for {kind}](/runbook?kind={kind})")
    if alerts:
        st.markdown(f"**Linked alerts** ({len(alerts)})")
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "#": f"/alerts?id={x['id']}",
                        "rule": x["rule"],
                        "severity": x["severity"],
                        "state": x["state"],
                        "since": ui.when(x["starts_at"]),
                        "opened it": "yes" if x["id"] == full.get("first_alert_id") else "",
                    }
                    for x in alerts
                ]
            ),
            hide_index=True,
            use_container_width=True,
            column_config={"#": st.column_config.LinkColumn(display_text=r"id=(\d+)$")},
        )
    if ui.may(c, "respond"):
        _oncall_actions(c, full, alerts)
    st.subheader("Timeline")
    entries = c.incident_timeline(inc["id"])
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "when": ui.when(e["at"]),
                    "what": e["kind"],
                    "who": e["actor"],
                    "details": e["text"],
                }
                for e in entries
            ],
            columns=["when", "what", "who", "details"],
        ),
        hide_index=True,
        use_container_width=True,
        column_config={"details": st.column_config.TextColumn(width="large")},
    )


def _by() -> str | None:
    return str(st.session_state.get("oncall_by") or "").strip() or None


def _oncall_actions(c: CollectorClient, inc: JSON, alerts: list[JSON]) -> None:
    iid = inc["id"]

    def ack(c: CollectorClient) -> str | None:
        c.ack_incident(iid, by=_by())
        return None

    def assign(c: CollectorClient) -> str | None:
        c.assign_incident(iid, str(st.session_state.get("oncall_owner") or ""), by=_by())
        return None

    def note(c: CollectorClient) -> str | None:
        c.note_incident(iid, str(st.session_state.get("oncall_note") or ""), by=_by())
        return None

    def link(c: CollectorClient) -> str | None:
        c.link_alert(iid, int(st.session_state["oncall_link"]), by=_by())
        return None

    def unlink(c: CollectorClient) -> str | None:
        c.unlink_alert(iid, int(st.session_state["oncall_unlink"]))
        return None

    ui.show_flash()
    if ui.me(c).get("person"):
        st.caption(f"Recorded as {ui.me(c)['name']}, as your sign-in names you.")
    else:
        st.text_input("Your name", key="oncall_by", help="Recorded as who acted. Empty: the token.")
    open_ = inc["state"] == "open"
    left, mid, right = st.columns(3)
    with left, st.form("oncall_ack", border=True):
        st.markdown("**Acknowledge and own**")
        st.form_submit_button(
            "Acknowledge",
            disabled=not open_ or inc["acked_by"] is not None,
            on_click=ui.act,
            args=("Incident acknowledged", ack),
        )
        st.text_input("Owner", key="oncall_owner")
        st.form_submit_button(
            "Assign", disabled=not open_, on_click=ui.act, args=("Owner assigned", assign)
        )
    with mid, st.form("oncall_note", clear_on_submit=True, border=True):
        st.markdown("**Add a note**")
        st.text_area("Note", key="oncall_note", max_chars=4000)
        st.form_submit_button("Add note", on_click=ui.act, args=("Note added", note))
    with right, st.form("oncall_links", border=True):
        st.markdown("**Link or unlink an alert**")
        linked = {a["id"] for a in alerts}
        candidates = [
            a
            for a in c.alerts(deployment_id=inc["deployment_id"], limit=200)
            if a["id"] not in linked
        ]
        st.selectbox(
            "Alert to link",
            [a["id"] for a in candidates],
            format_func=lambda i: f"#{i}",
            key="oncall_link",
            placeholder="No other alert on this deployment",
        )
        st.form_submit_button(
            "Link",
            disabled=not open_ or not candidates,
            on_click=ui.act,
            args=("Alert linked", link),
        )
        removable = sorted(linked - {inc.get("first_alert_id")})
        st.selectbox(
            "Alert to unlink",
            removable,
            format_func=lambda i: f"#{i}",
            key="oncall_unlink",
            placeholder="Only the alert that opened it is linked",
        )
        st.form_submit_button(
            "Unlink",
            disabled=not open_ or not removable,
            on_click=ui.act,
            args=("Alert unlinked", unlink),
        )


def _tenant_view(c: CollectorClient) -> None:
    """A tenant-scoped token sees the incidents that concern its data, its own side of each
    (the notice's contents: its requests, never the other party)."""
    mine = c.incidents(limit=200)
    if not mine:
        st.success("No incident concerns your data.", icon=":material/check_circle:")
        return
    inc = _choose(mine)
    view = c.incident(inc["id"])
    st.error(f"**{view['summary']}**", icon=":material/emergency:")
    i = view["incident"]
    st.caption(
        f"Incident #{i['id']} on {i['deployment_id']} · {i['state']} · opened "
        f"{ui.when(i['opened_at'])} · the service became aware {ui.when(i['our_awareness_at'])}"
    )
    st.markdown(view["what_happened"])
    for title, rows, who in (
        (
            "Your requests whose data another customer read",
            "your_requests_read_by_another",
            "read_by",
        ),
        (
            "Your requests that read another customer's data",
            "your_requests_that_read_another",
            "data_of",
        ),
    ):
        if view[rows]:
            st.subheader(title)
            st.dataframe(
                pd.DataFrame(
                    [
                        {
                            "request": r["request_id"],
                            "first seen": ui.when(r["first_seen"]),
                            "prompt tokens": r["prompt_tokens"],
                            # the extent in tokens: the answer that read the tenant's
                            # prompt, or the tenant's own answer that may hold another's
                            "answer tokens": r.get("reader_answer_tokens", r["completion_tokens"]),
                            "read at": ui.when(r["read_at"]),
                            who.replace("_", " "): r[who],
                        }
                        for r in view[rows]
                    ]
                ),
                hide_index=True,
                use_container_width=True,
            )
    if view["please_delete"]:
        st.warning(view["please_delete"], icon=":material/delete:")
    st.markdown(f"**Measures.** {view['measures']}")
    st.markdown(f"**Contact.** {view['contact']}")
    st.caption(f"Legal basis: {view['legal_basis']}")


def render(c: CollectorClient) -> None:
    if ui.token_scope(c) == "tenant":
        _tenant_view(c)
        return
    incidents = c.incidents(limit=200)
    if not incidents:
        st.success("No incidents.", icon=":material/check_circle:")
        return
    inc = _choose(incidents)
    incident_card(inc, datetime.now(UTC), c.incident_case(inc["id"]))
    _oncall(c, inc)
    doc = c.incident_assessment(inc["id"])
    st.markdown(doc.get("account") or "")
    _tenants(doc)
    _cause(doc)
    _reads(doc)
    _pool(c, inc, doc)
    _case(c, inc)
    _actions(c, inc, doc)


ui.page_header(
    "Incident",
    "One incident for the person on call: the deadline, who is affected, the cause chain, and "
    "the assessment and notices to write.",
)
ui.guarded(render)
