"""docs/configuration.md is generated from the settings classes (``kvwatch.docs_config``) and
cannot drift: the committed page is what the generator writes now, every settings class is
on it, and every ``KVWATCH_*`` variable the code reads by name is documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvwatch import docs_config

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
PACKAGES = ("collector", "engine_probe", "kvwatch", "dashboard", "policies", "refengine")


def test_the_committed_page_is_what_the_generator_writes() -> None:
    assert PAGE.read_text(encoding="utf-8") == docs_config.render(), (
        f"docs/configuration.md is out of date: run `{docs_config.COMMAND}` (make docs-config)"
    )


def _settings_classes() -> set[str]:
    """Every class in our packages that derives from BaseSettings, directly or through
    another such class (by name, from the source)."""
    bases: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases[node.name] = {ast.unparse(b).split(".")[-1] for b in node.bases}
    found = {"BaseSettings"}
    while True:
        more = {name for name, bs in bases.items() if bs & found} - found
        if not more:
            return found - {"BaseSettings"}
        found |= more


def test_every_settings_class_is_documented() -> None:
    documented = {cls.__name__ for _, cls, _ in docs_config.SECTIONS}
    # a documented class's bases are on the page with it (ProducerSettings: ProbeSettings)
    covered = documented | {
        base.__name__ for _, cls, _ in docs_config.SECTIONS for base in cls.__mro__
    }
    assert _settings_classes() - covered == set()


def test_every_variable_read_by_name_is_documented() -> None:
    text = PAGE.read_text(encoding="utf-8")
    named = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            named |= set(re.findall(r"[\"'](KVWATCH_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    missing = {n for n in named if not n.startswith("KVWATCH_TEST_") and f"`{n}`" not in text}
    assert missing == set()


def test_every_setting_has_a_description() -> None:
    for _, cls, _ in docs_config.SECTIONS:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description="
