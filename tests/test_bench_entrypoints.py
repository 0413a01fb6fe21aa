"""Every benchmark runs as a file and as a module, as docs/benchmarks.md shows both
(``python bench/ingest.py --quick`` once failed with "No module named 'bench'")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.name for p in (ROOT / "bench").glob("*.py") if p.name not in ("__init__.py", "common.py")
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts_as_a_file_and_as_a_module(script: str, tmp_path: Path) -> None:
    for cmd in (
        [sys.executable, str(ROOT / "bench" / script), "--help"],
        [sys.executable, "-m", f"bench.{script.removesuffix('.py')}", "--help"],
    ):
        # from elsewhere: nothing may depend on the working directory being the checkout
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (cmd, done.stderr[-2000:])
        assert "usage:" in done.stdout
