"""Inventory, limits card and the audit log, through the real collector (SQLite and
PostgreSQL) and the CLI: figures checked against what was ingested, tenant isolation, a real
config and verification, and a tampered audit log caught and named."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pypdf
import pytest
from sqlalchemy import delete, insert, select, update
from typer.testing import CliRunner

from collector import audit
from collector import models as m
from collector.db import Database
from collector.timefmt import to_micros
from kvwatch.cli import app
from tests import factories as f
from tests.conftest import Collector
from tests.pdf_helpers import assert_renders

runner = CliRunner()
MODEL = "glm-5.3"
SINCE = f.T0.isoformat()
UNTIL = (f.T0 + timedelta(hours=1)).isoformat()


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def send(c: Collector, *events: Any) -> None:
    with c.client(c.ingest) as h:
        r = h.post("/v1/events", json=[f.as_json(e) for e in events])
    assert r.status_code == 200, r.text


def _traffic(c: Collector) -> None:
    chat, emb = "/v1/chat/completions", "/v1/embeddings"
    send(
        c,
        f.admitted(1, "a1", "acme", 1_000, route=chat),
        f.admitted(2, "a2", "acme", 600_000, route=chat),
        f.admitted(3, "a3", "acme", 700_000, route=emb),
        f.admitted(4, "g1", "globex", 650_000, route=chat),
        f.admitted(5, "g2", "globex", 10, route=chat),
        f.admitted(6, "o1", "acme", 900_000, route=chat, model_id="other-model"),
        f.admitted(7200, "late", "acme", 990_000, route=chat),  # two hours in: outside
        f.finished(8, "a1", "acme"),
    )


def test_inventory_counts_per_tenant_and_route(collector: Collector) -> None:
    _traffic(collector)
    with collector.client(collector.admin) as h:
        r = h.get(
            "/v1/inventory",
            params={
                "model_id": MODEL,
                "since": SINCE,
                "until": UNTIL,
                "min_prompt_tokens": 600_000,
            },
        )
    assert r.status_code == 200, r.text
    doc = r.json()
    rows = {(x["tenant"], x["route"]): x for x in doc["rows"]}
    assert set(rows) == {
        ("acme", "/v1/chat/completions"),
        ("acme", "/v1/embeddings"),
        ("globex", "/v1/chat/completions"),
    }
    acme = rows[("acme", "/v1/chat/completions")]
    assert (acme["requests"], acme["at_or_above"], acme["max_prompt_tokens"]) == (2, 1, 600_000)
    assert acme["first_seen"].startswith("2026-08-27T12:00:01")
    assert acme["last_seen"].startswith("2026-08-27T12:00:08")  # a1 finished at seq 8
    g = rows[("globex", "/v1/chat/completions")]
    assert (g["requests"], g["at_or_above"], g["max_prompt_tokens"]) == (2, 1, 650_000)
    assert doc["totals"] == {
        "requests": 5,
        "prompts": 5,
        "at_or_above": 3,
        "max_prompt_tokens": 700_000,
        "tenants": 2,
        "routes": 2,
    }

    # a tenant-scoped read token sees its own rows only, and cannot ask for more
    scoped = collector.token("read", tenant="globex")
    with collector.client(scoped) as h:
        mine = h.get("/v1/inventory", params={"model_id": MODEL, "since": SINCE, "until": UNTIL})
        assert mine.status_code == 200, mine.text
        assert {x["tenant"] for x in mine.json()["rows"]} == {"globex"}
        assert mine.json()["totals"]["requests"] == 2
        assert h.get("/v1/audit/verify").status_code == 403
    with collector.client(collector.ingest) as h:
        r = h.get("/v1/inventory", params={"model_id": MODEL, "since": SINCE, "until": UNTIL})
        assert r.status_code == 403

    # bad arguments: the collector's error shape
    with collector.client(collector.admin) as h:
        for params, field in (
            ({"model_id": MODEL, "since": UNTIL, "until": SINCE}, "since"),
            ({"model_id": MODEL, "since": SINCE, "until": UNTIL, "tenant": "acme"}, "tenant"),
            ({"model_id": MODEL, "since": SINCE}, "until"),
            ({"model_id": MODEL, "since": "yesterday", "until": UNTIL}, "since"),
            ({"model_id": MODEL, "since": SINCE, "until": UNTIL, "min_prompt_tokens": -1}, None),
        ):
            r = h.get("/v1/inventory", params=params)
            assert r.status_code == 422, (params, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_input" and err["message"]
            if field is not None:
                assert field in err["message"], err

    # the CLI: the same figures as JSON and as a table; bad arguments exit 2
    res = cli(
        "report", "inventory", "--model", MODEL, "--since", SINCE, "--until", UNTIL,
        "--min-prompt-tokens", "600000", "--json", "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["totals"] == doc["totals"]
    res = cli(
        "report", "inventory", "--model", MODEL, "--since", SINCE, "--until", UNTIL,
        "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "globex" in res.stdout and "650000" in res.stdout
    res = cli(
        "report", "inventory", "--model", MODEL, "--since", UNTIL, "--until", SINCE,
        "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 2 and "must be before until" in res.output
    res = cli("report", "inventory", "--model", MODEL, "--since", "nope", "--until", UNTIL)
    assert res.exit_code == 2 and "ISO 8601" in res.output
    res = cli("report", "inventory", "--model", MODEL, "--since", SINCE, "--until", UNTIL, "--x")
    assert res.exit_code == 2


def test_inventory_counts_a_shared_prompt_once(collector: Collector) -> None:
    """vLLM's n=3 fan-out: three requests of one prompt (children 1 and 2 name child 0), and
    a plain request beside it: four requests, two prompts; the CLI says the same."""
    chat = "/v1/chat/completions"
    send(
        collector,
        *f.parallel_sampling(1, "cmpl-1", 3, "acme", 650_000, route=chat),
        f.admitted(4, "g1", "globex", 10, route=chat),
    )
    params = {"model_id": MODEL, "since": SINCE, "until": UNTIL, "min_prompt_tokens": 600_000}
    with collector.client(collector.admin) as h:
        doc = h.get("/v1/inventory", params=params).json()
    rows = {x["tenant"]: x for x in doc["rows"]}
    assert (rows["acme"]["requests"], rows["acme"]["prompts"]) == (3, 1)
    assert rows["acme"]["at_or_above"] == 3  # per request: each occupied the context
    assert (rows["globex"]["requests"], rows["globex"]["prompts"]) == (1, 1)
    assert (doc["totals"]["requests"], doc["totals"]["prompts"]) == (4, 2)
    res = cli(
        "report", "inventory", "--model", MODEL, "--since", SINCE, "--until", UNTIL,
        "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "4 requests (2 distinct prompts)" in res.stderr


def test_limits_card_from_config_and_verification(collector: Collector, tmp_path: Path) -> None:
    send(
        collector,
        f.config(1, pool_tokens=681_280),
        # (the decode pool equals the prefill pool: policies compare a verification's pool
        # with every node serving the model, the card reuses that comparison)
        f.config(2, pool_tokens=681_280, node="decode-0", role="decode", engine_version="0.5.21"),
    )
    with collector.client(collector.admin) as h:
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": MODEL,
                "passed": True,
                "verified_safe_context": 600_000,
            },
        )
        assert r.status_code == 201, r.text
        card = h.get("/v1/deployments/glm-prod/limits-card").json()
        (mod,) = card["models"]
        assert mod["advertised_context"] == 1_048_576
        assert mod["pool_capacity_per_node"] == {
            "decode-0": {"role": "decode", "capacity_tokens": 681_280},
            "prefill-0": {"role": "prefill", "capacity_tokens": 681_280},
        }
        assert mod["prefill_pool_tokens"] == 681_280
        v = mod["verified"]
        assert v["safe_context"] == 600_000 and v["engine_version"] == "0.5.21"
        assert v["verified_at"].startswith(r.json()["verified_at"][:16])
        assert mod["stale"] is False and mod["latest_verification_failed"] is False

        # the prefill pool shrinks, and a later verification fails: the card says both, and
        # still shows the latest passing verification
        send(collector, f.config(3, pool_tokens=500_000))
        r = h.post(
            "/v1/verifications",
            json={"deployment_id": "glm-prod", "model_id": MODEL, "passed": False},
        )
        assert r.status_code == 201, r.text
        (mod,) = h.get("/v1/deployments/glm-prod/limits-card?format=json").json()["models"]
        assert mod["verified"]["safe_context"] == 600_000
        assert mod["stale"] is True and mod["latest_verification_failed"] is True
        assert mod["stale_settings"]["prefill-0"]["pool_capacity_tokens"] == {
            "verified": 681_280,
            "now": 500_000,
        }
        md = h.get("/v1/deployments/glm-prod/limits-card", params={"format": "md"})
        assert md.status_code == 200 and md.headers["content-type"].startswith("text/markdown")
        assert "# Limits card: glm-prod" in md.text
        assert "**600,000 tokens**" in md.text and "0.5.21" in md.text
        assert "**stale**" in md.text
        assert "pool_capacity_tokens: 681280 -> 500000 on prefill-0" in md.text
        assert "prefill pool 500,000 tokens < verified safe context 600,000" in md.text
        # the limit in force: the failed verification holds every prompt (nothing passed
        # since the pool shrank, and the passing one is stale)
        assert "Limit in force: **" in md.text
        assert "| prefill-0 | prefill | 500,000 |" in md.text

        r = h.get("/v1/deployments/nope/limits-card")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert "**FAILED on " in md.text and "(no findings recorded)**" in md.text
        r = h.get("/v1/deployments/glm-prod/limits-card", params={"format": "html"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input"

    res = cli(
        "report", "limits", "--deployment", "glm-prod", "--format", "json",
        "--out", str(tmp_path), "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "limits-glm-prod.json").read_text())
    assert written["models"][0]["stale"] is True
    res = cli("report", "limits", "--deployment", "glm-prod", "--database-url", collector.db_url)
    assert res.exit_code == 0 and "# Limits card: glm-prod" in res.stdout
    res = cli("report", "limits", "--deployment", "nope", "--database-url", collector.db_url)
    assert res.exit_code == 2 and "no deployment 'nope'" in res.output
    res = cli(
        "report", "limits", "--deployment", "glm-prod", "--format", "pdf",
        "--out", str(tmp_path), "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert_renders((tmp_path / "limits-glm-prod.pdf").read_bytes())
    pages = pypdf.PdfReader(tmp_path / "limits-glm-prod.pdf").pages
    text = "\n".join(page.extract_text() for page in pages)
    assert "FAILED on " in text and "600,000 tokens" in text and "prefill-0" in text
    res = cli("report", "limits", "--deployment", "glm-prod", "--format", "pdf")
    assert res.exit_code == 2 and "--out" in res.output


def _verify_cli(c: Collector) -> Any:
    return cli("audit", "verify", "--database-url", c.db_url)


def test_audit_chain_verifies_and_names_tampered_rows(collector: Collector) -> None:
    send(collector, f.stale_read(1))  # fires an alert and opens an incident
    with collector.client(collector.admin) as h:
        (alert,) = h.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
        assert h.post(f"/v1/alerts/{alert['id']}/ack", json={}).status_code == 200
        r = h.post(
            "/v1/silences",
            json={"matchers": [{"name": "rule", "value": "x"}], "duration": "1h", "comment": "c"},
        )
        assert r.status_code == 201, r.text
        r = h.post(
            "/v1/verifications",
            json={"deployment_id": "glm-prod", "model_id": MODEL, "passed": True},
        )
        assert r.status_code == 201, r.text
        ok = h.get("/v1/audit/verify").json()
    assert ok["ok"] is True and ok["entries"] >= 6 and ok["first_bad_id"] is None
    res = _verify_cli(collector)
    assert res.exit_code == 0, res.output
    assert "intact" in res.output and ok["head"] in res.output

    t = m.AuditEntry.__table__
    db = Database(collector.db_url)
    try:
        with db.read() as conn:
            rows = [r._asdict() for r in conn.execute(select(t).order_by(t.c.id))]
        actions = {r["action"] for r in rows}
        assert {"alert.ack", "verification.add", "token.create"} <= actions, actions
        mid, nxt = rows[len(rows) // 2], rows[len(rows) // 2 + 1]

        def broken_at(expected_id: int, words: str) -> None:
            with db.read() as conn:
                check = audit.verify(conn)
            assert not check.ok and check.first_bad_id == expected_id, check
            assert words in (check.problem or ""), check
            res = _verify_cli(collector)
            assert res.exit_code == 1, res.output
            assert f"entry {expected_id}" in res.output

        def intact() -> None:
            with db.read() as conn:
                assert audit.verify(conn).ok

        # edited content
        with db.write() as conn:
            conn.execute(update(t).where(t.c.id == mid["id"]).values(detail='{"edited":1}'))
        broken_at(mid["id"], "does not match its hash")
        with db.write() as conn:
            conn.execute(update(t).where(t.c.id == mid["id"]).values(detail=mid["detail"]))
        intact()

        # a deleted middle entry: the next one is no longer chained to its predecessor
        with db.write() as conn:
            conn.execute(delete(t).where(t.c.id == mid["id"]))
        broken_at(nxt["id"], "deleted")
        with db.write() as conn:
            conn.execute(insert(t).values(**mid))
        intact()

        # a forged entry, with a made-up hash or correctly hashed but spliced in
        last = rows[-1]
        forged = {
            "ts": last["ts"],
            "actor": "mallory",
            "action": "alert.ack",
            "subject": "alert:1",
            "detail": "{}",
            "prev_hash": last["hash"],
            "hash": "f" * 64,
        }
        with db.write() as conn:
            fid = conn.execute(insert(t).values(**forged).returning(t.c.id)).scalar_one()
        broken_at(fid, "does not match its hash")
        ts_us = to_micros(forged["ts"])
        spliced = dict(forged, prev_hash=mid["hash"])
        spliced["hash"] = audit._digest(mid["hash"], ts_us, "mallory", "alert.ack", "alert:1", "{}")
        with db.write() as conn:
            conn.execute(update(t).where(t.c.id == fid).values(**spliced))
        broken_at(fid, "not chained")
        with db.write() as conn:
            conn.execute(delete(t).where(t.c.id == fid))
        intact()

        # two entries swapped (their ids exchanged)
        with db.write() as conn:
            conn.execute(update(t).where(t.c.id == mid["id"]).values(id=-1))
            conn.execute(update(t).where(t.c.id == nxt["id"]).values(id=mid["id"]))
            conn.execute(update(t).where(t.c.id == -1).values(id=nxt["id"]))
        broken_at(mid["id"], "not chained")
        with db.write() as conn:
            conn.execute(update(t).where(t.c.id == mid["id"]).values(id=-1))
            conn.execute(update(t).where(t.c.id == nxt["id"]).values(id=mid["id"]))
            conn.execute(update(t).where(t.c.id == -1).values(id=nxt["id"]))
        intact()
    finally:
        db.dispose()

    with collector.client(collector.admin) as h:
        assert h.get("/v1/audit/verify").json()["ok"] is True
    res = cli("audit", "verify", "--bogus")
    assert res.exit_code == 2


def test_an_exported_audit_bundle_verifies_without_the_database(
    collector: Collector, tmp_path: Path
) -> None:
    send(collector, f.stale_read(1))  # an alert, an incident: audit entries
    bundle = tmp_path / "bundle"
    res = cli("audit", "export", "--out", str(bundle), "--database-url", collector.db_url)
    assert res.exit_code == 0, res.output
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["entries"] >= 2 and manifest["chain_intact_at_export"] is True
    ok = cli("audit", "verify", "--bundle", str(bundle))
    assert ok.exit_code == 0 and f"head {manifest['head']}" in ok.output, ok.output
    # a second export into the same directory is refused, the first left as it was
    again = cli("audit", "export", "--out", str(bundle), "--database-url", collector.db_url)
    assert again.exit_code == 2 and "not empty" in again.output

    lines = (bundle / "entries.jsonl").read_text().splitlines()
    entry = json.loads(lines[0])
    entry["actor"] = "someone else"
    (bundle / "entries.jsonl").write_text("\n".join([json.dumps(entry), *lines[1:]]) + "\n")
    bad = cli("audit", "verify", "--bundle", str(bundle))
    assert bad.exit_code == 1 and "not the file exported" in bad.output
    # the manifest "fixed" to match the edit: the chain itself catches it
    manifest["files"]["entries.jsonl"] = hashlib.sha256(
        (bundle / "entries.jsonl").read_bytes()
    ).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    bad = cli("audit", "verify", "--bundle", str(bundle))
    assert bad.exit_code == 1 and "edited or forged" in bad.output
    assert cli("audit", "verify", "--bundle", str(tmp_path)).exit_code == 2


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_audit_verify_warns_on_a_bare_copy_of_a_live_sqlite_file(
    collector: Collector, tmp_path: Path
) -> None:
    """A plain copy of a running collector's file, without its -wal, may miss the newest
    entries: audit verify says so instead of only 'intact'."""
    send(collector, f.stale_read(1))
    live = Path(collector.db_url.removeprefix("sqlite:///"))
    assert Path(f"{live}-wal").exists()  # the collector holds it open
    copy = tmp_path / "copy.db"
    shutil.copyfile(live, copy)
    res = cli("audit", "verify", "--database-url", f"sqlite:///{copy}")
    assert "WAL mode with no copy.db-wal" in res.output, res.output
    res = cli("audit", "verify", "--database-url", collector.db_url)
    assert res.exit_code == 0 and "warning" not in res.output


def test_a_limits_card_keeps_a_long_model_id_inside_the_page(collector: Collector) -> None:
    """Model ids run to 256 characters (a hub path with quantisation and revision in it): the
    card's heading wraps instead of running off the page."""
    model = "neuralmagic/Meta-Llama-3.1-405B-Instruct-quantized.w8a8-FP8-dynamic-" + "x" * 150
    send(collector, f.config(1, model_id=model))
    with collector.client(collector.admin) as h:
        r = h.get("/v1/deployments/glm-prod/limits-card", params={"format": "pdf"})
    assert r.status_code == 200, r.text
    assert_renders(r.content)


