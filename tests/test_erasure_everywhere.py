"""Erasure (issue 20, item 4) against a database populated through every feature: the demo
replay, verifications, silences, acknowledged alerts, incidents closed with a reason, stored
breach and review reports, a tenant notice, outbox payloads and rollups. Afterwards neither
the tenant's name nor any of its request ids is in any column of any table (the audit
log's hashes excepted), and the audit chain still verifies; on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import select
from typer.testing import CliRunner

from collector import audit
from collector import models as m
from collector.db import Database
from collector.lifecycle.erasure import ERASED, Names
from collector.notify.outbox import add_endpoint
from collector.rollups.refresh import RollupRefresher
from collector.timefmt import now_micros
from kvwatch.cli import app
from tests.conftest import Collector
from tests.otlp_helpers import genai_span, tracer

runner = CliRunner()
# The demo's tenant whose pages the over-long prompt read (the exposed party of the stale
# read), so it is named in other tenants' evidence too.
HOOLI = "hooli"
# Hashes of the chain: they stay (and are hex, so they could not hold a name anyway).
HASHES = {("audit_log", "hash"), ("audit_log", "prev_hash"), ("audit_log", "detail_sha256")}


def cli(c: Collector, *args: str) -> Any:
    return runner.invoke(app, [*args, "--database-url", c.db_url])


def every_value(db_url: str) -> list[tuple[str, str, str]]:
    """(table, column, value) of every non-NULL value of every column of every table, the
    tables found by inspecting the database itself (not only the models)."""
    db = Database(db_url)
    out: list[tuple[str, str, str]] = []
    try:
        with db.read() as conn:
            meta = sa.MetaData()
            meta.reflect(conn)
            assert {t.name for t in meta.sorted_tables} >= set(m.Base.metadata.tables)
            for table in meta.sorted_tables:
                for row in conn.execute(select(table)):
                    for col, v in row._mapping.items():
                        if v is not None and (table.name, str(col)) not in HASHES:
                            out.append((table.name, str(col), str(v)))
    finally:
        db.dispose()
    return out


def found(values: list[tuple[str, str, str]], needles: set[str]) -> set[tuple[str, str]]:
    return {(t, c) for t, c, v in values if any(n in v for n in needles)}


def replay_demo(c: Collector, spool: Path) -> None:
    """``kvwatch demo``'s replay (both modes), its probe sending to this collector."""
    from engine_probe import Probe, ProbeSettings
    from kvwatch.demo import _engine, _replay

    probe = Probe(
        ProbeSettings(
            collector_url=c.url,
            ingest_token=c.ingest,
            probe_id="demo-probe",
            deployment_id="lab-legacy",
            probe_spool_dir=spool,
            probe_flush_interval_s=0.05,
        )
    )
    try:
        for mode in ("legacy", "hardened"):
            _replay(mode, _engine(mode, probe))
        probe.force_flush(30)
        deadline = time.monotonic() + 30
        while probe.stats()["sent"] < probe.stats()["emitted"]:
            assert time.monotonic() < deadline, probe.stats()
            time.sleep(0.05)
    finally:
        probe.shutdown(10)


def settle_rollups(db_url: str) -> None:
    """Recompute every marked rollup bucket now, the open one included (the refresher
    leaves a bucket to settle first)."""
    db = Database(db_url)
    try:
        RollupRefresher(db).refresh(everything=True)
    finally:
        db.dispose()


