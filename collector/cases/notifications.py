"""Per-party notification tracking: prepare -> approve -> send -> acknowledge, each a
separate step with who, when (and, for sending, the channel), each written to the audit log
in the transaction that records it; and a receiving party's confirmation that it deleted
what it received.

Preparing builds the party's notice (a tenant's: :func:`collector.reports.notice.build_notice`;
the authority's: the assessment's conclusions), gives it an id ``ntc_…`` and stores the
notice JSON as written (:func:`notice_bytes`), its SHA-256 and a JWS over it (sub
``notice:<id>``, ``files`` ``{"<id>.json": sha256}``, ``conclusions`` the notice's key fields
as dotted JSON paths).

Invariants: a step is taken only from the state before it (approve a prepared notice, send
an approved one, acknowledge a sent one); a refused step writes nothing; the stored notice is
never changed after preparing (a correction is a new notice for the same party).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from collector import audit
from collector.cases import repository as repo
from collector.cases import status
from collector.cases.register import Notification, decisions_for, notifications_for
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.reports.breach import BreachScope, BreachService
from collector.reports.breach_model import BreachReport, flatten, to_document
from collector.reports.notice import build_notice
from collector.settings import Settings
from collector.signing import sha256_bytes, statement
from collector.timefmt import iso, to_micros

STEPS = ("approve", "send", "ack", "confirm-deletion")
# step -> (the state it needs, the state it leaves, the columns it sets)
_FLOW = {
    "approve": ("prepared", "approved", ("approved_at", "approved_by")),
    "send": ("approved", "sent", ("sent_at", "sent_by")),
    "ack": ("sent", "acknowledged", ("acknowledged_at", "acknowledged_by")),
}
_ACTIONS = {
    "prepare": "incident.notice_prepared",
    "approve": "incident.notice_approved",
    "send": "incident.notice_sent",
    "ack": "incident.notice_acknowledged",
    "confirm-deletion": "incident.deletion_confirmed",
}
_NAME_MAX = 256


@dataclass(frozen=True, slots=True)
class Prepared:
    notification: Notification
    notice: dict[str, Any]
    notice_json: bytes


def _new_notice_id() -> str:
    return "ntc_" + secrets.token_urlsafe(12).replace("-", "x").replace("_", "y")


def notice_bytes(doc: dict[str, Any]) -> bytes:
    """The notice as its ``.json`` file holds it (what ``notice_sha256`` is taken over)."""
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def conclusions(doc: dict[str, Any]) -> dict[str, Any]:
    """Everything the notice states, as dotted JSON paths -> values (every scalar: its
    measures done and still open, its contact point, whether it is a draft, its legal basis,
    what happened, the extent): a verifier names each path a forgery changed. A notice is
    small; signing all of it leaves nothing a reader relies on outside the signature."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        flatten(value, key, out, frozenset())
    return out


def authority_notice(report: BreachReport, settings: Settings, now: datetime) -> dict[str, Any]:
    """The notification to the supervisory authority (Art. 33(3)): the assessment's
    conclusions, by reference to its evidence hash."""
    doc = to_document(report)
    return {
        "kind": "authority",
        "party": settings.supervisory_authority,
        "role": settings.operator_role,
        "generated_at": iso(now),
        "legal_basis": "GDPR Art. 33(1): notification of a personal data breach to the "
        "supervisory authority",
        "incident": doc["incident"],
        "timeline": doc["timeline"],
        "tenants": {
            k: doc["tenants"][k]
            for k in ("exposed_count", "exposed_requests", "receiving_count", "receiving_requests")
        },
        "data_categories": doc["data_categories"],
        "art34": doc["art34"],
        "account": doc["account"],
        "contact": settings.dpo_contact.strip() or "needs a person: set KVWATCH_DPO_CONTACT",
        "assessment_evidence_sha256": report.evidence_sha256,
    }


def _person(value: str, name: str) -> str:
    value = value.strip()
    if not value:
        raise InvalidInput(f"{name}: name the person (it is kept in the audit log)", {name: value})
    if len(value) > _NAME_MAX:
        raise InvalidInput(f"{name}: at most {_NAME_MAX} characters", {name: value[:40]})
    return value


