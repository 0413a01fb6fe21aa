"""The quarterly review, end to end through the real collector (SQLite and PostgreSQL).

Requests go in through ``POST /v1/events`` over four weeks on two deployments (one verified
through ``POST /v1/verifications``, one measured against min(advertised, pool)); the review is
read through ``GET /v1/review`` (JSON, CSV, PDF) and ``kvwatch report review``, and every
figure (count, max, nearest-rank p99, weekly series) is checked against the database; the PDF
is read back (text) and rendered (pages not blank).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pypdf
import pypdfium2
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from collector import models as m
from collector.db import Database
from kvwatch.cli import app as cli
from tests import factories as f
from tests.conftest import Collector
from tests.pdf_helpers import assert_renders

T0 = f.T0
MODEL = "glm-5.3"
CHAT, RAG = "/v1/chat/completions", "/v1/rag"
SINCE = T0 - timedelta(hours=1)
UNTIL = T0 + timedelta(days=28)
WINDOW = {"since": SINCE.isoformat(), "until": UNTIL.isoformat()}


def _events() -> list[Any]:
    ev: list[Any] = [f.config(1), f.config(1, probe="probe-b", dep="glm-stage")]
    seq = {"probe-a": 1, "probe-b": 1}

    def req(rid: str, prompt: int, day: float, route: str, probe: str = "probe-a") -> None:
        seq[probe] += 1
        dep = "glm-prod" if probe == "probe-a" else "glm-stage"
        ev.append(
            f.admitted(
                seq[probe],
                rid,
                prompt=prompt,
                route=route,
                probe=probe,
                dep=dep,
                ts=T0 + timedelta(days=day),
            )
        )

    # outside the window: never counted
    req("old", 900_000, -2, CHAT)
    # chat on glm-prod: 1,000 .. 150,000 tokens, growing over four weeks (far below 80%)
    for i in range(1, 151):
        req(f"c{i}", 1000 * i, (i - 1) * 27.5 / 150, CHAT)
    # rag on glm-prod: 100 small prompts and one at 82% of the pool: highlighted by its max
    for i in range(100):
        req(f"r{i}", 50_000 + i, i / 5, RAG)
    req("r-big", 560_000, 25, RAG)
    # chat on glm-stage, verified at 200,000: p99 at 85% of it
    for i in range(100):
        req(f"s{i}", 160_000 + 100 * i, i / 4, CHAT, probe="probe-b")
    return ev


@pytest.fixture
def admin(collector: Collector) -> Iterator[httpx.Client]:
    with collector.client(collector.ingest) as ingest:
        events = _events()
        for probe in ("probe-a", "probe-b"):  # a batch comes from one probe
            batch = [f.as_json(e) for e in events if e.probe_id == probe]
            r = ingest.post("/v1/events", json=batch)
            assert r.status_code == 200, r.text
    h = collector.client(collector.admin)
    r = h.post(
        "/v1/verifications",
        json={
            "deployment_id": "glm-stage",
            "model_id": MODEL,
            "passed": True,
            "verified_safe_context": 200_000,
        },
    )
    assert r.status_code == 201, r.text
    yield h
    h.close()


def _db_figures(db_url: str) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(deployment, route) -> (count, max, nearest-rank p99), straight from the table."""
    db = Database(db_url)
    try:
        with db.read() as conn:
            rows = conn.execute(
                select(m.Request.deployment_id, m.Request.route, m.Request.prompt_tokens).where(
                    m.Request.first_ts >= SINCE, m.Request.first_ts < UNTIL
                )
            ).all()
    finally:
        db.dispose()
    groups: dict[tuple[str, str], list[int]] = {}
    for dep, route, p in rows:
        groups.setdefault((dep, route), []).append(p)
    return {k: (len(v), max(v), sorted(v)[math.ceil(0.99 * len(v)) - 1]) for k, v in groups.items()}


