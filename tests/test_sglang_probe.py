"""The SGLang probe end to end: real SGLang classes in ``.venv-sglang`` (a subprocess
running ``tests/engines/sglang/sglang_incident.py``), the probe configured from the
``KVWATCH_*`` environment, a real collector, its read API.

Without ``.venv-sglang`` these tests skip (``make engines`` builds it); with ``CI`` set they
fail instead.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
SCENARIO = ROOT / "tests" / "engines" / "sglang" / "sglang_incident.py"

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _sglang_venv() -> None:
    if not (ROOT / ".venv-sglang" / ".kvwatch-installed").exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-sglang is missing (make engines builds it)")
        pytest.skip(".venv-sglang is missing: `make engines` builds it")


@pytest.fixture
def lab(collector: Any) -> Any:
    """Both scenarios in one subprocess (SGLang's imports cost most of its time): the
    incident under deployment ``lab-incident``, the clean run under ``lab-clean``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
    env.update(
        KVWATCH_COLLECTOR_URL=collector.url,
        KVWATCH_INGEST_TOKEN=collector.ingest,
        KVWATCH_DEPLOYMENT_ID="lab",
        KVWATCH_PROBE_FLUSH_INTERVAL_S="0.05",
    )
    done = subprocess.run(
        [str(SGLANG_PY), str(SCENARIO), "incident", "clean"],
        env=env,
        cwd=SCENARIO.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return collector


def get_items(collector: Any, path: str, deployment: str) -> list[dict[str, Any]]:
    with collector.client(collector.admin) as http:
        reply = http.get(path, params={"deployment_id": deployment})
    assert reply.status_code == 200, reply.text
    return list(reply.json()["items"])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_incident_is_a_cross_tenant_stale_read_and_the_clean_run_is_not(lab: Any) -> None:
    events = get_items(lab, "/v1/page-events", "lab-incident")
    stale = [e for e in events if e["kind"] == "page.stale_read"]
    exposing = [e for e in stale if e["other_tenant"] is not None]
    assert [(e["tenant"], e["other_tenant"], e["cross_tenant"]) for e in exposing] == [
        ("tenant-b", "tenant-a", True)
    ]
    assert exposing[0]["request_id"] == "b-1" and exposing[0]["other_request_id"] == "a-1"
    rejected = [
        r for r in get_items(lab, "/v1/requests", "lab-incident") if r["request_id"] == "b-1"
    ]
    assert [r["prompt_tokens"] for r in rejected] == [39]

    clean = get_items(lab, "/v1/page-events", "lab-clean")
    assert [e for e in clean if e["kind"] == "page.stale_read"] == []
    requests = {r["request_id"] for r in get_items(lab, "/v1/requests", "lab-clean")}
    assert requests == {"a-1", "b-1"}