class NotificationService:
    def __init__(self, db: Database, settings: Settings):
        self.db = db
        self.settings = settings

    # ------------------------------------------------------------------ reading

    def status(self, incident_id: int, *, now: datetime | None = None) -> list[status.PartyStatus]:
        with self.db.read() as conn:
            return status.party_status(conn, incident_id, self.settings, now=now)

    def listing(self, incident_id: int) -> list[Notification]:
        with self.db.read() as conn:
            status.incident_facts(conn, incident_id)  # NotFound for an unknown incident
            return notifications_for(conn, incident_id)

    def notice(self, notice_id: str) -> tuple[Notification, bytes]:
        """A stored notice: its record and its JSON exactly as prepared."""
        with self.db.read() as conn:
            row = repo.notification(conn, notice_id)
            if row is None:
                raise NotFound(f"no notice {notice_id}")
            rec = next(
                n for n in notifications_for(conn, row.incident_id) if n.notice_id == notice_id
            )
        return rec, str(row.notice).encode()

    # ------------------------------------------------------------------ steps

    def prepare(self, incident_id: int, party: str, *, by: str, now: datetime) -> Prepared:
        """Build, store, sign and log the notice for ``party`` (a tenant of the incident, or
        the authority when the operator is the controller)."""
        by = _person(by, "by")
        with self.db.read() as conn:
            inc = status.incident_facts(conn, incident_id)
            known = status.parties(conn, inc, self.settings)
        kind = known.get(party)
        if kind is None:
            raise InvalidInput(
                f"party {party!r} is not a party of incident {incident_id} (its parties: "
                f"{', '.join(known) or 'none: no cross-tenant read'})",
                {"party": party},
            )
        report = BreachService(self.db, self.settings).build(
            BreachScope(incident_id=incident_id), now=now
        )
        nid = _new_notice_id()
        if kind == status.AUTHORITY:
            body = authority_notice(report, self.settings, now)
        else:
            # Built as it will be sent (draft=False): what is approved is what goes out. It
            # stays a draft while the register records no measure or no contact point is
            # set, and a draft is not approved (see step()).
            with self.db.read() as conn:
                decisions = decisions_for(conn, incident_id)
                earlier = notifications_for(conn, incident_id)
            body = build_notice(
                report,
                party,
                self.settings,
                now,
                decisions=decisions,
                notifications=earlier,
                draft=False,
            )
        doc = {"notice_id": nid, **body}
        data = notice_bytes(doc)
        sha = sha256_bytes(data)
        signature = self.settings.key_ring().sign(
            statement(
                sub=f"notice:{nid}",
                iat=now,
                files={f"{nid}.json": sha},
                conclusions=conclusions(doc),
            ),
            now=now,
        )
        now_us = to_micros(now)
        with self.db.write() as conn:
            repo.insert_notification(
                conn,
                {
                    "incident_id": incident_id,
                    "party_kind": kind,
                    "party": party,
                    "notice_id": nid,
                    "notice_sha256": sha,
                    "notice": data.decode(),
                    "signature": signature,
                    "state": "prepared",
                    "prepared_at": now_us,
                    "prepared_by": by,
                },
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action=_ACTIONS["prepare"],
                subject=f"incident:{incident_id}",
                detail={
                    "notice_id": nid,
                    "party_kind": kind,
                    "party": party,
                    "notice_sha256": sha,
                    "assessment_evidence_sha256": report.evidence_sha256,
                },
            )
            rec = next(n for n in notifications_for(conn, incident_id) if n.notice_id == nid)
        return Prepared(rec, doc, data)

    def step(
        self,
        notice_id: str,
        step: str,
        *,
        by: str,
        now: datetime,
        channel: str | None = None,
    ) -> Notification:
        """Approve, send (with its ``channel``), acknowledge (``by``: who at the party), or
        record the receiving party's deletion confirmation. A step out of order is a
        :class:`Conflict` naming the state the notice is in; nothing is written."""
        if step not in STEPS:
            raise InvalidInput(f"step {step!r}: one of {', '.join(STEPS)}", {"step": step})
        by = _person(by, "by")
        if step == "send":
            channel = _person(channel or "", "channel")
        elif channel is not None:
            raise InvalidInput("channel: only sending takes a channel", {"channel": channel})
        now_us = to_micros(now)
        with self.db.write() as conn:
            row = repo.notification(conn, notice_id)
            if row is None:
                raise NotFound(f"no notice {notice_id}")
            detail: dict[str, Any] = {
                "notice_id": notice_id,
                "party_kind": row.party_kind,
                "party": row.party,
                "notice_sha256": row.notice_sha256,
            }
            if step == "confirm-deletion":
                if row.party_kind not in ("received", "both"):
                    raise InvalidInput(
                        f"notice {notice_id} is to a party that received no one's data "
                        f"({row.party_kind}): there is nothing for it to delete",
                        {"notice_id": notice_id},
                    )
                if row.sent_at is None:
                    raise Conflict(
                        f"notice {notice_id} is {row.state}, not sent: the party was not yet "
                        "asked to delete"
                    )
                if not repo.set_deletion_confirmed(conn, notice_id, now_us):
                    raise Conflict(f"notice {notice_id}: deletion already confirmed")
            else:
                need, new, (at_col, by_col) = _FLOW[step]
                if step in ("approve", "send"):
                    _refuse_a_draft(notice_id, str(row.notice))
                if row.state != need:
                    raise Conflict(
                        f"notice {notice_id} is {row.state}: {step} needs a {need} notice"
                        + (
                            " (approve it first)"
                            if step == "send" and row.state == "prepared"
                            else ""
                        ),
                        {"state": row.state},
                    )
                values: dict[str, Any] = {"state": new, at_col: now_us, by_col: by}
                if step == "send":
                    values["channel"] = channel
                    detail["channel"] = channel
                if not repo.advance(conn, notice_id, need, values):
                    raise Conflict(f"notice {notice_id} changed meanwhile; read it again")
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action=_ACTIONS[step],
                subject=f"incident:{row.incident_id}",
                detail=detail,
            )
            return next(
                n for n in notifications_for(conn, row.incident_id) if n.notice_id == notice_id
            )


def _refuse_a_draft(notice_id: str, stored: str) -> None:
    """A notice that says it is a draft (no measure recorded, no contact point) is not
    approved or sent: record what is missing, then prepare it again."""
    doc = json.loads(stored)
    if doc.get("draft"):
        because = "; ".join(r.rstrip(". ") for r in doc.get("draft_because") or [])
        raise Conflict(
            f"notice {notice_id} is a draft ({because or 'it says so'}). Record what is missing "
            "(kvwatch incidents decide; KVWATCH_DPO_CONTACT), then prepare it again.",
            {"notice_id": notice_id, "draft_because": doc.get("draft_because") or []},
        )


def write_files(out: Path, notice_id: str, data: bytes, signature: str | None) -> list[Path]:
    """``<id>.json`` and ``<id>.sig`` in ``out``: the notice as signed and its JWS."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{notice_id}.json"]
    paths[0].write_bytes(data)
    if signature:
        paths.append(out / f"{notice_id}.sig")
        paths[1].write_text(signature + "\n", encoding="utf-8")
    return paths
