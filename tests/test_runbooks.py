"""Runbooks: one per rule kind, shipped as package data; every ``kvwatch`` command they name
is a real command with real options; a pack's ``runbook_url`` overrides the link, which
``collector.runbooks.runbook_url`` decides; ``GET /v1/runbooks/{kind}`` serves them to any
read token; docs/runbooks.md is generated from them."""

from __future__ import annotations

import importlib.resources
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from collector.errors import NotFound
from collector.runbooks import kinds, runbook_text, runbook_url
from kvwatch import docs_runbooks
from kvwatch.cli import app
from policies import KINDS, PackError, load_pack
from policies.rule import Rule
from tests.conftest import Collector

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = importlib.resources.files("policies") / "runbooks"
# a `kvwatch ...` inline code span (spans may wrap a line, as Markdown allows)
_COMMAND = re.compile(r"`(kvwatch [^`]+)`")


def test_every_kind_has_a_runbook_and_nothing_else_does() -> None:
    shipped = {p.name.removesuffix(".md") for p in SHIPPED.iterdir() if p.name.endswith(".md")}
    assert shipped == set(KINDS)
    for kind in KINDS:
        text = runbook_text(kind)
        assert text.startswith(f"# {kind}\n")
        # containment comes first, and every runbook says how to confirm and when to close
        heads = re.findall(r"^## (\w+)", text, re.M)
        assert heads[0] == "Contain" and {"Confirm", "Close"} <= set(heads), kind
        assert "kvwatch gateway" in text, kind


def _commands() -> list[tuple[str, str]]:
    out = []
    for kind in sorted(KINDS):
        for m in _COMMAND.finditer(runbook_text(kind)):
            out.append((kind, " ".join(m.group(1).split())))
    return out


COMMANDS = _commands()


def _resolve(words: list[str]) -> tuple[Any, list[str]]:
    """The command the words name (``kvwatch`` dropped) and the words after it. Duck-typed:
    typer builds its commands on a click of its own, not the ``click`` package's classes."""
    cmd: Any = typer.main.get_command(app)
    rest = words[1:]
    while rest and rest[0] in getattr(cmd, "commands", {}):
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    return cmd, rest


@pytest.mark.parametrize(("kind", "command"), COMMANDS, ids=[f"{k}: {c}" for k, c in COMMANDS])
def test_every_command_a_runbook_names_parses(kind: str, command: str) -> None:
    words = shlex.split(command)
    cmd, rest = _resolve(words)
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    named = {w.split("=", 1)[0] for w in rest if w.startswith("--")}
    assert named <= known, f"{kind}: {command}: unknown option(s) {sorted(named - known)}"
    required = [
        p.opts for p in cmd.params if p.required and p.param_type_name == "option"
    ]  # a command copied as written must run: its required options are there
    missing = [opts[0] for opts in required if not named & {*opts, "--help"}]
    assert not missing, f"{kind}: {command}: missing required option(s) {missing}"
    path = words[1 : len(words) - len(rest)]
    r = CliRunner().invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output


def test_the_runbooks_name_commands_at_all() -> None:
    assert {k for k, _ in COMMANDS} == set(KINDS)


def test_an_unknown_kind_has_no_runbook() -> None:
    for kind in ("nope", "../packs/default", "stale_page_read.md"):
        with pytest.raises(NotFound):
            runbook_text(kind)


def _rule(**kw: Any) -> Rule:
    return Rule(name="r", kind="stale_page_read", severity="critical", params=None, **kw)


def test_the_runbook_link_is_decided_once() -> None:
    own = "https://wiki.example/leak"
    assert runbook_url(_rule(runbook_url=own), "https://kv.example") == own
    assert runbook_url(_rule(runbook_url=own), None) == own
    assert runbook_url(_rule(), "https://kv.example/") == (
        "https://kv.example/runbook?kind=stale_page_read"
    )
    assert runbook_url(_rule(), None) is None


def _pack(tmp_path: Path, url: str) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(
        f"pack: x\nrules:\n  - name: leak\n    kind: stale_page_read\n    runbook_url: {url!r}\n"
    )
    return p


def test_a_pack_overrides_a_rules_runbook_url(tmp_path: Path) -> None:
    (rule,) = load_pack(_pack(tmp_path, "https://wiki.example/kv?x=1")).rules
    assert rule.runbook_url == "https://wiki.example/kv?x=1"
    assert runbook_url(rule, "https://kv.example") == "https://wiki.example/kv?x=1"


@pytest.mark.parametrize("url", ["ftp://wiki.example/kv", "wiki.example/kv", "https://", " "])
def test_a_runbook_url_must_be_http(tmp_path: Path, url: str) -> None:
    with pytest.raises(PackError) as info:
        load_pack(_pack(tmp_path, url))
    assert info.value.field == "rules[0].runbook_url"
    assert "http(s) URL" in str(info.value)


def test_the_api_serves_a_runbook_to_any_read_token(collector: Collector) -> None:
    acme = collector.token("read", tenant="acme")
    for token in (collector.admin, collector.token("read"), acme):
        with collector.client(token) as h:
            r = h.get("/v1/runbooks/stale_page_read")
        assert r.status_code == 200, r.text
        assert r.json() == {
            "kind": "stale_page_read",
            "markdown": runbook_text("stale_page_read"),
        }
    with collector.client(acme) as h:
        r = h.get("/v1/runbooks/no_such_kind")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    assert "no_such_kind" in r.json()["error"]["message"]
    with collector.client(collector.ingest) as h:
        assert h.get("/v1/runbooks/stale_page_read").status_code == 403
    with collector.client(None) as h:
        assert h.get("/v1/runbooks/stale_page_read").status_code == 401


def test_the_docs_page_is_generated_from_the_runbooks() -> None:
    page = ROOT / "docs" / "runbooks.md"
    assert page.read_text(encoding="utf-8") == docs_runbooks.render(), (
        f"docs/runbooks.md is out of date: run `{docs_runbooks.COMMAND}`"
    )
    for kind in kinds():
        assert f"\n## {kind}\n" in page.read_text(encoding="utf-8")


def _runbook_page(env: pytest.MonkeyPatch, c: Collector, token: str, kind: str | None) -> AppTest:
    env.setenv("KVWATCH_COLLECTOR_URL", c.url)
    env.setenv("KVWATCH_DASHBOARD_TOKEN", token)
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60)
    if kind is not None:
        at.query_params["kind"] = kind
    at.switch_page("views/runbook.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_dashboard_shows_the_runbook_a_link_names(
    collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _runbook_page(monkeypatch, collector, collector.admin, "stale_page_read")
    assert at.selectbox[0].value == "stale_page_read"
    shown = "\n".join(m.value for m in at.markdown)
    assert "# stale_page_read" in shown and "## Contain" in shown
    # a tenant's read token reads it too (a runbook names no tenant)
    tenant = collector.token("read", tenant="acme")
    at = _runbook_page(monkeypatch, collector, tenant, "verification_failed")
    assert "# verification_failed" in "\n".join(m.value for m in at.markdown)
    # without a kind: the kinds of the rules in force to choose from, the first shown
    at = _runbook_page(monkeypatch, collector, collector.admin, None)
    assert set(at.selectbox[0].options) == set(KINDS)
    # a kind kvwatch does not have is the collector's 404, said as such
    at = _runbook_page(monkeypatch, collector, collector.admin, "no_such_kind")
    assert any("no_such_kind" in e.value for e in at.error), [e.value for e in at.error]
