"""The README and then every docs page, in reading order, as one reader's shell session.

A reader opens a shell at the checkout's top, runs ``make demo``, then pastes the README's
blocks and each page's in the order the site lists them (mkdocs.yml's nav), in that one
shell: the same working directory, the same variables, the same collector, the ports as
written. This test does exactly that (``make demo`` being ``kvwatch demo --dir kvwatch-demo``
into a copy of the checkout's layout: ``.venv`` and ``deploy/``), so a block that leaves the
shell somewhere else, starts a second collector on a taken port, or gives a variable a second
meaning fails here, where a test per page with fresh ports and directories never met it.

Then it checks what the README's incident did (the stale read, the alerts, the incident, the
breach PDF, the hardened engine's verdict), and that everything the session wrote is either
the demo's or ignored by the checkout's ``.gitignore``: a reader's ``git status`` stays clean.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pypdf
import pytest
from sqlalchemy import select

from collector import models as m
from collector.db import Database
from tests.test_docs_commands import BLOCKS, ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="the docs' shell is bash on Linux"),
    # the demo, the README's incident and every page's engines, gateways and verifications
    pytest.mark.timeout(1800),
]

#: every port a block names, as written (the bus example's NATS nodes: 4301 and the two after;
#: sign-in.md's test identity provider and its collector: 8960, 8962)
PORTS = (8700, 8710, 8000, 8001, 8780, 8781, 8501, 4301, 4302, 4303, 8960, 8962)
SESSION_TIMEOUT_S = 1500


def _taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _script() -> str:
    """Every block that runs, in reading order, each announced (so a failure names it)."""
    # the newline first: a block's last output may not end its line
    return "".join(f"printf '\\n>>> {b.id}\\n'\n{b.body}\n" for b in BLOCKS if b.kind != "skip")


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    taken = [p for p in PORTS if _taken(p)]
    if taken:
        pytest.fail(f"port(s) {taken} taken: the session uses the README's ports as written")
    cwd = tmp_path_factory.mktemp("checkout")
    home = tmp_path_factory.mktemp("home")  # a reader's home is not the checkout
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    # a checkout's: the Prometheus rules, and what the probe's wheel is built from
    for part in ("deploy", "probe", "engine_probe"):
        (cwd / part).symlink_to(ROOT / part)
    # the test identity provider sign-in.md starts: a copy, so the page's `npm ci` installs
    # into the session's checkout, never under a test that runs the provider meanwhile
    shutil.copytree(
        ROOT / "tests" / "oidc",
        cwd / "tests" / "oidc",
        ignore=shutil.ignore_patterns("node_modules"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVWATCH_", "OTEL_"))}
    # OMP_NUM_THREADS: one torch thread for the demo's and the pages' reference engines
    # (tiny tensors; beside another test worker on 2 cores a second thread only spins)
    env |= {"PYTHONUNBUFFERED": "1", "HOME": str(home), "COLUMNS": "100", "OMP_NUM_THREADS": "1"}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )  # the README activates the venv itself
    demo = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "kvwatch"), "demo", "--dir", "kvwatch-demo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    log = cwd.parent / f"{cwd.name}-session.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", "set -eu -o pipefail\n" + _script()],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # what the session leaves running goes with its group
        )
        try:
            rc = proc.wait(timeout=SESSION_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    text = log.read_text()
    failed = text.rsplit(">>> ", 1)[-1].split("\n", 1)[0] if ">>> " in text else "the start"
    assert rc == 0, f"{failed} exited {rc}:\n{text[-12000:]}"
    return cwd, text


def test_the_session_runs_top_to_bottom_and_leaves_nothing_untracked(
    session: tuple[Path, str],
) -> None:
    cwd, out = session
    ran = re.findall(r"^>>> (\S+)$", out, re.M)
    assert ran == [b.id for b in BLOCKS if b.kind != "skip"], ran  # every block, in order
    written = [
        str(Path(d, f).relative_to(cwd))
        for d, dirs, files in os.walk(cwd)
        for f in files
        if Path(d) != cwd or f not in (".venv", "deploy", "probe", "engine_probe")
    ]
    ignored = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(written),
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()  # one path a line: a name may hold spaces
    # the checkout's own files the session was given a copy of (the test identity provider)
    copied = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "oidc").iterdir() if p.is_file()}
    left = sorted(set(written) - set(ignored) - copied)
    assert not left, f"the session left files `git status` would show: {left}"


def test_the_incident_by_hand_happened_as_the_readme_says(session: tuple[Path, str]) -> None:
    cwd, out = session
    work = cwd / "by-hand"
    # legacy: the verifier found leaks, the card says UNSAFE, the engines said where they report
    assert "kvwatch verify: FAIL" in out and "kvwatch verify: PASS" in out, out
    assert "kvwatch verify exited 1: the endpoint leaks" in out, out
    assert "**UNSAFE: cross-tenant leak at ≥" in out, out
    assert "**verified safe context 2,048 tokens on" in out, out
    assert "reporting to http://127.0.0.1:8700" in (work / "legacy.log").read_text()
    # hardened: the over-pool prompt is refused in OpenAI's shape
    assert '"code":"context_length_exceeded"' in out, out
    assert "notify by" in out and "Art. 33(2)" in out and "lab-legacy" in out

    db = Database(f"sqlite:///{work / 'by-hand.db'}")
    try:
        with db.read() as conn:
            rows = conn.execute(select(m.Alert.rule, m.Alert.deployment_id, m.Alert.state,
                                       m.Alert.severity)).all()  # fmt: skip
            incidents = conn.execute(select(m.Incident)).all()
            crossed = conn.execute(
                select(m.PageEvent.tenant, m.PageEvent.other_tenant).where(
                    m.PageEvent.deployment_id == "lab-legacy",
                    m.PageEvent.kind == "page.stale_read",
                    m.PageEvent.cross_tenant.is_(True),
                )
            ).all()
            hardened_reads = conn.execute(
                select(m.PageEvent.id).where(
                    m.PageEvent.deployment_id == "lab-hardened",
                    m.PageEvent.kind == "page.stale_read",
                )
            ).all()
    finally:
        db.dispose()
    assert ("globex", "acme") in {(t, o) for t, o in crossed}
    assert hardened_reads == []
    # legacy: the chain the README lists, critical, and nothing the verifier's own prompts
    # raised; the fixed engine: nothing critical (its small pool, whose refusals are
    # verified, and a refused prompt past its limit are warnings)
    firing = {(rule, dep): sev for rule, dep, state, sev in rows if state == "firing"}
    chain = {"pool_below_advertised", "context_pressure", "rejected_prefill_kv_transfer",
             "stale_page_read", "verification_failed"}  # fmt: skip
    legacy = {rule for (rule, dep), sev in firing.items() if dep == "lab-legacy" and
              sev == "critical"}  # fmt: skip
    assert legacy == chain, firing
    hardened = {rule: sev for (rule, dep), sev in firing.items() if dep == "lab-hardened"}
    assert set(hardened.values()) == {"warning"}, hardened
    assert {"pool_below_advertised", "context_pressure"} <= set(hardened), hardened
    (incident,) = incidents
    assert incident.deployment_id == "lab-legacy" and incident.state == "open"

    (pdf,) = (work / "breach").glob("breach-*.pdf")
    text = "\n".join(p.extract_text() for p in pypdf.PdfReader(io.BytesIO(pdf.read_bytes())).pages)
    assert "lab-legacy" in text and "globex" in text and "acme" in text
    assert "merger" not in text and "Initech" not in text  # never the prompt's text
