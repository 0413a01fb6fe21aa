"""kvwatch-probe, the distribution for inference engines (probe/pyproject.toml), built by the
project's own build (``python -m build``): every module of ``engine_probe`` and nothing else,
the vLLM and SGLang plugin entry points, kvwatch's one version, and four small dependencies,
none of the collector's or the dashboard's. (``engines/build-venv.sh`` installs this wheel
into each engine's venv and fails if it pulls in anything.)"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import engine_probe

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"streamlit", "pandas", "scipy", "matplotlib", "sqlalchemy", "fastapi", "torch"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT / "probe")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("kvwatch_probe-*.whl")
    return built


def test_the_probe_wheel_holds_the_probe_and_needs_little(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(meta).decode())
        (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(eps).decode()
    modules = {n for n in names if not n.startswith("kvwatch_probe-")}
    source = {str(p.relative_to(ROOT)) for p in (ROOT / "engine_probe").rglob("*.py")}
    assert modules == source, modules ^ source  # the whole probe, and only it
    assert metadata["Name"] == "kvwatch-probe"
    assert metadata["Version"] == engine_probe.__version__  # the one version
    needs = {r.split(">")[0].split("=")[0].split("[")[0].strip().lower()
             for r in metadata.get_all("Requires-Dist") or []}  # fmt: skip
    assert needs == {"msgspec", "httpx", "pydantic", "pydantic-settings"}, needs
    assert not needs & HEAVY
    assert "kvwatch = engine_probe.adapters.vllm.plugin:register" in entry_points
    assert "kvwatch = engine_probe.adapters.sglang.plugin:register" in entry_points
    assert metadata["License-Expression"] == "Apache-2.0"


def test_the_probe_wheel_installs_and_imports_alone(wheel: Path, tmp_path: Path) -> None:
    """Installed by itself (its dependencies are this interpreter's, as an engine's image has
    them), the contract and the runtime import, and no kvwatch module comes with it."""
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")} == {
        "engine_probe"
    }
    code = (
        "import engine_probe, engine_probe.events, engine_probe.probe; "
        f"assert engine_probe.__file__.startswith({str(target)!r}), engine_probe.__file__; "
        "print(engine_probe.events.SCHEMA_VERSION)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout: its engine_probe/ would shadow the installed one
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "1"
