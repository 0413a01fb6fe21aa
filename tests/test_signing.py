"""Signed reports end to end: a breach report generated through the CLI and the API is
signed (Ed25519 JWS beside its files), and `kvwatch report verify` catches a forged JSON, CSV
and PDF, naming what changed; keys rotate without breaking old signatures; an unknown key
fails; the signing key set is served to a reader."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pypdfium2
import pytest
from typer.testing import CliRunner

from collector.reports.breach_model import from_document
from collector.reports.breach_pdf import render_pdf
from collector.signing import KeyRing, key_dir, verify
from collector.timefmt import iso, parse_iso
from kvwatch.cli import app as cli
from tests.conftest import Collector
from tests.test_report_breach import Env, env_of

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    """A real incident (globex read acme's KV pages), as the breach report tests make it."""
    yield from env_of(collector)


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def _breach(env: Env, out: Path) -> dict[str, Path]:
    code, output = _run(
        "report",
        "breach",
        "--incident",
        str(env.incident_id),
        "--out",
        str(out),
        "--database-url",
        env.c.db_url,
    )
    assert code == 0, output
    paths = {Path(x).suffix: Path(x) for x in output.split()}
    assert set(paths) == {".json", ".csv", ".pdf", ".sig"}
    return paths


def _verify(env: Env, *paths: Path, keys: Path | None = None) -> tuple[int, str]:
    where = ["--keys", str(keys)] if keys else ["--database-url", env.c.db_url]
    return _run("report", "verify", *map(str, paths), *where)


def _keys(env: Env) -> KeyRing:
    return KeyRing(key_dir(env.c.db_url, None))


def test_a_signed_report_verifies_and_its_forgeries_do_not(env: Env, tmp_path: Path) -> None:
    p = _breach(env, tmp_path)
    code, out = _verify(env, p[".json"], p[".csv"], p[".pdf"])
    assert code == 0, out
    assert out.count("intact:") == 3 and "signed by key" in out and "(current)" in out
    doc = json.loads(p[".json"].read_text())
    claims = verify(p[".sig"].read_text(), _keys(env).public_set()).claims
    assert claims["sub"] == f"report:{doc['report_id']}"
    assert claims["conclusions"]["timeline.deadline_at"] == doc["timeline"]["deadline_at"]
    assert claims["conclusions"]["art34.verdict"] == doc["art34"]["verdict"]
    assert claims["conclusions"]["account"] == doc["account"]

    # the API serves the same bytes the signature covers, and the signature itself
    rid = doc["report_id"]
    api = tmp_path / "api"
    api.mkdir()
    for fmt in ("json", "csv", "pdf"):
        r = env.admin.get(f"/v1/reports/{rid}", params={"format": fmt})
        assert r.status_code == 200, r.text
        (api / f"breach-{rid}.{fmt}").write_bytes(r.content)
    r = env.admin.get(f"/v1/reports/{rid}/signature")
    assert r.status_code == 200 and r.text == p[".sig"].read_text()
    (api / f"breach-{rid}.sig").write_text(r.text)
    code, out = _verify(env, *sorted(api.glob("*.[jcp][sd]*")))
    assert code == 0 and out.count("intact:") == 3, out

    # forged JSON: deadline moved three days later, Art. 34 flipped to "no"
    deadline = doc["timeline"]["deadline_at"]
    later = iso(parse_iso(deadline) + timedelta(days=3))
    forged = json.loads(p[".json"].read_text())
    forged["timeline"]["deadline_at"] = later
    forged["art34"]["verdict"] = "no"
    p[".json"].write_text(json.dumps(forged, indent=2, sort_keys=True) + "\n")
    code, out = _verify(env, p[".json"])
    print(out)
    assert code == 1 and "ALTERED" in out
    assert f'timeline.deadline_at: signed "{deadline}", file says "{later}"' in out
    assert f'art34.verdict: signed "{doc["art34"]["verdict"]}", file says "no"' in out

    # forged PDF: rendered again from the forged JSON
    p[".pdf"].write_bytes(render_pdf(from_document(forged)))
    code, out = _verify(env, p[".pdf"])
    print(out)
    assert code == 1 and "ALTERED" in out
    assert f"timeline.deadline_at: the PDF no longer shows 'Art. 33 deadline {deadline}'" in out
    assert "art34.verdict: the PDF no longer shows" in out
    pdfium = pypdfium2.PdfDocument(p[".pdf"].read_bytes())
    pdfium.close()

    # forged CSV: one row deleted (with the JSON put back, the rows are recounted)
    p[".json"].write_bytes(
        json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n"
    )
    lines = p[".csv"].read_text().splitlines(keepends=True)
    gone = lines.pop(-1)
    p[".csv"].write_text("".join(lines))
    code, out = _verify(env, p[".csv"])
    print(out)
    assert code == 1 and "ALTERED" in out
    assert f"request(s) the report lists are missing or changed: {gone.split(',')[1]}" in out
    assert "rows differ (file" in out
