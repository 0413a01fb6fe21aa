"""docs/using.md's probe snippet, run as written against a real collector: with a wrong token or
a URL that is no collector it says so once as an ERROR naming the setting, and the snippet's
check of ``shutdown()`` makes it fail instead of exiting 0 with the event gone (issue 21,
item 5); with the right settings it stores the event."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import Collector

ROOT = Path(__file__).resolve().parents[1]


def _snippet() -> str:
    page = (ROOT / "docs" / "using.md").read_text()
    after = page.split("needs two settings and one call:", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)  # type: ignore[union-attr]


def _run(url: str, token: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVWATCH_COLLECTOR_URL=url, KVWATCH_INGEST_TOKEN=token,
               KVWATCH_DEPLOYMENT_ID="snippet-dep", KVWATCH_PROBE_BACKOFF_MAX_S="0.2")  # fmt: skip
    env.pop("KVWATCH_PROBE_SPOOL_DIR", None)
    code = "import logging; logging.basicConfig(level=logging.WARNING)\n" + _snippet()
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the backend plays no part
def test_the_documented_probe_snippet_fails_loudly_on_configuration_errors(
    collector: Collector,
) -> None:
    wrong_token = _run(collector.url, "kvw_ingest_not-a-real-token")
    assert wrong_token.returncode != 0, wrong_token.stderr
    errors = [ln for ln in wrong_token.stderr.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and "KVWATCH_INGEST_TOKEN" in errors[0], wrong_token.stderr
    assert "events lost" in wrong_token.stderr

    wrong_url = _run(f"{collector.url}/not-the-collector", collector.ingest)
    assert wrong_url.returncode != 0, wrong_url.stderr
    errors = [ln for ln in wrong_url.stderr.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and "KVWATCH_COLLECTOR_URL" in errors[0], wrong_url.stderr

    right = _run(collector.url, collector.ingest)
    assert right.returncode == 0, right.stderr
    with collector.client(collector.admin) as c:
        samples = c.get("/v1/pool-samples", params={"deployment_id": "snippet-dep"}).json()
    assert samples["items"], samples
    assert httpx.get(f"{collector.url}/healthz").status_code == 200
