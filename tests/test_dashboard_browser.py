"""The dashboard in a real browser: ``kvwatch dashboard`` (a real Streamlit process) against a
real seeded collector, driven by Debian's headless Chromium through Playwright.

Every page is loaded, its key content waited for, and a screenshot saved per page (in the
pytest temporary directory and copied to ``$KVWATCH_TEST_ARTIFACTS``, default
``test-artifacts/dashboard`` at the repository root, git-ignored) for people to look at.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.embedded import free_port
from tests import dashboard_helpers as h
from tests.browser import CHROMIUM, chromium, page_of

if not CHROMIUM.exists():
    pytest.skip(
        "Debian's chromium is not installed at /usr/bin/chromium (.ci/run installs it)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, expect

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_MS = 30_000
expect.set_options(timeout=TIMEOUT_MS)


@dataclass
class Dashboard:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def _kvwatch() -> list[str]:
    exe = Path(sys.executable).parent / "kvwatch"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvwatch.cli"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("dashboard-screenshots")
    yield out
    copy = Path(os.environ.get("KVWATCH_TEST_ARTIFACTS") or ROOT / "test-artifacts") / "dashboard"
    copy.mkdir(parents=True, exist_ok=True)
    for png in out.glob("*.png"):
        shutil.copy2(png, copy / png.name)


def launch(collector_url: str, token: str, log: Path, refresh_s: int = 30) -> Dashboard:
    """Start `kvwatch dashboard` (not waiting: several start side by side, see ``ready``)."""
    port = free_port()
    env = dict(os.environ, HOME=str(log.parent))  # Streamlit writes ~/.streamlit
    for k in ("KVWATCH_DASHBOARD_TOKEN", "KVWATCH_COLLECTOR_URL"):
        env.pop(k, None)
    cmd = [
        *_kvwatch(),
        "dashboard",
        "--port",
        str(port),
        "--collector-url",
        collector_url,
        "--token",
        token,
        "--refresh-s",
        str(refresh_s),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Dashboard(f"http://127.0.0.1:{port}", proc, log)


def ready(d: Dashboard, timeout_s: float = 60) -> Dashboard:
    deadline = time.monotonic() + timeout_s
    while not _healthy(d.url):
        if d.proc.poll() is not None:
            raise AssertionError(
                f"kvwatch dashboard exited {d.proc.returncode}:\n{d.log.read_text()}"
            )
        if time.monotonic() > deadline:
            stop(d)
            raise AssertionError(f"the dashboard never became healthy:\n{d.log.read_text()}")
        time.sleep(0.2)
    return d


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def stop(d: Dashboard) -> None:
    """SIGTERM to `kvwatch dashboard`, which forwards it to Streamlit: both must go."""
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(timeout=5)
    assert not _healthy(d.url), "Streamlit outlived `kvwatch dashboard`"


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[h.Seeded]:
    with h.seeded_collector(tmp_path_factory.mktemp("collector")) as s:
        yield s


@dataclass
class Dashboards:
    main: Dashboard  # the seeded collector, refreshing every 30 s
    fast: Dashboard  # the seeded collector, refreshing every second
    down: Dashboard  # a collector address where nothing listens
    tenant: Dashboard  # the seeded collector, with the reading tenant's token
    dead_url: str


@pytest.fixture(scope="module")
def dashboards(seeded: h.Seeded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboards]:
    """Three dashboards, started side by side (each takes seconds to come up)."""
    tmp = tmp_path_factory.mktemp("dashboards")
    dead = f"http://127.0.0.1:{free_port()}"
    ds = Dashboards(
        launch(seeded.url, seeded.admin, tmp / "main.log"),
        launch(seeded.url, seeded.admin, tmp / "fast.log", refresh_s=1),
        launch(dead, "kvw_admin_nothing", tmp / "down.log"),
        launch(seeded.url, seeded.tenant, tmp / "tenant.log"),
        dead,
    )
    every = (ds.main, ds.fast, ds.down, ds.tenant)
    try:
        for d in every:
            ready(d)
        yield ds
    finally:
        for d in every:
            stop(d)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    with page_of(browser, TIMEOUT_MS) as pg:
        yield pg


def visit(page: Page, url: str, *texts: str, cells: tuple[str, ...] = (), charts: int = 0) -> None:
    """Load a page and wait until every text is visible, every table cell is there (tables
    draw on a canvas; their cells live in an accessible grid behind it) and ``charts``
    charts have drawn."""
    page.goto(url)
    for text in texts:
        expect(page.get_by_text(text, exact=False).first).to_be_visible()
    for cell in cells:
        expect(
            page.get_by_role("gridcell", name=cell, exact=True, include_hidden=True).first
        ).to_be_attached()
    if charts:
        drawn = page.locator("[data-testid='stVegaLiteChart'] svg.marks")
        expect(drawn.nth(charts - 1)).to_be_attached()
    # Streamlit shows a script error as an exception box: a page must never have one.
    expect(page.locator("[data-testid='stException']")).to_have_count(0)


def settle(page: Page) -> None:
    """Until Streamlit has finished running the page (its status widget says 'Running...'
    while it does)."""
    page.wait_for_timeout(300)  # the rerun a change just asked for has started
    expect(page.get_by_test_id("stStatusWidget").get_by_text("Running")).to_have_count(0)


def shot(page: Page, artifacts: Path, name: str) -> Path:
    """The whole page: Streamlit scrolls inside its main block, so the viewport is grown to
    the content's height first (a full-page screenshot alone would stop at the fold)."""
    height = page.evaluate(
        "() => document.querySelector(\"[data-testid='stMain']\")?.scrollHeight ?? 0"
    )
    page.set_viewport_size({"width": 1440, "height": min(max(int(height), 900), 8000)})
    page.wait_for_timeout(400)  # the resize re-lays out the charts; let Vega repaint
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, f"{name}: the screenshot is suspiciously small"
    return path


