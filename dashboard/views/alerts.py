"""Alerts and incidents: what fires, acknowledging and silencing it, and each incident's
notification deadline (GDPR Art. 33: 72 hours from awareness) counting down. A link to one
alert (``/alerts?id=N``) opens with that alert's detail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient
from dashboard.errors import BadRequest
from dashboard.incidents import incident_card, incident_markers

ANY = "(any)"
STATES = {"Firing": "firing", "Pending": "pending", "Resolved": "resolved", "All": None}
SEVERITIES = {"All": None, "Critical": "critical", "Warning": "warning", "Info": "info"}


def _summary(a: JSON) -> str:
    return str((a.get("annotations") or {}).get("summary", ""))


#: the alert tables' columns: each alert's incident a link to its page (``#N``), the summary
#: wide enough to read
ALERT_COLUMNS = {
    "incident": st.column_config.LinkColumn(display_text=r"id=(\d+)$", width="small"),
    "rule": st.column_config.TextColumn(width="medium"),
    "summary": st.column_config.TextColumn(width="large"),
}


def alerts_frame(alerts: list[JSON]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                # what a person triages with first, on the left (the grid scrolls sideways)
                "id": a["id"],
                "severity": a["severity"],
                "state": a["state"],
                "rule": a["rule"],
                "deployment": a["deployment_id"] or "(whole installation)",
                "incident": (
                    None if a["incident_id"] is None else f"/incident?id={a['incident_id']}"
                ),
                "since": ui.when(a["fired_at"] or a["starts_at"]),
                "summary": _summary(a),
                "acknowledged": (
                    f"{a['acked_by']} at {ui.when(a['acked_at'])}" if a["acked"] else "no"
                ),
                "silenced": bool(a.get("silenced")),
            }
            for a in alerts
        ]
    )


def incidents(c: CollectorClient) -> None:
    st.subheader("Incidents")
    items = c.incidents(limit=200)
    open_ = [i for i in items if i["state"] == "open"]
    if not items:
        st.success("No incidents.", icon=":material/check_circle:")
    elif not open_:
        st.success("No open incidents.", icon=":material/check_circle:")
    now = datetime.now(UTC)
    for inc in open_:
        incident_card(inc, now, c.incident_case(inc["id"]))
    closed = [i for i in items if i["state"] != "open"]
    if closed:
        with st.expander(f"Closed incidents ({len(closed)})"):
            st.dataframe(
                pd.DataFrame(
                    [
                        {
                            "id": i["id"],
                            "title": i["title"],
                            "deployment": i["deployment_id"],
                            "opened": ui.when(i["opened_at"]),
                            "deadline": ui.when(i["deadline_at"]),
                            "closed": ui.when(i["closed_at"]),
                            "closed by": i["closed_by"],
                            "reason": i["close_reason"],
                        }
                        for i in closed
                    ]
                ),
                hide_index=True,
            )


def alerts(c: CollectorClient) -> None:
    st.subheader("Alerts")
    f1, f2 = st.columns(2)
    state = STATES[f1.selectbox("State", list(STATES), key="alert_state")]
    severity = SEVERITIES[f2.selectbox("Severity", list(SEVERITIES), key="alert_severity")]
    items = c.alerts(state=state, severity=severity, limit=500)
    if not items:
        st.success(
            f"No {'' if state is None else state + ' '}alerts"
            f"{'' if severity is None else ' of severity ' + severity}.",
            icon=":material/check_circle:",
        )
        return
    crit = sum(1 for a in items if a["severity"] == "critical")
    unacked = sum(1 for a in items if not a["acked"] and a["state"] != "resolved")
    st.caption(f"{len(items)} alert(s): {crit} critical, {unacked} not acknowledged.")
    _timeline(c, items)
    st.dataframe(alerts_frame(items), hide_index=True, column_config=ALERT_COLUMNS)


def _timeline(c: CollectorClient, items: list[JSON]) -> None:
    """The listed alerts over time, with each incident's opening and stale read marked."""
    now = datetime.now(UTC)
    rows = []
    for a in items:
        start = ui.parse_time(a["starts_at"])
        if start is None:
            continue
        end = ui.parse_time(a["ends_at"]) or now
        where = a["deployment_id"] or "whole installation"
        rows.append(
            {
                "time": start,
                "end": max(end, start + timedelta(seconds=1)),  # a bar, not nothing
                "row": f"{a['rule']} · {where}",
                "severity": a["severity"],
                "id": a["id"],
                "state": a["state"],
            }
        )
    if not rows:
        return
    df = pd.DataFrame(rows)
    lo, hi = min(df["time"]), max(max(df["end"]), now)
    # the stale reads an alert reports happened before it fired (event time, then the
    # collector's pass): the axis reaches back to those of the day before
    marks = incident_markers(c, (lo - timedelta(days=1), hi), None)
    lo = min([lo, *(m[0] for m in marks)])
    pad = max((hi - lo) * 0.03, timedelta(seconds=5))
    window = (lo - pad, hi + pad)
    markers = charts.markers_frame(marks, window)
    st.markdown("**Alerts over time** (bars: active to resolved; rules: incidents, stale reads)")
    st.altair_chart(charts.alert_timeline(df, window, markers), width="stretch")


