"""An incident's card, shared by the alerts page and the incident page (a page script runs
on import, so pages never import each other)."""

from __future__ import annotations

from datetime import datetime, timedelta

import streamlit as st

from dashboard import ui
from dashboard.client import JSON


def incident_card(inc: JSON, now: datetime) -> None:
    awareness = ui.parse_time(inc["awareness_at"])
    deadline = ui.parse_time(inc["deadline_at"])
    with st.container(border=True):
        st.markdown(f"**#{inc['id']} {inc['title']}**")
        st.caption(
            f"{inc['deployment_id'] or 'no deployment'} · cause `{inc['cause_rule']}` · "
            f"opened {ui.when(inc['opened_at'])} · aware since {ui.when(inc['awareness_at'])}"
        )
        if deadline is None or awareness is None:
            st.warning("This incident has no notification deadline recorded.")
            return
        left = deadline - now
        a, b = st.columns(2)
        a.metric("Notification deadline (Art. 33)", ui.when(inc["deadline_at"]))
        if left > timedelta(0):
            b.metric("Time left", ui.span(left))
        else:
            b.metric("Overdue by", ui.span(left))
        total = (deadline - awareness).total_seconds()
        elapsed = min(max((now - awareness).total_seconds() / total, 0.0), 1.0) if total else 1.0
        st.progress(elapsed, text=f"{elapsed:.0%} of the notification window used")
        if left <= timedelta(0):
            st.error(
                f"**The deadline passed {ui.span(left)} ago.** A late notification must say "
                "why it is late (the breach report asks for the reason)."
            )
        elif left < timedelta(hours=24):
            st.warning(f"**Less than a day left:** {ui.span(left)}.")