def populate(c: Collector, tmp_path: Path) -> set[str]:
    """Every feature that stores a tenant's name or request ids; returns HOOLI's ids."""
    db = Database(c.db_url)
    try:
        with db.write() as conn:  # before the replay, so its alerts are notified
            add_endpoint(conn, "sink", "http://127.0.0.1:9/hook", now_us=now_micros())
    finally:
        db.dispose()
    c.token("read", tenant=HOOLI)
    replay_demo(c, tmp_path / "spool")
    # its requests seen through OTLP too: the spans' trace ids are kept with its request ids
    with tracer(c.url, c.ingest, service="lab-otel") as t:
        for i in range(3):
            genai_span(t, request_id=f"{HOOLI}-otel-{i}", tenant=HOOLI)
        genai_span(t, request_id="acme-otel-0", tenant="acme")
    settle_rollups(c.db_url)
    db = Database(c.db_url)
    try:
        with db.read() as conn:
            ids = set(
                conn.execute(
                    select(m.Request.request_id).where(m.Request.tenant == HOOLI)
                ).scalars()
            )
    finally:
        db.dispose()
    assert ids, "the demo's tenants all send a request"
    rid = sorted(ids)[0]
    with c.client(c.admin) as h:
        (inc,) = h.get("/v1/incidents").json()
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "lab-legacy",
                "model_id": "glm-lab",
                "passed": False,
                "verified_safe_context": 8_000,
                "evidence": {
                    # kvwatch verify's owner->reader pairs: the name followed by "-"
                    "leak_pairs": [f"{HOOLI}->massive-dynamic", "acme->globex"],
                    "leaks": [{"owner": HOOLI, "reader": "massive-dynamic", "request_id": rid}],
                    HOOLI: {"requests": sorted(ids)},
                    "note": f"swept as {HOOLI} (first request {rid}); acme-eu untouched",
                },
            },
        )
        assert r.status_code == 201, r.text
        r = h.post(
            "/v1/silences",
            json={
                "matchers": [{"name": "previous_tenant", "value": HOOLI}],
                "duration": "1h",
                "comment": "while we look",
            },
        )
        assert r.status_code == 201, r.text
        r = h.post(
            "/v1/silences",
            json={
                "matchers": [{"name": "deployment_id", "value": "lab-legacy"}],
                "duration": "1h",
                "comment": f"request {rid} is being looked at",
            },
        )
        assert r.status_code == 201, r.text
        alerts = h.get("/v1/alerts").json()
        for a in alerts:
            if a["state"] != "resolved":
                r = h.post(f"/v1/alerts/{a['id']}/ack", json={"comment": f"seen {rid}."})
                assert r.status_code == 200, r.text
        for body in ({"kind": "breach", "incident_id": inc["id"]}, {"kind": "review"}):
            r = h.post("/v1/reports", json=body)
            assert r.status_code == 201, r.text
        r = h.get(f"/v1/incidents/{inc['id']}/notice", params={"tenant": HOOLI})
        assert r.status_code == 200, r.text
        r = h.post(
            f"/v1/incidents/{inc['id']}/close",
            json={"reason": f"{rid} of {HOOLI} was read by massive-dynamic ({rid}); notified."},
        )
        assert r.status_code == 200, r.text
    return ids


def stale_reads(db_url: str) -> list[tuple[str | None, str | None]]:
    """(reader, exposed party) of every stale read, in id order."""
    pe = m.PageEvent
    db = Database(db_url)
    try:
        with db.read() as conn:
            q = select(pe.tenant, pe.other_tenant).where(pe.kind == "page.stale_read")
            return [(t, o) for t, o in conn.execute(q.order_by(pe.id))]
    finally:
        db.dispose()


