"""The documentation site builds with ``mkdocs build --strict`` (no broken link or anchor, no
page left out of the nav), every page in ``docs/`` is in the nav, and the README's "Where to
go next" links every page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _pages() -> set[str]:
    return {p.name for p in DOCS.glob("*.md")}


def _nav_pages(entry: Any) -> set[str]:
    if isinstance(entry, str):
        return {entry}
    if isinstance(entry, list):
        return set().union(*(_nav_pages(e) for e in entry))
    if isinstance(entry, dict):
        return set().union(*(_nav_pages(v) for v in entry.values()))
    return set()


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "index.html").exists()


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    assert "index.md" in nav
    assert _pages() - nav == set(), "docs pages missing from mkdocs.yml's nav"
    assert nav - _pages() == set(), "mkdocs.yml's nav names pages that do not exist"


def test_the_readme_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", readme))
    assert _pages() - linked == set(), "docs pages the README does not link"
    assert linked - _pages() == set(), "README links to docs pages that do not exist"
