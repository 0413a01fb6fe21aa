"""Reports: generate breach assessments (for an incident or a window) and quarterly reviews,
look at them, and download them as PDF, CSV and JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.client import JSON, CollectorClient, FileFormat

ANY = "(any)"
BY_INCIDENT, BY_WINDOW = "An incident", "A model and time window"
_MIME = {"pdf": "application/pdf", "csv": "text/csv", "json": "application/json"}
_FORMATS: tuple[FileFormat, ...] = ("pdf", "csv", "json")


def _start(d: date) -> datetime:
    return datetime.combine(d, time(), UTC)


def _window(since_key: str, until_key: str) -> tuple[datetime, datetime]:
    """The two date inputs as [since, until): the "to" day is included."""
    s = st.session_state
    return _start(s[since_key]), _start(s[until_key]) + timedelta(days=1)


def _deployment(key: str) -> str | None:
    value = st.session_state.get(key)
    return None if value in (None, ANY) else str(value)


def downloads(name: str, fetch: Callable[[CollectorClient, FileFormat], bytes], key: str) -> None:
    """PDF, CSV and JSON buttons. The file is fetched only when a button is clicked (a PDF
    takes a moment), on a thread of Streamlit's own: it gets the address and token, not the
    session."""
    settings, token = ui.settings(), ui.token()

    def getter(fmt: FileFormat) -> Callable[[], bytes]:
        def get() -> bytes:
            with CollectorClient(settings.collector_url, token, timeout_s=120) as c:
                return fetch(c, fmt)

        return get

    for col, fmt in zip(st.columns(3), _FORMATS, strict=True):
        col.download_button(
            f"Download {fmt.upper()}",
            data=getter(fmt),
            file_name=f"{name}.{fmt}",
            mime=_MIME[fmt],
            key=f"{key}_{fmt}",
            icon=":material/download:",
            on_click="ignore",
        )


# ---------------------------------------------------------------------- generating


def _generate_breach(c: CollectorClient) -> str | None:
    s = st.session_state
    if s.get("rep_mode") == BY_INCIDENT:
        report = c.create_breach_report(incident_id=int(s["rep_incident"]))
    else:
        since, until = _window("rep_since", "rep_until")
        report = c.create_breach_report(
            model_id=s.get("rep_model"),
            since=since,
            until=until,
            min_prompt_tokens=int(s.get("rep_min_tokens") or 0) or None,
            deployment_id=_deployment("rep_deployment"),
        )
    return _created(report)


def _generate_review(c: CollectorClient) -> str | None:
    since, until = _window("rev_since", "rev_until")
    report = c.create_review_report(
        since=since, until=until, deployment_id=_deployment("rev_deployment")
    )
    return _created(report)


def _created(report: JSON) -> str:
    st.session_state["rep_selected"] = report["report_id"]
    return (
        f"Report **{report['report_id']}** (evidence SHA-256 `{report['evidence_sha256']}`); "
        "download it below."
    )


def breach_form(c: CollectorClient) -> None:
    st.subheader("Breach assessment")
    st.caption(
        "Affected requests, exposed and receiving tenants, data categories, stale-read evidence, "
        "the timeline and deadline, and the Art. 33(3) checklist. Stored and audited."
    )
    mode = st.radio("For", [BY_INCIDENT, BY_WINDOW], horizontal=True, key="rep_mode")
    if mode == BY_INCIDENT:
        incidents = c.incidents(limit=200)
        if not incidents:
            st.info("No incidents: generate a report for a model and time window instead.")
            return
        titles = {i["id"]: f"#{i['id']} {i['title']} ({i['state']})" for i in incidents}
        with st.form("breach_incident", border=True):
            st.selectbox(
                "Incident",
                list(titles),
                format_func=lambda i: titles.get(i, str(i)),
                key="rep_incident",
            )
            st.form_submit_button(
                "Generate breach report",
                type="primary",
                on_click=ui.act,
                args=("Breach report generated", _generate_breach),
            )
        return
    deployments = c.deployments()
    models = sorted({x["model_id"] for d in deployments for x in d.get("config", [])})
    if not models:
        st.info("No models reported yet: there is nothing to assess.")
        return
    today = datetime.now(UTC).date()
    with st.form("breach_window", border=True):
        a, b = st.columns(2)
        a.selectbox("Model", models, key="rep_model")
        b.selectbox(
            "Deployment",
            [ANY, *sorted(d["deployment_id"] for d in deployments)],
            key="rep_deployment",
        )
        a.date_input("From (UTC)", value=today - timedelta(days=7), key="rep_since")
        b.date_input("To (UTC, inclusive)", value=today, key="rep_until")
        st.number_input(
            "Only prompts of at least (tokens; 0 = the stale reads' requests only)",
            min_value=0,
            value=0,
            step=1000,
            key="rep_min_tokens",
        )
        st.form_submit_button(
            "Generate breach report",
            type="primary",
            on_click=ui.act,
            args=("Breach report generated", _generate_breach),
        )


def review_form(c: CollectorClient, *, store: bool) -> None:
    st.subheader("Quarterly review")
    st.caption(
        "Max and p99 prompt tokens per route and model against the safe threshold, with the "
        "weekly trend; rows at 80% or more are highlighted."
        + (" Stored and audited." if store else " Built on demand; not stored.")
    )
    today = datetime.now(UTC).date()
    deployments = sorted(d["deployment_id"] for d in c.deployments())
    with st.form("review", border=True):
        a, b, cc = st.columns(3)
        a.date_input("From (UTC)", value=today - timedelta(days=90), key="rev_since")
        b.date_input("To (UTC, inclusive)", value=today, key="rev_until")
        cc.selectbox("Deployment", [ANY, *deployments], key="rev_deployment")
        if store:
            st.form_submit_button(
                "Generate review",
                on_click=ui.act,
                args=("Review generated", _generate_review),
            )
        else:
            st.form_submit_button("Build review", on_click=ui.act, args=("Review built", _adhoc))


# ---------------------------------------------------------------------- looking at them


def breach_preview(doc: JSON) -> None:
    ar = doc.get("affected_requests") or {}
    tenants = doc.get("tenants") or {}
    tl = doc.get("timeline") or {}
    a, b, cc, d = st.columns(4)
    a.metric("Affected requests", f"{ar.get('count', 0):,}")
    # a stored report as it was stored: of schema 2 or 3 (both count these), rarely older
    b.metric("Exposed tenants", tenants.get("exposed_count", "-"))
    cc.metric("Receiving tenants", tenants.get("receiving_count", "-"))
    d.metric("Largest prompt", ui.tokens(ar.get("max_prompt_tokens")))
    if tl.get("deadline_at"):
        late = " (late)" if tl.get("late") else ""
        st.caption(
            f"Aware {ui.when(tl.get('awareness_at'))} · notification deadline "
            f"**{ui.when(tl.get('deadline_at'))}**{late}"
        )
    a34 = doc.get("art34") or {}
    reasons = "; ".join(a34.get("reasons") or [])
    if a34.get("high_risk"):
        st.warning(f"**Art. 34: likely high risk to data subjects.** {reasons}")
    elif "high_risk" in a34 and a34["high_risk"] is None:
        st.warning(f"**Art. 34: risk undetermined, a person must assess.** {reasons}")


def review_preview(doc: JSON) -> None:
    totals = doc.get("totals") or {}
    a, b, cc = st.columns(3)
    a.metric("Requests", f"{totals.get('requests', 0):,}")
    b.metric("Routes", totals.get("routes", 0))
    cc.metric("At or above 80%", totals.get("highlighted", 0))
    rows = doc.get("rows") or []
    if not rows:
        st.info("No requests in this review's window.")
        return
    ratios = pd.DataFrame(
        [
            {"target": f"{r['deployment_id']} · {r['model_id']} · {_route(r)}", "max_ratio": x}
            for r in rows
            if (x := r.get("max_ratio")) is not None
        ],
        columns=["target", "max_ratio"],
    )
    if not ratios.empty:
        st.altair_chart(charts.review_ratios(ratios), width="stretch")
    tokens = st.column_config.NumberColumn(format="localized")
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "deployment": r["deployment_id"],
                    "route": _route(r),
                    "model": r["model_id"],
                    "requests": r["requests"],
                    "max prompt": r["max_prompt_tokens"],
                    "p99 prompt": r["p99_prompt_tokens"],
                    "safe context": r["safe_context"],
                    "verified": r["verified"],
                    "max / safe": r["max_ratio"],
                    "≥ 80%": "yes" if r["highlighted"] else "",
                    "max trend / week": (r.get("trend") or {}).get("max_slope_per_week"),
                }
                for r in rows
            ]
        ),
        hide_index=True,
        column_config={
            "max prompt": tokens,
            "p99 prompt": tokens,
            "safe context": tokens,
            "max / safe": st.column_config.NumberColumn(format="percent"),
        },
    )


def _route(r: JSON) -> str:
    return ui.label(r.get("route"), "(no route)")


def _scope(scope: Any) -> str:
    if not isinstance(scope, dict):
        return "" if scope is None else str(scope)
    return ", ".join(f"{k}={v}" for k, v in scope.items() if v is not None)


def _stored_doc(c: CollectorClient, report_id: str) -> JSON:
    """A stored report's JSON, kept for the session: stored reports never change."""
    cache: dict[str, JSON] = st.session_state.setdefault("report_docs", {})
    if report_id not in cache:
        cache[report_id] = c.report(report_id)
    return cache[report_id]


