"""People sign in to the dashboard at a real OpenID Connect provider (oidc-provider on loopback,
tests/oidc_provider.py), in Debian's headless Chromium through Playwright: ``kvwatch
dashboard`` with KVWATCH_OIDC_* set, against a real collector that trusts the same provider.

An operator signs in and acknowledges an alert; an auditor signs in and cannot; a tenant's
contact sees only their tenant's incident and notice; a person with no role is refused; a
session ends on sign-out and when the ID token expires. The audit log names each person.
Screenshots go beside the dashboard's (``test-artifacts/dashboard``).
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
from tests import oidc_world as w
from tests.browser import CHROMIUM, chromium, page_of
from tests.conftest import Collector
from tests.oidc_provider import OidcProvider

if not CHROMIUM.exists() or shutil.which("node") is None:
    pytest.skip(
        "needs Debian's chromium at /usr/bin/chromium and Node.js (.ci/run installs both)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, expect

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_MS = 30_000
expect.set_options(timeout=TIMEOUT_MS)
SHORT_TTL_S = 20  # the ID tokens of the expiry test's provider
REFRESH_S = 2  # how often the expiry test's pages refresh their sections


@dataclass
class Site:
    """A provider, a collector trusting it, and a dashboard signing people in at it."""

    op: OidcProvider
    collector: Collector
    dashboard: str
    alert: dict[str, Any]


def _kvwatch() -> list[str]:
    exe = Path(sys.executable).parent / "kvwatch"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvwatch.cli"]


def _dashboard(
    port: int, collector_url: str, issuer: str, log: Path, refresh_s: int
) -> subprocess.Popen[bytes]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVWATCH_OIDC_", "KVWATCH_DASHBOARD_"))
    }
    env |= {
        "HOME": str(log.parent),  # Streamlit writes ~/.streamlit
        "KVWATCH_COLLECTOR_URL": collector_url,
        "KVWATCH_OIDC_ISSUER": issuer,
        "KVWATCH_OIDC_CLIENT_ID": w.CLIENT_ID,
        "KVWATCH_OIDC_CLIENT_SECRET": w.CLIENT_SECRET,
        "KVWATCH_OIDC_SCOPES": "openid profile email groups",
    }
    with log.open("wb") as out:
        return subprocess.Popen(
            [*_kvwatch(), "dashboard", "--port", str(port), "--refresh-s", str(refresh_s)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Site]]:
    """Two sites, started side by side: ``main`` (ID tokens for 10 minutes) and ``short``
    (ID tokens for SHORT_TTL_S and pages that refresh themselves, for the expiry test)."""
    tmp = tmp_path_factory.mktemp("sign-in")
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Site] = {}
    try:
        with (
            w.provider(
                tmp / "main",
                redirect_uris=[f"http://127.0.0.1:{(p1 := free_port())}/oauth2callback"],
            ) as op1,
            w.provider(
                tmp / "short",
                redirect_uris=[f"http://127.0.0.1:{(p2 := free_port())}/oauth2callback"],
                id_token_ttl_s=SHORT_TTL_S,
            ) as op2,
            w.collector(f"sqlite:///{tmp / 'main.db'}", op1, tmp / "main") as c1,
            w.collector(f"sqlite:///{tmp / 'short.db'}", op2, tmp / "short") as c2,
        ):
            for name, port, op, c in (("main", p1, op1, c1), ("short", p2, op2, c2)):
                refresh_s = REFRESH_S if name == "short" else 0
                procs.append(_dashboard(port, c.url, op.issuer, tmp / f"{name}.log", refresh_s))
                out[name] = Site(op, c, f"http://127.0.0.1:{port}", w.seed_incident(c))
            deadline = time.monotonic() + 90
            for name, site in out.items():
                while not _healthy(site.dashboard):
                    log = (tmp / f"{name}.log").read_text()
                    assert time.monotonic() < deadline, f"dashboard never came up:\n{log}"
                    time.sleep(0.2)
            yield out
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    with page_of(browser, TIMEOUT_MS, height=1400) as pg:
        yield pg


@pytest.fixture(scope="module")
def shots() -> Path:
    out = Path(os.environ.get("KVWATCH_TEST_ARTIFACTS") or ROOT / "test-artifacts") / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    return out


def sign_in(page: Page, site: Site, login: str, *, button: str = "Sign in") -> None:
    """Press the dashboard's ``button`` (opening the dashboard first for the first sign-in)
    and sign in at the provider's own login form."""
    if button == "Sign in":
        page.goto(site.dashboard)
    page.get_by_role("button", name=button).click()
    page.wait_for_url(f"{site.op.issuer}/**")
    page.locator("input[name=login]").fill(login)
    page.locator("input[name=password]").fill("any password")
    page.locator("button[type=submit]").click()
    page.wait_for_url(f"{site.dashboard}/**")


def no_exception(page: Page) -> None:
    expect(page.locator("[data-testid='stException']")).to_have_count(0)


