"""Breach assessment, end to end through the real collector (SQLite and PostgreSQL).

Factory events go in through ``POST /v1/events``; the default policy pack opens an incident on
the cross-tenant stale read; the report is generated through the API and the CLI, and every
figure is checked against the database: the JSON, the CSV of affected requests, and the audit
PDF read back (text per page, pages rendered and checked not blank).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pypdf
import pypdfium2
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput
from collector.reports.breach import BreachScope, BreachService, evidence_digest
from collector.reports.breach_model import UnreadableReport, from_document, to_document
from collector.reports.breach_pdf import render_pdf
from collector.reports.stored import ReportStore
from collector.settings import Settings
from engine_probe import events as ev
from kvwatch.cli import app as cli
from tests import factories as f
from tests.conftest import DPO_CONTACT, Collector
from tests.pdf_helpers import assert_renders

T0 = f.T0
MODEL = "glm-5.3"


@dataclass
class Env:
    c: Collector
    admin: httpx.Client
    db: Database
    incident_id: int


def _events() -> list[Any]:
    return [
        f.config(1),
        f.config(2, role="decode", node="decode-0", pool_tokens=2_000_000),
        f.pool(3, used=200_000),
        f.admitted(4, "r-exposed", tenant="acme", prompt=5_000, data_categories=["health"]),
        f.finished(5, "r-exposed", tenant="acme"),
        f.admitted(6, "r-bystander", tenant="initech", prompt=3_000),
        f.finished(7, "r-bystander", tenant="initech"),
        f.pool(8, used=681_000),
        f.rejected(9, "r-victim", tenant="globex", data_categories=["contact"]),
        f.stale_read(10),  # globex read acme's pages
        f.pool(11, used=10_000),
    ]


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    yield from env_of(collector)


def env_of(collector: Collector) -> Iterator[Env]:
    """The incident every test here reads (also the signing and case-file tests')."""
    admin = collector.client(collector.admin)
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in _events()])
        assert r.status_code == 200, r.text
    (inc,) = admin.get("/v1/incidents").json()
    db = Database(collector.db_url)
    yield Env(collector, admin, db, inc["id"])
    admin.close()
    db.dispose()


def _pdf_checks(pdf: bytes, report: dict[str, Any]) -> str:
    reader = pypdf.PdfReader(io.BytesIO(pdf))
    texts = [" ".join((p.extract_text() or "").split()) for p in reader.pages]
    assert len(texts) >= 3
    for i, t in enumerate(texts, 1):
        assert report["report_id"] in t, f"page {i} lacks the report id"
        assert f"page {i} of {len(texts)}" in t
    assert report["evidence_sha256"] in texts[0]
    doc = pypdfium2.PdfDocument(pdf)
    try:
        for page in doc:
            img = page.render(scale=0.4).to_pil().convert("L")
            dark = sum(img.histogram()[:200])
            assert dark > 200, "a rendered page is blank"
    finally:
        doc.close()
    return " ".join(texts)


