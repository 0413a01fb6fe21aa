"""docs/policies.md cannot drift from the code: every YAML example on it loads (a pack
through the loader ``kvwatch policies check`` uses, an advisory file or a data map through
its own), and every rule kind and every parameter of each is described, with its mode,
default severity and default ``resolve_after``."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import yaml

from policies.datamap import DataMap
from policies.durations import parse_duration
from policies.kinds import KINDS
from policies.kinds.advisory import load_advisories
from policies.pack import check_path

DOC = Path(__file__).resolve().parent.parent / "docs" / "policies.md"
TEXT = DOC.read_text(encoding="utf-8")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
_NAMED = re.compile(r"^# ([\w.-]+\.ya?ml)\n")


def yaml_blocks() -> list[str]:
    return [body for lang, body in _FENCE.findall(TEXT) if lang == "yaml"]


def kind_section(name: str) -> str:
    """The text of the ``### `name``` section."""
    m = re.search(rf"^### `{re.escape(name)}`\n(.*?)(?=^#{{2,3}} )", TEXT, re.S | re.M)
    assert m, f"docs/policies.md has no section '### `{name}`'"
    return m.group(1)


def test_the_page_has_yaml_examples_of_each_file_kind() -> None:
    tops = [next(iter(yaml.safe_load(b))) for b in yaml_blocks()]
    assert tops.count("pack") >= len(KINDS)
    assert "advisories" in tops and "entries" in tops


def test_every_yaml_example_loads(tmp_path: Path) -> None:
    """All blocks are written side by side first (a pack may name an advisory file shown
    in another block, as ``# advisories.yaml`` on its first line), then each is loaded."""
    files = []
    for i, body in enumerate(yaml_blocks()):
        named = _NAMED.match(body)
        path = tmp_path / (named.group(1) if named else f"example-{i}.yaml")
        assert not path.exists(), f"two examples named {path.name}"
        path.write_text(body, encoding="utf-8")
        files.append(path)
    for path in files:
        top = next(iter(yaml.safe_load(path.read_text())))
        if top == "pack":
            ruleset = check_path(path)  # raises PackError with every problem
            assert ruleset.rules
        elif top == "advisories":
            assert load_advisories(path)
        elif top == "entries":
            assert DataMap.load(path).entries
        else:
            pytest.fail(f"an example of an unknown kind of file: {path.read_text()}")


def parameter_rows(section: str) -> list[str]:
    """The rows of the section's table headed ``| parameter |``."""
    lines = section.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| parameter |")), None)
    if start is None:
        return []
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_and_parameter_is_described(name: str) -> None:
    kind = KINDS[name]
    section = kind_section(name)
    assert f"Mode `{kind.mode}`" in section
    assert f"default severity `{kind.default_severity}`" in section
    if kind.mode == "event":
        m = re.search(r"default `resolve_after` `([^`]+)`", section)
        assert m and parse_duration(m.group(1)) == kind.default_resolve_after_s, section
    params = [f.encode_name for f in msgspec.structs.fields(kind.params)]
    if not params:
        assert "No parameters." in section
    rows = parameter_rows(section)
    for param in params:
        assert any(f"`{param}`" in row.split(" | ")[0] for row in rows), (
            f"{name}: parameter {param!r} has no row in its table"
        )
    for row in rows:
        if "(none)" in row:
            continue  # filled in by the loader: no default to compare
        first, _, default = (cell.strip() for cell in row.strip("|").split(" | ")[:3])
        (param,) = re.findall(r"`(\w+)`", first)
        field = next(f for f in msgspec.structs.fields(kind.params) if f.encode_name == param)
        value = (
            field.default_factory()
            if field.default_factory is not msgspec.NODEFAULT
            else field.default
        )
        shown = yaml.safe_load(default.strip("`"))
        assert shown == value, f"{name}.{param}: the table says {default}, the code {value!r}"