def test_an_operator_signs_in_and_acknowledges_an_alert(
    sites: dict[str, Site], page: Page, shots: Path
) -> None:
    site = sites["main"]
    sign_in(page, site, "olive")
    expect(page.get_by_text("Signed in as olive@operator.test, role operator")).to_be_visible()
    page.goto(site.dashboard + "/alerts")
    expect(page.get_by_text("Recorded as olive@operator.test (oidc sub olive)")).to_be_visible()
    form = page.locator("[data-testid='stForm']").filter(has_text="Acknowledge an alert")
    form.get_by_role("button", name="Acknowledge").click()
    no_exception(page)
    page.screenshot(path=str(shots / "sign-in-operator-alerts.png"), full_page=True)

    def acked() -> dict[str, Any]:
        with site.collector.client(site.collector.admin) as c:
            return dict(c.get(f"/v1/alerts/{site.alert['id']}").json())

    deadline = time.monotonic() + 30
    while not acked().get("acked_by"):
        assert time.monotonic() < deadline, "the operator's acknowledgement never arrived"
        time.sleep(0.3)
    assert acked()["acked_by"] == "olive@operator.test (oidc sub olive)"
    rows = w.audit_rows(site.collector.db_url)
    assert any(
        r["action"] == "alert.ack" and r["actor"] == "olive@operator.test (oidc sub olive)"
        for r in rows
    ), rows
    assert any(r["action"] == "person.use" and r["detail"]["role"] == "operator" for r in rows)


def test_an_auditor_signs_in_and_cannot_act(
    sites: dict[str, Site], page: Page, shots: Path
) -> None:
    site = sites["main"]
    sign_in(page, site, "audrey")
    expect(page.get_by_text("Signed in as audrey@operator.test, role auditor")).to_be_visible()
    page.goto(site.dashboard + "/alerts")
    expect(page.get_by_text("your role is auditor")).to_be_visible()
    expect(page.get_by_role("button", name="Acknowledge")).to_have_count(0)
    no_exception(page)
    page.screenshot(path=str(shots / "sign-in-auditor-alerts.png"), full_page=True)
    rows = w.audit_rows(site.collector.db_url)
    assert any(
        r["action"] == "person.use" and r["actor"] == "audrey@operator.test (oidc sub audrey)"
        for r in rows
    ), rows


def test_a_tenant_contact_sees_only_their_incident(
    sites: dict[str, Site], page: Page, shots: Path
) -> None:
    site = sites["main"]
    sign_in(page, site, "tess")
    expect(page.get_by_text("Signed in as tess@acme.test, role tenant:acme")).to_be_visible()
    page.goto(site.dashboard + "/incident")
    main = page.locator("[data-testid='stMain']")
    expect(main.get_by_text("Incident #", exact=False).first).to_be_visible()
    no_exception(page)
    page.screenshot(path=str(shots / "sign-in-tenant-incident.png"), full_page=True)
    assert "globex" not in main.inner_text().lower()
    page.goto(site.dashboard + "/alerts")
    expect(page.get_by_text("not available to your role (tenant:acme)")).to_be_visible()
    rows = w.audit_rows(site.collector.db_url)
    assert any(
        r["action"] == "person.use" and r["detail"]["role"] == "tenant:acme" for r in rows
    ), rows


def test_a_person_without_a_role_is_refused(
    sites: dict[str, Site], page: Page, shots: Path
) -> None:
    site = sites["main"]
    sign_in(page, site, "nemo")
    expect(page.get_by_text("You are signed in, but kvwatch gives you no access")).to_be_visible()
    expect(page.get_by_text("has no kvwatch role", exact=False)).to_be_visible()
    expect(page.get_by_role("button", name="Sign out")).to_be_visible()
    no_exception(page)
    page.screenshot(path=str(shots / "sign-in-no-role.png"), full_page=True)
    rows = w.audit_rows(site.collector.db_url)
    assert any(
        r["action"] == "person.refused" and r["actor"] == "nemo@operator.test (oidc sub nemo)"
        for r in rows
    ), rows


def test_sign_out_ends_the_session(sites: dict[str, Site], page: Page) -> None:
    site = sites["main"]
    sign_in(page, site, "olive")
    expect(page.get_by_text("Signed in as olive@operator.test")).to_be_visible()
    page.get_by_role("button", name="Sign out").click()
    # the provider asks before ending its own session too
    page.wait_for_url(f"{site.op.issuer}/**")
    page.get_by_role("button", name="Yes, sign me out").click()
    page.wait_for_url(f"{site.dashboard}/**")
    page.goto(site.dashboard)
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    expect(page.get_by_text("Signed in as")).to_have_count(0)


def test_a_session_ends_when_the_id_token_expires(
    sites: dict[str, Site], page: Page, shots: Path
) -> None:
    site = sites["short"]
    sign_in(page, site, "olive")
    expect(page.get_by_text("Signed in as olive@operator.test")).to_be_visible()
    # a wall screen left open: its refreshing sections end the session on their own
    ended = page.get_by_text("Your sign-in has ended")
    expect(ended).to_be_visible(timeout=(SHORT_TTL_S + 10 * REFRESH_S) * 1000)
    expect(page.get_by_text("Signed in as")).to_have_count(0)
    expect(page.get_by_text("was not accepted")).to_have_count(0)
    page.goto(site.dashboard + "/alerts")
    expect(ended).to_be_visible()
    expect(page.get_by_text("Signed in as")).to_have_count(0)
    page.screenshot(path=str(shots / "sign-in-expired.png"), full_page=True)
    sign_in(page, site, "olive", button="Sign in again")  # the role is read afresh
    expect(page.get_by_text("Signed in as olive@operator.test")).to_be_visible()
