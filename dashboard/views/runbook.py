"""Runbook: what to do about a rule kind's alert, containment first (``/runbook?kind=K``, the
page alerts, incidents and notifications link to)."""

from __future__ import annotations

import streamlit as st

from dashboard import ui
from dashboard.client import CollectorClient
from dashboard.errors import TokenRejected


def _kinds(c: CollectorClient) -> list[str]:
    """The kinds of the rules in force, to choose from; none where the token may not list
    rules (a runbook itself is readable by any read token)."""
    try:
        return sorted({r["kind"] for r in c.rules()})
    except TokenRejected as exc:
        if exc.forbidden:
            return []
        raise


def render(c: CollectorClient) -> None:
    wanted = st.query_params.get("kind")
    kinds = _kinds(c)
    if wanted and wanted not in kinds:
        kinds = [wanted, *kinds]  # the collector says whether it exists
    if not kinds:
        st.info(
            "Open a runbook from an alert or an incident, or as `/runbook?kind=KIND`.",
            icon=":material/menu_book:",
        )
        return
    kind = st.selectbox("Rule kind", kinds, index=kinds.index(wanted) if wanted else 0)
    st.query_params["kind"] = kind
    st.markdown(c.runbook(kind)["markdown"])


ui.page_header(
    "Runbook",
    "What to do about an alert of this kind: contain first (engine flag, gateway mode), "
    "confirm with kvwatch verify, then diagnose and close.",
)
ui.guarded(render)