def test_incident_report_through_the_api(env: Env) -> None:
    r = env.admin.post("/v1/reports", json={"kind": "breach", "incident_id": env.incident_id})
    assert r.status_code == 201, r.text
    rid = r.json()["report_id"]
    assert rid.startswith("rpt_")
    report = env.admin.get(f"/v1/reports/{rid}").json()

    # against the database
    with env.db.read() as conn:
        reads = conn.execute(
            select(m.PageEvent.request_id, m.PageEvent.other_request_id).where(
                m.PageEvent.kind == "page.stale_read"
            )
        ).all()
        named = {x for row in reads for x in row if x}
        tenants = dict(
            conn.execute(
                select(m.Request.request_id, m.Request.tenant).where(
                    m.Request.request_id.in_(named)
                )
            ).all()
        )
        stored = conn.execute(
            select(m.Report.sha256, m.Report.kind).where(m.Report.report_id == rid)
        ).one()
        entry = conn.execute(
            select(m.AuditEntry.action, m.AuditEntry.detail).where(
                m.AuditEntry.subject == f"report:{rid}"
            )
        ).one()
        assert audit.verify(conn).ok
    ar = report["affected_requests"]
    assert ar["count"] == len(named) == 2
    assert {x["request_id"]: x["tenant"] for x in ar["items"]} == tenants
    assert {x["request_id"]: x["role"] for x in ar["items"]} == {
        "r-victim": "reader",
        "r-exposed": "previous_writer",
    }
    assert ar["max_prompt_tokens"] == 700_000
    t = report["tenants"]
    assert [(x["tenant"], x["stale_reads"], x["receiving_tenants"]) for x in t["exposed"]] == [
        ("acme", 1, ["globex"])
    ]
    assert [(x["tenant"], x["requests"], x["exposed_tenants"]) for x in t["receiving"]] == [
        ("globex", 1, ["acme"])
    ]
    assert report["data_categories"] == {
        "affected": {"contact": 1, "health": 1},
        "exposed": {"health": 1},
        "exposed_undeclared": 0,
        "special": ["health"],
        "data_map": None,
        "data_subjects": None,
        "population": None,
    }
    # tenants are customers, not data subjects: labelled counts, subjects unknown
    assert (t["exposed_count"], t["exposed_requests"]) == (1, 1)
    assert (t["receiving_count"], t["receiving_requests"]) == (1, 1)
    (sr,) = report["stale_reads"]["items"]
    assert (sr["reader_tenant"], sr["previous_tenant"], sr["pages"]) == (
        "globex",
        "acme",
        [3, 4, 5],
    )
    assert sr["ts"] == "2026-08-27T12:00:10Z"
    (dep,) = report["deployments"]
    assert dep["deployment_id"] == "glm-prod"
    assert [c["pool_capacity_tokens"] for c in dep["configs"]] == [681_280, 2_000_000]
    assert dep["safe_context"] == 681_280 and dep["verifications"] == []
    tl = report["timeline"]
    assert tl["first_event_at"] == "2026-08-27T12:00:04Z"
    assert tl["last_event_at"] == "2026-08-27T12:00:10Z"
    assert tl["late"] is False and tl["late_reason"] is None
    assert _when(tl["deadline_at"]) - _when(tl["awareness_at"]) == timedelta(hours=72)
    checklist = {x["key"]: x for x in report["checklist"]}
    # the collector's KVWATCH_DPO_CONTACT (tests/conftest.py), as Art. 33(3)(b) asks
    assert checklist["contact"]["needs_person"] is False
    assert checklist["contact"]["value"] == DPO_CONTACT
    # the records concerned are the exposed ones (r-exposed), never the request that read them
    assert checklist["records"]["value"].startswith("1 exposed request (a prompt whose")
    assert "Counted apart: 1 receiving request that read it" in checklist["records"]["value"]
    assert checklist["records"]["needs_person"] is False
    steps = [x["step"] for x in report["cause"]]
    assert steps == ["pool_below_advertised", "prefill_rejected", "stale_read_cross_tenant"]
    assert (
        "681,280 tokens, smaller than the advertised context 1,048,576"
        in (report["cause"][0]["text"])
    )
    assert "globex" in report["account"] and "acme" in report["account"]
    assert "Art. 34 high risk: yes" in report["account"]
    assert report["art34"]["high_risk"] is True and report["art34"]["verdict"] == "yes"
    assert "health" in report["art34"]["reasons"][0]
    assert checklist["subjects"]["value"].startswith("unknown")
    assert checklist["subjects"]["needs_person"] is True
    assert report["series"]["stale_reads"] == [{"ts": _series_ts(report), "value": 1.0}]
    # the evidence hash, stored and audited
    assert report["evidence_sha256"] == evidence_digest(report) == stored.sha256
    assert stored.kind == "breach"
    assert entry.action == "report.generate"
    assert json.loads(entry.detail)["sha256"] == stored.sha256

    # CSV: one row per affected request
    c = env.admin.get(f"/v1/reports/{rid}", params={"format": "csv"})
    assert c.status_code == 200 and c.headers["content-type"].startswith("text/csv")
    head, body = c.text.split("\n", 1)
    assert head == f"# kvwatch breach report {rid} evidence_sha256={report['evidence_sha256']}"
    rows = list(csv.DictReader(io.StringIO(body)))
    assert {(x["request_id"], x["tenant"]) for x in rows} == set(tenants.items())
    assert {x["request_id"]: x["data_categories"] for x in rows}["r-exposed"] == "health"

    # PDF
    p = env.admin.get(f"/v1/reports/{rid}", params={"format": "pdf"})
    assert p.status_code == 200 and p.headers["content-type"] == "application/pdf"
    text = _pdf_checks(p.content, report)
    assert re.search(r"Affected requests\s*2\b", text)
    assert re.search(r"Largest prompt \(tokens\)\s*700,000", text)
    assert re.search(
        r"1 \(1 cross-tenant\); 3 pages read, of which 3 held another tenant's data", text
    )
    assert re.search(r"Exposed tenants\s*1\b", text) and re.search(r"Receiving tenants\s*1\b", text)
    assert re.search(r"Art. 34 high risk\s*yes", text)
    assert tl["deadline_at"] in text
    assert "NEEDS A PERSON" in text and "r-victim" in text and "r-exposed" in text
    assert "What happened" in text and "Cause chain, in order" in text
    assert "3-5 (3 pages)" in text  # page lists as ranges, never cut mid-list
    assert "pool below advertised" in text and "prefill rejected" in text


