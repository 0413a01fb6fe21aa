"""The incident's case register through the real collector (SQLite and PostgreSQL): its facts
as evidence (awareness and deadline changed only with who and why; a database edit fails
``kvwatch audit verify``), each party's notification (prepare, approve, send, ack,
confirm-deletion; signed; audit-logged in order), lateness judged from the register and not
from when a report is generated, and the decision register.

The incident is the breach tests' one: globex read acme's pages (acme exposed, globex
received), initech a bystander.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update
from typer.testing import CliRunner

from collector import models as m
from collector.cases.decisions import DecisionService
from collector.cases.notifications import NotificationService, notice_bytes
from collector.db import Database
from collector.errors import Conflict, InvalidInput, NotFound
from collector.reports.breach import BreachScope, BreachService
from collector.reports.breach_model import to_document
from collector.settings import Settings
from collector.signing import load_key_set, sha256_bytes, sha256_file, verify
from collector.timefmt import iso, parse_iso
from kvwatch.cli import app as cli
from tests import factories as f
from tests.conftest import Collector
from tests.test_report_breach import _events


@dataclass
class Env:
    c: Collector
    admin: httpx.Client
    db: Database
    incident_id: int
    keys: Path

    def settings(self, **kw: Any) -> Settings:
        kw.setdefault("dpo_contact", "Data protection officer, dpo@operator.example")
        return Settings(database_url=self.c.db_url, signing_key_dir=self.keys, **kw)

    def record_a_measure(self, now: datetime) -> None:
        """A tenant notice states the measures from the register; with none it is a draft,
        which is not approved or sent."""
        DecisionService(self.db).decide(
            self.incident_id,
            kind="containment",
            status="done",
            what="prompts above the prefill pool refused at the gateway",
            why="no further stale reads",
            by="on-call",
            now=now,
        )


@pytest.fixture
def env(collector: Collector, tmp_path: Path) -> Iterator[Env]:
    admin = collector.client(collector.admin)
    with collector.client(collector.ingest) as ingest:
        r = ingest.post("/v1/events", json=[f.as_json(e) for e in _events()])
        assert r.status_code == 200, r.text
    (inc,) = admin.get("/v1/incidents").json()
    db = Database(collector.db_url)
    yield Env(collector, admin, db, inc["id"], tmp_path / "keys")
    admin.close()
    db.dispose()


def run(env: Env, *args: str, **env_vars: str) -> Any:
    return CliRunner().invoke(
        cli,
        [*args, "--database-url", env.c.db_url],
        env={"KVWATCH_SIGNING_KEY_DIR": str(env.keys), **env_vars},
    )


def _audit(env: Env, prefix: str = "incident.") -> list[tuple[str, str, dict[str, Any]]]:
    a = m.AuditEntry
    with env.db.read() as conn:
        rows = conn.execute(
            select(a.action, a.actor, a.detail).where(a.action.like(prefix + "%")).order_by(a.id)
        ).all()
    return [(r.action, r.actor, json.loads(r.detail)) for r in rows]


def _count(env: Env, model: Any) -> int:
    with env.db.read() as conn:
        return int(conn.execute(select(func.count()).select_from(model)).scalar_one())


def _incident(env: Env) -> Any:
    with env.db.read() as conn:
        return conn.execute(
            select(m.Incident.awareness_at, m.Incident.deadline_at).where(
                m.Incident.id == env.incident_id
            )
        ).one()


# ---------------------------------------------------------------- the incident's facts


def test_a_database_edit_to_the_deadline_fails_audit_verify(env: Env) -> None:
    opened = [d for a, _, d in _audit(env) if a == "incident.opened"]
    inc = _incident(env)
    assert opened[0]["awareness_at"] == iso(inc.awareness_at)
    assert opened[0]["deadline_at"] == iso(inc.deadline_at)
    res = run(env, "audit", "verify")
    assert res.exit_code == 0, res.output

    later = inc.deadline_at + timedelta(days=3)
    with env.db.write() as conn:
        conn.execute(
            update(m.Incident).where(m.Incident.id == env.incident_id).values(deadline_at=later)
        )
    res = run(env, "audit", "verify")
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert f"incident {env.incident_id} deadline_at" in text
    assert iso(later) in text and iso(inc.deadline_at) in text
    # a report's clock is the logged one: the edit does not move it
    report = BreachService(env.db, env.settings()).build(
        BreachScope(incident_id=env.incident_id), now=datetime.now(UTC)
    )
    assert report.timeline.deadline_at == iso(inc.deadline_at)
    r = env.admin.get("/v1/audit/verify")
    assert r.status_code == 200 and r.json()["ok"] is False
    assert f"incident {env.incident_id} deadline_at" in r.json()["problem"]

    # the same value set through the command, with who and why, is the logged fact
    res = run(
        env,
        *("incidents", "set-deadline", str(env.incident_id), "--at", iso(later)),
        *("--why", "the controller agreed an extension", "--by", "dpo@op.example"),
    )
    assert res.exit_code == 0, res.output
    assert run(env, "audit", "verify").exit_code == 0
    (change,) = [(who, d) for a, who, d in _audit(env) if a == "incident.fact_changed"]
    assert change[0] == "dpo@op.example"
    assert change[1] == {
        "field": "deadline_at",
        "old": iso(later),  # what the database held: edited outside kvwatch, and so named
        "logged_before": iso(inc.deadline_at),
        "new": iso(later),
        "why": "the controller agreed an extension",
    }

    # awareness, through the API
    aware = inc.awareness_at - timedelta(hours=2)
    r = env.admin.post(
        f"/v1/incidents/{env.incident_id}/facts",
        json={"field": "awareness_at", "at": iso(aware), "why": "first ticket", "by": "ops"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["new"] == iso(aware)
    assert run(env, "audit", "verify").exit_code == 0
    with env.db.write() as conn:
        conn.execute(
            update(m.Incident)
            .where(m.Incident.id == env.incident_id)
            .values(awareness_at=inc.awareness_at)
        )
    res = run(env, "audit", "verify")
    assert res.exit_code == 1 and f"incident {env.incident_id} awareness_at" in " ".join(
        res.output.split()
    )


def test_bad_fact_changes_are_refused_and_store_nothing(env: Env) -> None:
    before = _audit(env)
    inc = _incident(env)
    cases = [
        (("set-deadline", "999", "--at", "2026-12-01T00:00:00Z"), "no incident 999"),
        (("set-deadline", str(env.incident_id), "--at", "tomorrow"), "not an ISO 8601"),
        (("set-deadline", str(env.incident_id), "--at", "2000-01-01T00:00:00Z"), "after"),
    ]
    for args, msg in cases:
        res = run(env, "incidents", *args, "--why", "x", "--by", "ops")
        assert res.exit_code == 2, res.output
        assert msg in " ".join(res.output.split())
    res = run(
        env,
        "incidents",
        "set-deadline",
        str(env.incident_id),
        "--at",
        iso(inc.deadline_at),
        "--why",
        " ",
        "--by",
        "ops",
    )
    assert res.exit_code == 2 and "why" in res.output
    r = env.admin.post(
        f"/v1/incidents/{env.incident_id}/facts",
        json={"field": "opened_at", "at": iso(inc.deadline_at), "why": "x"},
    )
    assert r.status_code == 422
    assert _audit(env) == before
    assert _incident(env).deadline_at == inc.deadline_at


# ---------------------------------------------------------------- notifications


def test_processor_notifies_each_controller_step_by_step(env: Env, tmp_path: Path) -> None:
    s = env.settings(controller_notice_target_h=12)
    svc = NotificationService(env.db, s)
    inc = _incident(env)
    aware = inc.awareness_at
    st = {p.party: p for p in svc.status(env.incident_id)}
    assert {k: v.party_kind for k, v in st.items()} == {"acme": "exposed", "globex": "received"}
    assert st["acme"].due_at == iso(aware + timedelta(hours=12))
    assert st["acme"].state == "not prepared" and st["acme"].late is False
    assert "Art. 33(2)" in st["acme"].due_rule

    t = aware + timedelta(hours=1)
    # nothing recorded in the decision register yet: the notice is a draft, not approved
    draft = svc.prepare(env.incident_id, "acme", by="alice", now=t)
    assert draft.notice["draft"] is True and draft.notice["draft_because"]
    with pytest.raises(Conflict, match="is a draft"):
        svc.step(draft.notification.notice_id, "approve", by="bob", now=t)
    env.record_a_measure(t)
    acme = svc.prepare(env.incident_id, "acme", by="alice", now=t)
    assert acme.notice["draft"] is False
    globex = svc.prepare(env.incident_id, "globex", by="alice", now=t)
    assert acme.notification.notice_id.startswith("ntc_")
    assert acme.notice["notice_id"] == acme.notification.notice_id
    assert acme.notice["tenant"] == "acme" and "globex" not in acme.notice_json.decode()

    # out of order: refused, nothing written
    before = (_audit(env), svc.listing(env.incident_id))
    with pytest.raises(Conflict, match="approve it first"):
        svc.step(globex.notification.notice_id, "send", by="bob", channel="email", now=t)
    with pytest.raises(Conflict, match="not sent"):
        svc.step(globex.notification.notice_id, "confirm-deletion", by="globex dpo", now=t)
    with pytest.raises(InvalidInput, match="nothing for it to delete"):
        svc.step(acme.notification.notice_id, "confirm-deletion", by="x", now=t)
    with pytest.raises(InvalidInput, match="channel"):
        svc.step(globex.notification.notice_id, "approve", by="bob", channel="email", now=t)
    with pytest.raises(NotFound, match="no notice ntc_nope"):
        svc.step("ntc_nope", "approve", by="bob", now=t)
    assert (_audit(env), svc.listing(env.incident_id)) == before

    nid = globex.notification.notice_id
    svc.step(nid, "approve", by="bob", now=t + timedelta(minutes=10))
    sent = svc.step(
        nid, "send", by="carol", channel="email to dpo@globex", now=t + timedelta(hours=2)
    )
    assert (sent.state, sent.channel, sent.sent_by) == ("sent", "email to dpo@globex", "carol")
    svc.step(nid, "ack", by="globex dpo", now=t + timedelta(hours=3))
    svc.step(nid, "confirm-deletion", by="globex dpo", now=t + timedelta(hours=20))
    steps = [(a, who) for a, who, d in _audit(env) if d.get("notice_id") == nid]
    assert steps == [
        ("incident.notice_prepared", "alice"),
        ("incident.notice_approved", "bob"),
        ("incident.notice_sent", "carol"),
        ("incident.notice_acknowledged", "globex dpo"),
        ("incident.deletion_confirmed", "globex dpo"),
    ]
    st = {p.party: p for p in svc.status(env.incident_id, now=t + timedelta(days=5))}
    g = st["globex"]
    assert (g.state, g.late, g.overdue) == ("acknowledged", False, False)
    assert g.sent_at == iso(t + timedelta(hours=2))
    assert g.sent_after_h == 3.0  # awareness -> sent: the delay Art. 33(2) asks about
    assert g.deletion_confirmed_at == iso(t + timedelta(hours=20))
    # acme: prepared, never sent: overdue now, never "late" (late is a recorded fact)
    assert (st["acme"].state, st["acme"].late, st["acme"].overdue) == ("prepared", False, True)

    # the signature covers the stored notice; the file written verifies against it
    res = run(env, "incidents", "notify", "approve", acme.notification.notice_id, "--by", "bob")
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    res = run(
        env,
        *("incidents", "notify", "send", acme.notification.notice_id, "--by", "carol"),
        *("--channel", "portal", "--out", str(out)),
    )
    assert res.exit_code == 0, res.output
    sig = (out / f"{acme.notification.notice_id}.sig").read_text()
    v = verify(sig, load_key_set(env.keys))
    assert v.claims["sub"] == f"notice:{acme.notification.notice_id}"
    assert v.claims["files"] == {
        f"{acme.notification.notice_id}.json": sha256_file(
            out / f"{acme.notification.notice_id}.json"
        )
    }
    assert (
        v.claims["files"][f"{acme.notification.notice_id}.json"] == acme.notification.notice_sha256
    )
    assert v.claims["conclusions"]["tenant"] == "acme"
    assert v.claims["conclusions"]["incident.id"] == env.incident_id
    # all of it is signed: a forged contact point or legal basis is named by its path
    name = acme.notification.notice_id
    forged = tmp_path / "forged"
    forged.mkdir()
    doc = json.loads((out / f"{name}.json").read_text())
    doc["contact"], doc["legal_basis"] = "someone else", "none"
    (forged / f"{name}.json").write_text(json.dumps(doc))
    (forged / f"{name}.sig").write_text(sig)
    res = run(env, "report", "verify", str(forged / f"{name}.json"), "--keys", str(env.keys))
    assert res.exit_code == 1, res.output
    assert "contact: signed" in res.output and "legal_basis: signed" in res.output
    assert "not signed" not in res.output
    assert sha256_bytes(notice_bytes(acme.notice)) == acme.notification.notice_sha256
    # sent (now) within 12 h of awareness (the incident opened now): not late
    st = {p.party: p for p in svc.status(env.incident_id)}
    assert (st["acme"].state, st["acme"].channel, st["acme"].late) == ("sent", "portal", False)

    res = run(env, "incidents", "notify", "list", str(env.incident_id))
    assert res.exit_code == 0, res.output
    assert "acme" in res.output and "portal" in res.output and "acknowledged" in res.output


def test_bad_notification_inputs_store_nothing(env: Env) -> None:
    before = (_audit(env), _count(env, m.IncidentNotification))
    res = run(env, "incidents", "notify", "prepare", "999", "--party", "acme", "--by", "a")
    assert res.exit_code == 2 and "no incident 999" in res.output
    res = run(
        env,
        "incidents",
        "notify",
        "prepare",
        str(env.incident_id),
        "--party",
        "initech",
        "--by",
        "a",
    )
    assert res.exit_code == 2, res.output
    assert "not a party" in res.output and "acme, globex" in res.output
    # the authority is a party only when the operator is the controller
    res = run(
        env,
        "incidents",
        "notify",
        "prepare",
        str(env.incident_id),
        "--party",
        "supervisory authority",
        "--by",
        "a",
    )
    assert res.exit_code == 2 and "not a party" in res.output
    res = run(env, "incidents", "notify", "send", "ntc_unknown", "--by", "a", "--channel", "x")
    assert res.exit_code == 2 and "no notice ntc_unknown" in res.output
    r = env.admin.post(f"/v1/incidents/{env.incident_id}/notifications", json={"party": "nobody"})
    assert r.status_code == 422 and "not a party" in r.json()["error"]["message"]
    assert (_audit(env), _count(env, m.IncidentNotification)) == before


def test_the_controller_notifies_the_authority_by_the_deadline(env: Env) -> None:
    s = env.settings(operator_role="controller", supervisory_authority="CNIL")
    svc = NotificationService(env.db, s)
    inc = _incident(env)
    st = {p.party: p for p in svc.status(env.incident_id)}
    assert st["CNIL"].party_kind == "authority"
    assert st["CNIL"].due_at == iso(inc.deadline_at) and st["CNIL"].counts
    assert st["acme"].counts is False

    # through the API: prepare, approve, send (after the deadline), ack
    prep = env.admin.post(
        f"/v1/incidents/{env.incident_id}/notifications", json={"party": "acme", "by": "alice"}
    )
    assert prep.status_code == 201, prep.text  # the API's settings: processor role
    auth = svc.prepare(
        env.incident_id, "CNIL", by="alice", now=inc.awareness_at + timedelta(hours=1)
    )
    assert auth.notice["kind"] == "authority" and auth.notice["art34"]["verdict"]
    nid = auth.notification.notice_id
    steps = f"/v1/incidents/{env.incident_id}/notifications/steps"
    r = env.admin.post(steps, json={"notice_id": nid, "step": "send", "channel": "portal"})
    assert r.status_code == 409 and "approve it first" in r.json()["error"]["message"]
    r = env.admin.post(steps, json={"notice_id": nid, "step": "approve", "by": "bob"})
    assert r.status_code == 200 and r.json()["state"] == "approved"
    late_at = inc.deadline_at + timedelta(hours=5)
    svc.step(nid, "send", by="carol", channel="CNIL portal", now=late_at)
    r = env.admin.post(steps, json={"notice_id": nid, "step": "ack", "by": "CNIL desk"})
    assert r.status_code == 200 and r.json()["state"] == "acknowledged"

    build = BreachService(env.db, s).build
    first = to_document(build(BreachScope(incident_id=env.incident_id), now=late_at))
    again = to_document(
        build(BreachScope(incident_id=env.incident_id), now=late_at + timedelta(days=5))
    )
    for doc in (first, again):
        assert doc["timeline"]["late"] is True
        assert "CNIL" in doc["timeline"]["late_reason"]
        assert "Art. 33(1)" in doc["timeline"]["deadline_rule"]
    assert first["timeline"] == again["timeline"]
    assert first["art34"] == again["art34"]
    case = env.admin.get(f"/v1/incidents/{env.incident_id}/case").json()
    # the app runs as processor; a party once notified stays in the register
    assert {p["party"]: p["late"] for p in case["parties"]} == {
        "acme": False,
        "globex": False,
        "CNIL": True,
    }


def test_a_report_regenerated_five_days_later_says_what_the_original_said(env: Env) -> None:
    s = env.settings()
    svc = NotificationService(env.db, s)
    inc = _incident(env)
    env.record_a_measure(inc.awareness_at + timedelta(minutes=30))
    for party in ("acme", "globex"):  # each controller told within the target
        p = svc.prepare(
            env.incident_id, party, by="alice", now=inc.awareness_at + timedelta(hours=1)
        )
        nid = p.notification.notice_id
        svc.step(nid, "approve", by="bob", now=inc.awareness_at + timedelta(hours=2))
        svc.step(nid, "send", by="bob", channel="email", now=inc.awareness_at + timedelta(hours=3))
    build = BreachService(env.db, s).build
    original = to_document(
        build(BreachScope(incident_id=env.incident_id), now=inc.awareness_at + timedelta(hours=4))
    )
    five_days = inc.deadline_at + timedelta(days=5)
    later = to_document(build(BreachScope(incident_id=env.incident_id), now=five_days))
    assert (
        original["timeline"]["deadline_at"]
        == later["timeline"]["deadline_at"]
        == iso(inc.deadline_at)
    )
    assert original["timeline"]["late"] is later["timeline"]["late"] is False
    assert later["timeline"]["late_reason"] is None
    assert original["art34"] == later["art34"]
    assert original["timeline"] == later["timeline"]
    assert "Art. 33(2)" in later["timeline"]["deadline_rule"]
    assert parse_iso(later["generated_at"]) > parse_iso(original["generated_at"])


# ---------------------------------------------------------------- decisions


def test_the_decision_register(env: Env) -> None:
    res = run(
        env,
        *("incidents", "decide", str(env.incident_id), "--kind", "containment", "--status", "done"),
        *(
            "--what",
            "prompts over 512 tokens refused",
            "--why",
            "stop further reads",
            "--by",
            "ops",
        ),
    )
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout)
    assert (first["kind"], first["status"], first["by"]) == ("containment", "done", "ops")
    r = env.admin.post(
        f"/v1/incidents/{env.incident_id}/decisions",
        json={
            "kind": "art34",
            "status": "done",
            "what": "no communication to data subjects",
            "why": "the exposed prompt held no special-category data",
            "supersedes": first["id"],
        },
    )
    assert r.status_code == 201, r.text
    before = (_audit(env), _count(env, m.IncidentDecision))
    bad = [
        (("--kind", "nonsense", "--status", "done"), "kind 'nonsense'"),
        (("--kind", "other", "--status", "maybe"), "status 'maybe'"),
        (
            ("--kind", "other", "--status", "open", "--supersedes", str(first["id"])),
            "already superseded",
        ),
        (("--kind", "other", "--status", "open", "--supersedes", "9999"), "no such decision"),
    ]
    for args, msg in bad:
        res = run(
            env,
            "incidents",
            "decide",
            str(env.incident_id),
            *args,
            "--what",
            "w",
            "--why",
            "y",
            "--by",
            "ops",
        )
        assert res.exit_code == 2, res.output
        assert msg in res.output
    res = run(
        env,
        "incidents",
        "decide",
        str(env.incident_id),
        "--kind",
        "other",
        "--status",
        "open",
        "--what",
        " ",
        "--why",
        "y",
        "--by",
        "ops",
    )
    assert res.exit_code == 2 and "what: must not be empty" in res.output
    res = run(
        env,
        "incidents",
        "decide",
        "999",
        "--kind",
        "other",
        "--status",
        "open",
        "--what",
        "w",
        "--why",
        "y",
        "--by",
        "ops",
    )
    assert res.exit_code == 2 and "no incident 999" in res.output
    assert (_audit(env), _count(env, m.IncidentDecision)) == before
    reg = DecisionService(env.db).listing(env.incident_id)
    assert [(d.kind, d.superseded) for d in reg] == [("containment", True), ("art34", False)]
    assert [a for a, _, _ in _audit(env) if a == "incident.decision"] == ["incident.decision"] * 2
    case = env.admin.get(f"/v1/incidents/{env.incident_id}/case").json()
    assert [d["kind"] for d in case["decisions"]] == ["containment", "art34"]
    assert case["deadline_at"] == iso(_incident(env).deadline_at)


def test_erasing_a_tenant_erases_it_from_the_register(env: Env) -> None:
    """A notice names its tenant; erasure (Art. 17) walks the register's tables as every
    other, and the audit chain still verifies."""
    svc = NotificationService(env.db, env.settings())
    p = svc.prepare(env.incident_id, "acme", by="alice", now=datetime.now(UTC))
    res = run(env, "erase", "--tenant", "acme", "--yes")
    assert res.exit_code == 0, res.output
    with env.db.read() as conn:
        party, notice = conn.execute(
            select(m.IncidentNotification.party, m.IncidentNotification.notice).where(
                m.IncidentNotification.notice_id == p.notification.notice_id
            )
        ).one()
    assert party != "acme" and '"acme"' not in notice
    assert run(env, "audit", "verify").exit_code == 0