def silences(c: CollectorClient) -> None:
    st.subheader("Silences")
    items = [s for s in c.silences() if s["active"]]
    if not items:
        st.caption("No active silences.")
        return
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "id": s["id"],
                    "matchers": ", ".join(
                        f"{m['name']}{'=~' if m['regex'] else '='}{m['value']}"
                        for m in s["matchers"]
                    ),
                    "until": ui.when(s["ends_at"]),
                    "by": s["created_by"],
                    "comment": s["comment"],
                }
                for s in items
            ]
        ),
        hide_index=True,
    )


def linked(c: CollectorClient) -> None:
    """The alert a link names (``/alerts?id=N``, as notifications link), above everything:
    whoever followed the link came for that one."""
    wanted = st.query_params.get("id")
    if not wanted or not wanted.isdigit():
        return
    try:
        a = c.alert(int(wanted))
    except BadRequest as e:  # 404 included: a link to an alert since deleted
        st.warning(f"Alert #{wanted}: {e}")
        return
    st.subheader(f"Alert #{a['id']}: {a['rule']} ({a['severity']}, {a['state']})")
    st.markdown(_summary(a) or "(no summary)")
    if action := (a.get("annotations") or {}).get("action"):
        st.markdown(f"**What to do:** {action}")
    st.dataframe(alerts_frame([a]), hide_index=True, column_config=ALERT_COLUMNS)
    if a["incident_id"] is not None:
        st.markdown(f"Part of [incident #{a['incident_id']}](incident?id={a['incident_id']}).")


def render(c: CollectorClient) -> None:
    if ui.require_operator(c, "Alerts and incidents") is None:
        return
    linked(c)
    incidents(c)
    alerts(c)
    silences(c)


# ---------------------------------------------------------------------- actions (admin)


def _actor() -> str | None:
    """Who acts: the dashboard shares one token, so the person says who they are (else the
    collector records the token)."""
    return str(st.session_state.get("actor") or "").strip() or None


def _ack(c: CollectorClient) -> str | None:
    alert_id = int(st.session_state["ack_alert"])
    comment = (st.session_state.get("ack_comment") or "").strip() or None
    c.ack(alert_id, by=_actor(), comment=comment)
    return None


def _silence(c: CollectorClient) -> str | None:
    matchers = []
    for name, key in (("alertname", "sil_rule"), ("deployment_id", "sil_deployment")):
        value = st.session_state.get(key)
        if value and value != ANY:
            matchers.append({"name": name, "value": value, "regex": False})
    if not matchers:
        raise BadRequest("choose a rule or a deployment to silence", status=422)
    s = c.create_silence(
        matchers,
        duration=str(st.session_state.get("sil_duration") or "").strip(),
        comment=str(st.session_state.get("sil_comment") or "").strip(),
        created_by=_actor(),
    )
    return f"Silence #{s['id']} until {ui.when(s['ends_at'])}."


