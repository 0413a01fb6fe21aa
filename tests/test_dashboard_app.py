"""Every dashboard page through Streamlit's AppTest, against a real collector with seeded data
(``tests/dashboard_helpers.py``): the key figures each page shows, the actions it offers
(acknowledge, silence, close, generate reports), what a tenant-scoped token sees, and the
error and empty states (wrong token, no token, collector down, nothing ingested yet)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dashboard.charts import MARKERS
from kvwatch.cli import app as cli
from kvwatch.embedded import free_port, serve_in_thread
from tests import dashboard_helpers as h
from tests.conftest import make_token

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "dashboard" / "app.py")
PAGES = [
    "views/fleet.py",
    "views/context.py",
    "views/pool.py",
    "views/alerts.py",
    "views/incident.py",
    "views/verifications.py",
    "views/reports.py",
]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[h.Seeded]:
    with h.seeded_collector(tmp_path_factory.mktemp("collector")) as s:
        yield s


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean dashboard environment: no auto-refresh (AppTest runs a script once)."""
    for k in ("KVWATCH_COLLECTOR_URL", "KVWATCH_DASHBOARD_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KVWATCH_DASHBOARD_REFRESH_S", "0")
    return monkeypatch


def open_page(env: pytest.MonkeyPatch, url: str, token: str | None, page: str) -> AppTest:
    env.setenv("KVWATCH_COLLECTOR_URL", url)
    if token is None:
        env.delenv("KVWATCH_DASHBOARD_TOKEN", raising=False)
    else:
        env.setenv("KVWATCH_DASHBOARD_TOKEN", token)
    at = AppTest.from_file(APP, default_timeout=60).switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def text(at: AppTest) -> str:
    """Everything a person can read on the page: text, alerts, metrics, labels, table cells."""
    out: list[str] = []

    def walk(node: Any) -> None:
        for child in getattr(node, "children", {}).values():
            walk(child)
        if type(node).__name__ == "Dataframe":
            out.append(node.value.to_csv(index=False))
            return
        for attr in ("label", "value"):
            try:
                v = getattr(node, attr)
            except Exception:
                continue
            if isinstance(v, str):
                out.append(v)

    walk(at.main)
    walk(at.sidebar)
    return "\n".join(out)


