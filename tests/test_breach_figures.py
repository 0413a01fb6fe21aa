"""The figures of a breach assessment and the tenant notices, on the demo's incident: hooli's
HR-case request (76 prompt tokens) had 10 of its KV-cache pages read by massive-dynamic's
long request, which also read 732 pages no request had written. Events go in through the real
collector (``POST /v1/events``); the decision register and the notifications are rows of the
real database; every PDF is rendered to PNG (kept under the test's ``tmp_path``) and its text
read back with pypdf.

What each test guards: the records concerned are the exposed requests (1), not every request
on either side (2); the nature statement cites the 10 pages that held another tenant's data,
apart from the 732 that held no one's, and says "may contain" as the account does; a data
map's population is never the number of persons concerned; a non-special data-map category
leaves Art. 34 undetermined, never "no"; a notice states measures from the register only,
gives the extent in tokens, tells the exposed party whether the receiver was asked to delete
and confirmed, frames the receiving party's notice as a recipient's, and is marked a draft
only while it is one.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pypdf
import pypdfium2
import pytest
from sqlalchemy import select

from collector import models as m
from collector.db import Database
from collector.reports.breach import BreachScope, BreachService
from collector.reports.breach_model import BreachReport, to_document
from collector.reports.breach_pdf import render_pdf
from collector.reports.notice import NoticeService, to_markdown
from collector.reports.notice import render_pdf as notice_pdf
from collector.settings import Settings
from tests import factories as f
from tests.conftest import Collector
from tests.pdf_helpers import assert_renders

EXPOSED, RECEIVER = "hooli", "massive-dynamic"
EXPOSED_REQ, READER_REQ = "req-5", "req-6"
ROUTE = "/v1/completions"


def _events(extra: list[Any] | None = None) -> list[Any]:
    return [
        f.config(1),
        f.config(2, role="decode", node="decode-0", pool_tokens=2_000_000),
        f.admitted(3, EXPOSED_REQ, tenant=EXPOSED, prompt=76, route=ROUTE),
        f.finished(4, EXPOSED_REQ, tenant=EXPOSED, completion=77),
        f.rejected(5, READER_REQ, tenant=RECEIVER, prompt=11_862),
        f.finished(6, READER_REQ, tenant=RECEIVER, completion=81),
        f.stale_read(  # pages no request wrote: no one's data
            7,
            reader_request_id=READER_REQ,
            reader_tenant=RECEIVER,
            previous_request_id=None,
            previous_tenant=None,
            page_ids=list(range(10, 742)),
        ),
        f.stale_read(  # hooli's pages
            8,
            reader_request_id=READER_REQ,
            reader_tenant=RECEIVER,
            previous_request_id=EXPOSED_REQ,
            previous_tenant=EXPOSED,
            page_ids=list(range(0, 10)),
        ),
        *(extra or []),
    ]


@dataclass
class Case:
    c: Collector
    db: Database
    incident_id: int
    tmp: Path

    def settings(self, **kw: Any) -> Settings:
        return Settings(database_url=self.c.db_url, **kw)

    def report(self, **kw: Any) -> BreachReport:
        return BreachService(self.db, self.settings(**kw)).build(
            BreachScope(incident_id=self.incident_id), now=datetime.now(UTC)
        )


def _case(collector: Collector, tmp_path: Path, extra: list[Any] | None = None) -> Iterator[Case]:
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in _events(extra)])
        assert r.status_code == 200, r.text
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            (incident_id,) = conn.execute(select(m.Incident.id)).scalars().all()
        yield Case(collector, db, incident_id, tmp_path)
    finally:
        db.dispose()


@pytest.fixture
def case(collector: Collector, tmp_path: Path) -> Iterator[Case]:
    yield from _case(collector, tmp_path)


def _pdf_text(pdf: bytes, out: Path) -> str:
    """Every page rendered to PNG (``out``-N.png, for a person to look at) and checked to
    show ink within the margins; the text read back with pypdf, whitespace folded."""
    pages = assert_renders(pdf)
    doc = pypdfium2.PdfDocument(pdf)
    try:
        for i, page in enumerate(doc, 1):
            page.render(scale=1.5).to_pil().save(out.with_name(f"{out.name}-{i}.png"))
    finally:
        doc.close()
    assert len(list(out.parent.glob(f"{out.name}-*.png"))) == pages
    reader = pypdf.PdfReader(io.BytesIO(pdf))
    return " ".join(" ".join((p.extract_text() or "").split()) for p in reader.pages)


def _checklist(doc: dict[str, Any]) -> dict[str, str]:
    return {x["key"]: x["value"] for x in doc["checklist"]}


# ---------------------------------------------------------------------- the assessment


def test_the_figures_count_what_was_exposed(case: Case) -> None:
    built = case.report()
    doc = to_document(built)
    items = _checklist(doc)
    # the records concerned: the one exposed request, never the reader's own request
    assert doc["affected_requests"]["count"] == 2  # either side: still reported as such
    assert items["records"] == (
        "1 exposed request (a prompt whose KV-cache pages another tenant's request read; what "
        "it held is not stored). Counted apart: 1 receiving request that read it, whose "
        "answers may contain fragments of that prompt."
    )
    # the nature: 10 pages held another tenant's data, 732 no one's; never "742 pages" alone
    assert items["nature"] == (
        "Confidentiality breach on glm-prod: 1 cross-tenant stale KV-cache read covered 10 "
        "pages that held another tenant's data; the answers to the reading requests may "
        "contain fragments of that tenant's prompts. 1 other stale read covered 732 pages that "
        "held no one's data (never written since the KV pool was made): no data crossed "
        "tenants there."
    )
    # one wording everywhere: answers "may contain" fragments; nothing says they carried them
    assert "carried" not in json.dumps(doc)
    for text in (items["nature"], items["consequences"], doc["account"]):
        assert "may contain fragments" in text, text
    assert (
        "Of the 742 pages read, 10 held another tenant's data; 732 had never been written"
        in (doc["account"])
    )

    text = _pdf_text(render_pdf(built), case.tmp / "breach")
    assert re.search(r"Exposed requests \(records concerned\)\s*1\b", text)
    assert re.search(r"Receiving requests\s*1\b", text)
    assert re.search(
        r"Stale reads\s*2 \(1 cross-tenant\); 742 pages read, of which 10 held another "
        r"tenant's data, 732 no one's",
        text,
    )
    assert "1 exposed request (a prompt whose KV-cache pages" in text
    assert "carried" not in text and "2 requests" not in text


def test_a_non_special_data_map_category_never_makes_art34_no(case: Case) -> None:
    """hooli's route declared as hr_records with a population of 1,200: a leaked HR complaint
    may hold health or other sensitive data, and the text is never stored, so Art. 34 stays
    undetermined and says why; 1,200 is the population, the persons concerned unknown."""
    datamap = case.tmp / "datamap.yaml"
    datamap.write_text(
        f"entries:\n  - tenant: {EXPOSED}\n    route: {ROUTE}\n"
        "    categories: [hr_records]\n    population: 1200\n"
    )
    built = case.report(data_map=datamap)
    doc = to_document(built)
    cats, a34 = doc["data_categories"], doc["art34"]
    assert cats["exposed"] == {"hr_records": 1} and cats["special"] == []
    assert (cats["population"], cats["data_subjects"]) == (1200, None)
    assert (a34["verdict"], a34["high_risk"]) == ("undetermined", None)
    (reason,) = a34["reasons"]
    assert "only non-special categories (hr_records)" in reason
    assert "categories alone cannot rule out special or sensitive content" in reason
    assert "kvwatch never stores the text" in reason
    subjects = _checklist(doc)["subjects"]
    assert subjects.startswith("unknown: kvwatch stores no prompt text")
    assert "Declared population behind the exposed requests: 1,200 persons" in subjects
    assert "not the number concerned" in subjects
    assert "Art. 34 high risk: undetermined" in doc["account"]

    text = _pdf_text(render_pdf(built), case.tmp / "breach-hr")
    assert re.search(r"Art. 34 high risk\s*undetermined", text)
    assert re.search(r"Data subjects concerned\s*unknown", text)
    assert re.search(r"Declared population\s*1,200 persons \(declared in the data map", text)
    assert "High risk: undetermined" in text and "never stores the text" in text


def test_a_document_written_before_the_population_reads_it_as_the_population(
    case: Case,
) -> None:
    """A stored schema-3 document whose data_subjects was the data map's population (as
    kvwatch wrote it before): read back, that number is the population, the persons concerned
    unknown, and its PDF says so."""
    from collector.reports.breach_model import from_document

    doc = to_document(case.report())
    cats = {k: v for k, v in doc["data_categories"].items() if k != "population"}
    old = dict(doc, data_categories=dict(cats, data_subjects=1200))
    report = from_document(old)
    assert (report.data_categories.population, report.data_categories.data_subjects) == (
        1200,
        None,
    )
    text = _pdf_text(render_pdf(report), case.tmp / "breach-old")
    assert re.search(r"Data subjects concerned\s*unknown", text)
    assert re.search(r"Declared population\s*1,200 persons", text)


# ---------------------------------------------------------------------- the notices


def _decide(case: Case, kind: str, status: str, what: str, at: datetime) -> None:
    with case.db.write() as conn:
        conn.execute(
            m.IncidentDecision.__table__.insert(),
            {
                "incident_id": case.incident_id,
                "ts": at,
                "actor": "dpo@example.test",
                "kind": kind,
                "status": status,
                "what": what,
                "why": "the incident",
                "supersedes": None,
            },
        )


def _notified(case: Case, party: str, kind: str, at: datetime, confirmed: bool) -> None:
    with case.db.write() as conn:
        conn.execute(
            m.IncidentNotification.__table__.insert(),
            {
                "incident_id": case.incident_id,
                "party_kind": kind,
                "party": party,
                "notice_id": f"ntc-{party}",
                "notice_sha256": "0" * 64,
                "notice": "{}",
                "signature": None,
                "state": "sent",
                "prepared_at": at,
                "prepared_by": "dpo@example.test",
                "approved_at": at,
                "approved_by": "dpo@example.test",
                "sent_at": at + timedelta(minutes=1),
                "sent_by": "dpo@example.test",
                "channel": "email",
                "acknowledged_at": None,
                "acknowledged_by": None,
                "deletion_confirmed_at": at + timedelta(hours=2) if confirmed else None,
            },
        )


def _notice(case: Case, tenant: str, name: str, *, draft: bool = True) -> tuple[dict, str, str]:
    """The notice's JSON, Markdown and PDF text; none names the other tenant or its request."""
    service = NoticeService(case.db, case.settings(dpo_contact="dpo@example.test"))
    doc = service.build(case.incident_id, tenant, now=datetime.now(UTC), draft=draft)
    md = to_markdown(doc)
    pdf = _pdf_text(notice_pdf(doc), case.tmp / name)
    other, foreign = (RECEIVER, READER_REQ) if tenant == EXPOSED else (EXPOSED, EXPOSED_REQ)
    for text in (json.dumps(doc), md, pdf):
        assert other not in text and foreign not in text, (tenant, text)
        assert not re.search(r"\b\d+ pages\b", text), "the extent is in tokens, never pages"
    return doc, md, pdf


