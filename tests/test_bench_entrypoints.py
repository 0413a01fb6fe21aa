"""Every benchmark starts as docs/benchmarks.md and bench/README.md show it: as a module,
``python -m bench.X``, from the checkout's root. bench is not part of the installed package
(a top-level ``bench`` in site-packages would shadow other projects'), so this is the one way
to run it; the checkout's root on ``sys.path`` comes from ``-m`` and the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.name for p in (ROOT / "bench").glob("*.py") if p.name not in ("__init__.py", "common.py")
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts_as_a_module_from_the_checkout(script: str) -> None:
    # no PYTHONPATH: the root must be found the way a reader's shell finds it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-m", f"bench.{script.removesuffix('.py')}", "--help"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (cmd, done.stderr[-2000:])
    assert "usage:" in done.stdout
