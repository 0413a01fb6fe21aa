"""Rule packs: the default pack, operator packs, and errors that name file, line and field."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from policies import (
    BatchFacts,
    DeploymentFacts,
    NodeConfig,
    PackError,
    PackErrors,
    Rule,
    RuleSet,
    default_pack,
    evaluate_batch,
    load_pack,
    load_ruleset,
)
from policies.kinds import KINDS
from tests import factories as f

GOOD = """\
pack: acme
rules:
  - name: acme_pressure
    kind: context_pressure
    params: {warn_ratio: 0.5}
    labels: {team: inference}
    annotations: {runbook: "https://runbooks/{deployment_id}"}
"""


def write(tmp_path: Path, text: str, name: str = "pack.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path: Path) -> PackError:
    with pytest.raises(PackError) as info:
        load_pack(path)
    return info.value


def test_the_default_pack_has_every_kind() -> None:
    pack = default_pack()
    assert {r.kind for r in pack.rules} == set(KINDS)
    assert all(r.source.endswith(f":{r.source.rsplit(':', 1)[1]}") for r in pack.rules)


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        ("pack: x\nrules:\n  - name: a\n    kind: nope\n", 4, "rules[0].kind", "unknown kind"),
        (
            "pack: x\nrules:\n  - name: a\n    kind: context_pressure\n    params:\n"
            "      warn_ratio: lots\n",
            6,
            "rules[0].params.warn_ratio",
            "expected `float`",
        ),
        (
            "pack: x\nrules:\n  - name: a\n    kind: pool_headroom\n    params: {factr: 3}\n",
            5,
            "rules[0].params.factr",
            "unknown field",
        ),
        ("pack: x\nrules:\n  - kind: pool_headroom\n", 3, "rules[0].name", "missing required"),
        (
            "pack: x\nrules:\n  - name: a\n    kind: config_drift\n    for: soon\n",
            5,
            "rules[0].for",
            "duration",
        ),
        (
            "pack: x\nrules:\n  - name: a\n    kind: pool_headroom\n  - name: a\n"
            "    kind: pool_headroom\n",
            5,
            "rules[1].name",
            "appears twice",
        ),
        (
            "pack: x\nrules:\n  - name: a\n    kind: context_pressure\n    params:\n"
            "      warn_ratio: 0.9\n      critical_ratio: 0.5\n",
            7,
            "rules[0].params.critical_ratio",
            ">= warn_ratio",
        ),
        (
            "pack: x\nrules:\n  - name: a\n    kind: config_drift\n    params:\n"
            "      settings: [colour]\n",
            6,
            "rules[0].params.settings",
            "unknown",
        ),
        ("pack: x\nrules: [\n", None, None, "not valid YAML"),
        (
            "pack: x\nincidents: {reminders_before: [80h]}\nrules: []\n",
            2,
            "incidents.reminders_before[0]",
            "deadline",
        ),
    ],
)
def test_errors_name_file_line_and_field(
    tmp_path: Path, text: str, line: int | None, field: str | None, words: str
) -> None:
    path = write(tmp_path, text)
    e = error_of(path)
    assert e.path == str(path)
    if line is not None:
        assert e.line == line, str(e)
    assert e.field == field, str(e)
    assert words.lower() in e.message.lower(), str(e)
    assert str(path) in str(e)


def test_an_operator_pack_adds_rules_and_one_named_default_replaces_it(tmp_path: Path) -> None:
    write(tmp_path, GOOD)
    rules = load_ruleset(tmp_path)
    assert rules.rule("acme_pressure") is not None and rules.rule("stale_page_read") is not None
    write(tmp_path, "pack: default\nrules:\n  - name: only\n    kind: stale_page_read\n", "z.yaml")
    replaced = load_ruleset(tmp_path)
    assert sorted(r.name for r in replaced.rules) == ["acme_pressure", "only"]


def test_a_rule_name_clash_across_packs_names_both_places(tmp_path: Path) -> None:
    write(tmp_path, "pack: other\nrules:\n  - name: stale_page_read\n    kind: stale_page_read\n")
    with pytest.raises(PackError) as info:
        load_ruleset(tmp_path)
    assert "already defined at" in str(info.value) and "default.yaml" in str(info.value)


def test_an_advisory_file_is_validated_with_its_own_lines(tmp_path: Path) -> None:
    write(
        tmp_path,
        "advisories:\n  - id: x\n    engine: vllm\n    affected: 'not a spec'\n    summary: s\n",
        "adv.yaml",
    )
    pack = write(
        tmp_path,
        "pack: x\nrules:\n  - name: a\n    kind: engine_version_advisory\n"
        "    params: {files: [adv.yaml]}\n",
        "pack.yml",
    )
    e = error_of(pack)
    assert e.path.endswith("adv.yaml") and e.line == 4 and e.field == "advisories[0].affected"


def test_operator_advisories_fire_on_their_condition(tmp_path: Path) -> None:
    write(
        tmp_path,
        "advisories:\n  - id: vllm-old\n    engine: vllm\n    affected: '<0.9'\n"
        "    summary: old\n    severity: info\n    when: {prefix_caching: true}\n",
        "adv.yaml",
    )
    pack = load_pack(
        write(
            tmp_path,
            "pack: x\nrules:\n  - name: adv\n    kind: engine_version_advisory\n"
            "    params: {files: [adv.yaml], include_builtin: false}\n",
        )
    )
    now = datetime.now(UTC)
    rs = RuleSet.of([pack])
    for caching, firing in ((True, True), (False, False)):
        e = f.config(1, engine="vllm", engine_version="0.8.5", prefix_caching=caching)
        cfg = NodeConfig.from_event(e)  # type: ignore[arg-type]
        facts = BatchFacts(
            events=[e], deployments={"glm-prod": DeploymentFacts("glm-prod", {cfg.node: cfg})}
        )
        (sig,) = evaluate_batch(rs, facts, now).signals
        assert sig.firing is firing and sig.severity == "info"


def test_a_failing_rule_is_unhealthy_and_the_others_still_run() -> None:
    broken = Rule(name="broken", kind="context_pressure", severity="warning", params=None)
    fine = Rule(
        name="stale",
        kind="stale_page_read",
        severity="critical",
        params=next(r for r in default_pack().rules if r.name == "stale_page_read").params,
    )
    e = f.admitted(1, "r", prompt=10)
    stale = f.stale_read(2)
    cfg = NodeConfig.from_event(f.config(3))  # type: ignore[arg-type]
    facts = BatchFacts(
        events=[e, stale], deployments={"glm-prod": DeploymentFacts("glm-prod", {cfg.node: cfg})}
    )
    result = evaluate_batch(RuleSet(rules=(broken, fine)), facts, datetime.now(UTC))
    health = {h.rule: h for h in result.health}
    assert not health["broken"].ok and "AttributeError" in (health["broken"].error or "")
    assert health["stale"].ok
    assert [s.rule for s in result.signals] == ["stale"]


def test_cli_check_and_list(tmp_path: Path) -> None:
    good = write(tmp_path, GOOD)
    bad = write(tmp_path, "pack: x\nrules:\n  - name: a\n    kind: nope\n", "bad.yaml")
    run = [sys.executable, "-m", "kvwatch.cli", "policies"]
    ok = subprocess.run([*run, "check", str(good)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "acme_pressure" in ok.stdout and "valid" in ok.stderr
    no = subprocess.run([*run, "check", str(bad)], capture_output=True, text=True, timeout=60)
    assert no.returncode == 1
    assert f"{bad}:4" in no.stderr and "rules[0] (a).kind" in no.stderr
    listed = subprocess.run(
        [*run, "list", "--packs-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 1 and "not a directory" in listed.stderr
    bad.unlink()
    listed = subprocess.run(
        [*run, "list", "--packs-dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0 and "acme_pressure" in listed.stdout


THREE_PROBLEMS = """\
pack: acme
rules:
  - name: fine
    kind: pool_headroom
  - name: pressure
    kind: context_pressure
    params: {warn_ratio: lots, critical_ratio: 0.5}
  - name: drift
    kind: config_drift
    for: soon
    params: {settings: [colour]}
