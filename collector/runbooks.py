"""Runbooks: one per rule kind, and the one decision of where a rule's runbook link points.

The text ships as package data (``policies/runbooks/<kind>.md``) beside the kinds it is
about, so the API, the dashboard and the docs page (``python -m kvwatch.docs_runbooks``) all
read the same words."""

from __future__ import annotations

import importlib.resources

from collector.errors import NotFound
from policies import KINDS, Rule


def runbook_url(rule: Rule, dashboard_url: str | None) -> str | None:
    """The rule's own ``runbook_url`` (a pack's override), else the dashboard's runbook page
    for its kind when a dashboard URL is configured, else None."""
    if rule.runbook_url:
        return rule.runbook_url
    if dashboard_url:
        return f"{dashboard_url.rstrip('/')}/runbook?kind={rule.kind}"
    return None


def kinds() -> list[str]:
    """Every rule kind, each of which has a runbook."""
    return sorted(KINDS)


def runbook_text(kind: str) -> str:
    """The runbook of ``kind`` as Markdown; :class:`NotFound` for a kind kvwatch does not
    have (checked against the kinds first, so no caller-supplied name becomes a path)."""
    if kind not in KINDS:
        raise NotFound(f"no runbook for kind {kind!r}; known: {', '.join(kinds())}")
    ref = importlib.resources.files("policies") / "runbooks" / f"{kind}.md"
    return ref.read_text(encoding="utf-8")