def stored(c: CollectorClient) -> None:
    st.subheader("Stored reports")
    items = c.reports(limit=100)
    if not items:
        st.info("No reports generated yet.", icon=":material/inbox:")
        return
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "report": r["report_id"],
                    "kind": r["kind"],
                    "generated": ui.when(r["generated_at"]),
                    "by": r["created_by"],
                    "scope": _scope(r.get("scope")),
                    "evidence SHA-256": r["evidence_sha256"],
                }
                for r in items
            ]
        ),
        hide_index=True,
    )
    kinds = {r["report_id"]: r["kind"] for r in items}
    if st.session_state.get("rep_selected") not in kinds:
        st.session_state["rep_selected"] = items[0]["report_id"]
    rid = str(
        st.selectbox(
            "Report",
            list(kinds),
            key="rep_selected",
            format_func=lambda i: f"{i} ({kinds.get(i, '?')})",
        )
    )
    with st.container(border=True):
        doc = _stored_doc(c, rid)
        (review_preview if kinds[rid] == "review" else breach_preview)(doc)
        downloads(f"{kinds[rid]}-{rid}", lambda cl, fmt: cl.report_file(rid, fmt), key=rid)


def _adhoc(c: CollectorClient) -> str | None:
    since, until = _window("rev_since", "rev_until")
    deployment = _deployment("rev_deployment")
    st.session_state["review_doc"] = c.review(since=since, until=until, deployment_id=deployment)
    st.session_state["review_params"] = (since, until, deployment)
    return None


