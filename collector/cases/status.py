"""Each affected party's notification status, decided once (:func:`party_status`) and served
to the API, the CLI, the breach report's timeline and the dashboard alike.

The parties: every tenant whose data crossed in the incident (``exposed``: another tenant read
its pages; ``received``: it read another's; ``both``), and, when the operator is the
controller (``KVWATCH_OPERATOR_ROLE=controller``), the supervisory authority.

When each is due:

- a tenant: ``awareness_at + KVWATCH_CONTROLLER_NOTICE_TARGET_H``. As a processor this is
  kvwatch's measure of Art. 33(2)'s "without undue delay" to each controller (the
  controller's own 72 hours start at its awareness, i.e. at this notice);
- the authority (controller only): the incident's ``deadline_at`` (Art. 33(1), 72 hours from
  awareness unless a person changed it, logged).

Invariant: ``late`` depends only on recorded facts (a notice's ``sent_at`` after its
``due_at``), never on when it is asked; ``overdue`` (not sent, past due) is the only answer
that depends on ``now``, and is None without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import BigInteger, Connection, select, type_coerce

from collector import models as m
from collector.cases.facts import as_logged
from collector.cases.register import Notification, notifications_for
from collector.errors import NotFound
from collector.settings import Settings
from collector.timefmt import iso, parse_iso, to_micros

AUTHORITY = "authority"
TENANT_KINDS = ("exposed", "received", "both")


@dataclass(frozen=True, slots=True)
class PartyStatus:
    """One party: when its notice is due, how far it got, and whether it was late.
    ``counts`` says whether the party's notice is the one the incident's lateness is judged
    by (the controllers as processor; the authority as controller)."""

    party_kind: str
    party: str
    due_at: str
    due_rule: str
    counts: bool
    notice_id: str | None
    state: str  # not prepared | prepared | approved | sent | acknowledged
    prepared_at: str | None
    approved_at: str | None
    sent_at: str | None
    channel: str | None
    acknowledged_at: str | None
    deletion_confirmed_at: str | None
    notices: int
    sent_after_h: float | None  # hours from awareness to the sent notice: the delay counted
    late: bool
    overdue: bool | None


@dataclass(frozen=True, slots=True)
class IncidentFacts:
    """An incident's id, deployment and close, with its awareness and deadline as logged
    (:func:`collector.cases.facts.as_logged`)."""

    id: int
    deployment_id: str
    awareness_at: int
    deadline_at: int
    closed_at: int | None


def incident_facts(conn: Connection, incident_id: int) -> IncidentFacts:
    i = m.Incident
    r = conn.execute(
        select(
            i.id,
            i.deployment_id,
            type_coerce(i.awareness_at, BigInteger).label("awareness_at"),
            type_coerce(i.deadline_at, BigInteger).label("deadline_at"),
            type_coerce(i.closed_at, BigInteger).label("closed_at"),
        ).where(i.id == incident_id)
    ).one_or_none()
    if r is None:
        raise NotFound(f"no incident {incident_id}")
    awareness, deadline = as_logged(conn, r.id, r.awareness_at, r.deadline_at)
    return IncidentFacts(r.id, r.deployment_id, awareness, deadline, r.closed_at)


def affected_tenants(conn: Connection, inc: IncidentFacts) -> dict[str, str]:
    """Tenant -> ``exposed`` | ``received`` | ``both``: the incident's cross-tenant stale reads
    (the window a breach report of it covers)."""
    from collector.reports.breach import previous_close  # breach imports this module

    p = m.PageEvent
    ts = type_coerce(p.ts, BigInteger)
    q = select(p.tenant, p.other_tenant).where(
        p.kind == "page.stale_read",
        p.cross_tenant.is_(True),
        p.deployment_id == inc.deployment_id,
        ts >= (previous_close(conn, inc.deployment_id, inc.id) or 0),
    )
    if inc.closed_at is not None:
        q = q.where(ts < inc.closed_at)
    sides: dict[str, set[str]] = {}
    for reader, owner in conn.execute(q.distinct()).all():
        if owner:
            sides.setdefault(owner, set()).add("exposed")
        if reader:
            sides.setdefault(reader, set()).add("received")
    return {t: "both" if len(s) == 2 else next(iter(s)) for t, s in sorted(sides.items())}


def parties(conn: Connection, inc: IncidentFacts, settings: Settings) -> dict[str, str]:
    """Party -> kind, tenants first (by name), then the authority when controller."""
    out = affected_tenants(conn, inc)
    if settings.operator_role == "controller":
        out[settings.supervisory_authority] = AUTHORITY
    return out


def party_status(
    conn: Connection, incident_id: int, settings: Settings, *, now: datetime | None = None
) -> list[PartyStatus]:
    """Every party of the incident (and any other that was sent a notice), with its status."""
    inc = incident_facts(conn, incident_id)
    kinds = parties(conn, inc, settings)
    by_party: dict[str, list[Notification]] = {}
    for n in notifications_for(conn, incident_id):
        by_party.setdefault(n.party, []).append(n)
        kinds.setdefault(n.party, n.party_kind)
    target_us = int(settings.controller_notice_target_h * 3600e6)
    controller = settings.operator_role == "controller"
    out = []
    for party, kind in kinds.items():
        if kind == AUTHORITY:
            due = inc.deadline_at
            rule = "GDPR Art. 33(1): to the supervisory authority by the incident's deadline"
            counts = True
        else:
            due = inc.awareness_at + target_us
            hours = f"{settings.controller_notice_target_h:g} h"
            rule = (
                f"kvwatch target: {hours} from awareness (KVWATCH_CONTROLLER_NOTICE_TARGET_H)"
                + ("" if controller else "; GDPR Art. 33(2): without undue delay")
            )
            counts = not controller
        out.append(
            _status(party, kind, due, rule, counts, by_party.get(party, []), now, inc.awareness_at)
        )
    return out


def _status(
    party: str,
    kind: str,
    due_us: int,
    rule: str,
    counts: bool,
    notes: list[Notification],
    now: datetime | None,
    awareness_us: int,
) -> PartyStatus:
    # The notice that counts: the first one sent (it started the party's clock); else the
    # latest prepared (what is in the works).
    sent = sorted((n for n in notes if n.sent_at), key=lambda n: n.sent_at or "")
    current = sent[0] if sent else (notes[-1] if notes else None)
    acks = sorted(n.acknowledged_at for n in notes if n.acknowledged_at)
    deleted = sorted(n.deletion_confirmed_at for n in notes if n.deletion_confirmed_at)
    sent_us = to_micros(parse_iso(current.sent_at)) if current and current.sent_at else None
    late = sent_us is not None and sent_us > due_us
    overdue = None if now is None else (sent_us is None and to_micros(now) > due_us)
    return PartyStatus(
        party_kind=kind,
        party=party,
        due_at=str(iso(due_us)),
        due_rule=rule,
        counts=counts,
        notice_id=current.notice_id if current else None,
        state=current.state if current else "not prepared",
        prepared_at=current.prepared_at if current else None,
        approved_at=current.approved_at if current else None,
        sent_at=current.sent_at if current else None,
        channel=current.channel if current else None,
        acknowledged_at=acks[0] if acks else None,
        deletion_confirmed_at=deleted[0] if deleted else None,
        notices=len(notes),
        sent_after_h=None if sent_us is None else round((sent_us - awareness_us) / 3600e6, 2),
        late=late,
        overdue=overdue,
    )


def late_parties(statuses: list[PartyStatus]) -> list[PartyStatus]:
    """The parties whose notice, counted for the incident's lateness, was sent late."""
    return [s for s in statuses if s.counts and s.late]