def charts(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def table(at: AppTest, column: str) -> Any:
    """The first table with that column."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def problems(at: AppTest) -> list[str]:
    """Error boxes other than the fleet's red status and a tenant's incident banner (data,
    not failures)."""
    data = ("**Why red", "**This incident concerns", "**Open incident #")
    return [e.value for e in at.error if not e.value.startswith(data)]


def submit(at: AppTest, label: str) -> AppTest:
    next(b for b in at.button if b.label == label).click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# ---------------------------------------------------------------------- an admin's pages


def test_fleet(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/fleet.py")
    t = text(at)
    assert metric(at, "Deployments") == "2"
    assert metric(at, "Red") == "1"
    assert metric(at, "Open incidents") == "1"
    red = next(e.value for e in at.error if h.RED in t and "Why red" in e.value)
    assert "glm-5.3: pool 681,280 tokens < advertised context 1,048,576" in red
    assert ":red-badge[RED]" in t and ":green-badge[GREEN]" in t
    # the red card links its open incident's page for the person on call, and comes first
    assert f"Open incident #{seeded.incident_id}**](/incident?id={seeded.incident_id})" in t
    cards = [line for line in t.splitlines() if h.RED in line or h.GREEN in line]
    assert h.RED in cards[0], cards
    why = [e.value for e in at.error if e.value.startswith("**Why red")]
    assert why[0].splitlines()[1].startswith(f"- open incident #{seeded.incident_id}: ")
    models = table(at, "verified safe context")
    assert models.iloc[0]["verified safe context"] == h.RED_SAFE
    assert models.iloc[0]["verified on engine"] == "0.5.21"
    assert models.iloc[0]["age (days)"] == pytest.approx(3.0, abs=0.1)
    assert models.iloc[0]["verification"] == "current"
    all_models = [d.value for d in at.dataframe if "verified safe context" in d.value.columns]
    assert {int(m.iloc[0]["verified safe context"]) for m in all_models} == {
        h.RED_SAFE,
        h.GREEN_SAFE,
    }
    for rule in ("stale_page_read", "pool_below_advertised", "engine_version_advisory"):
        assert f"`{rule}` (critical)" in t
    # an advisory says what to do beside what goes wrong
    assert "**What to do:** Upgrade SGLang to 0.5.22 or later." in t
    assert charts(at) == 1
    # each deployment's nodes, with their role and the config replicas must agree on
    nodes = {n: row for d in at.dataframe if "prefix cache" in d.value.columns
             for n, row in d.value.set_index("node").iterrows()}  # fmt: skip
    assert nodes["decode-0"]["role"] == "decode" and nodes["prefill-0"]["role"] == "prefill"
    assert nodes["prefill-0"]["KV dtype"] == "fp8" and nodes["prefill-0"]["state"] == "running"
    assert nodes["prefill-0"]["prefix cache"] == "off"
    assert nodes["prefill-0"]["KV past the pool"] == "none reported"


def test_context_pressure(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/context.py")
    t = text(at)
    assert "80% line **480,000** · 100% line **600,000**" in t
    assert "80% line **104,857** · 100% line **131,072**" in t
    assert metric(at, "Largest prompt") == "700,000"
    assert metric(at, "At or above 100%") == "1"
    assert charts(at) == 4  # per model: over time, and the distribution
    near = table(at, "share of safe context")
    assert list(near["request"][:2]) == ["r-victim", h.NEAR_REQUEST]
    assert near.iloc[1]["prompt tokens"] == h.NEAR_PROMPT
    assert near.iloc[1]["share of safe context"] == pytest.approx(0.9)
    routes = table(at, "largest / safe")
    assert set(routes["route"]) == {"(no route)", "/v1/chat/completions", "/v1/completions"}

    at.selectbox(key="cp_model").set_value(h.GREEN_MODEL).run()
    t = text(at)
    assert h.NEAR_REQUEST not in t and "480,000" not in t
    assert charts(at) == 2
    assert set(table(at, "share of safe context")["model"]) == {h.GREEN_MODEL}
    # usage counts the prompt that three requests share once; the rest counts requests
    (green,) = table(at, "largest / safe").to_dict("records")
    assert (green["requests"], green["prompts"]) == (14, 12)
    assert green["prompt tokens"] == h.GREEN_PROMPT_TOKENS


def test_pool_and_isolation(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/pool.py")
    assert metric(at, "Pages reused") == "36"
    assert metric(at, "Cross-tenant reuse events") == "3"
    assert metric(at, "Stale reads") == "1"
    assert charts(at) == 3  # two deployments' occupancy, the page events
    peaks = table(at, "peak occupancy")
    prefill = peaks[peaks["node"] == "prefill-0 (prefill)"].iloc[0]
    assert prefill["capacity"] == 681_280
    stale = table(at, "exposed tenant (previous writer)").iloc[0]
    assert (stale["reader tenant"], stale["reader request"]) == (h.TENANT, "r-victim")
    assert (stale["exposed tenant (previous writer)"], stale["exposed request"]) == (
        "acme",
        "r-exposed",
    )

    at.selectbox(key="pool_deployment").set_value(h.GREEN).run()
    assert charts(at) == 1
    assert "No stale reads" in text(at)


def test_alerts_and_incident_deadline(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/alerts.py")
    t = text(at)
    incident = httpx.get(
        f"{seeded.url}/v1/incidents/{seeded.incident_id}",
        headers={"Authorization": f"Bearer {seeded.admin}"},
    ).json()
    assert f"#{seeded.incident_id} {incident['title']}" in t
    case = httpx.get(
        f"{seeded.url}/v1/incidents/{seeded.incident_id}/case",
        headers={"Authorization": f"Bearer {seeded.admin}"},
    ).json()
    # the default role is processor: the clock is each customer's notice (Art. 33(2)),
    # KVWATCH_CONTROLLER_NOTICE_TARGET_H (24 h) from awareness, not the 72 hours
    due = datetime.fromisoformat(case["duty"]["due_at"].replace("Z", "+00:00"))
    aware = datetime.fromisoformat(incident["awareness_at"].replace("Z", "+00:00"))
    assert due - aware == timedelta(hours=24)
    assert metric(at, "Tell each customer by (Art. 33(2))") == due.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert re.fullmatch(r"23 h \d+ min", metric(at, "Time left"))
    assert "Not yet sent: " in t and case["duty"]["pending"][0] in t
    alerts = table(at, "rule")
    assert {"stale_page_read", "pool_below_advertised", "context_pressure"} <= set(alerts["rule"])
    assert set(alerts["state"]) == {"firing"}
    assert "No active silences." in t


@pytest.mark.parametrize("page", PAGES)
def test_a_tenant_is_told_an_open_incident_concerns_its_data(
    env: pytest.MonkeyPatch, seeded: h.Seeded, page: str
) -> None:
    """(Before the incident is closed below.) Every page tells the reading tenant's token that
    the open incident concerns its data, with a link to its own side of it."""
    at = open_page(env, seeded.url, seeded.tenant, page)
    if page == "views/incident.py":  # the page itself says it, in full
        # the receiving tenant is told what it is: it received another's data, its own was
        # not disclosed
        assert [e.value for e in at.error] == [
            "**This incident concerns data your requests received: they read KV-cache pages "
            "that held another customer's data; the answers may contain it and are to be "
            "deleted. Your own data was not disclosed.**"
        ]
        return
    (banner,) = [e.value for e in at.error if "(/incident?id=" in e.value]
    assert banner.startswith("**This incident concerns data your requests received")
    assert "they read KV-cache pages that held another customer's data" in banner
    assert f"(/incident?id={seeded.incident_id})" in banner
    assert not [o for o in h.OTHERS if o in banner]
    # an operator's token gets the operator's banner: every open incident, linked
    at = open_page(env, seeded.url, seeded.admin, page)
    assert not [e for e in at.error if "This incident concerns" in e.value]
    (banner,) = [e.value for e in at.error if e.value.startswith("**Open incident #")]
    assert f"[open it](/incident?id={seeded.incident_id})" in banner
    assert "not acknowledged" in banner


def test_verifications(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/verifications.py")
    history = table(at, "verified safe context")
    assert dict(zip(history["deployment"], history["verified safe context"], strict=True)) == {
        h.RED: h.RED_SAFE,
        h.GREEN: h.GREEN_SAFE,
    }
    assert set(history["result"]) == {"passed"}
    assert charts(at) == 1
    # the newest first; then the other one's evidence
    assert metric(at, "Rejection point (tokens)") == f"{h.GREEN_SAFE + 1:,}"
    red_id = int(history[history["deployment"] == h.RED].iloc[0]["id"])
    at.selectbox(key="evidence_for").set_value(red_id).run()
    assert metric(at, "Rejection point (tokens)") == f"{h.RED_SAFE + 1:,}"
    assert '"tool": "kvwatch verify"' in at.json[0].value


def test_reports_page_lists_nothing_before_generating(
    env: pytest.MonkeyPatch, seeded: h.Seeded
) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/reports.py")
    assert "No reports generated yet." in text(at)
    assert at.selectbox(key="rep_incident").value == seeded.incident_id


# ---------------------------------------------------------------------- actions


def test_generate_breach_and_review_reports(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.admin, "views/reports.py")
    submit(at, "Generate breach report")
    (ok,) = at.success
    rid = re.search(r"\*\*(rpt_\w+)\*\*", ok.value)
    assert rid, ok.value
    stored = httpx.get(
        f"{seeded.url}/v1/reports", headers={"Authorization": f"Bearer {seeded.admin}"}
    ).json()["items"]
    assert rid.group(1) in {r["report_id"] for r in stored}
    assert at.selectbox(key="rep_selected").value == rid.group(1)
    assert metric(at, "Affected requests") == "2"
    assert metric(at, "Exposed tenants") == "1"
    assert [b.label for b in at.get("download_button")] == [
        "Download PDF",
        "Download CSV",
        "Download JSON",
    ]

    submit(at, "Generate review")
    rev = re.search(r"\*\*(rev_\w+)\*\*", at.success[0].value)
    assert rev, at.success[0].value
    assert at.selectbox(key="rep_selected").value == rev.group(1)
    # 2, not 3: r-victim's 700,000-token prompt was refused (pool_exhausted); a refused
    # prompt never occupied the context and highlights no row (docs/reports.md)
    assert metric(at, "At or above 80%") == "2"
    assert charts(at) == 1
    assert h.RED in table(at, "max / safe")["deployment"].tolist()

    at.radio(key="rep_mode").set_value("A model and time window").run()
    at.selectbox(key="rep_model").set_value(h.RED_MODEL)
    at.number_input(key="rep_min_tokens").set_value(500_000)
    submit(at, "Generate breach report")
    window = re.search(r"\*\*(rpt_\w+)\*\*", at.success[0].value)
    assert window and window.group(1) != rid.group(1)
    # the window's prompts of at least 500,000 tokens: r-victim, r-near and three of 505,000
    assert metric(at, "Affected requests") == "5"


def test_incident_view_for_the_person_on_call(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    """(After the reports page's tests: it stores an assessment that page must not see first;
    before the incident is closed below.)
    The incident's page: the countdown, who is affected, the cause chain, the stale reads,
    then the assessment and a tenant's notice written from it."""
    at = open_page(env, seeded.url, seeded.admin, "views/incident.py")
    t = text(at)
    # processor (the default): the clock is each customer's notice, 24 h from awareness
    assert re.fullmatch(r"23 h \d+ min", metric(at, "Time left"))
    assert metric(at, "Exposed tenants") == "1" and metric(at, "Receiving tenants") == "1"
    assert metric(at, "Data subjects concerned") == "unknown"
    cause = table(at, "step")
    assert "stale_read_cross_tenant" in set(cause["step"])
    reads = table(at, "reader request")
    assert h.TENANT in set(reads["reader tenant"])
    assert "may contain fragments of the other tenant's prompts" in t
    # click-through: a stale read's two requests, the reader and the one whose KV it read
    at.selectbox(key="stale_read_requests").set_value(0).run()
    assert not at.exception, [e.value for e in at.exception]
    sides = [d.value for d in at.dataframe if list(d.value.columns) == ["field", "value"]]
    fields = [dict(zip(d["field"], d["value"], strict=True)) for d in sides]
    assert [(x["request"], x["tenant"]) for x in fields] == [
        ("r-victim", h.TENANT),
        ("r-exposed", "acme"),
    ]
    assert fields[0]["rejected because"] == "pool_exhausted"
    assert fields[1]["prompt tokens"] == "5,000"
    at = submit(at, "Generate the breach assessment (stored, audited)")
    assert any(s.value.startswith("Assessment rpt_") for s in at.success)
    notice = next(b for b in at.button if b.label.startswith(f"Prepare the notice to {h.TENANT}"))
    notice.click().run()
    assert not at.exception, [e.value for e in at.exception]
    pdf = at.session_state[f"notice-{seeded.incident_id}-{h.TENANT}"]
    assert pdf.startswith(b"%PDF")
    assert not problems(at)


def test_acknowledge_silence_and_close(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    auth = {"Authorization": f"Bearer {seeded.admin}"}
    at = open_page(env, seeded.url, seeded.admin, "views/alerts.py")
    alerts = httpx.get(f"{seeded.url}/v1/alerts?state=firing", headers=auth).json()
    target = next(a for a in alerts if a["rule"] == "stale_page_read")
    at.text_input(key="actor").input("dana (on call)")
    at.selectbox(key="ack_alert").set_value(target["id"])
    at.text_input(key="ack_comment").input("looking into it")
    submit(at, "Acknowledge")
    assert at.success[0].value == "Alert acknowledged."
    after = httpx.get(f"{seeded.url}/v1/alerts/{target['id']}", headers=auth).json()
    assert after["acked"] and after["ack_comment"] == "looking into it"
    assert after["acked_by"] == "dana (on call)"
    row = table(at, "acknowledged").set_index("id").loc[target["id"]]
    assert row["acknowledged"].startswith("dana (on call) at ")

    submit(at, "Silence")  # neither a rule nor a deployment: refused, clearly
    assert "choose a rule or a deployment" in problems(at)[0]
    at.selectbox(key="sil_rule").set_value("pool_headroom")
    at.text_input(key="sil_comment").input("resizing decode pool")
    submit(at, "Silence")
    assert at.success[0].value.startswith("Silenced. Silence #")
    assert "alertname=pool_headroom" in table(at, "matchers")["matchers"].tolist()

    submit(at, "Expire now")
    assert at.success[0].value == "Silence expired."
    assert "No active silences." in text(at)

    at.text_input(key="close_reason").input("false positive: canary test")
    submit(at, "Close incident")
    assert at.success[0].value == "Incident closed."
    assert "No open incidents." in text(at)
    inc = httpx.get(f"{seeded.url}/v1/incidents/{seeded.incident_id}", headers=auth).json()
    assert inc["state"] == "closed" and inc["close_reason"] == "false positive: canary test"
    assert inc["closed_by"] == "dana (on call)"
    # its page then says it is closed, by whom and why, and counts down nothing
    page = open_page(env, seeded.url, seeded.admin, "views/incident.py")
    assert metric(page, "Closed by") == "dana (on call)"
    assert "false positive: canary test" in text(page)
    assert not [m for m in page.metric if m.label == "Time left"]


# ---------------------------------------------------------------------- who sees what


@pytest.mark.parametrize("page", PAGES)
def test_a_tenant_token_sees_only_its_tenant(
    env: pytest.MonkeyPatch, seeded: h.Seeded, page: str
) -> None:
    at = open_page(env, seeded.url, seeded.tenant, page)
    t = text(at)
    for other in h.OTHERS:
        assert other not in t, f"{page} shows tenant {other!r} to a {h.TENANT} token"
    assert not problems(at)
    assert "tenant-scoped token: only its tenant's traffic" in t
    if page in ("views/alerts.py", "views/reports.py"):
        assert "not available to a tenant-scoped token" in t
    if page == "views/incident.py":  # its own side of the (now closed) incident
        assert "This incident concerns data your requests received" in t
        assert "Your own data was not disclosed" in t and "delete those answers" in t
        rows = table(at, "data of")
        assert set(rows["request"]) == {"r-victim"} and "r-exposed" not in t
        assert set(rows["data of"]) == {"another customer of the service"}
    if page == "views/context.py":
        assert set(table(at, "share of safe context")["tenant"]) == {h.TENANT}
        assert "r-victim" in t and h.NEAR_REQUEST not in t
    if page == "views/pool.py":
        stale = table(at, "exposed tenant (previous writer)").iloc[0]
        assert stale["reader tenant"] == h.TENANT
        assert stale["exposed tenant (previous writer)"] == "(another tenant)"
    if page == "views/fleet.py":
        assert "Alert names are not shown to a tenant-scoped token." in t


def test_a_read_token_cannot_act_or_generate(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, seeded.read, "views/alerts.py")
    t = text(at)
    assert "need an admin token" in t and "Acknowledge" not in [b.label for b in at.button]
    assert "stale_page_read" in table(at, "rule")["rule"].tolist()
    at = open_page(env, seeded.url, seeded.read, "views/reports.py")
    assert "Breach reports and stored reviews need an admin token" in text(at)
    submit(at, "Build review")
    assert at.success[0].value == "Review built."
    assert metric(at, "Routes") == "4"


# ---------------------------------------------------------------------- failures


@pytest.mark.parametrize("page", PAGES)
def test_a_wrong_token_is_a_clear_error(
    env: pytest.MonkeyPatch, seeded: h.Seeded, page: str
) -> None:
    at = open_page(env, seeded.url, "kvw_admin_not-a-real-token", page)
    (error,) = problems(at)
    assert "The token was rejected" in error and "401" in error
    assert "kvwatch tokens create" in error


def test_no_token_asks_for_one(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    at = open_page(env, seeded.url, None, "views/fleet.py")
    assert "No token is configured" in at.error[0].value
    at.sidebar.text_input(key="typed_token").input(seeded.admin).run()
    assert not problems(at)
    assert metric(at, "Deployments") == "2"


@pytest.mark.parametrize("page", PAGES)
def test_collector_down_is_a_clear_error(env: pytest.MonkeyPatch, page: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    at = open_page(env, dead, "kvw_admin_whatever", page)
    (error,) = problems(at)
    assert "Collector unavailable" in error and dead in error


def test_a_bad_setting_is_named(env: pytest.MonkeyPatch) -> None:
    at = open_page(env, "ftp://127.0.0.1:1", "kvw_admin_whatever", "views/fleet.py")
    assert "KVWATCH_COLLECTOR_URL" in at.error[0].value
    res = CliRunner().invoke(cli, ["dashboard", "--collector-url", "ftp://x"])
    assert res.exit_code == 2 and "KVWATCH_COLLECTOR_URL" in res.output


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A real collector with nothing ingested yet."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings

    db_url = f"sqlite:///{tmp_path_factory.mktemp('empty') / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, notify_enabled=False)
    with serve_in_thread(create_app(settings)) as url:
        yield url, make_token(db_url, "admin")


EMPTY = {
    "views/fleet.py": "No deployments yet.",
    "views/context.py": "No requests in the last 24 hours.",
    "views/pool.py": "No deployments yet.",
    "views/alerts.py": "No incidents.",
    "views/incident.py": "No incidents.",
    "views/verifications.py": "No verifications yet.",
    "views/reports.py": "No reports generated yet.",
}


@pytest.mark.parametrize("page", PAGES)
def test_empty_states(env: pytest.MonkeyPatch, empty: tuple[str, str], page: str) -> None:
    url, admin = empty
    at = open_page(env, url, admin, page)
    assert not problems(at)
    assert EMPTY[page] in text(at)
    assert charts(at) == 0


def test_a_silent_source_is_on_its_fleet_card(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """kvwatch kv-events' source.gap reaches the fleet card of its deployment as a warning
    with the producer's reason (telemetry_gap's source_silent, from the collector's fleet)."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from engine_probe import events as ev
    from tests import factories as f

    db_url = f"sqlite:///{tmp_path / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, notify_enabled=False)
    with serve_in_thread(create_app(settings)) as url:
        gap = ev.SourceGap(
            **f.base(1, probe="kv-events-silent-1-abcdef", dep="silent-dep",
                     ts=datetime.now(UTC)),
            node="vllm-9:8000", source="kv_events", interval_s=10.0, silent_s=75.0,
            cause="not_connected",
            reason="no KV event for 75 s: nothing accepts connections at tcp://vllm-9:5557",
        )  # fmt: skip
        r = httpx.post(
            f"{url}/v1/events",
            json=[f.as_json(gap)],
            headers={"Authorization": f"Bearer {make_token(db_url, 'ingest')}"},
        )
        assert r.status_code == 200, r.text
        at = open_page(env, url, make_token(db_url, "admin"), "views/fleet.py")
    (warning,) = [w.value for w in at.warning if w.value.startswith("**Source silent**")]
    assert "(kv_events, node vllm-9:8000)" in warning
    assert "nothing accepts connections at tcp://vllm-9:5557" in warning
    assert ":orange-badge[AMBER]" in text(at)


def test_window_changes_what_is_shown(env: pytest.MonkeyPatch, seeded: h.Seeded) -> None:
    """The sidebar's window reaches the collector: the seeded traffic is 40 minutes to 12
    hours old, so the last hour holds only its newest requests."""
    at = open_page(env, seeded.url, seeded.admin, "views/context.py")
    all_day = int(metric(at, "Requests").replace(",", ""))
    at.sidebar.selectbox(key="window").set_value("Last hour").run()
    last_hour = int(metric(at, "Requests").replace(",", ""))
    assert 0 < last_hour < all_day
    assert datetime.now(UTC).year >= 2026  # the seed is relative to now; nothing fixed


# ---------------------------------------------------------------------- a minute in a day


@pytest.fixture(scope="module")
def burst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, datetime]]:
    """A real collector whose only traffic is one minute, about three hours ago (as after the
    demo): a pool sampled every second, requests, page events."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from tests import factories as f
    from tests.conftest import wait_rollups

    db_url = f"sqlite:///{tmp_path_factory.mktemp('burst') / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    settings = Settings(
        database_url=db_url, auto_migrate=False, rollup_interval_s=0.2, notify_enabled=False
    )
    # the minute straddles an hour's boundary: two hourly buckets, still a minute of data
    hour = (datetime.now(UTC) - timedelta(hours=3)).replace(minute=0, second=0, microsecond=0)
    start = hour - timedelta(seconds=30)
    events: list[Any] = [f.config(1, ts=start)]
    for i in range(60):
        at = start + timedelta(seconds=i)
        events.append(f.pool(2 + 3 * i, used=10_000 * (i % 30), cap=681_280, ts=at))
        events.append(f.admitted(3 + 3 * i, f"b-{i}", prompt=1_000 + 100 * i, ts=at))
        events.append(f.finished(4 + 3 * i, f"b-{i}", ts=at + timedelta(milliseconds=500)))
    events.append(f.stale_read(500, ts=start + timedelta(seconds=59)))
    with serve_in_thread(create_app(settings)) as url:
        ingest, admin = make_token(db_url, "ingest"), make_token(db_url, "admin")
        r = httpx.post(
            f"{url}/v1/events",
            json=[f.as_json(e) for e in events],
            headers={"Authorization": f"Bearer {ingest}"},
        )
        assert r.status_code == 200, r.text
        wait_rollups(db_url)
        yield url, admin, start


def _x_domain(spec: dict[str, Any]) -> tuple[datetime, datetime] | None:
    """The time axis's domain of a chart (the first layer that fixes one)."""
    for layer in [spec, *spec.get("layer", [])]:
        x = layer.get("encoding", {}).get("x", {})
        domain = x.get("scale", {}).get("domain")
        if isinstance(domain, list):
            lo, hi = (
                datetime(
                    d["year"], d["month"], d["date"], d["hours"], d["minutes"], d["seconds"],
                    tzinfo=UTC,
                )
                for d in domain
            )  # fmt: skip
            return lo, hi
    return None


def _specs(at: AppTest) -> list[dict[str, Any]]:
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


@pytest.mark.parametrize("page", ["views/pool.py", "views/context.py"])
def test_a_minute_of_events_in_a_day_is_drawn_zoomed(
    env: pytest.MonkeyPatch, burst: tuple[str, str, datetime], page: str
) -> None:
    url, admin, start = burst
    at = open_page(env, url, admin, page)
    assert "Zoomed to where the data is" in text(at)
    domains = [d for d in map(_x_domain, _specs(at)) if d is not None]
    assert domains
    for lo, hi in domains:  # the axis is the data's minutes (with a margin), not the day
        assert lo <= start + timedelta(minutes=5) and hi >= start
        assert hi - lo < timedelta(minutes=30), (lo, hi)
    if page == "views/pool.py":
        # a second-by-second pool: many points once zoomed, and the capacity line drawn
        # across the whole chart (its first and last points at the axis's ends)
        occupancy = table(at, "peak occupancy")
        assert int(occupancy["samples"].sum()) == 60
        specs = _specs(at)
        (index,) = [i for i, s in enumerate(specs) if "tokens in use" in json.dumps(s)]
        lo, hi = _x_domain(specs[index]) or (None, None)
        times = _dashed_layer_times(at, index)
        assert lo is not None and hi is not None
        assert abs(times[0] - lo) < timedelta(seconds=1) and abs(times[-1] - hi) < timedelta(
            seconds=1
        )
        # the zoomed buckets' width, to three figures ("0.11088-second" once)
        assert re.search(r"\b\d{1,3}(\.\d{1,2})?-(millisecond|second) buckets", text(at))
    # and with zooming off, the axis is the whole window again
    at.sidebar.toggle(key="zoom").set_value(False).run()
    assert "Zoomed to where the data is" not in text(at)
    for lo, hi in filter(None, map(_x_domain, _specs(at))):
        assert hi - lo > timedelta(hours=23)


def _dashed_layer_times(at: AppTest, index: int) -> list[datetime]:
    """The times of chart ``index``'s dashed (capacity) layer, read from the data Streamlit
    sends beside the spec (Arrow, one named dataset per layer)."""
    import pyarrow as pa

    chart = at.get("vega_lite_chart")[index].proto
    spec = json.loads(chart.spec)
    layer = next(
        x for x in spec.get("layer", []) if (x.get("mark") or {}).get("strokeDash") is not None
    )
    (data,) = [d.data.data for d in chart.datasets if d.name == layer["data"]["name"]]
    frame = pa.ipc.open_stream(data).read_pandas()
    return sorted(t.to_pydatetime() for t in pd.to_datetime(frame["time"], utc=True))


def test_the_incident_draws_each_involved_node_over_its_own_minutes(
    env: pytest.MonkeyPatch, burst: tuple[str, str, datetime]
) -> None:
    """The incident of the minute's cross-tenant stale read: its page draws the involved
    deployment's pool per node on the incident's own window (the assessment's time axis, not
    the day), with the capacity as a dashed line from one end of the axis to the other."""
    url, admin, start = burst
    at = open_page(env, url, admin, "views/incident.py")
    assert "Pool occupancy over the incident" in text(at)
    auth = {"Authorization": f"Bearer {admin}"}
    (incident,) = httpx.get(f"{url}/v1/incidents", headers=auth).json()
    doc = httpx.get(f"{url}/v1/incidents/{incident['id']}/assessment", headers=auth).json()
    window = doc["series"]["window"]
    lo, hi = (datetime.fromisoformat(window[k].replace("Z", "+00:00")) for k in ("from", "until"))
    specs = _specs(at)
    (index,) = [i for i, s in enumerate(specs) if "tokens in use" in json.dumps(s)]
    assert _x_domain(specs[index]) == (lo.replace(microsecond=0), hi.replace(microsecond=0))
    assert hi - lo < timedelta(minutes=5) and lo <= start + timedelta(seconds=59) <= hi
    times = _dashed_layer_times(at, index)
    assert (times[0], times[-1]) == (lo, hi)
    # the stale read is marked where it happened, on the pool it happened in
    assert "stale read" in _markers(at)[index]
    assert not problems(at)


def test_every_page_event_kind_has_a_colour_on_the_page_events_chart() -> None:
    """The chart's colour scale has a fixed domain: a kind the collector stores as a page
    event but the chart does not list would be drawn without a colour."""
    from dashboard import charts
    from engine_probe import events as ev

    not_page_rows = {
        "engine.config",
        "request.admitted",
        "request.rejected",
        "request.finished",
        "pool.sample",
        "probe.drops",
        "probe.stopped",
    }
    assert set(charts.KINDS) == set(ev.KINDS) - not_page_rows


def test_a_link_to_an_alert_opens_its_detail_first(
    env: pytest.MonkeyPatch, seeded: h.Seeded
) -> None:
    """Notifications link to ``/alerts?id=N``: that alert's detail leads the page."""
    auth = {"Authorization": f"Bearer {seeded.admin}"}
    alerts = httpx.get(f"{seeded.url}/v1/alerts?state=firing", headers=auth).json()
    target = next(a for a in alerts if a["rule"] == "stale_page_read")
    env.setenv("KVWATCH_COLLECTOR_URL", seeded.url)
    env.setenv("KVWATCH_DASHBOARD_TOKEN", seeded.admin)
    at = AppTest.from_file(APP, default_timeout=60).switch_page("views/alerts.py")
    at.query_params["id"] = str(target["id"])
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    heads = [s.value for s in at.subheader]
    assert heads[0].startswith(f"Alert #{target['id']}: stale_page_read"), heads
    assert heads.index("Incidents") > 0


def _markers(at: AppTest) -> list[set[str]]:
    """Per chart, the markers its incident-annotation layer draws (read from the data
    Streamlit sends beside the spec), in chart order; an empty set for a chart without."""
    import pyarrow as pa

    out = []
    for chart in at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        names = [
            x["data"]["name"]
            for x in spec.get("layer", [])
            if (x.get("mark") or {}).get("type") == "rule"
            and x.get("encoding", {}).get("color", {}).get("field") == "marker"
        ]
        found: set[str] = set()
        for d in chart.proto.datasets:
            if d.name in names:
                found |= set(pa.ipc.open_stream(d.data.data).read_pandas()["marker"])
        out.append(found)
    return out


@pytest.mark.parametrize("page", ["views/pool.py", "views/context.py", "views/alerts.py"])
def test_charts_mark_the_incident_and_its_stale_reads(
    env: pytest.MonkeyPatch, seeded: h.Seeded, page: str
) -> None:
    at = open_page(env, seeded.url, seeded.admin, page)
    marked = [m for m in _markers(at) if m]
    assert marked, f"no chart of {page} marks the incident"
    if page == "views/pool.py":
        # the occupancy chart and the page-events chart both mark the stale reads
        assert sum("stale read" in m for m in marked) >= 2, marked
    if page == "views/context.py":
        assert any("incident opened" in m or "stale read" in m for m in marked)
    if page == "views/alerts.py":  # the alerts over time, around the incident's opening
        assert {"incident opened", "stale read"} <= marked[0], marked


def test_the_context_chart_draws_p99_and_no_line_over_buckets_without_requests() -> None:
    """Two runs of buckets with an empty hour between: each run is a segment of its own (no
    flat line bridges the hour), and p99 is a series drawn wider than max, so it shows even
    where the two are equal."""
    from dashboard import charts

    t0 = datetime(2026, 12, 1, 12, tzinfo=UTC)
    rows = [
        {"time": t0 + timedelta(minutes=m), "route": "/v1/c", "stat": stat, "tokens": 900,
         "requests": 3}
        for m in (0, 1, 2, 65, 66)
        for stat in ("max", "p99")
    ]  # fmt: skip
    df = pd.DataFrame(rows)
    steps = charts._steps(df, ["route", "stat"], 60, break_gaps=True)
    assert steps.groupby("stat")["segment"].nunique().to_dict() == {"max": 2, "p99": 2}
    # each run ends at the end of its last bucket, never at the next run's start
    ends = steps.groupby("segment")["time"].max().sort_values().tolist()
    assert t0 + timedelta(minutes=3) in ends and t0 + timedelta(minutes=65) not in ends
    spec = charts.prompt_timeline(df, 800, 1000, (t0, t0 + timedelta(hours=2)), 60).to_dict()
    (line,) = [x for x in spec["layer"] if (x.get("mark") or {}).get("type") == "line"]
    enc = line["encoding"]
    assert enc["detail"]["field"] == "segment"
    assert enc["strokeWidth"]["scale"]["domain"] == ["max", "p99"]
    max_w, p99_w = enc["strokeWidth"]["scale"]["range"]
    assert p99_w > max_w


@pytest.mark.parametrize(
    ("seconds", "label"),
    [(0.11088, "111-millisecond"), (0.9996, "1-second"), (7.2, "7.2-second"),
     (59.97, "1-minute"), (60, "1-minute"), (300, "5-minute"), (3_599.9, "1-hour"),
     (5_400, "1.5-hour"), (86_400, "1-day")],
)  # fmt: skip
def test_bucket_widths_read_to_three_figures_in_the_largest_unit(
    seconds: float, label: str
) -> None:
    from dashboard import ui

    assert ui.bucket_width(seconds) == label


def test_marker_labels_close_in_time_take_separate_rows_in_the_markers_colours(
    env: pytest.MonkeyPatch, seeded: h.Seeded
) -> None:
    # the incident opens a moment after its stale read: their labels once overprinted, in
    # the node line's blue, past the chart's right edge
    import pyarrow as pa

    at = open_page(env, seeded.url, seeded.admin, "views/pool.py")
    checked = 0
    for chart in at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        texts = [
            x
            for x in spec.get("layer", [])
            if (x.get("mark") or {}).get("type") == "text"
            and x.get("encoding", {}).get("text", {}).get("field") == "label"
        ]
        if not texts:
            continue
        for layer in texts:
            scale = layer["encoding"]["color"]["scale"]
            assert scale["domain"] == list(MARKERS), scale
            assert scale["range"] == list(MARKERS.values()), scale
        names = {x["data"]["name"] for x in texts}
        (frame,) = {
            d.name: pa.ipc.open_stream(d.data.data).read_pandas()
            for d in chart.proto.datasets
            if d.name in names
        }.values()  # both sides' layers read one frame, each filtering its side
        frame = frame.sort_values("time")
        rows = list(frame["row"])
        assert all(a != b for a, b in itertools.pairwise(rows)), rows
        # every marker here is at the (zoomed) window's end: labelled on the rule's left
        assert set(frame["side"]) == {"left"}, frame
        checked += len(frame) >= 2
    assert checked  # the occupancy chart marks the stale read and the incident