def test_window_report_through_the_cli(env: Env, tmp_path: Path) -> None:
    since, until = T0, T0 + timedelta(hours=1)
    res = CliRunner().invoke(
        cli,
        [
            "report",
            "breach",
            "--model",
            MODEL,
            "--since",
            since.isoformat(),
            "--until",
            until.isoformat(),
            "--min-prompt-tokens",
            "4000",
            "--out",
            str(tmp_path),
            "--database-url",
            env.c.db_url,
        ],
    )
    assert res.exit_code == 0, res.output
    paths = [Path(x) for x in res.output.split()]
    assert [x.suffix for x in paths] == [".json", ".csv", ".pdf", ".sig"]
    assert all(x.exists() for x in paths)
    report = json.loads(paths[0].read_text())
    with env.db.read() as conn:
        expected = conn.execute(
            select(func.count()).where(m.Request.model_id == MODEL, m.Request.prompt_tokens >= 4000)
        ).scalar()
        assert (
            conn.execute(
                select(func.count()).where(m.Report.report_id == report["report_id"])
            ).scalar()
            == 1
        )
    assert report["mode"] == "window"
    assert report["affected_requests"]["count"] == expected == 2
    assert {x["role"] for x in report["affected_requests"]["items"]} == {"in_window"}
    assert report["tenants"]["exposed_count"] == 1
    assert report["timeline"]["deadline_at"] is None
    assert report["evidence_sha256"] == evidence_digest(report)
    rows = list(csv.DictReader(io.StringIO(paths[1].read_text().split("\n", 1)[1])))
    assert sorted(x["request_id"] for x in rows) == ["r-exposed", "r-victim"]

    # kvwatch report verify: intact as written; an edited CSV or JSON is caught
    keys = ["--database-url", env.c.db_url]  # the published keys: the collector's
    for p in paths[:2]:
        ok = CliRunner().invoke(cli, ["report", "verify", str(p), *keys])
        assert ok.exit_code == 0 and "intact" in ok.output, ok.output
    paths[1].write_text(paths[1].read_text().replace("r-victim", "r-someone"))
    bad = CliRunner().invoke(cli, ["report", "verify", str(paths[1]), *keys])
    assert bad.exit_code == 1 and "not the affected-request list" in bad.output
    edited = dict(report, affected_requests=dict(report["affected_requests"], count=1))
    paths[0].write_text(json.dumps(edited))
    bad = CliRunner().invoke(cli, ["report", "verify", str(paths[0]), *keys])
    assert (
        bad.exit_code == 1 and "ALTERED" in bad.output and report["evidence_sha256"] in bad.output
    )
    assert "affected_requests.count: signed 2, file says 1" in bad.output
    gone = CliRunner().invoke(cli, ["report", "verify", str(tmp_path / "nope.csv")])
    assert gone.exit_code == 2 and "nope.json" in gone.output
    text = _pdf_checks(paths[2].read_bytes(), report)
    assert re.search(r"Affected requests\s*2\b", text)

    # an inverted window: a clear error, exit 2, nothing written
    bad = CliRunner().invoke(
        cli,
        [
            "report",
            "breach",
            "--model",
            MODEL,
            "--since",
            until.isoformat(),
            "--until",
            since.isoformat(),
            "--out",
            str(tmp_path / "bad"),
            "--database-url",
            env.c.db_url,
        ],
    )
    assert bad.exit_code == 2
    assert "inverted window" in bad.output
    assert not (tmp_path / "bad").exists()

    # a time that is year 0 in UTC: a clear error naming the option, never a traceback
    for opt in ("--since", "--until"):
        args = {"--since": since.isoformat(), "--until": until.isoformat()}
        args[opt] = "0001-01-01T00:00:00+00:01"
        bad = CliRunner().invoke(
            cli,
            [
                *("report", "breach", "--model", MODEL),
                *(x for kv in args.items() for x in kv),
                *("--out", str(tmp_path / "bad"), "--database-url", env.c.db_url),
            ],
        )
        assert bad.exit_code == 2, bad.output
        assert opt in bad.output and "1-9999" in bad.output and bad.exception is not None
        assert isinstance(bad.exception, SystemExit)
        assert not (tmp_path / "bad").exists()


def test_two_generations_of_an_incident_give_one_evidence_hash(env: Env) -> None:
    """The scope names the incident's own window (open sides None), never the generation time:
    the same evidence hashes the same, and new evidence changes the hash."""
    later = datetime.now(UTC) + timedelta(minutes=5)
    service = BreachService(env.db, Settings(database_url=env.c.db_url))
    first = to_document(
        service.build(BreachScope(incident_id=env.incident_id), now=datetime.now(UTC))
    )
    second = to_document(service.build(BreachScope(incident_id=env.incident_id), now=later))
    assert first["report_id"] != second["report_id"]
    assert first["generated_at"] != second["generated_at"]
    assert first["evidence_sha256"] == second["evidence_sha256"]
    assert first["scope"]["since"] is None and first["scope"]["until"] is None  # open
    assert "1970" not in json.dumps(first["scope"])
    with env.c.client(env.c.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(f.stale_read(12, reader_request_id="r-x"))])
        assert r.status_code == 200, r.text
    third = to_document(service.build(BreachScope(incident_id=env.incident_id), now=later))
    assert third["evidence_sha256"] != first["evidence_sha256"]


def test_undeclared_categories_make_art34_undetermined_never_no(collector: Collector) -> None:
    """Absence of tags is not absence of risk: an exposed request with no declared data
    categories makes high risk undetermined, in the JSON and the PDF."""
    events = [e for e in _events() if not isinstance(e, ev.RequestAdmitted)]
    events += [
        f.admitted(4, "r-exposed", tenant="acme", prompt=5_000),
        f.admitted(6, "r-bystander", tenant="initech", prompt=3_000),
    ]
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text
    with collector.client(collector.admin) as admin:
        (inc,) = admin.get("/v1/incidents").json()
        rid = admin.post("/v1/reports", json={"kind": "breach", "incident_id": inc["id"]}).json()[
            "report_id"
        ]
        report = admin.get(f"/v1/reports/{rid}").json()
        pdf = admin.get(f"/v1/reports/{rid}", params={"format": "pdf"}).content
    a34 = report["art34"]
    assert a34["high_risk"] is None and a34["verdict"] == "undetermined"
    assert "declare no data categories" in a34["reasons"][0]
    assert report["data_categories"]["exposed_undeclared"] == 1
    text = _pdf_checks(pdf, report)
    assert re.search(r"Art. 34 high risk\s*undetermined", text)
    assert "High risk: undetermined" in text
    assert "unknown: 1 exposed request(s) declare no categories" in text


