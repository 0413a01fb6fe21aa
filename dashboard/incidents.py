"""An incident's card, shared by the alerts page and the incident page (a page script runs
on import, so pages never import each other)."""

from __future__ import annotations

from datetime import datetime, timedelta

import streamlit as st

from dashboard import ui
from dashboard.client import JSON, CollectorClient
from dashboard.errors import TokenRejected

# (when, a key of charts.MARKERS, label, its deployment)
Marker = tuple[datetime, str, str, str | None]


def incident_card(inc: JSON, now: datetime, case: JSON | None = None) -> None:
    """The incident's clock. With its case document (``GET /v1/incidents/{id}/case``) the
    clock is the operator's own duty as the collector decides it for the role
    (collector/cases/status.py ``duty``): as processor, each customer without undue delay
    (Art. 33(2)); as controller, the authority by the deadline (Art. 33(1))."""
    awareness = ui.parse_time(inc["awareness_at"])
    duty = (case or {}).get("duty")
    due_text = duty["due_at"] if duty else inc["deadline_at"]
    deadline = ui.parse_time(due_text)
    with st.container(border=True):
        st.markdown(f"**#{inc['id']} {inc['title']}**")
        st.caption(
            f"{inc['deployment_id'] or 'no deployment'} · cause `{inc['cause_rule']}` · "
            f"opened {ui.when(inc['opened_at'])} · aware since {ui.when(inc['awareness_at'])}"
        )
        if inc["state"] == "closed":
            _closed(inc, duty)
            return
        if deadline is None or awareness is None:
            st.warning("This incident has no notification deadline recorded.")
            return
        left = deadline - now
        a, b = st.columns(2)
        if duty and duty["role"] == "processor":
            a.metric("Tell each customer by (Art. 33(2))", ui.when(due_text))
        elif duty:
            a.metric("Notify the authority by (Art. 33(1))", ui.when(due_text))
        else:
            a.metric("Notification deadline (Art. 33)", ui.when(due_text))
        all_sent = duty is not None and not duty["pending"]
        if all_sent:
            b.metric("Notified", "every party")
        elif left > timedelta(0):
            b.metric("Time left", ui.span(left))
        else:
            b.metric("Overdue by", ui.span(left))
        if duty:
            pending = ", ".join(duty["pending"]) or "none"
            st.caption(f"{duty['rule']}. Not yet sent: {pending}.")
            if duty.get("controller_clock"):
                st.caption(duty["controller_clock"])
        total = (deadline - awareness).total_seconds()
        elapsed = min(max((now - awareness).total_seconds() / total, 0.0), 1.0) if total else 1.0
        if all_sent:
            return
        st.progress(elapsed, text=f"{elapsed:.0%} of the notification window used")
        if left <= timedelta(0):
            st.error(
                f"**The due time passed {ui.span(left)} ago.** A late notification must say "
                "why it is late (the breach report asks for the reason)."
            )
        elif left < timedelta(hours=24):
            st.warning(f"**Less than a day left:** {ui.span(left)}.")


def _closed(inc: JSON, duty: JSON | None) -> None:
    """A closed incident: who closed it, when and why, in place of the clock (its countdown
    ended with it). Notices still owed are said: closing does not discharge them."""
    a, b = st.columns(2)
    a.metric("Closed", ui.when(inc["closed_at"]))
    b.metric("Closed by", inc["closed_by"] or "-")
    st.success(
        f"**Closed.** Why: {inc['close_reason'] or 'no reason recorded'}",
        icon=":material/check_circle:",
    )
    if duty and duty["pending"]:
        st.warning(
            f"Closed with notices not yet sent: {', '.join(duty['pending'])} ({duty['rule']})."
        )


def incident_markers(
    c: CollectorClient, window: tuple[datetime, datetime], deployment: str | None
) -> list[Marker]:
    """What every chart of a page marks (``charts.markers_frame`` keeps each chart's own
    range): each incident's opening and each stale read in the window, of ``deployment`` or
    all. Read once per page; a token that may not read one of them gets the other."""
    since, until = window
    out: list[Marker] = []
    try:
        incidents = c.incidents(limit=200)
    except TokenRejected as exc:
        if not exc.forbidden:
            raise
        incidents = []
    for inc in incidents:
        at = ui.parse_time(inc.get("opened_at"))
        if at is None or (deployment is not None and inc.get("deployment_id") != deployment):
            continue
        out.append((at, "incident opened", f"incident #{inc['id']}", inc.get("deployment_id")))
    reads = c.page_events(
        kind="page.stale_read", since=since, until=until, deployment_id=deployment, limit=200
    )["items"]
    for r in reads:
        at = ui.parse_time(r["ts"])
        if at is not None:
            label = "stale read, cross-tenant" if r.get("cross_tenant") else "stale read"
            out.append((at, "stale read", label, r.get("deployment_id")))
    return out
