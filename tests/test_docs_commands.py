"""Every shell command in the README and on every docs page runs as written: this module
reads the blocks; ``tests/test_reading_session.py`` runs them, the README and then the docs
pages in reading order, in one shell.

Each ``sh`` code block of ``README.md`` and ``docs/*.md`` is one of:

- skipped, marked ``<!-- ci: skip: REASON -->``, for what this machine cannot run (a GPU build,
  a vLLM install, a foreground server a person stops with Ctrl-C); the reason is required;
- or run, in order, in the one shell a reader has open at the checkout's top (a variable one
  block sets, the next uses), with ``set -eu -o pipefail``, so every command must succeed.
  ``<!-- ci: setup -->`` (README, "Using it") names the block that starts the collector the
  pages after it use; ``<!-- by-hand:... -->`` the README's incident, whose outcome the
  session's test checks in what it left.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?P<before>(?:[^\n]*\n){0,3})```(?:sh|bash|shell)\n(?P<body>.*?)```", re.S)
_MARKER = re.compile(r"<!--\s*(?P<text>[^>]*?)\s*-->\s*$")


def reading_order() -> list[Path]:
    """The README, then the docs site's pages in its nav's order (mkdocs.yml), then any page
    the nav leaves out (mkdocs --strict warns of those)."""

    def flat(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [p for item in nav for p in flat(item)]
        if isinstance(nav, dict):
            return [p for v in nav.values() for p in flat(v)]
        return []

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    pages = [ROOT / "docs" / p for p in flat(nav)]
    rest = sorted(set((ROOT / "docs").glob("*.md")) - set(pages))
    return [ROOT / "README.md", *pages, *rest]


PAGES = reading_order()


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    body: str
    marker: str  # "" when none

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        if self.marker.startswith("ci: setup"):
            return "setup"
        if self.marker.startswith("ci: skip"):
            return "skip"
        if "by-hand" in self.marker:
            return "by-hand"
        return "run"


def blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            lines = [ln for ln in m.group("before").splitlines() if ln.strip()]
            marker = _MARKER.search(lines[-1]) if lines else None
            out.append(
                Block(
                    page=str(page.relative_to(ROOT)),
                    line=text[: m.start("body")].count("\n"),
                    body=m.group("body"),
                    marker=marker.group("text") if marker else "",
                )
            )
    return out


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.kind == "run"]


def test_every_block_runs_or_says_why_not() -> None:
    (setup,) = [b for b in BLOCKS if b.kind == "setup"]
    assert setup.page == "README.md"
    for b in BLOCKS:
        if b.kind == "skip":
            reason = b.marker.removeprefix("ci: skip").strip(" :")
            assert len(reason) > 10, f"{b.id}: a skipped block says why it cannot run here"
    assert len(RUN) >= 10
    assert set(PAGES) >= {ROOT / b.page for b in BLOCKS}, "a page outside the reading order"