def _expire(c: CollectorClient) -> str | None:
    c.expire_silence(int(st.session_state["expire_silence"]))
    return None


def _close(c: CollectorClient) -> str | None:
    c.close_incident(
        int(st.session_state["close_incident"]),
        reason=str(st.session_state.get("close_reason") or "").strip(),
        by=_actor(),
    )
    return None


def actions(c: CollectorClient) -> None:
    scope = ui.token_scope(c)
    if scope == "tenant":
        return
    st.divider()
    st.subheader("Act")
    if not ui.may(c, "respond"):
        who = ui.me(c)
        this = f"your role is {who['role']}" if who.get("person") else "this is a read token"
        st.info(
            f"Acknowledging, silencing and closing need an admin token or a signed-in "
            f"operator; {this}."
        )
        return
    if ui.me(c).get("person"):
        st.caption(f"Recorded as {ui.me(c)['name']}, as your sign-in names you.")
    else:
        st.text_input(
            "Your name",
            key="actor",
            help="Recorded as who acknowledged, silenced or closed (the audit log names the "
            "token too). Empty: the token's name.",
        )
    open_alerts = [a for a in c.alerts(limit=500) if a["state"] != "resolved" and not a["acked"]]
    left, right = st.columns(2)
    with left, st.form("ack", clear_on_submit=True, border=True):
        st.markdown("**Acknowledge an alert**")
        labels = {
            a["id"]: f"#{a['id']} {a['rule']} ({a['severity']}) on "
            f"{a['deployment_id'] or 'the whole installation'}"
            for a in open_alerts
        }
        st.selectbox(
            "Alert",
            list(labels),
            format_func=lambda i: labels.get(i, str(i)),
            key="ack_alert",
            placeholder="No unacknowledged alerts",
        )
        st.text_input("Comment", key="ack_comment")
        st.form_submit_button(
            "Acknowledge",
            disabled=not open_alerts,
            on_click=ui.act,
            args=("Alert acknowledged", _ack),
        )
    with right, st.form("silence", clear_on_submit=True, border=True):
        st.markdown("**Silence notifications**")
        rules = sorted({r["name"] for r in c.rules()})
        deployments = sorted({d["deployment_id"] for d in c.deployments()})
        st.selectbox("Rule (alertname)", [ANY, *rules], key="sil_rule")
        st.selectbox("Deployment", [ANY, *deployments], key="sil_deployment")
        st.text_input("For", value="2h", key="sil_duration", help="e.g. 30m, 2h, 1d")
        st.text_input("Comment (required)", key="sil_comment")
        st.form_submit_button("Silence", on_click=ui.act, args=("Silenced", _silence))
    left, right = st.columns(2)
    active = [s for s in c.silences() if s["active"]]
    if active:
        with left, st.form("expire", border=True):
            st.markdown("**Expire a silence**")
            st.selectbox(
                "Silence",
                [s["id"] for s in active],
                key="expire_silence",
                format_func=lambda i: f"#{i}",
            )
            st.form_submit_button("Expire now", on_click=ui.act, args=("Silence expired", _expire))
    open_incidents = c.incidents(state="open", limit=200)
    if open_incidents:
        with right, st.form("close", clear_on_submit=True, border=True):
            st.markdown("**Close an incident**")
            titles = {i["id"]: f"#{i['id']} {i['title']}" for i in open_incidents}
            st.selectbox(
                "Incident",
                list(titles),
                format_func=lambda i: titles.get(i, str(i)),
                key="close_incident",
            )
            st.text_input("Reason (required)", key="close_reason")
            st.form_submit_button(
                "Close incident", on_click=ui.act, args=("Incident closed", _close)
            )


ui.page_header(
    "Alerts and incidents",
    "Alerts from the policy packs; incidents opened by cross-tenant exposure, each with its "
    "72-hour notification deadline (GDPR Art. 33).",
)
ui.show_flash()
ui.live(render)
ui.guarded(actions, quiet=True)
