"""Debian's ``promtool`` (the ``prometheus`` package, which ``.ci/run`` installs), for the
tests that lint /metrics and check and unit-test the Prometheus rules."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

PROMTOOL = "/usr/bin/promtool"
# promtool reserves colons for recording rules; vLLM's own names have one (vllm:...), so the
# engine metrics that keep vLLM's names keep that complaint, and only that one.
_VLLM_COLON = re.compile(r"^vllm:\S+ metric names should not contain ':'$")


def promtool() -> str:
    """The binary; in CI its absence fails the test, elsewhere it skips it."""
    if not os.path.exists(PROMTOOL):
        if os.environ.get("CI"):
            pytest.fail(f"{PROMTOOL} is missing: .ci/run installs Debian's prometheus package")
        pytest.skip(f"{PROMTOOL} not installed (apt-get install prometheus)")
    return PROMTOOL


def run(*args: str, stdin: str | None = None, cwd: Path | None = None) -> tuple[int, str]:
    r = subprocess.run(
        [promtool(), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )
    return r.returncode, r.stdout + r.stderr


def metric_problems(exposition: str) -> list[str]:
    """What ``promtool check metrics`` finds in ``exposition``, less the colon in vLLM's
    names. A text it cannot parse fails the test outright."""
    code, out = run("check", "metrics", stdin=exposition)
    assert code in (0, 3), f"promtool could not parse the exposition (exit {code}):\n{out}"
    return [
        line for line in out.splitlines() if line.strip() and not _VLLM_COLON.match(line.strip())
    ]
