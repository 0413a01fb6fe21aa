"""The README's "The incident, by hand" runs as written: its shell blocks, in one bash, as
subprocesses talking real HTTP (only the ports are swapped for free ones), then every step's
outcome is checked in what they printed, in the database they left and in the breach PDF."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pypdf
import pytest
from sqlalchemy import select

from collector import models as m
from collector.db import Database
from kvwatch.embedded import free_port

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(text: str, name: str) -> str:
    part = text.split(f"<!-- {name}:start -->")[1].split(f"<!-- {name}:end -->")[0]
    found = re.search(r"```sh\n(.*?)```", part, re.S)
    assert found is not None, f"no sh block between the {name} markers"
    return found.group(1)


def _script() -> str:
    text = README.read_text(encoding="utf-8")
    script = _block(text, "by-hand") + _block(text, "by-hand-hardened")
    for port in ("8700", "8000", "8001"):
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    # the README's last step stops the collector after a look at the dashboard
    return "set -u\n" + script + "kill $COLLECTOR; wait $COLLECTOR\n"


@pytest.mark.skipif(sys.platform != "linux", reason="the README's shell is bash on Linux")
def test_the_incident_by_hand_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    env["PYTHONUNBUFFERED"] = "1"
    r = subprocess.run(
        ["bash", "-c", _script()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    work = tmp_path / "by-hand"

    # legacy: the verifier found leaks, the card says UNSAFE, the engines said where they report
    assert "kvwatch verify: FAIL" in out and "kvwatch verify: PASS" in out, out
    assert "**UNSAFE: cross-tenant leak at ≥" in out, out
    assert "**verified safe context 2,048 tokens on" in out, out
    assert "reporting to http://127.0.0.1:" in (work / "legacy.log").read_text()
    # hardened: the over-pool prompt is refused in OpenAI's shape
    assert '"code":"context_length_exceeded"' in out, out
    assert "notify by" in out and "Art. 33(2)" in out and "lab-legacy" in out

    db = Database(f"sqlite:///{work / 'by-hand.db'}")
    try:
        with db.read() as conn:
            alerts = {
                (a.rule, a.deployment_id): (a.state, a.severity, json.loads(a.labels))
                for a in conn.execute(select(m.Alert))
            }
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
    for rule in ("stale_page_read", "verification_failed"):
        state, severity, _ = alerts[(rule, "lab-legacy")]
        assert (state, severity) == ("firing", "critical"), alerts
    # the fixed engine still has the small pool (a warning of its own), but no isolation alert
    isolation = {"stale_page_read", "verification_failed", "rejected_prefill_kv_transfer"}
    assert not [k for k in alerts if k[1] == "lab-hardened" and k[0] in isolation], alerts
    (incident,) = incidents
    assert incident.deployment_id == "lab-legacy" and incident.state == "open"

    (pdf,) = (work / "breach").glob("breach-*.pdf")
    text = "\n".join(p.extract_text() for p in pypdf.PdfReader(io.BytesIO(pdf.read_bytes())).pages)
    assert "lab-legacy" in text and "globex" in text and "acme" in text
    assert "merger" not in text and "Initech" not in text  # never the prompt's text