def test_with_nothing_recorded_a_notice_is_a_draft_that_claims_no_measure(case: Case) -> None:
    for tenant in (EXPOSED, RECEIVER):
        doc, md, pdf = _notice(case, tenant, f"draft-{tenant}", draft=False)
        assert doc["draft"] is True
        assert doc["draft_because"] == [
            "the measures taken are still to be recorded in the decision register"
        ]
        assert doc["measures_done"] == [] and doc["measures_open"] == []
        for text in (md, pdf):
            assert "DRAFT: review before sending" in text
            assert "The measures taken are still to be recorded" in text
            # nothing is claimed as done: the old notice said these were in place
            assert "are refused" not in text and "are zeroed" not in text
            assert "(Review before sending" not in text


def test_a_sent_notice_states_the_register_and_the_extent_in_tokens(case: Case) -> None:
    t0 = datetime.now(UTC) - timedelta(hours=3)
    _decide(case, "containment", "done", "Capped the served context at 10,640 tokens", t0)
    _decide(
        case,
        "deletion_request",
        "done",
        f"Asked {RECEIVER} to delete the answer to {READER_REQ}",
        t0 + timedelta(minutes=5),
    )
    _decide(case, "engine_upgrade", "open", "Upgrade the engine to reject cleanly", t0)
    _notified(case, RECEIVER, "received", t0 + timedelta(minutes=10), confirmed=True)

    doc, md, pdf = _notice(case, EXPOSED, "sent-exposed", draft=False)
    assert (doc["draft"], doc["draft_because"]) == (False, [])
    for text in (md, pdf):
        assert "DRAFT" not in text and "Review before sending" not in text
        assert "Done:" in text and "Capped the served context at 10,640 tokens" in text
        # a person's words naming the other party are told in the notice's words
        assert (
            "Asked another customer of the service to delete the answer to another "
            "customer's request" in text
        )
        assert "Still open:" in text and "Upgrade the engine to reject cleanly" in text
        # the extent in tokens: its prompt (76) and the answer that read it (81)
        assert "your prompts whose pages were read, 76 tokens" in text
        assert "which may contain fragments of them, 81 tokens" in text
        # the receiver was asked to delete, and confirmed
        assert "The customer whose request read your data was asked on" in text
        assert "and confirmed on" in text
        assert "GDPR Art. 33(2)" in text
    assert [x["what"] for x in doc["measures_open"]] == ["Upgrade the engine to reject cleanly"]
    rd = doc["receiver_deletion"]
    assert (rd["receivers"], rd["asked"], rd["confirmed"]) == (1, 1, 1)
    assert doc["extent"]["your_prompt_tokens_read"] == 76

    # the receiving party: told it received another's data, its own was not disclosed
    doc, md, pdf = _notice(case, RECEIVER, "sent-receiver", draft=False)
    assert doc["kind"] == "received" and doc["draft"] is False
    for text in (md, pdf):
        assert "Notice: your requests received another customer's data" in text
        assert "Your own data was not disclosed" in text
        assert "Art. 33(2)" not in text and "personal-data incident" not in text
        assert "Please delete" in text
        assert "your answers that may contain another customer's data, 81 tokens" in text