def test_erasure_leaves_neither_name_nor_request_ids_anywhere(
    collector: Collector, tmp_path: Path
) -> None:
    ids = populate(collector, tmp_path)
    before = every_value(collector.db_url)
    stale = stale_reads(collector.db_url)
    assert ("massive-dynamic", HOOLI) in stale
    named = found(before, {HOOLI})
    # what the features stored: each of these holds the name before erasure
    for table in (
        "requests",
        "request_rollups",
        "request_rollups_hourly",
        "page_events",
        "deployment_tenants",
        "api_tokens",
        "alerts",
        "outbox",
        "verifications",
        "silences",
        "incidents",
        "reports",
        "audit_log",
    ):
        assert any(t == table for t, _ in named), (table, named)
    assert ("otlp_spans", "request_id") in found(before, ids)
    assert ("incidents", "close_reason") in found(before, ids)
    assert ("silences", "comment") in found(before, ids)

    res = cli(collector, "erase", "--tenant", HOOLI, "--yes")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["request_ids"] == len(ids)
    assert out["removed"]["requests"] == 2 + 3  # one in each demo deployment, 3 through OTLP
    assert out["removed"]["otlp_spans"] == 3
    assert out["rewritten"]["verifications"] == 1 and out["rewritten"]["incidents"] == 1
    assert out["audit_log"]["redacted"] >= 3  # token.create, silence.create, notice.draft...
    assert out["audit_log"]["named_in_hashed_fields"] == []
    assert "hash" in out["kept"]["audit_log"]
    assert HOOLI not in res.stdout and not ids & set(res.stdout.split())

    after = every_value(collector.db_url)
    assert found(after, {HOOLI}) == set()
    assert found(after, ids) == set()
    # Other tenants keep their records and the evidence that someone's pages were read.
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            (evidence,) = conn.execute(select(m.Verification.evidence)).scalars()
            tenants = set(conn.execute(select(m.Request.tenant)).scalars())
            check = audit.verify(conn)
    finally:
        db.dispose()
    doc = json.loads(evidence)
    assert doc["leak_pairs"] == [f"{ERASED}->massive-dynamic", "acme->globex"]
    assert doc["leaks"] == [{"owner": ERASED, "reader": "massive-dynamic", "request_id": ERASED}]
    assert doc["note"].endswith("acme-eu untouched")
    assert tenants == {"acme", "globex", "initech", "umbrella", "massive-dynamic"}
    assert ("otlp_spans", "request_id") in found(after, {"acme-otel-0"})  # others' spans stay
    # the reader's stale reads all stay, the exposed party blanked
    assert stale_reads(collector.db_url) == [(t, None) for t, _ in stale]
    assert check.ok, check
    res = cli(collector, "audit", "verify")
    assert res.exit_code == 0, res.output
    # Idempotent: nothing is left to erase, and a second run says so and changes nothing.
    res = cli(collector, "erase", "--tenant", HOOLI, "--yes")
    assert res.exit_code == 2 and "no records of tenant" in res.output
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            erasures = conn.execute(
                select(sa.func.count()).where(m.AuditEntry.action == "tenant.erase")
            ).scalar_one()
    finally:
        db.dispose()
    assert erasures == 1


def test_a_tenant_named_only_in_verifications_silences_or_the_audit_log_is_erased(
    collector: Collector,
) -> None:
    only_verified, only_silenced, only_audited = "zed-verified", "zed-silenced", "zed-audited"
    with collector.client(collector.admin) as h:
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": "glm-5.3",
                "passed": False,
                "evidence": {"leak_pairs": [f"{only_verified}->globex"]},
            },
        )
        assert r.status_code == 201, r.text
        r = h.post(
            "/v1/silences",
            json={
                "matchers": [{"name": "reader_tenant", "value": only_silenced}],
                "duration": "1h",
                "comment": "known",
            },
        )
        assert r.status_code == 201, r.text
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            audit.append(
                conn,
                now_us=now_micros(),
                actor="cli",
                action="note",
                detail={"about": [only_audited]},
            )
    finally:
        db.dispose()
    res = cli(collector, "erase", "--tenant", "tenant-nobody", "--yes")
    assert res.exit_code == 2 and "no records of tenant" in res.output
    for tenant in (only_verified, only_silenced, only_audited):
        res = cli(collector, "erase", "--tenant", tenant, "--yes")
        assert res.exit_code == 0, (tenant, res.output)
        assert found(every_value(collector.db_url), {tenant}) == set(), tenant
    # globex is another tenant: only the erased one went from the pair
    assert ("verifications", "evidence") in found(every_value(collector.db_url), {"globex"})

    # A name in a field the chain hashes (here a subject, "kind:id") cannot go: it is listed.
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            audit.append(
                conn,
                now_us=now_micros(),
                actor="cli",
                action="notify.endpoint.add",
                subject="endpoint:zed-held",
                detail={"name": "zed-held"},
            )
            held = audit.last_id(conn)
    finally:
        db.dispose()
    res = cli(collector, "erase", "--tenant", "zed-held", "--yes")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["audit_log"]["named_in_hashed_fields"] == [held]
    assert out["audit_log"]["redacted"] == 1  # its detail
    assert found(every_value(collector.db_url), {"zed-held"}) == {("audit_log", "subject")}
    res = cli(collector, "erase", "--tenant", "zed-held", "--yes")
    assert res.exit_code == 2 and "1 audit entries name it" in res.output
    with collector.client(collector.admin) as h:
        assert h.get("/v1/audit/verify").json()["ok"] is True


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("globex->acme", f"{ERASED}->acme"),
        ("acme->globex", f"acme->{ERASED}"),
        ("globex", ERASED),
        ("read by globex, then r-7.", f"read by {ERASED}, then {ERASED}."),
        ("(r-7)", f"({ERASED})"),
        ("globex_x", "globex_x"),
        ("globex-eu and r-70 and tenant:globex", "globex-eu and r-70 and tenant:globex"),
        ("notice-globex.pdf", "notice-globex.pdf"),
        ("r-7-", ERASED),  # an id may end in punctuation: the longest one is taken
        ("globex.", f"{ERASED}."),
    ],
)
def test_the_rule_for_a_name_inside_a_text(text: str, expected: str) -> None:
    names = Names("globex", {"r-7", "r-7-"})
    assert names.scrub(text) == expected
    assert names.scrub({text: [text, 7, None]}) == {expected: [expected, 7, None]}