def test_inventory_names_the_deployment(collector: Collector) -> None:
    """One model on two deployments: the same tenant and route are two rows, each naming the
    deployment that served it, in the API and in the CLI's table."""
    chat = "/v1/chat/completions"
    send(collector, f.admitted(1, "p1", "acme", 600_000, route=chat, dep="glm-prod"))
    send(collector, f.admitted(1, "s1", "acme", 20, route=chat, dep="glm-stage", probe="probe-b"))
    params = {"model_id": MODEL, "since": SINCE, "until": UNTIL}
    with collector.client(collector.admin) as h:
        doc = h.get("/v1/inventory", params=params).json()
    got = {
        (x["deployment_id"], x["tenant"], x["route"]): x["max_prompt_tokens"] for x in doc["rows"]
    }
    assert got == {("glm-prod", "acme", chat): 600_000, ("glm-stage", "acme", chat): 20}
    with collector.client(collector.admin) as h:
        one = h.get("/v1/inventory", params={**params, "deployment_id": "glm-stage"}).json()
    assert [x["deployment_id"] for x in one["rows"]] == ["glm-stage"]
    res = cli(
        "report", "inventory", "--model", MODEL, "--since", SINCE, "--until", UNTIL,
        "--database-url", collector.db_url,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "deployment" in res.stdout and "glm-prod" in res.stdout and "glm-stage" in res.stdout


def test_a_limits_card_leads_with_the_open_incident(collector: Collector) -> None:
    """A stale page read opens an incident on glm-prod: the card (JSON, Markdown, PDF) names it
    before any verdict, so "not verified" never stands alone for a deployment that leaked."""
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    send(collector, f.config(1, ts=now), f.stale_read(2, ts=now))
    with collector.client(collector.admin) as h:
        (inc,) = h.get("/v1/incidents").json()
        card = h.get("/v1/deployments/glm-prod/limits-card").json()
        md = h.get("/v1/deployments/glm-prod/limits-card", params={"format": "md"}).text
        pdf = h.get("/v1/deployments/glm-prod/limits-card", params={"format": "pdf"}).content
    said = card["open_incident"]
    assert said["id"] == inc["id"] and said["text"].startswith(f"OPEN INCIDENT #{inc['id']}: ")
    assert said["title"] == inc["title"] and "opened " in said["text"]
    assert card["models"][0]["verdict"]["status"] == "not_verified"
    assert md.index(said["text"]) < md.index(card["models"][0]["verdict"]["text"])
    assert_renders(pdf)
    text = " ".join(
        " ".join((p.extract_text() or "").split()) for p in pypdf.PdfReader(io.BytesIO(pdf)).pages
    )
    assert text.index(f"OPEN INCIDENT #{inc['id']}") < text.index("Model glm-5.3")
    # closed: the card goes back to the verification alone
    with collector.client(collector.admin) as h:
        r = h.post(f"/v1/incidents/{inc['id']}/close", json={"reason": "test traffic, not a leak"})
        assert r.status_code == 200, r.text
        assert h.get("/v1/deployments/glm-prod/limits-card").json()["open_incident"] is None