PAGES = [
    (
        "fleet",
        "",
        [h.RED, h.GREEN, "RED", "pool 681,280 tokens < advertised context 1,048,576"],
        ["600000", "131072", "0.5.21"],
        1,
    ),
    (
        "context-pressure",
        "context",
        ["Nearest the threshold", "80% line", "480,000"],
        [h.NEAR_REQUEST, str(h.NEAR_PROMPT)],
        4,
    ),
    (
        "pool-isolation",
        "pool",
        ["KV pool occupancy", "Stale reads", "Pages reused"],
        ["r-victim", "r-exposed", "acme", "globex"],
        3,
    ),
    (
        "alerts-incidents",
        "alerts",
        ["Suspected cross-tenant exposure", "Time left", "Acknowledge an alert"],
        ["stale_page_read", "pool_below_advertised"],
        0,
    ),
    (
        "incident",
        "incident",
        ["Cause chain, from the evidence", "Time left", "Pool occupancy over the incident"],
        ["stale_read_cross_tenant", "r-victim"],
        0,  # the seeded pool samples lie outside the incident's own seconds
    ),
    ("verifications", "verifications", ["Evidence", "kvwatch verify"], ["600000"], 1),
    ("reports", "reports", ["Breach assessment", "Quarterly review"], [], 0),
]


@pytest.mark.parametrize(
    ("name", "path", "texts", "cells", "charts"), PAGES, ids=[p[0] for p in PAGES]
)
def test_each_page_renders(
    dashboards: Dashboards,
    page: Page,
    artifacts: Path,
    name: str,
    path: str,
    texts: list[str],
    cells: list[str],
    charts: int,
) -> None:
    visit(page, f"{dashboards.main.url}/{path}", *texts, cells=tuple(cells), charts=charts)
    shot(page, artifacts, name)


def test_a_tenant_sees_its_own_side_of_the_incident(
    dashboards: Dashboards, page: Page, artifacts: Path
) -> None:
    """The reading tenant's token: a banner on every page, and on the incident page its own
    requests, the other party never named."""
    visit(
        page,
        f"{dashboards.tenant.url}/",
        "This incident concerns data your requests received",
        "Your own data was not disclosed",
        "open it",
    )
    visit(
        page,
        f"{dashboards.tenant.url}/incident",
        "Your requests that read another customer's data",
        "delete those answers",
        cells=("r-victim", "another customer of the service"),
    )
    body = page.locator("[data-testid='stMain']").inner_text()
    assert not [o for o in h.OTHERS if o in body], body
    shot(page, artifacts, "incident-tenant")