def test_a_data_map_declares_what_tags_do_not(collector: Collector, tmp_path: Path) -> None:
    """The same untagged incident, with a data map declaring special: [health] and a
    population of 1,200 persons for acme's route: high risk, and why. The population is stated
    as what it is (the persons behind the route), never as the persons concerned, which stay
    unknown: in the JSON, the checklist and the PDF. A bad map is a clear error naming file,
    line and field."""
    events = [e for e in _events() if not isinstance(e, ev.RequestAdmitted)]
    events += [f.admitted(4, "r-exposed", tenant="acme", prompt=5_000)]
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text
    datamap = tmp_path / "datamap.yaml"
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            (incident_id,) = conn.execute(select(m.Incident.id)).scalars().all()
        service = BreachService(db, Settings(database_url=collector.db_url, data_map=datamap))
        # population is the key; data_subjects, its earlier name, reads the same
        for key in ("population", "data_subjects"):
            datamap.write_text(
                "entries:\n"
                "  - tenant: acme\n"
                "    route: /v1/chat/completions\n"
                "    categories: [hr_records]\n"
                "    special: [health]\n"
                f"    {key}: 1200\n"
            )
            built = service.build(BreachScope(incident_id=incident_id), now=datetime.now(UTC))
            report = to_document(built)
            cats = report["data_categories"]
            assert cats["special"] == ["health"] and cats["exposed_undeclared"] == 0
            assert cats["exposed"] == {"health": 1, "hr_records": 1}
            assert (cats["population"], cats["data_subjects"]) == (1200, None)
            assert cats["data_map"] == str(datamap)
        assert report["art34"]["verdict"] == "yes" and "health" in report["art34"]["reasons"][0]
        subjects = {x["key"]: x for x in report["checklist"]}["subjects"]["value"]
        assert subjects.startswith("unknown: kvwatch stores no prompt text")
        assert (
            f"Declared population behind the exposed requests: 1,200 persons (data map "
            f"{datamap}): whose data that traffic carries, not the number concerned." in subjects
        )
        text = _pdf_checks(render_pdf(built), report)
        assert re.search(r"Data subjects concerned\s*unknown", text), text[:3000]
        assert re.search(r"Declared population\s*1,200 persons \(declared in the data map", text)
        assert not re.search(r"Data subjects\S*\s*1,200", text)
        assert re.search(r"Art. 34 high risk\s*yes", text)

        datamap.write_text("entries:\n  - tenant: acme\n    population: 5\n    data_subjects: 5\n")
        with pytest.raises(InvalidInput) as bad:
            service.build(BreachScope(incident_id=incident_id), now=datetime.now(UTC))
        assert "give population only" in str(bad.value)
        datamap.write_text("entries:\n  - categories: [x]\n    colour: red\n")
        with pytest.raises(InvalidInput) as bad:
            service.build(BreachScope(incident_id=incident_id), now=datetime.now(UTC))
        assert f"{datamap}:3" in str(bad.value) and "colour" in str(bad.value)
        datamap.write_text("entries:\n  - categories: [x]\n")
        with pytest.raises(InvalidInput) as bad:
            service.build(BreachScope(incident_id=incident_id), now=datetime.now(UTC))
        assert "at least one of tenant, route, model_id, deployment_id" in str(bad.value)
    finally:
        db.dispose()


def test_a_window_names_only_the_deployments_where_data_crossed(env: Env) -> None:
    """A deployment in the window whose long prompt was refused cleanly is in scope (its
    request is listed) but not involved in the breach."""
    hardened = [
        f.config(1, dep="lab-hardened", probe="p-h"),
        f.rejected(2, "r-refused", tenant="globex", dep="lab-hardened", probe="p-h"),
    ]
    with env.c.client(env.c.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in hardened])
        assert r.status_code == 200, r.text
    report = to_document(
        BreachService(env.db, Settings(database_url=env.c.db_url)).build(
            BreachScope(model_id=MODEL, since=T0, until=T0 + timedelta(hours=1)),
            now=datetime.now(UTC),
        )
    )
    assert {d["deployment_id"] for d in report["deployments"]} == {"glm-prod", "lab-hardened"}
    assert report["involved_deployments"] == ["glm-prod"]
    nature = {x["key"]: x for x in report["checklist"]}["nature"]["value"]
    assert "glm-prod" in nature and "lab-hardened" not in nature
    assert "lab-hardened" not in report["account"]


