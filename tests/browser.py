"""Debian's headless Chromium through Playwright, as the browser tests drive it (never a
downloaded browser); a module skips itself where ``CHROMIUM`` is missing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def page_of(browser: Browser, timeout_ms: int, *, height: int = 1800) -> Iterator[Page]:
    """A page in a fresh context (its own cookies), downloads accepted."""
    ctx = browser.new_context(viewport={"width": 1440, "height": height}, accept_downloads=True)
    try:
        pg = ctx.new_page()
        pg.set_default_timeout(timeout_ms)
        yield pg
    finally:
        ctx.close()
