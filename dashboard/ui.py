"""What every page shares: the settings and token, the collector client, the time window,
auto-refresh, the error and empty states, and number and time formatting."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import pandas as pd
import streamlit as st
from pydantic import ValidationError
from streamlit.delta_generator import DeltaGenerator

from dashboard import signin
from dashboard.client import JSON, CollectorClient
from dashboard.errors import CollectorDown, DashboardError, TokenRejected
from dashboard.settings import DashboardSettings

Scope = Literal["admin", "operator", "tenant"]

WINDOWS: dict[str, timedelta] = {
    "Last hour": timedelta(hours=1),
    "Last 6 hours": timedelta(hours=6),
    "Last 24 hours": timedelta(hours=24),
    "Last 7 days": timedelta(days=7),
    "Last 30 days": timedelta(days=30),
}
DEFAULT_WINDOW = "Last 24 hours"
TOKEN_HELP = (
    "Create one with `kvwatch tokens create --kind admin` (or `--kind read`, optionally "
    "`--tenant T`) and start the dashboard with `KVWATCH_DASHBOARD_TOKEN=…` or "
    "`kvwatch dashboard --token …`."
)


def settings() -> DashboardSettings:
    """The settings from the environment; a bad one stops the page with its variable named."""
    try:
        return DashboardSettings()
    except ValidationError as exc:
        for e in exc.errors():
            msg = str(e["msg"]).removeprefix("Value error, ")
            st.error(f"KVWATCH_{str(e['loc'][0]).upper()}: {msg}" if e["loc"] else msg)
        st.stop()
        raise  # unreachable: st.stop() raises; keeps the type checker sure


def token() -> str | None:
    """With sign-in (KVWATCH_OIDC_ISSUER), the signed-in person's ID token, which the
    collector verifies; else the configured token, else one typed into the sidebar (kept for
    this session only)."""
    s = settings()
    if s.oidc:
        return signin.id_token()
    if s.token:
        return s.token
    typed = str(st.session_state.get("typed_token") or "").strip()
    return typed or None


@contextmanager
def collector(timeout_s: float = 30.0) -> Iterator[CollectorClient]:
    with CollectorClient(settings().collector_url, token(), timeout_s=timeout_s) as c:
        yield c


def me(c: CollectorClient) -> JSON:
    """Who the token or signed-in person is and what they may do, as the collector decides
    it (``GET /v1/whoami``); asked once per session and credential."""
    key = "whoami:" + hashlib.sha256(f"{c.base_url} {token()}".encode()).hexdigest()
    cached = st.session_state.get(key)
    if isinstance(cached, dict):
        return cached
    doc = c.whoami()
    st.session_state[key] = doc
    return doc


def admit_person() -> None:
    """With sign-in: stop the page unless a person is signed in, their sign-in is live, and
    the collector gives them a role (it says why not, and the page shows it)."""
    s = settings()
    assert s.oidc_issuer is not None
    signin.gate(s.oidc_issuer)
    try:
        with collector(timeout_s=10) as c:
            me(c)
    except TokenRejected as exc:
        if exc.forbidden:
            signin.refused(exc.message)
        signin.ended(f"The collector did not accept your sign-in: {exc.message}.")
    except DashboardError:
        return  # the collector is down: the page says so, in full


def may(c: CollectorClient, what: str) -> bool:
    """Whether the caller may ``what``: read, respond (acknowledge, silence, work
    incidents), report (reports, notices, evidence) or admin."""
    return what in me(c).get("may", [])


def token_scope(c: CollectorClient) -> Scope:
    """admin; tenant (one tenant's view); operator: everyone else who reads every tenant."""
    doc = me(c)
    if "admin" in doc.get("may", []):
        return "admin"
    return "tenant" if doc.get("tenant") else "operator"


def who_label(c: CollectorClient) -> str:
    """How the sidebar names the caller and what they may do."""
    doc = me(c)
    if doc.get("person"):
        person = doc["person"]
        who = person.get("email") or person.get("name") or person["subject"]
        return f"Signed in as {who}, role {doc['role']}."
    return {
        "admin": "Signed in with an admin token.",
        "operator": "Signed in with a read token (no acknowledging or reports).",
        "tenant": "Signed in with a tenant-scoped token: only its tenant's traffic is shown.",
    }[token_scope(c)]


def show_error(exc: DashboardError) -> None:
    """A person-readable explanation of why the page has no data; never a traceback."""
    url = settings().collector_url
    if isinstance(exc, CollectorDown):
        st.error(
            f"**Collector unavailable.** {exc.message}. Check that the collector is running "
            f"(`kvwatch serve`) and that KVWATCH_COLLECTOR_URL ({url}) points at it; this page "
            "retries on the next refresh.",
            icon=":material/cloud_off:",
        )
    elif isinstance(exc, TokenRejected) and exc.forbidden:
        whom = "your role" if settings().oidc else "this token"
        st.warning(
            f"**Not available to {whom}.** The collector said: {exc.message}.",
            icon=":material/lock:",
        )
    elif isinstance(exc, TokenRejected) and settings().oidc:
        st.error(
            f"**Your sign-in was not accepted** (HTTP 401: {exc.message}). Sign out and sign "
            "in again.",
            icon=":material/key_off:",
        )
    elif isinstance(exc, TokenRejected):
        what = "No token is configured" if token() is None else "The token was rejected"
        st.error(
            f"**{what}** (HTTP 401: {exc.message}). {TOKEN_HELP}",
            icon=":material/key_off:",
        )
    else:
        st.error(f"**The collector refused the request:** {exc.message}", icon=":material/error:")


def guarded(render: Callable[[CollectorClient], None], *, quiet: bool = False) -> None:
    """Run a page section against the collector; any failure becomes a clear message (or,
    ``quiet``, none: for a section below one that has already explained the same failure)."""
    try:
        with collector() as c:
            render(c)
    except DashboardError as exc:
        if not quiet:
            show_error(exc)


def require_operator(c: CollectorClient, what: str, *, admin: bool = False) -> Scope | None:
    """The token's scope if it may see ``what``; else say why not and return None."""
    scope = token_scope(c)
    if scope == "tenant" and me(c).get("person"):
        st.info(
            f"**{what} are not available to your role ({me(c)['role']}).** They name every "
            "tenant and deployment; ask the service's operator.",
            icon=":material/lock:",
        )
        return None
    if scope == "tenant":
        st.info(
            f"**{what} are not available to a tenant-scoped token.** They name every tenant "
            "and deployment; ask an operator, or use a read or admin token.",
            icon=":material/lock:",
        )
        return None
    if admin and not may(c, "report"):
        st.info(f"**{what} need an admin token.** This is a read token.", icon=":material/lock:")
        return None
    return scope


def live(render: Callable[[CollectorClient], None]) -> None:
    """Run a guarded section as a fragment that reruns on its own every
    KVWATCH_DASHBOARD_REFRESH_S (unless turned off in the sidebar): a wall screen stays
    current without reloading, and the rest of the page (forms being filled in) is left alone."""
    period = settings().dashboard_refresh_s
    on = period > 0 and bool(st.session_state.get("auto_refresh", True))

    def section() -> None:
        # a fragment reruns alone, past the page's sign-in gate: a session that ended
        # while a wall screen refreshed reruns the whole page, whose gate says so
        if settings().oidc and signin.why_ended() is not None:
            st.rerun(scope="app")
        guarded(render)

    st.fragment(section, run_every=period if on else None)()


def window() -> tuple[datetime, datetime]:
    """The sidebar's window, ending now (recomputed on every refresh, so it slides)."""
    label = st.session_state.get("window", DEFAULT_WINDOW)
    until = datetime.now(UTC)
    return until - WINDOWS.get(label, WINDOWS[DEFAULT_WINDOW]), until


ZOOM_BELOW = 20  # data covering less than 1/20 of the window is zoomed to
ZOOM_MARGIN = timedelta(seconds=1)


def fit(
    window: tuple[datetime, datetime],
    first: datetime | None,
    last: datetime | None,
    resolution: timedelta = timedelta(0),
) -> tuple[datetime, datetime] | None:
    """The window around the data, when the data (``first`` to ``last``) covers less than
    1/``ZOOM_BELOW`` of the sidebar's window and zooming is on: a minute of events in a day's
    window is otherwise one dot. ``resolution``: how much of that span the buckets add (a
    minute across an hour's boundary is two hourly buckets, yet a minute). A margin of a
    tenth of the data's span (at least a second) each side, inside the window. None: keep
    the window."""
    if first is None or last is None or not st.session_state.get("zoom", True):
        return None
    lo, hi = window
    span = max(last - first, timedelta(0))
    if max(span - resolution, timedelta(0)) * ZOOM_BELOW >= hi - lo:
        return None
    margin = max(span / 10, ZOOM_MARGIN)
    return max(lo, first - margin), min(hi, last + margin)


def buckets_extent(items: list[Any], bucket_s: float) -> tuple[datetime | None, datetime | None]:
    """From the first bucket's start (``bucket_start_us``) to the last one's end."""
    starts = [x["bucket_start_us"] for x in items]
    if not starts:
        return None, None
    first, last = parse_time(min(starts)), parse_time(max(starts))
    assert first is not None and last is not None
    return first, last + timedelta(seconds=bucket_s)


def zoomed(
    window: tuple[datetime, datetime],
    fetch: Callable[[datetime, datetime], Any],
    items: Callable[[Any], list[Any]],
    first: Any = None,
) -> tuple[tuple[datetime, datetime] | None, Any]:
    """``fetch(since, until)`` over the window (or ``first``, that fetch's result already at
    hand), then again over the window around its data while that narrows it (coarse buckets
    first: an hour's rollup, then five minutes...). Returns (the zoomed window or None, the
    last document fetched). A page with one chart per deployment or model zooms each chart on
    its own: a minute of one deployment's events beside another's day is still a line."""
    doc = fetch(*window) if first is None else first
    zoom: tuple[datetime, datetime] | None = None
    for _ in range(3):
        width = doc["bucket_seconds"]
        z = fit(window, *buckets_extent(items(doc), width), timedelta(seconds=width))
        if z is None or z == zoom:
            break
        zoom, doc = z, fetch(*z)
    return zoom, doc


def zoom_caption(zoomed: tuple[datetime, datetime]) -> None:
    st.caption(
        f":material/zoom_in: Zoomed to where the data is, {when(zoomed[0])} to "
        f"{when(zoomed[1])} (the window is the {window_label()}; turn zooming off in the "
        "sidebar)."
    )


def window_label() -> str:
    label = st.session_state.get("window", DEFAULT_WINDOW)
    return str(label if label in WINDOWS else DEFAULT_WINDOW).lower()


ALL = "All"


def choice(
    options: list[str], key: str, title: str, where: DeltaGenerator | None = None
) -> str | None:
    """A filter selectbox (None for All); a remembered choice no longer offered falls back to
    All instead of raising."""
    opts = [ALL, *options]
    if st.session_state.get(key) not in opts:
        st.session_state[key] = ALL
    box = st.selectbox if where is None else where.selectbox
    picked = box(title, opts, key=key)
    return None if picked == ALL else str(picked)


def act(done: str, action: Callable[[CollectorClient], str | None]) -> None:
    """Run an action (a widget callback: before the page reruns, so the tables drawn next
    already show its effect) and leave a message for :func:`show_flash`."""
    try:
        with collector(timeout_s=120) as c:
            extra = action(c)
    except DashboardError as exc:
        st.session_state["flash"] = ("error", f"{done} failed: {exc.message}")
        return
    st.session_state["flash"] = ("success", f"{done}." + (f" {extra}" if extra else ""))


def show_flash() -> None:
    flash = st.session_state.pop("flash", None)
    if flash:
        kind, text = flash
        (st.success if kind == "success" else st.error)(text)


def page_header(title: str, caption: str) -> None:
    st.title(title)
    st.caption(caption)


# ---------------------------------------------------------------------- formatting


def tokens(n: int | float | None) -> str:
    return "—" if n is None else f"{int(n):,}"


def percent(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.0%}"


def parse_time(value: str | int | datetime | None) -> datetime | None:
    """The collector's ISO strings (``…Z``) and microsecond integers, as aware datetimes."""
    if value is None or isinstance(value, datetime):
        return value
    if isinstance(value, int):
        return datetime.fromtimestamp(value / 1_000_000, UTC)
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def when(value: str | int | datetime | None) -> str:
    dt = parse_time(value)
    return "—" if dt is None else dt.strftime("%Y-%m-%d %H:%M:%S UTC")


def span(delta: timedelta) -> str:
    """``2 d 23 h 59 min``: to the minute, which is what a deadline needs."""
    minutes = int(abs(delta).total_seconds() // 60)
    d, rem = divmod(minutes, 24 * 60)
    h, m = divmod(rem, 60)
    parts = ([f"{d} d"] if d else []) + ([f"{h} h"] if d or h else []) + [f"{m} min"]
    return " ".join(parts)


def bucket_width(seconds: float) -> str:
    """``5-minute``, ``7.2-second``, ``111-millisecond``: a chart bucket's width to three
    figures in the largest unit it fills (a zoomed window's buckets are the span over the
    point budget, so their width is rarely round)."""

    def three(x: float) -> float:  # three figures, never in exponent form ("1e+03")
        return float(f"{x:.3g}")

    seconds = three(seconds)  # rounded first: 59.97 s is a minute, not 60 seconds
    for unit, size in (("day", 86_400.0), ("hour", 3_600.0), ("minute", 60.0), ("second", 1.0)):
        if seconds >= size:
            return f"{three(seconds / size):g}-{unit}"
    return f"{three(seconds * 1000):g}-millisecond"


def us_to_time(values: Any) -> Any:
    """A column of microsecond timestamps as pandas UTC datetimes (for charts)."""
    return pd.to_datetime(values, unit="us", utc=True)


def label(value: str | None, none: str = "(none)") -> str:
    return none if value is None else value


def request_status(r: dict[str, Any]) -> str:
    """A request's status with why: the rejection's reason, or why it was lost (its probe
    went away before it finished: ``collector.lost``)."""
    why = r.get("reject_reason") or r.get("lost_reason")
    return str(r["status"]) + (f" ({why})" if why else "")