@dataclass(frozen=True, slots=True)
class Duty:
    """The operator's own notification clock for an incident, decided once from the role and
    the parties: what every view shows as "notify by" (the incident card, ``kvwatch incidents
    list``, the demo, the case document).

    As processor: each affected customer (controller) without undue delay (Art. 33(2)), so
    ``due_at`` is the earliest due time of a counting party not yet sent a notice (or, all
    sent, the earliest due time), and ``controller_clock`` says the 72 hours are the
    controller's own, from its awareness. As controller: the supervisory authority by the
    incident's logged deadline (Art. 33(1)). ``pending`` names the counting parties not yet
    sent a notice."""

    role: str
    due_at: str
    rule: str
    pending: tuple[str, ...]
    controller_clock: str | None


def duty(settings: Settings, inc: IncidentFacts, statuses: list[PartyStatus]) -> Duty:
    counting = [p for p in statuses if p.counts]
    pending = tuple(p.party for p in counting if p.sent_at is None)
    if settings.operator_role == "controller":
        return Duty(
            role="controller",
            due_at=str(iso(inc.deadline_at)),
            rule="GDPR Art. 33(1): the supervisory authority within 72 hours of awareness",
            pending=pending,
            controller_clock=None,
        )
    dues = [p.due_at for p in counting if p.sent_at is None] or [p.due_at for p in counting]
    target_us = int(settings.controller_notice_target_h * 3600e6)
    due = min(dues) if dues else str(iso(inc.awareness_at + target_us))
    return Duty(
        role="processor",
        due_at=due,
        rule=(
            "GDPR Art. 33(2): each affected customer (the controller) without undue delay; "
            f"kvwatch's target {settings.controller_notice_target_h:g} h from awareness"
        ),
        pending=pending,
        controller_clock=(
            "Each customer's own 72 hours to its supervisory authority (Art. 33(1)) start "
            "when it becomes aware, at the latest on our notice."
        ),
    )
