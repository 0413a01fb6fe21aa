"""The notice to one tenant about one incident (``kvwatch report notice``).

Most operators of multi-tenant inference are processors for their tenants: under GDPR
Art. 33(2) they notify each affected controller (the tenant) without undue delay, and the
tenant runs its own 72 hours. A notice says what happened to *that tenant's* requests: for an
exposed tenant, which of its requests' KV was read, when, by "another customer of the
service", the extent in tokens (its prompt, and the answer that may contain it), and whether
that customer was asked to delete what it received and confirmed it; for a tenant that only
received another customer's data, that its own data was not disclosed (not a breach of its
data), which of its requests read another's KV, and the request to delete those answers; a
tenant on both sides gets both parts. The measures are the decision register's, done and
still open, never more; the contact point follows. Only a draft carries the review marker.

Invariant: a notice never carries another tenant's identity or request ids. It is built from
the breach assessment of the incident and checked against it before it is returned (every
other tenant and every request id not the tenant's own is looked for in the serialised
notice).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, select, type_coerce

from collector import audit
from collector import models as m
from collector.cases.register import Decision, Notification, decisions_for, notifications_for
from collector.db import Database
from collector.errors import CollectorError, InvalidInput, NotFound
from collector.reports.breach import BreachScope, BreachService, previous_close
from collector.reports.breach_model import BreachReport, StaleRead
from collector.settings import Settings
from collector.timefmt import iso, to_micros

OTHER = "another customer of the service"
CONCERNS = {
    "exposed": "This incident concerns your data: another customer's requests read KV-cache "
    "pages that held data of your requests.",
    "received": "This incident concerns data your requests received: they read KV-cache pages "
    "that held another customer's data; the answers may contain it and are to be deleted. "
    "Your own data was not disclosed.",
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
        """The tenant's notice as it stands (a draft), recorded in the audit log as
        prepared for review (``report.notice``), not as sent."""
        doc = self.build(incident_id, tenant, now=now)
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
                    "draft": doc["draft"],
                    "assessment_evidence_sha256": doc["assessment_evidence_sha256"],
                },
            )
        return doc

    def build(
        self, incident_id: int, tenant: str, *, now: datetime, draft: bool = True
    ) -> dict[str, Any]:
        """The notice from the incident's assessment and its case register (decisions, and
        the notifications that say whether receivers were asked to delete); logs nothing.
        ``draft`` False: the notice as it is sent (the register's send step)."""
        report = BreachService(self.db, self.settings).build(
            BreachScope(incident_id=incident_id), now=now
        )
        with self.db.read() as conn:
            decisions = decisions_for(conn, incident_id)
            notifications = notifications_for(conn, incident_id)
        return build_notice(
            report,
            tenant,
            self.settings,
            now,
            decisions=decisions,
            notifications=notifications,
            draft=draft,
        )

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
            doc = self.build(incident_id, tenant, now=now)
        except (InvalidInput, NotFound):
            raise NotFound(f"no incident {incident_id}") from None
        # The notice's measures are a draft for the operator to review before sending, and
        # its missing-contact placeholder is addressed to the operator: neither is for the
        # tenant until a person has sent the notice (nor is the draft's review list).
        for operator_only in ("draft", "draft_because"):
            doc.pop(operator_only)
        return {
            "concerns": doc["kind"],
            "summary": CONCERNS[doc["kind"]],
            **doc,
            "measures": "The measures taken are in the operator's notice to you.",
            "measures_done": [],
            "measures_open": [],
            "contact": self.settings.dpo_contact.strip()
            or "Your usual contact at the service (no data-protection contact is configured).",
        }


def build_notice(
    report: BreachReport,
    tenant: str,
    settings: Settings,
    now: datetime,
    *,
    decisions: Sequence[Decision] | None = None,
    notifications: Sequence[Notification] = (),
    draft: bool = True,
) -> dict[str, Any]:
    """The notice to ``tenant`` from the incident's assessment: a JSON document (the tenant's
    own view of the incident, ``kvwatch report notice``'s .json).

    ``decisions`` are the incident's decision register (:func:`decisions_for`): what the
    notice says is done and still open, never more; None or empty: the measures are still to
    be recorded, and the notice is a draft. ``notifications`` (:func:`notifications_for`)
    say whether the receiving parties were asked to delete and confirmed it. ``draft``: False
    only for the notice as it is sent; it stays a draft (``draft_because``) while measures or
    the contact point are missing."""
    inc = report.incident
    if inc is None:
        raise InvalidInput("a notice is about an incident; this report covers a window")
    reads = report.stale_reads.items
    mine = {r.request_id: r for r in report.affected_requests.items if r.tenant == tenant}
    everyone = {r.request_id: r for r in report.affected_requests.items}
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

    def answer_tokens(rid: str | None) -> int | None:
        # the extent of the answer that may carry the tenant's data: a count, never an id
        r = everyone.get(rid or "")
        return None if r is None else r.completion_tokens

    processor = settings.operator_role == "processor"
    contact = settings.dpo_contact.strip()
    others = _other_parties(report, tenant)
    live = [d for d in decisions or () if not d.superseded]
    done = [_measure(d, others) for d in live if d.status == "done"]
    still_open = [_measure(d, others) for d in live if d.status != "done"]
    draft_because = [
        *(["not yet approved and sent"] if draft else []),
        *([] if live else ["the measures taken are still to be recorded in the decision register"]),
        *([] if contact else ["no contact point is set (KVWATCH_DPO_CONTACT)"]),
    ]
    doc: dict[str, Any] = {
        "kind": kind,
        "tenant": tenant,
        "draft": bool(draft_because),
        "draft_because": draft_because,
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
        "legal_basis": _legal_basis(kind, processor),
        "received_only": RECEIVED_ONLY if kind == "received" else None,
        "what_happened": (
            "A defect in the KV-cache of the inference service let a request read memory "
            "pages that held part of another request's prompt. kvwatch, which watches the "
            "service, records which requests were involved and their sizes in tokens, never "
            "the text."
        ),
        "your_requests_read_by_another": [
            {
                **request(s.previous_request_id),
                "read_at": s.ts,
                "reader_answer_tokens": answer_tokens(s.reader_request_id),
                "read_by": OTHER,
            }
            for s in exposed
        ],
        "your_requests_that_read_another": [
            {
                **request(s.reader_request_id),
                "read_at": s.ts,
                "data_of": OTHER,
            }
            for s in received
        ],
        "extent": _extent(exposed, received, request, answer_tokens),
        "please_delete": (
            "The answers to your requests listed under 'Your requests that read another "
            "customer's data' may contain fragments of that customer's data. Please delete "
            "those answers and anything derived from them, and confirm to us that you have."
            if received
            else None
        ),
        "receiver_deletion": (_receiver_deletion(exposed, notifications) if exposed else None),
        "measures": _measures_text(live, done, still_open),
        "measures_done": done,
        "measures_open": still_open,
        "contact": contact or "needs a person: set KVWATCH_DPO_CONTACT",
        "assessment_evidence_sha256": report.evidence_sha256,
    }
    _check_names_no_one_else(doc, report, tenant)
    return doc


RECEIVED_ONLY = (
    "Your own data was not disclosed in this incident: this is not a notice of a breach of "
    "your data. Your requests received another customer's data; we tell you so that it goes "
    "no further."
)


def _legal_basis(kind: str, processor: bool) -> str:
    """Why the tenant is told: the Art. 33(2) framing for a tenant whose data was read
    (exposed, or both); a tenant that only received another's data is told what it is, a
    recipient asked to delete, not the controller of breached data."""
    if kind == "received":
        return (
            "As your processor we ask you to delete the answers that may contain another "
            "customer's data, and to confirm to us that you have."
            if processor
            else "We ask you to delete the answers that may contain another customer's data, "
            "and to confirm to us that you have."
        )
    basis = (
        "GDPR Art. 33(2): as your processor we notify you, the controller, without undue "
        "delay. Your own assessment and, where required, your notification to the "
        "supervisory authority (Art. 33(1), 72 hours from your awareness) and to data "
        "subjects (Art. 34) are yours."
        if processor
        else "GDPR Art. 34: information to the customer whose data was concerned."
    )
    if kind == "both":
        basis += (
            " Separately, answers to some of your requests may contain another customer's "
            "data: for those we ask you to delete them and confirm (below)."
        )
    return basis


def _extent(
    exposed: Sequence[StaleRead],
    received: Sequence[StaleRead],
    request: Callable[[str | None], dict[str, Any]],
    answer_tokens: Callable[[str | None], int | None],
) -> dict[str, Any]:
    """The extent in tokens (never pages): of the tenant's prompts another request read, and
    of the answers that may carry them; of the tenant's answers that may carry another's."""

    def total(values: Iterable[int | None]) -> int | None:
        vs = list(values)
        return None if not vs or any(v is None for v in vs) else sum(v or 0 for v in vs)

    mine_read = {s.previous_request_id for s in exposed}
    readers = {s.reader_request_id for s in exposed}
    mine_reading = {s.reader_request_id for s in received}
    return {
        "your_prompt_tokens_read": total(request(r)["prompt_tokens"] for r in mine_read)
        if exposed
        else None,
        "answer_tokens_that_may_contain_your_data": total(answer_tokens(r) for r in readers)
        if exposed
        else None,
        "your_answer_tokens_that_may_contain_another_customers_data": total(
            request(r)["completion_tokens"] for r in mine_reading
        )
        if received
        else None,
    }


def _receiver_deletion(
    exposed: Sequence[StaleRead], notifications: Sequence[Notification]
) -> dict[str, Any]:
    """Whether the customers whose requests read this tenant's data were asked to delete
    what they received (their notice sent) and confirmed it, counted, never named."""
    receivers = {s.reader_tenant for s in exposed if s.reader_tenant}
    latest: dict[str, Notification] = {}
    for n in notifications:  # oldest first: the last one of a party is its latest
        if n.party in receivers and n.party_kind in ("received", "both"):
            latest[n.party] = n
    asked = [latest[t] for t in receivers if t in latest and latest[t].sent_at]
    confirmed = [n for n in asked if n.deletion_confirmed_at]
    total = len(receivers)
    if not asked:
        text = (
            "The customer whose request read your data is to be asked to delete what it "
            "received; that request has not been sent yet."
            if total == 1
            else f"The {total} customers whose requests read your data are to be asked to "
            "delete what they received; those requests have not been sent yet."
        )
    elif total == 1:
        n = asked[0]
        text = (
            f"The customer whose request read your data was asked on {_when(n.sent_at)} to delete "
        ) + (
            f"what it received, and confirmed on {_when(n.deletion_confirmed_at)} that it has."
            if n.deletion_confirmed_at
            else "what it received; it has not confirmed the deletion yet."
        )
    else:
        text = (
            f"Of the {total} customers whose requests read your data, {len(asked)} were "
            f"asked to delete what they received, and {len(confirmed)} confirmed that they "
            "have."
        )
    return {
        "receivers": total,
        "asked": len(asked),
        "confirmed": len(confirmed),
        "confirmed_at": max((n.deletion_confirmed_at or "" for n in confirmed), default=None),
        "text": text,
    }


def _other_parties(report: BreachReport, tenant: str) -> tuple[set[str], set[str]]:
    """The other tenants of the incident, and the request ids that are not ``tenant``'s."""
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
    return others, foreign_ids


def _measure(d: Decision, others: tuple[set[str], set[str]]) -> dict[str, Any]:
    """One register entry as the notice states it: its words, with any other party's name
    or request id (a decision may well say "asked globex to delete") replaced by the words
    a notice uses for them."""
    tenants, ids = others

    def redact(text: str) -> str:
        for word, instead in [
            *((i, "another customer's request") for i in sorted(ids, key=len, reverse=True)),
            *((t, OTHER) for t in sorted(tenants, key=len, reverse=True)),
        ]:
            text = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", instead, text)
        return text

    return {
        "kind": d.kind,
        "what": redact(d.what),
        "status": d.status,
        "at": d.at,
    }


def _measures_text(
    live: Sequence[Decision], done: Sequence[dict[str, Any]], still_open: Sequence[dict[str, Any]]
) -> str:
    """The measures in one paragraph, from the register only: done, then still open."""
    if not live:
        return (
            "The measures taken are still to be recorded: no decision or measure is recorded "
            "against this incident yet."
        )
    parts = [
        "Done: " + "; ".join(f"{m['what']} ({m['at']})" for m in done) + "."
        if done
        else "No measure is recorded as done yet."
    ]
    parts.append(
        "Still open: " + "; ".join(m["what"] for m in still_open) + "."
        if still_open
        else "Nothing is recorded as still open."
    )
    return " ".join(parts)


def _check_names_no_one_else(doc: dict[str, Any], report: BreachReport, tenant: str) -> None:
    text = json.dumps(doc)
    others, foreign_ids = _other_parties(report, tenant)
    # free text written by a person (the register's measures) is searched word by word
    free = " ".join(m["what"] for m in (*doc["measures_done"], *doc["measures_open"]))
    leaked = sorted(
        x
        for x in others | foreign_ids
        if f'"{x}"' in text or re.search(rf"(?<![\w-]){re.escape(x)}(?![\w-])", free)
    )
    if leaked:
        raise NoticeLeak(f"the notice for {tenant!r} would name {len(leaked)} other party ids")


# ("h", title), ("p", text), ("label", text), ("small", text), ("list", items), ("draft",
# reasons), ("table", (headings, rows, widths))
Block = tuple[str, Any]


def _when(at: str | None) -> str:
    """An instant as a person reads it in a notice: to the second, UTC."""
    return "-" if not at else at.replace("T", " ").rstrip("Z")[:19] + " UTC"


def _tokens(n: int | None) -> str:
    return "unknown" if n is None else f"{n:,} tokens"


def _blocks(doc: dict[str, Any]) -> tuple[str, list[Block]]:
    """The notice's title and body, in order: what the Markdown and the PDF both set, so the
    two never say different things."""
    from collector.reports.pdf import figure, short_time

    inc = doc["incident"]
    received_only = doc["kind"] == "received"
    title = (
        f"Notice: your requests received another customer's data: {doc['tenant']}"
        if received_only
        else f"Notice of a personal-data incident: {doc['tenant']}"
    )
    out: list[Block] = []
    if doc.get("draft", True):
        out.append(
            ("draft", [f"{why[:1].upper()}{why[1:]}." for why in doc.get("draft_because", [])])
        )
    out.append(
        (
            "p",
            f"Incident {inc['id']} on {inc['deployment_id']}, opened "
            f"{short_time(inc['opened_at'])} UTC; we became aware at "
            f"{short_time(inc['our_awareness_at'])} UTC. Generated "
            f"{short_time(doc['generated_at'])} UTC.",
        )
    )
    if doc.get("received_only"):
        out.append(("p", doc["received_only"]))
    out += [("p", doc["legal_basis"]), ("h", "What happened"), ("p", doc["what_happened"])]
    extent = doc.get("extent") or {}
    read = doc["your_requests_read_by_another"]
    if read:
        out += [
            ("h", "Your requests whose data another customer read"),
            (
                "table",
                (
                    [
                        "request",
                        "first seen",
                        "prompt tokens",
                        "read at",
                        "answer that read it (tokens)",
                        "read by",
                    ],
                    [
                        [
                            r["request_id"],
                            short_time(r["first_seen"]),
                            figure(r["prompt_tokens"]),
                            short_time(r["read_at"]),
                            figure(r.get("reader_answer_tokens")),
                            r["read_by"],
                        ]
                        for r in read
                    ],
                    [30, 34, 20, 34, 24, 48],
                ),
            ),
            (
                "p",
                "Extent, in tokens: your prompts whose pages were read, "
                f"{_tokens(extent.get('your_prompt_tokens_read'))}; the answers to the "
                "requests that read them, which may contain fragments of them, "
                f"{_tokens(extent.get('answer_tokens_that_may_contain_your_data'))}.",
            ),
        ]
        if doc.get("receiver_deletion"):
            out.append(("p", doc["receiver_deletion"]["text"]))
    reading = doc["your_requests_that_read_another"]
    if reading:
        out += [
            ("h", "Your requests that read another customer's data"),
            (
                "table",
                (
                    [
                        "request",
                        "first seen",
                        "prompt tokens",
                        "answer tokens",
                        "read at",
                        "data of",
                    ],
                    [
                        [
                            r["request_id"],
                            short_time(r["first_seen"]),
                            figure(r["prompt_tokens"]),
                            figure(r["completion_tokens"]),
                            short_time(r["read_at"]),
                            r["data_of"],
                        ]
                        for r in reading
                    ],
                    [30, 34, 20, 20, 34, 52],
                ),
            ),
            (
                "p",
                "Extent, in tokens: your answers that may contain another customer's data, "
                + _tokens(extent.get("your_answer_tokens_that_may_contain_another_customers_data"))
                + ".",
            ),
        ]
    if doc["please_delete"]:
        out += [("h", "Please delete"), ("p", doc["please_delete"])]
    out.append(("h", "Measures"))
    done, still_open = doc.get("measures_done") or [], doc.get("measures_open") or []
    if done or still_open:
        out += [
            ("label", "Done:") if done else ("p", "No measure is recorded as done yet."),
            ("list", [f"{m['what']} ({_when(m['at'])})" for m in done]),
            ("label", "Still open:") if still_open else ("p", "Nothing is recorded as still open."),
            ("list", [m["what"] for m in still_open]),
        ]
    else:
        out.append(("p", doc["measures"]))
    out += [
        ("h", "Contact"),
        ("p", doc["contact"]),
        (
            "small",
            f"Evidence: the breach assessment's SHA-256 {doc['assessment_evidence_sha256']}.",
        ),
    ]
    return title, [b for b in out if b[0] != "list" or b[1]]


def to_markdown(doc: dict[str, Any]) -> str:
    title, blocks = _blocks(doc)
    lines = [f"# {title}", ""]
    for kind, body in blocks:
        if kind == "draft":
            lines += ["> **DRAFT: review before sending**", ">", *(f"> - {x}" for x in body), ""]
        elif kind == "h":
            lines += [f"## {body}", ""]
        elif kind == "list":
            lines += [*(f"- {x}" for x in body), ""]
        elif kind == "label":
            lines += [f"**{body}**", ""]
        elif kind == "table":
            headings, rows, _ = body
            lines += [
                "| " + " | ".join(headings) + " |",
                "| " + " | ".join("---" for _ in headings) + " |",
                *("| " + " | ".join(str(c) for c in r) + " |" for r in rows),
                "",
            ]
        else:
            lines += [body, ""]
    return "\n".join(lines)


def render_pdf(doc: dict[str, Any]) -> bytes:
    from collector.reports.pdf import ReportPdf

    title, blocks = _blocks(doc)
    pdf = ReportPdf(f"incident {doc['incident']['id']}", f"notice to {doc['tenant']}")
    pdf.add_page()
    pdf.h1(title)
    for kind, body in blocks:
        if kind == "draft":
            # unmissable, and only on a draft: a sent notice carries no review marker
            pdf.set_text_color(192, 57, 43)
            pdf.set_font("DejaVu", "B", 11)
            pdf.cell(0, 7, "DRAFT: review before sending", new_x="LMARGIN", new_y="NEXT")
            for x in body:
                pdf.para(f"- {x}")
            pdf.set_text_color(0, 0, 0)
            pdf.ln(2)
        elif kind == "h":
            pdf.ln(2)
            pdf.h1(body)
        elif kind == "list":
            for x in body:
                pdf.para(f"- {x}")
            pdf.ln(1.5)
        elif kind == "label":
            pdf.set_font("DejaVu", "B", 9)
            pdf.multi_cell(0, 5, body, new_x="LMARGIN", new_y="NEXT")
        elif kind == "table":
            pdf.grid(*body)
        elif kind == "small":
            pdf.ln(2)
            pdf.para(body, 8)
        else:
            pdf.para(body)
            pdf.ln(1.5)
    pdf.ln(8)
    pdf.para("Signature: ______________________________    Date: ______________")
    return bytes(pdf.output())