def test_late_report_asks_for_a_reason(env: Env, tmp_path: Path) -> None:
    """Late is judged from the notification register (a controller's notice sent after its
    due time), not from when the report is generated."""
    from collector.cases.decisions import DecisionService
    from collector.cases.notifications import NotificationService

    settings = Settings(
        database_url=env.c.db_url, dpo_contact="dpo@x.example", signing_key_dir=tmp_path
    )
    svc = BreachService(env.db, settings)
    with env.db.read() as conn:
        deadline = conn.execute(select(m.Incident.deadline_at)).scalar_one()
    unsent = to_document(
        svc.build(BreachScope(incident_id=env.incident_id), now=deadline + timedelta(hours=1))
    )
    assert unsent["timeline"]["late"] is False  # generated late, but nothing was sent late
    notices = NotificationService(env.db, settings)
    DecisionService(env.db).decide(
        env.incident_id,
        kind="containment",
        status="done",
        what="prompts above the pool refused",
        why="no further stale reads",
        by="on-call",
        now=deadline,
    )
    nid = notices.prepare(env.incident_id, "acme", by="a", now=deadline).notification.notice_id
    notices.step(nid, "approve", by="b", now=deadline)
    notices.step(nid, "send", by="b", channel="email", now=deadline + timedelta(minutes=1))
    late = to_document(
        svc.build(BreachScope(incident_id=env.incident_id), now=deadline + timedelta(hours=1))
    )
    assert late["timeline"]["late"] is True
    assert "needs a person" in late["timeline"]["late_reason"]
    contact = {x["key"]: x for x in late["checklist"]}["contact"]
    assert (contact["value"], contact["needs_person"]) == ("dpo@x.example", False)
    given = to_document(
        svc.build(
            BreachScope(incident_id=env.incident_id),
            now=deadline + timedelta(hours=1),
            late_reason="forensics took 80 hours",
        )
    )
    assert given["timeline"]["late_reason"] == "forensics took 80 hours"
    # the generation time is not evidence: the hash depends on the data only
    assert late["evidence_sha256"] == given["evidence_sha256"]


