"""Every shell command in the README and on every docs page runs as written.

Each ``sh`` code block of ``README.md`` and ``docs/*.md`` is one of:

- the setup, marked ``<!-- ci: setup -->`` (README, "Using it"): it runs first, in a fresh
  directory holding a fresh demo (``kvwatch demo --dir kvwatch-demo``); the collector it starts
  stays up, and what it exports (``KVWATCH_DATABASE_URL``, ``COLLECTOR``, ``ADMIN``, ...) is
  every later block's environment, as it is a reader's shell;
- covered by its own test, marked ``<!-- by-hand:... -->`` (``tests/test_readme_by_hand.py``
  runs those and checks what they did);
- skipped, marked ``<!-- ci: skip: REASON -->``, for what this machine cannot run (a GPU build,
  a vLLM install, a foreground server a person stops with Ctrl-C); the reason is required;
- or run: a page's blocks in order, in one shell (a variable one block sets, the next uses),
  with ``set -eu -o pipefail``, so every command must succeed.

Blocks run where a reader stands in a checkout: beside ``.venv``, ``kvwatch-demo`` and
``deploy/`` (the Prometheus rules). Ports are the only thing changed: on a page that starts
servers of its own, each port it names gets a free one (8700 too, when it starts its own
collector); elsewhere 8700 is the setup's collector.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvwatch.embedded import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?P<before>(?:[^\n]*\n){0,3})```(?:sh|bash|shell)\n(?P<body>.*?)```", re.S)
_MARKER = re.compile(r"<!--\s*(?P<text>[^>]*?)\s*-->\s*$")
_PORTS = ("8700", "8000", "8001", "8780", "8501", "8781")
_STARTS_SERVERS = re.compile(r"kvwatch (serve|engine serve|gateway)\b[^&]*&")
BLOCK_TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    body: str
    marker: str  # "" when none

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        if self.marker.startswith("ci: setup"):
            return "setup"
        if self.marker.startswith("ci: skip"):
            return "skip"
        if "by-hand" in self.marker:
            return "by-hand"
        return "run"


def blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            lines = [ln for ln in m.group("before").splitlines() if ln.strip()]
            marker = _MARKER.search(lines[-1]) if lines else None
            out.append(
                Block(
                    page=str(page.relative_to(ROOT)),
                    line=text[: m.start("body")].count("\n"),
                    body=m.group("body"),
                    marker=marker.group("text") if marker else "",
                )
            )
    return out


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.kind == "run"]


def test_every_block_runs_or_says_why_not() -> None:
    (setup,) = [b for b in BLOCKS if b.kind == "setup"]
    assert setup.page == "README.md"
    for b in BLOCKS:
        if b.kind == "skip":
            reason = b.marker.removeprefix("ci: skip").strip(" :")
            assert len(reason) > 10, f"{b.id}: a skipped block says why it cannot run here"
    assert len(RUN) >= 10


@dataclass
class Sandbox:
    cwd: Path
    env: dict[str, str]


def _swap_ports(body: str, collector_port: int) -> str:
    own = {p for p in _PORTS if p != "8700" or re.search(r"kvwatch serve\b[^\n]*&", body)}
    if not _STARTS_SERVERS.search(body):
        own = set()
    for port in _PORTS:
        new = free_port() if port in own else collector_port if port == "8700" else None
        if new is not None:
            body = re.sub(rf"\b{port}\b", str(new), body)
    return body


def _run(body: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        ["bash", "-c", "set -eu -o pipefail\n" + body],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # what a page leaves running goes with its group
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    cwd = tmp_path_factory.mktemp("docs")
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    (cwd / "deploy").symlink_to(ROOT / "deploy")  # a checkout's: the Prometheus rules
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    # OMP_NUM_THREADS: one torch thread for the demo's and the pages' reference engines
    # (tiny tensors; beside another test worker on 2 cores a second thread only spins)
    env |= {"PYTHONUNBUFFERED": "1", "HOME": str(cwd), "COLUMNS": "100", "OMP_NUM_THREADS": "1"}
    demo = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "kvwatch"), "demo", "--dir", "kvwatch-demo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    (setup,) = [b for b in BLOCKS if b.kind == "setup"]
    port = free_port()
    body = re.sub(r"\b8700\b", str(port), setup.body)
    # The setup's servers stay up for the other blocks: its shell writes out its environment
    # and leaves them running in its process group, stopped after the module.
    dump = cwd / "setup.env"
    proc = subprocess.Popen(
        ["bash", "-c", f"set -eu -o pipefail\n{body}\nenv -0 > {dump}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, f"{setup.id}:\n{out}"
        exported = dict(item.split("=", 1) for item in dump.read_text().split("\0") if "=" in item)
        exported["KVWATCH_TEST_COLLECTOR_PORT"] = str(port)
        yield Sandbox(cwd, exported)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the collector the setup left running


RUN_PAGES = sorted({b.page for b in RUN}, key=lambda p: (p != "README.md", p))


@pytest.mark.skipif(sys.platform != "linux", reason="the docs' shell is bash on Linux")
@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_pages_commands_run_as_written(page: str, sandbox: Sandbox) -> None:
    port = int(sandbox.env["KVWATCH_TEST_COLLECTOR_PORT"])
    script = "".join(f"echo '>>> {b.id}'\n{b.body}\n" for b in RUN if b.page == page)
    r = _run(_swap_ports(script, port), sandbox.cwd, sandbox.env)  # where the reader stands
    failed = r.stdout.rsplit(">>> ", 1)[-1].split("\n", 1)[0] if ">>> " in r.stdout else page
    assert r.returncode == 0, f"{failed} exited {r.returncode}:\n{r.stdout}"
