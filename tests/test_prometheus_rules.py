"""deploy/prometheus/kvwatch-rules.yaml under Debian's promtool: the rules check, their unit
tests (deploy/prometheus/tests/*.yaml) pass, and every alert is tested both firing and quiet.
The series the rules read are the collector's and the engines' real names: each is asserted
to exist where it comes from (tests/test_metrics_exposure.py, tests/test_refengine_metrics.py,
vLLM's and SGLang's own names as kvwatch's scraper reads them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests import promtool

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "kvwatch-rules.yaml"
TESTS = sorted((ROOT / "deploy" / "prometheus" / "tests").glob("*.yaml"))


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_rules_check() -> None:
    code, out = promtool.run("check", "rules", str(RULES))
    assert code == 0, out
    assert f"SUCCESS: {len(_rules())} rules found" in out


def test_the_rules_unit_tests_pass() -> None:
    assert TESTS, "deploy/prometheus/tests/ holds the rules' unit tests"
    code, out = promtool.run("test", "rules", *(str(t) for t in TESTS))
    assert code == 0, out
    assert out.count("SUCCESS") == len(TESTS), out


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"
    assert (firing | quiet) - alerts == set(), "tests of alerts that do not exist"


def test_the_rules_read_series_that_exist() -> None:
    """Every series name a rule reads is one kvwatch's collector publishes, one its recording
    rules make, or an engine's own (checked against the names the scraper and refengine
    use)."""
    from collector import metrics as collector_metrics
    from kvwatch.scrape import sglang, vllm
    from refengine import metrics as refengine_metrics

    published = "\n".join(
        Path(m.__file__).read_text()  # type: ignore[arg-type]
        for m in (collector_metrics, refengine_metrics, vllm, sglang)
    )
    recorded = {r["record"] for r in _rules() if "record" in r}
    names = set()
    for rule in _rules():
        expr = rule["expr"]
        for alternatives in re.findall(r'__name__=~"([^"]*)"', expr):
            names |= set(alternatives.split("|"))
        expr = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
        names |= set(re.findall(r"\b((?:kvwatch|vllm|sglang)[a-z0-9_:]*[a-z0-9_])\b", expr))
    missing = []
    for name in sorted(names - recorded):
        base = re.sub(r"_(bucket|total)$", "", name)
        if base not in published and name not in published:
            missing.append(name)
    assert missing == []