def test_bad_requests_get_clear_errors(env: Env) -> None:
    def post(body: dict[str, Any], client: httpx.Client | None = None) -> httpx.Response:
        return (client or env.admin).post("/v1/reports", json={"kind": "breach", **body})

    r = post({"incident_id": 424242})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "424242" in r.json()["error"]["message"]
    r = post({"model_id": MODEL, "since": "2026-08-28T00:00:00Z", "until": "2026-08-27T00:00:00Z"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input"
    assert "inverted window" in r.json()["error"]["message"]
    r = post({"model_id": MODEL})
    assert r.status_code == 422 and "since, until" in r.json()["error"]["message"]
    assert env.admin.post("/v1/reports", json={"kind": "nope"}).status_code == 422
    with env.c.client(env.c.ingest) as ingest:
        assert post({"incident_id": env.incident_id}, ingest).status_code == 403
    missing = env.admin.get("/v1/reports/rpt_doesnotexist")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    with env.db.read() as conn:
        assert conn.execute(select(func.count()).select_from(m.Report)).scalar() == 0


def _when(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(UTC)


def _series_ts(report: dict[str, Any]) -> str:
    (point,) = report["series"]["stale_reads"]
    return str(point["ts"])


def test_tenant_notices_name_no_one_else(env: Env, tmp_path: Path) -> None:
    """acme's data was read (r-exposed) by globex (r-victim). Each tenant's notice tells it
    what happened to its own requests; the receiving one is asked to delete what it got;
    neither names the other tenant or the other's request, in JSON, Markdown or the PDF."""
    r = env.admin.post("/v1/reports", json={"kind": "breach", "incident_id": env.incident_id})
    report = env.admin.get(f"/v1/reports/{r.json()['report_id']}").json()
    assert [(n["tenant"], n["kind"]) for n in report["notices"]] == [
        ("acme", "exposed"),
        ("globex", "received"),
    ]
    texts: dict[str, str] = {}
    for tenant, other, own, foreign in (
        ("acme", "globex", "r-exposed", "r-victim"),
        ("globex", "acme", "r-victim", "r-exposed"),
    ):
        for suffix in (".json", ".md", ".pdf"):
            out = tmp_path / f"notice-{tenant}{suffix}"
            res = CliRunner().invoke(
                cli,
                [
                    *("report", "notice", "--incident", str(env.incident_id)),
                    *("--tenant", tenant, "--out", str(out), "--database-url", env.c.db_url),
                ],
            )
            assert res.exit_code == 0, res.output
            if suffix == ".pdf":
                assert_renders(out.read_bytes())
                text = "\n".join(p.extract_text() for p in pypdf.PdfReader(out).pages)
            else:
                text = out.read_text()
            texts[f"{tenant}{suffix}"] = text
            assert own in text and "another customer" in text
            assert other not in text and foreign not in text, (tenant, suffix)
    acme = json.loads(texts["acme.json"])
    assert acme["kind"] == "exposed" and acme["please_delete"] is None
    (read,) = acme["your_requests_read_by_another"]
    # the extent in tokens, never pages
    assert (read["request_id"], read["prompt_tokens"]) == ("r-exposed", 5_000)
    assert "pages" not in read and acme["extent"]["your_prompt_tokens_read"] == 5_000
    globex = json.loads(texts["globex.json"])
    assert globex["kind"] == "received" and "delete" in globex["please_delete"]
    assert "Please delete" in texts["globex.pdf"] and "Please delete" not in texts["acme.pdf"]
    assert acme["role"] == "processor" and "Art. 33(2)" in acme["legal_basis"]

    # a tenant with nothing in the incident: a clear error, nothing written
    out = tmp_path / "notice-initech.pdf"
    res = CliRunner().invoke(
        cli,
        [
            *("report", "notice", "--incident", str(env.incident_id), "--tenant", "initech"),
            *("--out", str(out), "--database-url", env.c.db_url),
        ],
    )
    assert res.exit_code == 2 and "no request whose data crossed" in res.output
    assert not out.exists()
    with env.db.read() as conn:
        actions = conn.execute(
            select(m.AuditEntry.action).where(m.AuditEntry.action == "notice.draft")
        ).all()
    assert len(actions) == 6


def test_the_pdf_wraps_at_word_boundaries_and_explains_its_figures(
    collector: Collector, tmp_path: Path
) -> None:
    """Long tenant names and request ids are never broken mid-word (a cell too narrow for a
    word sets it smaller); every summary figure and the no-writer stale read are explained."""
    reader, victim = "massive-dynamic-holdings-international", "hooli-xyz-europe-subsidiary"
    reader_req, victim_req = "req-2026-12-02-0000000000123456", "req-2026-12-02-0000000000654321"
    events = [
        f.config(1),
        f.config(2, role="decode", node="decode-0", pool_tokens=2_000_000),
        f.admitted(3, victim_req, tenant=victim, prompt=5_000),
        f.finished(4, victim_req, tenant=victim),
        f.rejected(5, reader_req, tenant=reader),
        f.stale_read(
            6,
            reader_request_id=reader_req,
            reader_tenant=reader,
            previous_request_id=victim_req,
            previous_tenant=victim,
        ),
        f.stale_read(
            7,
            reader_request_id=reader_req,
            reader_tenant=reader,
            previous_request_id=None,
            previous_tenant=None,
            page_ids=list(range(10, 742)),
        ),
    ]
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in events])
        assert r.status_code == 200, r.text
    with collector.client(collector.admin) as admin:
        (inc,) = admin.get("/v1/incidents").json()
        created = admin.post("/v1/reports", json={"kind": "breach", "incident_id": inc["id"]})
        rid = created.json()["report_id"]
        report = admin.get(f"/v1/reports/{rid}").json()
        pdf = admin.get(f"/v1/reports/{rid}", params={"format": "pdf"}).content
        notices = [
            admin.get(f"/v1/incidents/{inc['id']}/notice", params={"tenant": t, "format": "pdf"})
            for t in (reader, victim)
        ]
    (tmp_path / "long-names.pdf").write_bytes(pdf)  # for a person to look at
    assert_renders(pdf)  # nothing runs past a margin
    for notice in notices:
        assert notice.status_code == 200, notice.text
        assert_renders(notice.content)
    _pdf_checks(pdf, report)
    lines = [
        line
        for page in pypdf.PdfReader(io.BytesIO(pdf)).pages
        for line in (page.extract_text() or "").splitlines()
    ]
    for word in (reader, victim, reader_req, victim_req):
        assert any(word in line for line in lines), f"{word!r} is broken across lines"
    text = " ".join(" ".join(lines).split())
    for figure in (
        "Affected requests:",
        "Largest prompt:",
        "Stale reads:",
        "Exposed tenants, requests:",
        "Receiving tenants, requests:",
        "Data subjects concerned:",
        "Declared population:",
        "Special categories:",
        "never written / no one:",
        "10-741 (732 pages)",
    ):
        assert figure in text, figure
    assert "receiving tenant" in text and "victim tenant" not in text


def test_the_csv_lists_every_request_beyond_the_sample(collector: Collector) -> None:
    """A window of more requests than the JSON samples: the CSV (COPY on PostgreSQL, a cursor
    on SQLite) lists all of them, formatted exactly as the JSON's items are (times with and
    without microseconds, categories joined, nulls empty, a comma quoted); the counts stay
    exact; and once rows are deleted the stored report's CSV is a 409, never a short file."""
    from collector.reports.breach import SAMPLE_ROWS, check_csv
    from collector.reports.breach_rows import csv_row

    n = SAMPLE_ROWS + 37
    t0 = int(T0.timestamp() * 10**6)
    rows = [
        {
            "deployment_id": f"dep-{i % 2}",
            "request_id": f"bulk-{i}",
            "tenant": f"tenant-{i % 7}",
            "route": None if i % 11 == 0 else f"/v1/route,{i % 3}",
            "model_id": MODEL,
            "prompt_tokens": None if i % 13 == 0 else 100 + i,
            "completion_tokens": 5,
            "status": "rejected" if i % 17 == 0 else "completed",
            "reject_reason": "too_long" if i % 17 == 0 else None,
            "data_categories": ['["contact", "health"]', None, '["hr"]'][i % 3],
            "first_ts": t0 + i * 1_000_003,
            "last_ts": t0 + i * 1_000_003 + (0 if i % 2 else 250_000),
            "part_ts": t0 + i * 1_000_003,
        }
        for i in range(n)
    ]
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            conn.execute(m.Request.__table__.insert(), rows)
        service = BreachService(db, Settings(database_url=collector.db_url))
        scope = BreachScope(model_id=MODEL, since=T0, until=T0 + timedelta(days=1))
        created = service.create(scope, created_by="test")
        report = to_document(created)
        ar = report["affected_requests"]
        assert (ar["count"], ar["listed"], ar["truncated"]) == (n, SAMPLE_ROWS, True)
        assert sum(ar["by_tenant"].values()) == sum(ar["by_route"].values()) == n
        assert ar["by_deployment"] == {"dep-0": (n + 1) // 2, "dep-1": n // 2}
        assert report["data_categories"]["affected"] == {
            "contact": len(range(0, n, 3)),
            "health": len(range(0, n, 3)),
            "hr": len(range(2, n, 3)),
        }
        chunks: list[bytes] = []
        assert service.write_csv(created, chunks.append) == n
        text = b"".join(chunks).decode()
        head, body = text.split("\n", 1)
        assert head == (
            f"# kvwatch breach report {report['report_id']} "
            f"evidence_sha256={report['evidence_sha256']}"
        )
        # the sample is the CSV's first rows, byte for byte as the JSON's items would be
        buf = io.StringIO()
        items = created.affected_requests.items
        csv.writer(buf, lineterminator="\n").writerows(csv_row(x) for x in items)
        lines = body.splitlines(keepends=True)
        assert "".join(lines[1 : SAMPLE_ROWS + 1]) == buf.getvalue()
        listed = list(csv.DictReader(io.StringIO(body)))
        assert [x["request_id"] for x in listed] == [f"bulk-{i}" for i in range(n)]
        last = listed[-1]
        i = n - 1
        assert last["first_ts"].endswith("Z") and "." in last["first_ts"]
        assert last["data_categories"] == ["contact;health", "", "hr"][i % 3]
        assert check_csv(created, text.splitlines(keepends=True)) == []

        with collector.client(collector.admin) as admin:
            got = admin.get(f"/v1/reports/{report['report_id']}", params={"format": "csv"})
            assert got.status_code == 200 and got.text == text
            with db.write() as conn:
                conn.execute(m.Request.__table__.delete().where(m.Request.request_id == "bulk-5"))
            gone = admin.get(f"/v1/reports/{report['report_id']}", params={"format": "csv"})
        assert gone.status_code == 409, gone.text
        assert gone.json()["error"]["code"] == "conflict"
        assert "generate a new report" in gone.json()["error"]["message"]
        edited = text.replace("bulk-7,", "bulk-x,")
        assert check_csv(created, edited.splitlines(keepends=True)) != []
    finally:
        db.dispose()


def test_postgresql_writes_times_as_iso_does(collector: Collector) -> None:
    """The CSV's times, formatted by PostgreSQL inside the COPY, are collector.timefmt.iso's
    text: microseconds only when there are some, instants before 1970 included."""
    from sqlalchemy import text

    from collector.reports.breach_rows import _iso_sql
    from collector.timefmt import iso

    if not collector.db_url.startswith("postgresql"):
        pytest.skip("SQLite's CSV is formatted by collector.timefmt.iso itself")
    t = int(T0.timestamp() * 10**6)
    values = [t, t + 1, t + 120_000, t + 999_999, 0, -1, -1_500_000, 253402300799999999]
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            conn.exec_driver_sql("SET LOCAL DateStyle = 'ISO, MDY'")
            got = [
                conn.execute(
                    text(f"SELECT {_iso_sql('x')} FROM (SELECT :v AS x) s"), {"v": v}
                ).scalar_one()
                for v in values
            ]
    finally:
        db.dispose()
    assert got == [iso(v) for v in values]


# Schema-2 reports of this module's window, as the versions before this one wrote them: the
# last one, and one from before the deployments section had the limits in force.
SCHEMA_2 = Path(__file__).parent / "data" / "breach-rpt_schema2window.json"
SCHEMA_2_EARLY = SCHEMA_2.with_name("breach-rpt_schema2early.json")


def _renamed(row: dict[str, Any], **names: str) -> dict[str, Any]:
    return {names.get(k, k): v for k, v in row.items()}


def _store(env: Env, doc: dict[str, Any]) -> None:
    ReportStore(env.db).save(doc, created_by="an earlier kvwatch", now=datetime.now(UTC))


@pytest.mark.parametrize("path", [SCHEMA_2, SCHEMA_2_EARLY], ids=["last", "early"])
def test_a_schema_2_report_still_verifies_and_renders(env: Env, tmp_path: Path, path: Path) -> None:
    """A report an earlier version wrote (schema 2: ``victims`` beside ``receiving_*``, rows'
    ``readers``/``sources``), over this environment's events: its JSON and CSV verify, and
    stored, it is served as stored and renders its PDF and CSV in today's words."""
    for p in (path, path.with_suffix(".csv")):
        (tmp_path / p.name).write_bytes(p.read_bytes())
        ok = CliRunner().invoke(cli, ["report", "verify", str(tmp_path / p.name)])
        assert ok.exit_code == 0 and "intact" in ok.output, ok.output
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 2 and "victims" in doc["tenants"]
    report = from_document(doc)
    assert report.schema_version == 2
    assert [(x.tenant, x.exposed_tenants) for x in report.tenants.receiving] == [
        ("globex", ("acme",))
    ]
    assert [(x.tenant, x.receiving_tenants) for x in report.tenants.exposed] == [
        ("acme", ("globex",))
    ]
    (dep,) = report.deployments
    assert dep.safe_context == 681_280
    if path == SCHEMA_2:
        # the same evidence, assessed today, is the same evidence in today's words
        service = BreachService(env.db, Settings(database_url=env.c.db_url))
        scope = BreachScope(
            model_id=MODEL, since=T0, until=T0 + timedelta(hours=1), min_prompt_tokens=4000
        )
        today = to_document(service.build(scope, now=datetime.now(UTC)))
        t = dict(today["tenants"], victim_count=today["tenants"]["receiving_count"])
        t["exposed"] = [_renamed(x, receiving_tenants="readers") for x in t["exposed"]]
        t["victims"] = [_renamed(x, exposed_tenants="sources") for x in t.pop("receiving")]
        # (schema 2 hashed its deployments' limit figures with the rest, and counted no
        # statuses)
        ar = {k: v for k, v in today["affected_requests"].items() if k != "by_status"}
        # (nor the data map's population apart from the persons concerned)
        dc = {k: v for k, v in today["data_categories"].items() if k != "population"}
        old_words = dict(
            today, tenants=t, affected_requests=ar, data_categories=dc, schema_version=2
        )
        assert evidence_digest(old_words) == doc["evidence_sha256"]
        assert dep.limit is not None and dep.limits_in_force[0].source == "pool"
    else:  # before the limits in force: the rule it had then, in its own words
        assert (dep.safe_context_source, dep.limit, dep.limits_in_force) == (
            "smallest prefill pool (no passed verification)",
            None,
            (),
        )

    _store(env, doc)
    rid = doc["report_id"]
    assert env.admin.get(f"/v1/reports/{rid}").json() == doc  # its hash was taken over it
    c = env.admin.get(f"/v1/reports/{rid}", params={"format": "csv"})
    assert c.status_code == 200, c.text
    assert c.text == path.with_suffix(".csv").read_text()
    p = env.admin.get(f"/v1/reports/{rid}", params={"format": "pdf"})
    assert p.status_code == 200, p.text
    text = _pdf_checks(p.content, doc)
    assert re.search(r"Receiving tenants\s*1\b", text) and "receiving tenant" in text


@pytest.mark.parametrize("version", [1, 4])
def test_a_report_of_a_schema_not_read_is_a_clear_error(
    env: Env, tmp_path: Path, version: int
) -> None:
    """Schema 1 (every request in the JSON, no figures to recount a CSV against) and any
    schema newer than this kvwatch: served as stored, verified by hash, and its PDF or CSV a
    409 naming the schema (exit 2 for its CSV's check), never a 500."""
    doc = json.loads(SCHEMA_2.read_text())
    doc["schema_version"] = version
    if version >= 3:
        # from schema 3 the limit figures are conclusions outside the evidence hash: what a
        # newer kvwatch would have written for the same evidence
        doc["evidence_sha256"] = evidence_digest(doc)
    path = tmp_path / SCHEMA_2.name
    path.write_text(json.dumps(doc))
    path.with_suffix(".csv").write_bytes(SCHEMA_2.with_suffix(".csv").read_bytes())
    ok = CliRunner().invoke(cli, ["report", "verify", str(path)])
    assert ok.exit_code == 0 and "intact" in ok.output, ok.output
    bad = CliRunner().invoke(cli, ["report", "verify", str(path.with_suffix(".csv"))])
    assert bad.exit_code == 2 and f"schema-{version} breach report" in bad.output, bad.output

    _store(env, doc)
    rid = doc["report_id"]
    assert env.admin.get(f"/v1/reports/{rid}").json() == doc
    for fmt in ("pdf", "csv"):
        r = env.admin.get(f"/v1/reports/{rid}", params={"format": fmt})
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
        message = r.json()["error"]["message"]
        assert f"schema-{version} breach report" in message and "reads schema 2, 3" in message
        assert r.json()["error"]["details"] == {"schema_version": version, "reads": [2, 3]}


def test_the_document_reads_back_as_the_report(env: Env) -> None:
    """A schema-3 document is the report, field for field; one whose field has the wrong type
    is refused naming the field."""
    service = BreachService(env.db, Settings(database_url=env.c.db_url))
    for scope in (
        BreachScope(incident_id=env.incident_id),
        BreachScope(model_id=MODEL, since=T0, until=T0 + timedelta(hours=1)),
    ):
        report = service.build(scope, now=datetime.now(UTC))
        doc = to_document(report)
        assert doc["schema_version"] == 3 and "victims" not in doc["tenants"]
        assert from_document(json.loads(json.dumps(doc))) == report
        assert evidence_digest(doc) == report.evidence_sha256
    broken = dict(doc, affected_requests=dict(doc["affected_requests"], count="two"))
    with pytest.raises(UnreadableReport) as exc:
        from_document(broken)
    assert "schema-3" in exc.value.message and "$.affected_requests.count" in exc.value.message


def test_the_limit_in_force_is_a_conclusion_outside_the_evidence_hash() -> None:
    """A schema-3 report's deployments carry the limit in force as decided when the report
    is made (a verification passing its maximum age changes it with nothing new recorded):
    the evidence hash leaves it out, so the same evidence hashes the same whenever the report
    is generated; what the deployments record (configs, verifications) stays in it."""
    doc = json.loads(SCHEMA_2.read_text())
    doc = dict(doc, schema_version=3)
    base = evidence_digest(doc)
    dep = dict(doc["deployments"][0])
    later = dict(dep, safe_context=1, safe_context_source="pool", limit="1 tokens (...)")
    assert evidence_digest(dict(doc, deployments=[later, *doc["deployments"][1:]])) == base
    recorded = dict(dep, verifications=[*dep["verifications"], {"model_id": "x"}])
    assert evidence_digest(dict(doc, deployments=[recorded, *doc["deployments"][1:]])) != base
    # schema 2 hashed them, and a stored schema-2 report still verifies as it was written
    old = dict(doc, schema_version=2)
    assert evidence_digest(dict(old, deployments=[later, *doc["deployments"][1:]])) != (
        evidence_digest(old)
    )