"""


def test_check_reports_every_problem_of_a_pack_in_one_run(tmp_path: Path) -> None:
    """Not the first problem only: each bad field of each rule, by line, rule and field, so
    one run of ``policies check`` says everything to fix; exit 1."""
    bad = write(tmp_path, THREE_PROBLEMS, "bad.yaml")
    run = [sys.executable, "-m", "kvwatch.cli", "policies", "check", str(bad)]
    no = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert no.returncode == 1
    lines = [line for line in no.stderr.splitlines() if line.startswith("invalid:")]
    assert lines[0] == "invalid: 3 problems", no.stderr
    assert lines[1:] == [
        f"invalid: {bad}:7: rules[1] (pressure).params.warn_ratio: expected `float`, got `str`",
        f"invalid: {bad}:10: rules[2] (drift).for: expected a duration such as 30s, 15m or 4h, "
        "got 'soon'",
        f"invalid: {bad}:11: rules[2] (drift).params.settings: unknown ['colour']; known: "
        "['engine_version', 'pool_capacity_tokens', 'quantization', 'tp_size', 'cuda_graphs', "
        "'advertised_context', 'disaggregated', 'prefix_caching', 'prefix_cache_salting', "
        "'model_id', 'engine', 'dtype']",
    ], no.stderr
    # the same errors, as one exception, wherever packs are loaded (the collector refuses
    # to start with all of them)
    with pytest.raises(PackErrors) as info:
        load_ruleset(tmp_path)
    assert [(e.line, e.rule, e.field) for e in info.value.errors] == [
        (7, "pressure", "rules[1].params.warn_ratio"),
        (10, "drift", "rules[2].for"),
        (11, "drift", "rules[2].params.settings"),
    ]
    assert str(info.value).count("\n") == 2


def test_a_directory_reports_every_files_problems_and_every_clash(tmp_path: Path) -> None:
    write(tmp_path, "pack: a\nrules:\n  - name: x\n    kind: nope\n", "a.yaml")
    write(tmp_path, "pack: b\nrules:\n  - kind: pool_headroom\n", "b.yaml")
    with pytest.raises(PackErrors) as info:
        load_ruleset(tmp_path)
    assert [(Path(e.path).name, e.field) for e in info.value.errors] == [
        ("a.yaml", "rules[0].kind"),
        ("b.yaml", "rules[0].name"),
    ]
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).unlink()
    write(
        tmp_path,
        "pack: c\nrules:\n  - name: stale_page_read\n    kind: stale_page_read\n"
        "  - name: pool_headroom\n    kind: pool_headroom\n",
        "c.yaml",
    )
    with pytest.raises(PackErrors) as clash:
        load_ruleset(tmp_path)
    assert [e.rule for e in clash.value.errors] == ["stale_page_read", "pool_headroom"]
    assert all("already defined at" in e.message for e in clash.value.errors)


def test_group_keys_quote_label_values() -> None:
    """Free-form label values (routes, model ids) cannot make two groups' keys collide."""
    from collector.alerting.docs import group_key

    a, _ = group_key({"model_id": 'x",route="y', "route": ""}, ("model_id", "route"))
    b, _ = group_key({"model_id": "x", "route": 'y",route="'}, ("model_id", "route"))
    assert a != b
    assert (
        group_key({"alertname": "r", "deployment_id": "d"}, ("alertname", "deployment_id"))[0]
        == '{alertname="r",deployment_id="d"}'
    )