def test_generate_and_download_reports(
    dashboards: Dashboards, page: Page, artifacts: Path, seeded: h.Seeded
) -> None:
    visit(page, f"{dashboards.main.url}/reports", "Breach assessment")
    page.get_by_role("button", name="Generate breach report").click()
    expect(page.get_by_text("Breach report generated", exact=False)).to_be_visible()
    report_id = page.get_by_text("rpt_", exact=False).first.inner_text()
    assert "rpt_" in report_id
    with page.expect_download() as dl:
        page.get_by_role("button", name="Download PDF").click()
    pdf = Path(dl.value.path())
    assert pdf.read_bytes().startswith(b"%PDF"), "the PDF download is not a PDF"
    assert dl.value.suggested_filename.endswith(".pdf")
    with page.expect_download() as dl:
        page.get_by_role("button", name="Download CSV").click()
    csv_text = Path(dl.value.path()).read_text()
    assert "r-victim" in csv_text and "r-exposed" in csv_text
    shot(page, artifacts, "reports-breach")

    page.get_by_role("button", name="Generate review").click()
    expect(page.get_by_text("Review generated", exact=False)).to_be_visible()
    expect(page.get_by_text("rev_", exact=False).first).to_be_visible()
    # the review's chart: each route's largest prompt against its safe context
    expect(page.locator("[data-testid='stVegaLiteChart'] svg.marks").first).to_be_attached()
    with page.expect_download() as dl:
        page.get_by_role("button", name="Download CSV").click()
    assert dl.value.suggested_filename.startswith("review-rev_")
    rows = Path(dl.value.path()).read_text()
    assert h.RED in rows and h.GREEN in rows
    shot(page, artifacts, "reports-review")


def test_collector_down_is_a_clear_error(
    dashboards: Dashboards, page: Page, artifacts: Path
) -> None:
    visit(page, dashboards.down.url, "Collector unavailable", dashboards.dead_url)
    shot(page, artifacts, "collector-down")


def test_pages_refresh_on_their_own(dashboards: Dashboards, page: Page) -> None:
    """With KVWATCH_DASHBOARD_REFRESH_S=1 the fleet reloads from the collector every second:
    the collector's "generated at" time moves on without anyone touching the page."""
    visit(page, dashboards.fast.url, h.RED, "Auto-refresh every 1 s")
    generated = page.get_by_text("Generated ", exact=False).first
    first = generated.inner_text()
    expect(generated).not_to_have_text(first, timeout=15_000)


def test_the_incident_page_shows_each_party_and_the_decision_register(
    seeded: h.Seeded, dashboards: Dashboards, page: Page, artifacts: Path
) -> None:
    """A decision recorded and a notice prepared, approved and sent through the API: the
    incident page shows each party's due time and steps, and the register."""
    base = f"/v1/incidents/{seeded.incident_id}"
    with httpx.Client(
        base_url=seeded.url, headers={"Authorization": f"Bearer {seeded.admin}"}, timeout=60
    ) as admin:
        r = admin.post(
            f"{base}/decisions",
            json={
                "kind": "containment",
                "status": "done",
                "what": "prompts over the pool refused at the gateway",
                "why": "no further stale reads",
                "by": "on-call",
            },
        )
        assert r.status_code == 201, r.text
        parties = admin.get(f"{base}/case").json()["parties"]
        assert parties, "the seeded incident has parties"
        party = parties[0]["party"]
        r = admin.post(f"{base}/notifications", json={"party": party, "by": "on-call"})
        assert r.status_code == 201, r.text
        nid = r.json()["notice_id"]
        for step in ({"step": "approve"}, {"step": "send", "channel": "email to the DPO"}):
            r = admin.post(f"{base}/notifications/steps", json={"notice_id": nid, **step})
            assert r.status_code == 200, r.text
    visit(
        page,
        f"{dashboards.main.url}/incident",
        "Notification of each party",
        "Decision register",
        cells=(party, "sent", "email to the DPO", "prompts over the pool refused at the gateway"),
        charts=0,
    )
    shot(page, artifacts, "incident-case-register")


