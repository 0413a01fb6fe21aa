"""Retention and erasure through the CLI against a real collector (SQLite and PostgreSQL):
what goes, what an open incident keeps, the rollups after both, the audit log intact, and a
scan of every column of every table proving nothing of an erased tenant remains."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select
from typer.testing import CliRunner

from collector import audit
from collector import models as m
from collector.db import Database
from collector.notify.outbox import add_endpoint
from collector.timefmt import to_micros
from kvwatch.cli import app
from tests import factories as f
from tests.conftest import Collector, wait_rollups

runner = CliRunner()
NOW = datetime.now(UTC).replace(microsecond=0)
ZETA = "tenant-zeta"


def cli(c: Collector, *args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, [*args, "--database-url", c.db_url], env=env)


def send(c: Collector, *events: Any) -> None:
    with c.client(c.ingest) as h:
        r = h.post("/v1/events", json=[f.as_json(e) for e in events])
    assert r.status_code == 200, r.text


def days_ago(d: float) -> datetime:
    return NOW - timedelta(days=d)


def count(db_url: str, table: Any, *where: Any) -> int:
    db = Database(db_url)
    try:
        with db.read() as conn:
            return int(
                conn.execute(select(sa.func.count()).select_from(table).where(*where)).scalar_one()
            )
    finally:
        db.dispose()


def test_retention_deletes_old_data_and_keeps_what_an_open_incident_references(
    collector: Collector,
) -> None:
    a = {"dep": "dep-a", "probe": "probe-a"}
    b = {"dep": "dep-b", "probe": "probe-b"}
    send(
        collector,
        f.config(1, ts=days_ago(100), **a),
        # an exposed writer long ago, and the stale read of its pages 40 days ago: evidence
        f.admitted(2, "writer", "acme", 500, ts=days_ago(45), **a),
        f.admitted(3, "old", "acme", 600, ts=days_ago(50), **a),
        f.admitted(4, "reader", "globex", 700, ts=days_ago(40), **a),
        f.stale_read(
            5, ts=days_ago(40), reader_request_id="reader", previous_request_id="writer", **a
        ),
        f.admitted(6, "recent", "acme", 800, ts=days_ago(2), **a),
        f.pool(7, ts=days_ago(60), **a),
        f.pool(8, ts=days_ago(1), **a),
    )
    send(
        collector,
        f.config(1, ts=days_ago(100), **b),
        f.admitted(2, "b-old", "acme", 500, ts=days_ago(70), **b),
        f.admitted(3, "b-mid", "acme", 500, ts=days_ago(20), **b),
        f.pool(4, ts=days_ago(70), **b),
    )
    wait_rollups(collector.db_url)
    with collector.client(collector.admin) as h:
        (inc,) = h.get("/v1/incidents").json()
        assert inc["deployment_id"] == "dep-a" and inc["state"] == "open"

    res = cli(collector, "retention", "set", "--deployment", "dep-a", "--days", "30")
    assert res.exit_code == 0, res.output
    res = cli(collector, "retention", "set", "--deployment", "nope", "--days", "30")
    assert res.exit_code == 2 and "no deployment 'nope'" in res.output
    res = cli(collector, "retention", "set", "--deployment", "dep-a", "--days", "0")
    assert res.exit_code == 2 and "keep_days" in res.output
    env = {"KVWATCH_RETENTION_DAYS": "60"}  # dep-b has no policy of its own
    res = cli(collector, "retention", "show", env=env)
    assert "dep-a\t30 days\tpolicy" in res.stdout and "dep-b\t60 days\tdefault" in res.stdout

    dry = json.loads(cli(collector, "retention", "apply", "--dry-run", env=env).stdout)
    reqs = count(collector.db_url, m.Request)
    assert reqs == 6 and dry["dry_run"] is True

    out = json.loads(cli(collector, "retention", "apply", env=env).stdout)
    by_dep = {d["deployment_id"]: d for d in out["deployments"]}
    # dep-a: the open incident holds everything from an hour before its first stale read
    # (40 days ago) and the requests it names; "old" (50 days) goes, so does a 60-day sample.
    assert by_dep["dep-a"]["kept_for_incidents"] == [inc["id"]]
    assert by_dep["dep-a"]["deleted"] == {"requests": 1, "pool_samples": 1, "page_events": 0}
    assert by_dep["dep-b"]["deleted"] == {"requests": 1, "pool_samples": 1, "page_events": 0}
    assert [d["deleted"] for d in dry["deployments"]] == [d["deleted"] for d in out["deployments"]]
    left = {
        r
        for (r,) in Database(collector.db_url)
        .engine.connect()
        .execute(select(m.Request.request_id))
    }
    assert left == {"writer", "reader", "recent", "b-mid"}
    assert count(collector.db_url, m.PageEvent) == 1

    # The rollups follow: the refresher recomputes the marked buckets.
    wait_rollups(collector.db_url)
    with collector.client(collector.admin) as h:
        stats = h.get(
            "/v1/stats/prompt-tokens",
            params={"since": days_ago(200).isoformat(), "until": NOW.isoformat()},
        ).json()
    assert sum(x["requests"] for x in stats["routes"]) == 4
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            check = audit.verify(conn)
            actions = [a for (a,) in conn.execute(select(m.AuditEntry.action))]
    finally:
        db.dispose()
    assert check.ok, check
    assert actions.count("retention.set") == 1 and actions.count("retention.apply") == 2


def _every_text(db_url: str) -> list[tuple[str, str, str]]:
    """(table, column, value) of every non-NULL value of every column of every table."""
    db = Database(db_url)
    out = []
    try:
        with db.read() as conn:
            for table in m.Base.metadata.sorted_tables:
                for row in conn.execute(select(table)):
                    for col, v in row._mapping.items():
                        if v is not None:
                            out.append((table.name, str(col), str(v)))
    finally:
        db.dispose()
    return out


def test_erasing_a_tenant_leaves_nothing_of_it_in_any_table(collector: Collector) -> None:
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            add_endpoint(conn, "sink", "http://127.0.0.1:9/hook", now_us=to_micros(NOW))
    finally:
        db.dispose()
    zeta_token = collector.token("read", tenant=ZETA)
    exposed = {"previous_request_id": "z1", "previous_tenant": ZETA}
    from_globex = {"previous_request_id": "g2", "previous_tenant": "globex"}
    send(
        collector,
        f.config(1),
        f.admitted(2, "z1", ZETA, 5_000, data_categories=["health"]),
        f.admitted(3, "g1", "globex", 6_000),
        f.admitted(4, "g2", "globex", 7_000),
        # globex read zeta's pages: zeta is the exposed party of globex's evidence
        f.stale_read(5, reader_request_id="g1", reader_tenant="globex", **exposed),
        # and zeta read globex's
        f.stale_read(6, reader_request_id="z1", reader_tenant=ZETA, **from_globex),
    )
    wait_rollups(collector.db_url)
    with collector.client(collector.admin) as h:
        r = h.post(
            "/v1/silences",
            json={
                "matchers": [{"name": "reader_tenant", "value": ZETA}],
                "duration": "1h",
                "comment": f"quiet {ZETA} while we look",
            },
        )
        assert r.status_code == 201, r.text
        (inc,) = h.get("/v1/incidents").json()
        r = h.post("/v1/reports", json={"kind": "breach", "incident_id": inc["id"]})
        assert r.status_code == 201, r.text
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": "glm-5.3",
                "passed": True,
                "verified_safe_context": 600_000,
                "evidence": {"tenants": [ZETA, "globex"], "note": f"swept as {ZETA}"},
            },
        )
        assert r.status_code == 201, r.text
    assert any(ZETA in v for *_, v in _every_text(collector.db_url))

    res = cli(collector, "erase", "--tenant", ZETA)
    assert res.exit_code == 2 and "--yes" in res.output
    res = cli(collector, "erase", "--tenant", ZETA, "--yes")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    removed = out["removed"]
    assert removed["requests"] == 1 and removed["page_events"] == 1
    assert out["rewritten"]["page_events"] == 1 and removed["api_tokens"] == 1
    assert removed["alerts"] >= 1 and removed["reports"] == 1 and removed["silences"] == 1
    assert out["audit_log"]["redacted"] >= 1
    assert out["audit_log"]["named_in_hashed_fields"] == []

    leftovers = [(t, c) for t, c, v in _every_text(collector.db_url) if ZETA in v]
    assert leftovers == []
    # globex keeps its records, and the evidence that it received someone's pages.
    assert count(collector.db_url, m.Request, m.Request.tenant == "globex") == 2
    assert (
        count(
            collector.db_url,
            m.PageEvent,
            m.PageEvent.tenant == "globex",
            m.PageEvent.other_tenant.is_(None),
        )
        == 1
    )
    with collector.client(collector.admin) as h:
        check = h.get("/v1/audit/verify").json()
    assert check["ok"] is True, check
    with collector.client(zeta_token) as h:
        assert h.get("/v1/requests").status_code == 401  # its token went too
    res = cli(collector, "erase", "--tenant", ZETA, "--yes")
    assert res.exit_code == 2 and "no records of tenant" in res.output


def test_a_redaction_nobody_claims_breaks_the_chain(collector: Collector) -> None:
    collector.token("read", tenant="acme")  # a token.create entry naming acme
    db = Database(collector.db_url)
    try:
        with db.write() as conn:
            (eid,) = conn.execute(
                select(m.AuditEntry.id)
                .where(m.AuditEntry.action == "token.create")
                .order_by(m.AuditEntry.id.desc())
                .limit(1)
            ).one()
            # "redacted" by an entry that does not exist (or does not list it): caught
            conn.execute(
                sa.update(m.AuditEntry)
                .where(m.AuditEntry.id == eid)
                .values(detail=audit.redaction_marker(eid + 1000), redacted_by=eid + 1000)
            )
        with db.read() as conn:
            check = audit.verify(conn)
    finally:
        db.dispose()
    assert not check.ok and check.first_bad_id == eid, check


def test_token_use_is_audited_once_per_interval(collector: Collector) -> None:
    reader = collector.token("read")
    for _ in range(3):
        with collector.client(reader) as h:
            assert h.get("/v1/deployments").status_code == 200
    with collector.client("kvw_read_not-a-real-token") as h:
        assert h.get("/v1/deployments").status_code == 401
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            rows = conn.execute(
                select(m.AuditEntry.action, m.AuditEntry.subject, m.AuditEntry.actor).where(
                    m.AuditEntry.action.in_(("token.create", "token.use"))
                )
            ).all()
            stored = [r for (r,) in conn.execute(select(m.ApiToken.token_hash))]
    finally:
        db.dispose()
    created = {s for a, s, _ in rows if a == "token.create"}
    used = [s for a, s, _ in rows if a == "token.use"]
    # the admin token (used by the fixture's calls) and the reader, each once
    assert len(used) == len(set(used)) and set(used) <= created
    reader_id = next(s for a, s, _ in reversed(rows) if a == "token.create")
    assert reader_id in used
    # stored hashed: neither secret appears, only its SHA-256
    assert reader not in stored and all(len(h) == 64 for h in stored)