def test_review_figures_against_the_database(collector: Collector, admin: httpx.Client) -> None:
    r = admin.get("/v1/review", params=WINDOW)
    assert r.status_code == 200, r.text
    doc = r.json()
    rows = {(x["deployment_id"], x["route"]): x for x in doc["rows"]}
    expected = _db_figures(collector.db_url)
    assert (
        set(rows) == set(expected) == {("glm-prod", CHAT), ("glm-prod", RAG), ("glm-stage", CHAT)}
    )
    for key, (count, mx, p99) in expected.items():
        row = rows[key]
        assert (row["requests"], row["max_prompt_tokens"], row["p99_prompt_tokens"]) == (
            count,
            mx,
            p99,
        ), key
        weeks = row["trend"]["weeks"]
        assert sum(w["requests"] for w in weeks) == count
        assert max(w["max"] for w in weeks) == mx
    chat, rag, stage = rows[("glm-prod", CHAT)], rows[("glm-prod", RAG)], rows[("glm-stage", CHAT)]
    assert (chat["requests"], chat["max_prompt_tokens"], chat["p99_prompt_tokens"]) == (
        150,
        150_000,
        149_000,
    )
    assert (rag["max_prompt_tokens"], rag["p99_prompt_tokens"]) == (560_000, 50_099)
    # thresholds: unverified min(advertised 1,048,576, pool 681,280); verified 200,000
    assert (chat["safe_context"], chat["verified"]) == (681_280, False)
    assert (stage["safe_context"], stage["verified"]) == (200_000, True)
    # highlighting at 80%: rag by its max (82%), stage by max and p99 (>= 85%), chat not
    assert rag["highlighted"] and rag["max_ratio"] >= 0.8 > rag["p99_ratio"]
    assert stage["highlighted"] and stage["p99_ratio"] >= 0.8
    assert not chat["highlighted"] and chat["max_ratio"] < 0.8
    assert doc["totals"] == {"requests": 351, "lost_requests": 0, "routes": 3, "highlighted": 2}
    # trend: four weekly points, chat growing ~35,000 tokens a week
    assert len(chat["trend"]["weeks"]) == 4
    assert 30_000 < chat["trend"]["max_slope_per_week"] < 40_000
    assert chat["trend"]["p99_slope_per_week"] > 0

    # CSV: one row per route and model, the same figures
    r = admin.get("/v1/review", params={**WINDOW, "format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    got = {(x["deployment_id"], x["route"]): x for x in csv.DictReader(io.StringIO(r.text))}
    assert set(got) == set(expected)
    for key, (count, mx, p99) in expected.items():
        assert (int(got[key]["requests"]), int(got[key]["max_prompt_tokens"])) == (count, mx)
        assert int(got[key]["p99_prompt_tokens"]) == p99
        assert got[key]["highlighted"] == str(rows[key]["highlighted"])

    # one deployment only
    only = admin.get("/v1/review", params={**WINDOW, "deployment_id": "glm-stage"}).json()
    assert [(x["deployment_id"], x["route"]) for x in only["rows"]] == [("glm-stage", CHAT)]


def _pdf_text(pdf: bytes, report_id: str) -> str:
    reader = pypdf.PdfReader(io.BytesIO(pdf))
    texts = [" ".join((p.extract_text() or "").split()) for p in reader.pages]
    assert len(texts) >= 2
    for i, t in enumerate(texts, 1):
        assert report_id in t, f"page {i} lacks the report id"
        assert f"page {i} of {len(texts)}" in t
    doc = pypdfium2.PdfDocument(pdf)
    try:
        for page in doc:
            img = page.render(scale=0.4).to_pil().convert("L")
            assert sum(img.histogram()[:200]) > 200, "a rendered page is blank"
    finally:
        doc.close()
    return " ".join(texts)


def test_review_pdf_and_cli(collector: Collector, admin: httpx.Client, tmp_path: Path) -> None:
    r = admin.get("/v1/review", params={**WINDOW, "format": "pdf"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/pdf"
    rid = (
        r.headers["content-disposition"].split('"')[1].removeprefix("review-").removesuffix(".pdf")
    )
    text = _pdf_text(r.content, rid)
    for figure in ("150,000", "149,000", "560,000", "50,099", "681,280", "200,000", "351"):
        assert figure in text, figure
    assert "Highlighted routes" in text and "unverified" in text

    res = CliRunner().invoke(
        cli,
        [
            "report",
            "review",
            "--since",
            SINCE.isoformat(),
            "--until",
            UNTIL.isoformat(),
            "--out",
            str(tmp_path),
            "--database-url",
            collector.db_url,
        ],
    )
    assert res.exit_code == 0, res.output
    paths = [Path(p) for p in res.stdout.split()]
    assert [p.suffix for p in paths] == [".json", ".csv", ".pdf", ".sig"]
    doc = json.loads(paths[0].read_text())
    assert doc["totals"] == {"requests": 351, "lost_requests": 0, "routes": 3, "highlighted": 2}
    assert len(paths[1].read_text().splitlines()) == 4  # header + 3 rows
    assert "560,000" in _pdf_text(paths[2].read_bytes(), doc["report_id"])

    # signed: the three files verify; an edited total is named
    keys = ["--database-url", collector.db_url]
    ok = CliRunner().invoke(cli, ["report", "verify", *map(str, paths[:3]), *keys])
    assert ok.exit_code == 0 and ok.output.count("intact:") == 3, ok.output
    paths[0].write_text(json.dumps({**doc, "totals": {**doc["totals"], "highlighted": 0}}))
    bad = CliRunner().invoke(cli, ["report", "verify", str(paths[0]), *keys])
    assert bad.exit_code == 1, bad.output
    assert "totals.highlighted: signed 2, file says 0" in bad.output


def test_review_bad_window_and_default(collector: Collector, admin: httpx.Client) -> None:
    r = admin.get("/v1/review", params={"since": UNTIL.isoformat(), "until": SINCE.isoformat()})
    assert r.status_code == 422, r.text
    assert "inverted window" in r.text
    r = admin.get("/v1/review", params={**WINDOW, "bogus": "1"})
    assert r.status_code == 422 and "bogus" in r.text
    res = CliRunner().invoke(
        cli,
        [
            "report",
            "review",
            "--since",
            UNTIL.isoformat(),
            "--until",
            SINCE.isoformat(),
            "--out",
            "/nonexistent-never-written",
            "--database-url",
            collector.db_url,
        ],
    )
    assert res.exit_code == 2 and "inverted window" in res.output, res.output
    # default: the 90 days before now (the factory data is older: nothing in it)
    doc = admin.get("/v1/review").json()
    sc = doc["scope"]
    assert sc["weeks"] == 13
    until = sc["until"].replace("Z", "+00:00")
    since = sc["since"].replace("Z", "+00:00")
    from datetime import datetime

    assert datetime.fromisoformat(until) - datetime.fromisoformat(since) == timedelta(days=90)


def test_a_review_is_stored_audited_and_served_like_a_breach_report(
    collector: Collector, admin: httpx.Client
) -> None:
    r = admin.post("/v1/reports", json={"kind": "review", **WINDOW})
    assert r.status_code == 201, r.text
    made = r.json()
    rid = made["report_id"]
    assert rid.startswith("rev_") and made["kind"] == "review"
    doc = admin.get(f"/v1/reports/{rid}").json()
    assert doc["totals"] == {"requests": 351, "lost_requests": 0, "routes": 3, "highlighted": 2}
    # The stored evidence hash is recomputable from the stored body.
    from collector.reports.review import review_digest

    assert review_digest(doc) == made["evidence_sha256"] == doc["evidence_sha256"]
    rows = list(csv.DictReader(io.StringIO(admin.get(f"/v1/reports/{rid}?format=csv").text)))
    assert len(rows) == 3
    pdf = admin.get(f"/v1/reports/{rid}", params={"format": "pdf"})
    assert pdf.headers["content-type"] == "application/pdf"
    assert "560,000" in _pdf_text(pdf.content, rid)
    listed = admin.get("/v1/reports", params={"kind": "review"}).json()["items"]
    assert [x["report_id"] for x in listed] == [rid]
    assert listed[0]["evidence_sha256"] == made["evidence_sha256"]
    audit = admin.get("/v1/audit/verify").json()
    assert audit["ok"] is True
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            subjects = conn.execute(
                select(m.AuditEntry.subject).where(m.AuditEntry.action == "report.generate")
            ).scalars()
            assert f"report:{rid}" in set(subjects)
    finally:
        db.dispose()
    # A breach-only parameter is refused, naming it; nothing is stored.
    r = admin.post("/v1/reports", json={"kind": "review", "model_id": MODEL, **WINDOW})
    assert r.status_code == 422 and "model_id" in r.text
    assert len(admin.get("/v1/reports").json()["items"]) == 1


def test_review_chart_axes_fit_the_data(collector: Collector, admin: httpx.Client) -> None:
    """A one-week review: each highlighted route's chart spans that week, not the two years
    either side that a single point gets by default."""
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    from collector.reports.review_pdf import chart_figure

    week_end = SINCE + timedelta(days=7)
    doc = admin.get(
        "/v1/review", params={"since": SINCE.isoformat(), "until": week_end.isoformat()}
    )
    high = [r for r in doc.json()["rows"] if r["highlighted"]]
    assert high and all(len(r["trend"]["weeks"]) == 1 for r in high)
    for row in high:
        fig = chart_figure(row, week_end)
        assert fig is not None
        try:
            lo, hi = (mdates.num2date(v) for v in fig.axes[0].get_xlim())
        finally:
            plt.close(fig)
        assert SINCE - timedelta(days=1) <= lo and hi <= week_end + timedelta(days=1), (lo, hi)
    pdf = admin.get(
        "/v1/review",
        params={"since": SINCE.isoformat(), "until": week_end.isoformat(), "format": "pdf"},
    )
    assert pdf.status_code == 200 and "Highlighted routes" in _pdf_text(
        pdf.content,
        pdf.headers["content-disposition"]
        .split('"')[1]
        .removeprefix("review-")
        .removesuffix(".pdf"),
    )


def test_review_leads_with_incidents_and_not_with_a_refusal(collector: Collector) -> None:
    """glm-prod leaked (a stale page read opened an incident); glm-stage refused two prompts
    past its pool, as it should. The review lists the incident first, puts glm-prod's rows
    first, and highlights nothing on glm-stage: a refused prompt never occupied the context."""
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    prod = [f.config(1, ts=now), f.admitted(2, "p1", prompt=5_000, ts=now)]
    prod.append(f.stale_read(3, ts=now))
    stage = [
        f.config(1, probe="probe-b", dep="glm-stage", ts=now),
        f.admitted(2, "s1", prompt=1_000, probe="probe-b", dep="glm-stage", ts=now),
        f.rejected(3, "s2", prompt=700_000, probe="probe-b", dep="glm-stage", ts=now),
        f.rejected(4, "s3", prompt=900_000, probe="probe-b", dep="glm-stage", ts=now),
    ]
    with collector.client(collector.ingest) as ingest:
        for batch in (stage, prod):  # stage first: its rows must not lead by name alone
            r = ingest.post("/v1/events", json=[f.as_json(e) for e in batch])
            assert r.status_code == 200, r.text
    window = {
        "since": (now - timedelta(hours=1)).isoformat(),
        "until": (now + timedelta(hours=1)).isoformat(),
    }
    with collector.client(collector.admin) as admin:
        (inc,) = admin.get("/v1/incidents").json()
        doc = admin.get("/v1/review", params=window).json()
        pdf = admin.get("/v1/review", params={**window, "format": "pdf"})
    assert [(i["id"], i["deployment_id"], i["state"]) for i in doc["incidents"]] == [
        (inc["id"], "glm-prod", "open")
    ]
    assert doc["incidents"][0]["deadline_at"] and doc["incidents"][0]["opened_at"]
    assert doc["rows"][0]["deployment_id"] == "glm-prod"
    stage_rows = [r for r in doc["rows"] if r["deployment_id"] == "glm-stage"]
    assert sum(r["requests"] for r in stage_rows) == 3
    assert sum(r["refused_requests"] for r in stage_rows) == 2
    assert {r["max_prompt_tokens"] for r in stage_rows} <= {1_000, None}
    assert not any(r["highlighted"] for r in stage_rows)
    assert_renders(pdf.content)
    reader = pypdf.PdfReader(io.BytesIO(pdf.content))
    text = " ".join(" ".join((p.extract_text() or "").split()) for p in reader.pages)
    assert text.index("Incidents in the window") < text.index("p99 slope/wk")
    assert inc["title"] in text and "glm-prod" in text
