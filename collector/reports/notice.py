"""The notice to one tenant about one incident (``kvwatch report notice``).

Most operators of multi-tenant inference are processors for their tenants: under GDPR
Art. 33(2) they notify each affected controller (the tenant) without undue delay, and the
tenant runs its own 72 hours. A notice says what happened to *that tenant's* requests: for an
exposed tenant, which of its requests' KV was read, when, how many pages, by "another customer
of the service"; for a receiving tenant, which of its requests read another customer's KV,
with the request to delete what those answers returned. The measures and the contact point
follow.

Invariant: a notice never carries another tenant's identity or request ids. It is built from
the breach assessment of the incident and checked against it before it is returned (every
other tenant and every request id not the tenant's own is looked for in the serialised
notice).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, select, type_coerce

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import CollectorError, InvalidInput, NotFound
from collector.reports.breach import BreachScope, BreachService, previous_close
from collector.reports.breach_model import BreachReport
from collector.settings import Settings
from collector.timefmt import iso, to_micros

OTHER = "another customer of the service"
CONCERNS = {
    "exposed": "This incident concerns your data: another customer's requests read KV-cache "
    "pages that held data of your requests.",
    "received": "This incident concerns your data: your requests read KV-cache pages that held "
    "another customer's data; the answers may contain it and are to be deleted.",
    "both": "This incident concerns your data: another customer's requests read KV-cache pages "
    "that held data of your requests, and your requests read pages that held another "
    "customer's data.",
}


class NoticeLeak(CollectorError):
    """A notice would have named another tenant or another tenant's request (a bug)."""


class NoticeService:
    def __init__(self, db: Database, settings: Settings):
        self.db = db
        self.settings = settings

    def notice(
        self, incident_id: int, tenant: str, *, created_by: str, now: datetime
    ) -> dict[str, Any]:
        report = BreachService(self.db, self.settings).build(
            BreachScope(incident_id=incident_id), now=now
        )
        doc = build_notice(report, tenant, self.settings, now)
        with self.db.write() as conn:
            audit.append(
                conn,
                now_us=to_micros(now),
                actor=created_by,
                # A file for someone to review, not a notification: preparing, approving
                # and sending one are the steps of collector.cases.notifications.
                action="notice.draft",
                subject=f"incident:{incident_id}",
                detail={
                    "sent": False,
                    "tenant": tenant,
                    "kind": doc["kind"],
                    "assessment_evidence_sha256": report.evidence_sha256,
                },
            )
        return doc

    # ------------------------------------------------------------ a tenant's own view

    def tenant_incidents(
        self, tenant: str, *, state: str | None, limit: int, now: datetime
    ) -> list[dict[str, Any]]:
        """The incidents in which ``tenant``'s data crossed (its pages read by another, or it
        read another's), newest first: what a tenant-scoped token sees of ``/v1/incidents``.
        Each names only the tenant's side (``concerns``), never the other party."""
        i, p = m.Incident, m.PageEvent
        q = select(
            i.id,
            i.deployment_id,
            i.state,
            type_coerce(i.opened_at, BigInteger).label("opened_at"),
            type_coerce(i.closed_at, BigInteger).label("closed_at"),
        ).order_by(i.id.desc())
        if state is not None:
            q = q.where(i.state == state)
        ts = type_coerce(p.ts, BigInteger)
        out: list[dict[str, Any]] = []
        with self.db.read() as conn:
            for inc in conn.execute(q).all():
                lo = previous_close(conn, inc.deployment_id, inc.id) or 0
                hi = inc.closed_at or to_micros(now) + 1
                sides = conn.execute(
                    select(p.tenant, p.other_tenant)
                    .where(
                        p.kind == "page.stale_read",
                        p.cross_tenant.is_(True),
                        p.deployment_id == inc.deployment_id,
                        ts >= lo,
                        ts < hi,
                        sa.or_(p.tenant == tenant, p.other_tenant == tenant),
                    )
                    .distinct()
                ).all()
                exposed = any(s.other_tenant == tenant for s in sides)
                received = any(s.tenant == tenant for s in sides)
                if not (exposed or received):
                    continue
                kind = "both" if exposed and received else "exposed" if exposed else "received"
                out.append(
                    {
                        "id": inc.id,
                        "deployment_id": inc.deployment_id,
                        "state": inc.state,
                        "opened_at": iso(inc.opened_at),
                        "closed_at": iso(inc.closed_at),
                        "concerns": kind,
                        "summary": CONCERNS[kind],
                    }
                )
                if len(out) >= limit:
                    break
        return out

    def tenant_view(self, incident_id: int, tenant: str, *, now: datetime) -> dict[str, Any]:
        """One incident as ``tenant`` may see it: its notice (naming no other party), with
        ``concerns`` and ``summary``. An incident that does not concern the tenant is, to it,
        no incident (404): its existence is other tenants' business."""
        try:
            report = BreachService(self.db, self.settings).build(
                BreachScope(incident_id=incident_id), now=now
            )
            doc = build_notice(report, tenant, self.settings, now)
        except (InvalidInput, NotFound):
            raise NotFound(f"no incident {incident_id}") from None
        # The notice's measures are a draft for the operator to review before sending, and
        # its missing-contact placeholder is addressed to the operator: neither is for the
        # tenant until a person has sent the notice.
        return {
            "concerns": doc["kind"],
            "summary": CONCERNS[doc["kind"]],
            **doc,
            "measures": "The measures taken are in the operator's notice to you.",
            "contact": self.settings.dpo_contact.strip()
            or "Your usual contact at the service (no data-protection contact is configured).",
        }


