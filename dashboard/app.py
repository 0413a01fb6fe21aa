"""The dashboard's entry script (``kvwatch dashboard`` runs it with ``streamlit run``): the
sidebar every page shares, and the pages."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import signin, ui
from dashboard.errors import DashboardError

HERE = Path(__file__).parent
# The page scripts live in views/, not pages/: Streamlit would also read a pages/ folder as
# old-style pages, which confuses st.navigation's routing (deep links open "Page not found").
# Each page's URL is its file name (/context, /pool, ...): no custom url_path, so AppTest can
# open a page directly by its file.
PAGES = [
    st.Page(HERE / "views" / "fleet.py", title="Fleet", icon=":material/dns:", default=True),
    st.Page(
        HERE / "views" / "context.py",
        title="Context pressure",
        icon=":material/stacked_line_chart:",
    ),
    st.Page(
        HERE / "views" / "pool.py",
        title="Pool and isolation",
        icon=":material/memory:",
    ),
    st.Page(
        HERE / "views" / "alerts.py",
        title="Alerts and incidents",
        icon=":material/notifications_active:",
    ),
    st.Page(
        HERE / "views" / "incident.py",
        title="Incident",
        icon=":material/emergency:",
    ),
    st.Page(
        HERE / "views" / "runbook.py",
        title="Runbook",
        icon=":material/menu_book:",
    ),
    st.Page(
        HERE / "views" / "verifications.py",
        title="Verifications",
        icon=":material/verified:",
    ),
    st.Page(
        HERE / "views" / "reports.py",
        title="Reports",
        icon=":material/description:",
    ),
]


def sidebar() -> None:
    settings = ui.settings()
    with st.sidebar:
        st.markdown("### kvwatch")
        st.caption(f"Collector: `{settings.collector_url}`")
        if settings.token is None and not settings.oidc:
            st.text_input(
                "Token",
                type="password",
                key="typed_token",
                help="A read or admin token; KVWATCH_DASHBOARD_TOKEN is not set.",
            )
        scope = _scope_caption()
        if scope:
            st.caption(scope)
        if settings.oidc:
            signin.sign_out_button()
        st.selectbox("Time window", list(ui.WINDOWS), index=2, key="window")
        st.toggle(
            "Zoom charts to the data",
            value=True,
            key="zoom",
            help="When the events cover a small part of the window (a minute in a day), the "
            "charts show just that stretch, in finer buckets.",
        )
        period = settings.dashboard_refresh_s
        if period > 0:
            st.toggle(f"Auto-refresh every {period:g} s", value=True, key="auto_refresh")
        else:
            st.caption("Auto-refresh is off (KVWATCH_DASHBOARD_REFRESH_S=0).")
        st.button("Refresh now", icon=":material/refresh:")


def _scope_caption() -> str | None:
    if ui.token() is None:
        return None
    try:
        with ui.collector(timeout_s=5) as c:
            return ui.who_label(c)
    except DashboardError:
        return None  # the page says what is wrong, in full


def incident_banner() -> None:
    """Every page says that an incident is open, and links to it: to a tenant-scoped token,
    the incidents that concern its data; to everyone else, every open incident."""
    if ui.token() is None:
        return
    try:
        with ui.collector(timeout_s=5) as c:
            tenant = ui.token_scope(c) == "tenant"
            open_now = c.incidents(state="open", limit=20)
    except DashboardError:
        return  # the page says what is wrong, in full
    for inc in open_now:
        if tenant:
            text = f"**{inc['summary']}** Incident #{inc['id']}, opened {ui.when(inc['opened_at'])}"
        else:
            who = (
                f"acknowledged by {inc['acked_by']}" if inc.get("acked_by") else "not acknowledged"
            )
            text = (
                f"**Open incident #{inc['id']}**: {inc['title']}. Opened "
                f"{ui.when(inc['opened_at'])}, {who}"
                + (f", owner {inc['owner']}" if inc.get("owner") else "")
            )
        st.error(f"{text}: [open it](/incident?id={inc['id']})", icon=":material/emergency:")


st.set_page_config(page_title="kvwatch", page_icon=":material/shield:", layout="wide")
if ui.settings().oidc:
    ui.admit_person()  # stops here: not signed in, sign-in ended, or no role
page = st.navigation(PAGES)
sidebar()
if page.url_path != "incident":  # the incident page says it in full
    incident_banner()
page.run()