def adhoc_review(c: CollectorClient) -> None:
    """A read token's review: built on demand (``GET /v1/review``), not stored."""
    review_form(c, store=False)
    doc: JSON | None = st.session_state.get("review_doc")
    if doc is None:
        return
    since, until, deployment = st.session_state["review_params"]
    with st.container(border=True):
        review_preview(doc)

        def fetch(cl: CollectorClient, fmt: FileFormat) -> bytes:
            if fmt == "json":
                return json.dumps(doc, indent=2).encode()  # the very review shown
            return cl.review_file(fmt, since=since, until=until, deployment_id=deployment)

        downloads(f"review-{doc.get('report_id')}", fetch, key="adhoc_review")


def render(c: CollectorClient) -> None:
    scope = ui.require_operator(c, "Reports")
    if scope is None:
        return
    if not ui.may(c, "report"):
        st.info(
            "Breach reports and stored reviews need an admin token (or a signed-in operator "
            "or auditor); this read token can build a quarterly review on demand.",
            icon=":material/lock:",
        )
        adhoc_review(c)
        return
    left, right = st.columns(2)
    with left:
        breach_form(c)
    with right:
        review_form(c, store=True)
    ui.live(stored)


ui.page_header(
    "Reports",
    "Breach assessments and quarterly reviews: generated, stored with the SHA-256 of their "
    "evidence, and downloadable as PDF, CSV and JSON.",
)
ui.show_flash()
ui.guarded(render)