def build_notice(
    report: BreachReport, tenant: str, settings: Settings, now: datetime
) -> dict[str, Any]:
    """The notice to ``tenant`` from the incident's assessment: a JSON document (the tenant's
    own view of the incident, ``kvwatch report notice``'s .json)."""
    inc = report.incident
    if inc is None:
        raise InvalidInput("a notice is about an incident; this report covers a window")
    reads = report.stale_reads.items
    mine = {r.request_id: r for r in report.affected_requests.items if r.tenant == tenant}
    exposed = [s for s in reads if s.cross_tenant and s.previous_tenant == tenant]
    received = [s for s in reads if s.cross_tenant and s.reader_tenant == tenant]
    if not exposed and not received:
        involved = {r.tenant for r in report.affected_requests.items}
        raise InvalidInput(
            f"tenant {tenant!r} has no request whose data crossed in incident "
            f"{inc.id} (tenants with requests in it: {len(involved)})",
            {"tenant": tenant},
        )
    kind = "both" if exposed and received else "exposed" if exposed else "received"

    def request(rid: str | None) -> dict[str, Any]:
        # None for a request not in the evidence (its record never reached the collector)
        r = mine.get(rid or "")
        return {
            "request_id": rid,
            "first_seen": None if r is None else r.first_ts,
            "prompt_tokens": None if r is None else r.prompt_tokens,
            "completion_tokens": None if r is None else r.completion_tokens,
            "route": None if r is None else r.route,
            "model_id": None if r is None else r.model_id,
        }

    processor = settings.operator_role == "processor"
    doc: dict[str, Any] = {
        "kind": kind,
        "tenant": tenant,
        "incident": {
            "id": inc.id,
            "deployment_id": inc.deployment_id,
            "state": inc.state,
            "opened_at": inc.opened_at,
            "closed_at": inc.closed_at,
            "our_awareness_at": report.timeline.awareness_at,
        },
        "generated_at": iso(now),
        "role": settings.operator_role,
        "legal_basis": (
            "GDPR Art. 33(2): as your processor we notify you, the controller, without undue "
            "delay. Your own assessment and, where required, your notification to the "
            "supervisory authority (Art. 33(1), 72 hours from your awareness) and to data "
            "subjects (Art. 34) are yours."
            if processor
            else "GDPR Art. 34: information to the customer whose data was concerned."
        ),
        "what_happened": (
            "A defect in the KV-cache of the inference service let a request read memory "
            "pages that held part of another request's prompt. kvwatch, which watches the "
            "service, records which requests and pages were involved, never the text."
        ),
        "your_requests_read_by_another": [
            {
                **request(s.previous_request_id),
                "read_at": s.ts,
                "pages": s.page_count,
                "read_by": OTHER,
            }
            for s in exposed
        ],
        "your_requests_that_read_another": [
            {
                **request(s.reader_request_id),
                "read_at": s.ts,
                "pages": s.page_count,
                "data_of": OTHER,
            }
            for s in received
        ],
        "please_delete": (
            "The answers to your requests listed under 'your requests that read another' may "
            "contain fragments of another customer's data. Please delete those answers and "
            "anything derived from them, and confirm to us that you have."
            if received
            else None
        ),
        "measures": (
            "Prompts above the verified safe context are refused; rejected prefills no longer "
            "hand KV to decode; reused pages are zeroed. (Review before sending: the measures "
            "actually taken.)"
        ),
        "contact": settings.dpo_contact.strip() or "needs a person: set KVWATCH_DPO_CONTACT",
        "assessment_evidence_sha256": report.evidence_sha256,
    }
    _check_names_no_one_else(doc, report, tenant)
    return doc