def test_the_incident_is_acknowledged_owned_and_annotated_from_its_page(
    seeded: h.Seeded, dashboards: Dashboards, page: Page, artifacts: Path
) -> None:
    """The on-call section: acknowledge, assign, note from the page; the collector records
    each (the API reads them back) and the page's timeline shows them in order."""
    url = f"{dashboards.main.url}/incident?id={seeded.incident_id}"
    visit(page, url, "On call", "Linked alerts", "Timeline", "Runbook")
    # a text box outside a form commits on Enter with a rerun of the page; a click that lands
    # during that rerun is lost, so each one waits for the page to settle (as a person's does)
    page.get_by_role("textbox", name="Your name", exact=True).fill("ana")
    page.get_by_role("textbox", name="Your name", exact=True).press("Enter")
    settle(page)
    page.get_by_role("button", name="Acknowledge", exact=True).click()
    expect(page.get_by_text("Incident acknowledged.", exact=False)).to_be_visible()
    settle(page)
    page.get_by_role("textbox", name="Owner", exact=True).fill("ana")
    page.get_by_role("button", name="Assign", exact=True).click()
    expect(page.get_by_text("Owner assigned.", exact=False)).to_be_visible()
    page.get_by_role("textbox", name="Note", exact=True).fill(
        "gateway refuses prompts over the pool"
    )
    page.get_by_role("button", name="Add note", exact=True).click()
    expect(page.get_by_text("Note added.", exact=False)).to_be_visible()
    with httpx.Client(
        base_url=seeded.url, headers={"Authorization": f"Bearer {seeded.admin}"}, timeout=60
    ) as admin:
        inc = admin.get(f"/v1/incidents/{seeded.incident_id}").json()
        timeline = admin.get(f"/v1/incidents/{seeded.incident_id}/timeline").json()
    assert inc["acked_by"] == "ana" and inc["owner"] == "ana"
    mine = [e["kind"] for e in timeline if e["actor"] == "ana"]
    assert mine == ["incident.ack", "incident.owner", "incident.note"], timeline
    # the page shows who is on it (the timeline's grid draws only the rows in view, so its
    # order is checked through the API above)
    visit(page, url, "On call", "Acknowledged", "Owner")
    expect(page.get_by_test_id("stMetricValue").filter(has_text="ana").first).to_be_visible()
    shot(page, artifacts, "incident-oncall")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_closed_incident_reads_closed_and_an_unknown_id_is_refused(
    collector: Any, page: Page, artifacts: Path, tmp_path: Path
) -> None:
    """A closed incident shows who closed it, when and why, and no countdown; a link to an
    incident that does not exist says so instead of showing another one; the alerts table
    links each alert to its incident's page."""
    from engine_probe.events import utcnow
    from tests import factories as f

    with collector.client(collector.ingest) as c:
        read = f.stale_read(1, dep="closed-dep", ts=utcnow())
        assert c.post("/v1/events", json=[f.as_json(read)]).status_code == 200
    with collector.client(collector.admin) as c:
        (inc,) = c.get("/v1/incidents").json()
        r = c.post(
            f"/v1/incidents/{inc['id']}/close",
            json={"by": "dana", "reason": "engine upgraded; no stale read since"},
        )
        assert r.status_code == 200, r.text
    d = ready(launch(collector.url, collector.admin, tmp_path / "dashboard.log"))
    try:
        visit(page, f"{d.url}/incident?id={inc['id']}", "Closed by", "dana",
              "engine upgraded; no stale read since")  # fmt: skip
        expect(page.get_by_text("Time left")).to_have_count(0)
        expect(page.get_by_text("of the notification window used")).to_have_count(0)
        shot(page, artifacts, "incident-closed")

        visit(page, f"{d.url}/incident?id=99", "No incident #99 here")
        expect(page.get_by_text("Cause chain, from the evidence")).to_have_count(0)

        # a link column's cell holds its target (the grid draws the id, #N, on its canvas)
        visit(page, f"{d.url}/alerts", "Alerts",
              cells=("stale_page_read", f"/incident?id={inc['id']}"))  # fmt: skip
    finally:
        stop(d)