def test_the_exposed_party_is_told_the_receiver_has_not_yet_been_asked(case: Case) -> None:
    _decide(case, "containment", "done", "Capped the served context", datetime.now(UTC))
    doc, md, pdf = _notice(case, EXPOSED, "unsent-exposed")
    assert doc["draft"] is True and doc["draft_because"] == ["not yet approved and sent"]
    assert "DRAFT: review before sending" in pdf and "Not yet approved and sent." in pdf
    assert "> **DRAFT: review before sending**" in md and "> - Not yet approved and sent." in md
    assert "is to be asked to delete what it received; that request has not been sent" in pdf
    assert doc["receiver_deletion"]["asked"] == 0
    _notified(case, RECEIVER, "received", datetime.now(UTC), confirmed=False)
    doc, _, pdf = _notice(case, EXPOSED, "unconfirmed-exposed")
    assert "it has not confirmed the deletion yet" in pdf
    assert (doc["receiver_deletion"]["asked"], doc["receiver_deletion"]["confirmed"]) == (1, 0)


def test_a_tenant_on_both_sides_gets_both_parts(collector: Collector, tmp_path: Path) -> None:
    """hooli's later request also read 2 pages of massive-dynamic's: hooli's notice tells it
    both that its data was read (Art. 33(2)) and that it received another's (delete it)."""
    extra = [
        f.admitted(9, "req-7", tenant=EXPOSED, prompt=50, route=ROUTE),
        f.finished(10, "req-7", tenant=EXPOSED, completion=12),
        f.stale_read(
            11,
            reader_request_id="req-7",
            reader_tenant=EXPOSED,
            previous_request_id=READER_REQ,
            previous_tenant=RECEIVER,
            page_ids=[900, 901],
        ),
    ]
    for case in _case(collector, tmp_path, extra):
        doc, md, pdf = _notice(case, EXPOSED, "both")
        assert doc["kind"] == "both"
        for text in (md, pdf):
            assert "Notice of a personal-data incident" in text and "GDPR Art. 33(2)" in text
            assert "Separately, answers to some of your requests may contain" in text
            assert "Your requests whose data another customer read" in text
            assert "Your requests that read another customer's data" in text
            assert "Please delete" in text
            assert "your answers that may contain another customer's data, 12 tokens" in text