def _check_names_no_one_else(doc: dict[str, Any], report: BreachReport, tenant: str) -> None:
    text = json.dumps(doc)
    reads = report.stale_reads.items
    others = {
        t for s in reads for t in (s.reader_tenant, s.previous_tenant) if t and t != tenant
    } | {r.tenant for r in report.affected_requests.items if r.tenant != tenant}
    foreign_ids = {
        rid
        for s in reads
        for rid, who in (
            (s.reader_request_id, s.reader_tenant),
            (s.previous_request_id, s.previous_tenant),
        )
        if rid and who != tenant
    }
    leaked = sorted(x for x in others | foreign_ids if f'"{x}"' in text)
    if leaked:
        raise NoticeLeak(f"the notice for {tenant!r} would name {len(leaked)} other party ids")


def to_markdown(doc: dict[str, Any]) -> str:
    inc = doc["incident"]
    lines = [
        f"# Notice of a personal-data incident: {doc['tenant']}",
        "",
        f"Incident {inc['id']} on {inc['deployment_id']}, opened {inc['opened_at']}; "
        f"we became aware at {inc['our_awareness_at']}. Generated {doc['generated_at']}.",
        "",
        doc["legal_basis"],
        "",
        "## What happened",
        "",
        doc["what_happened"],
        "",
    ]

    def table(title: str, rows: list[dict[str, Any]], who: str) -> None:
        if not rows:
            return
        lines.extend(
            [
                f"## {title}",
                "",
                "| request | first seen | prompt tokens | read at | pages | "
                + who.replace("_", " ")
                + " |",
                "| --- | --- | ---: | --- | ---: | --- |",
            ]
        )
        for r in rows:
            lines.append(
                f"| {r['request_id']} | {r['first_seen'] or '-'} | "
                f"{r['prompt_tokens'] if r['prompt_tokens'] is not None else '-'} | "
                f"{r['read_at']} | {r['pages']} | {r[who]} |"
            )
        lines.append("")

    table(
        "Your requests whose data another customer read",
        doc["your_requests_read_by_another"],
        "read_by",
    )
    table(
        "Your requests that read another customer's data",
        doc["your_requests_that_read_another"],
        "data_of",
    )
    if doc["please_delete"]:
        lines += ["## Please delete", "", doc["please_delete"], ""]
    lines += [
        "## Measures",
        "",
        doc["measures"],
        "",
        "## Contact",
        "",
        doc["contact"],
        "",
        f"Evidence: the breach assessment's SHA-256 {doc['assessment_evidence_sha256']}.",
        "",
    ]
    return "\n".join(lines)


def render_pdf(doc: dict[str, Any]) -> bytes:
    from collector.reports.pdf import ReportPdf, short_time

    inc = doc["incident"]
    pdf = ReportPdf(f"incident {inc['id']}", f"notice to {doc['tenant']}")
    pdf.add_page()
    pdf.h1(f"Notice of a personal-data incident: {doc['tenant']}")
    pdf.para(
        f"Incident {inc['id']} on {inc['deployment_id']}, opened "
        f"{short_time(inc['opened_at'])} UTC; we became aware at "
        f"{short_time(inc['our_awareness_at'])} UTC. Generated "
        f"{short_time(doc['generated_at'])} UTC."
    )
    pdf.para(doc["legal_basis"])
    pdf.ln(2)
    pdf.h1("What happened")
    pdf.para(doc["what_happened"])
    for title, rows, who in (
        (
            "Your requests whose data another customer read",
            doc["your_requests_read_by_another"],
            "read_by",
        ),
        (
            "Your requests that read another customer's data",
            doc["your_requests_that_read_another"],
            "data_of",
        ),
    ):
        if rows:
            pdf.ln(2)
            pdf.h1(title)
            pdf.grid(
                [
                    "request",
                    "first seen",
                    "prompt tokens",
                    "read at",
                    "pages",
                    who.replace("_", " "),
                ],
                [
                    [
                        r["request_id"],
                        short_time(r["first_seen"]),
                        r["prompt_tokens"],
                        short_time(r["read_at"]),
                        r["pages"],
                        r[who],
                    ]
                    for r in rows
                ],
                [30, 36, 20, 36, 14, 54],
            )
    if doc["please_delete"]:
        pdf.h1("Please delete")
        pdf.para(doc["please_delete"])
    pdf.h1("Measures")
    pdf.para(doc["measures"])
    pdf.h1("Contact")
    pdf.para(doc["contact"])
    pdf.ln(2)
    pdf.para(f"Evidence: the breach assessment's SHA-256 {doc['assessment_evidence_sha256']}.", 8)
    pdf.ln(8)
    pdf.para("Signature: ______________________________    Date: ______________")
    return bytes(pdf.output())