def test_every_table_naming_a_tenant_or_a_request_by_column_is_handled_by_a_step() -> None:
    """The walk skips columns named tenant, request_id and the like (their rows are the
    structural steps' to delete or blank): a new table with such a column that no step
    handles would keep them after an erasure. ``otlp_spans`` was such a table."""
    from collector.lifecycle.erasure import STEPS_COVER

    naming = {
        t.name
        for t in m.Base.metadata.sorted_tables
        for c in t.columns
        if c.name in ("tenant", "other_tenant", "reader_tenant", "owner_tenant")
        or c.name.endswith("request_id")
        or c.name == "prompt_shared_with"
    }
    assert naming - STEPS_COVER == set(), "handle these tables in collector.lifecycle.erasure"
    assert STEPS_COVER - naming == set(), "STEPS_COVER lists tables without such a column"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_after_erase_compact_the_sqlite_file_and_its_wal_hold_no_erased_bytes(
    collector: Collector, tmp_path: Path
) -> None:
    c = collector
    ids = populate(c, tmp_path)
    path = Path(c.db_url.removeprefix("sqlite:///"))
    distinctive = {HOOLI, *(i for i in ids if len(i) >= 8)}

    def on_disk() -> set[str]:
        data = b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
        return {n for n in distinctive if n.encode() in data}

    assert HOOLI in on_disk()
    res = cli(c, "erase", "--tenant", HOOLI, "--yes")
    assert res.exit_code == 0, res.output
    storage = json.loads(res.stdout)["storage"]
    assert storage["wal"] == "checkpointed and truncated", storage
    assert "earlier versions of rows" in storage["remains"], storage  # said, not hidden
    assert "may still hold the erased bytes" in res.stderr
    # another tenant then erased with --compact: the file is rewritten from its live rows
    res = cli(c, "erase", "--tenant", "globex", "--yes", "--compact")
    assert res.exit_code == 0, res.output
    storage = json.loads(res.stdout)["storage"]
    assert storage["vacuumed"] is True and "earlier versions" not in storage["remains"]
    assert on_disk() == set(), "erased values are still in the database file or its WAL"


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_on_postgresql_erase_says_what_remains_and_compact_vacuums(
    collector: Collector, tmp_path: Path
) -> None:
    c = collector
    populate(c, tmp_path)
    res = cli(c, "erase", "--tenant", HOOLI, "--yes")
    assert res.exit_code == 0, res.output
    storage = json.loads(res.stdout)["storage"]
    assert storage["backend"] == "postgresql" and storage["vacuumed_full"] == []
    assert "until VACUUM" in storage["remains"], storage
    res = cli(c, "erase", "--tenant", "globex", "--yes", "--compact")
    assert res.exit_code == 0, res.output
    storage = json.loads(res.stdout)["storage"]
    assert "requests" in storage["vacuumed_full"] and "audit_log" in storage["vacuumed_full"]
