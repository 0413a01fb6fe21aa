"""The case file end to end: a real incident (globex read acme's KV pages) with a signed
breach report, a notice sent and a decision in the register, exported with `kvwatch
incidents export` and checked offline with `kvwatch report verify --bundle`; a tampered
member fails, naming what changed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pypdfium2
import pytest
from sqlalchemy import insert, select
from typer.testing import CliRunner

from collector import audit
from collector import models as m
from collector.reports.signed import report_json_bytes
from collector.signing import KeyRing, key_dir, sha256_bytes, statement
from collector.timefmt import to_micros
from kvwatch.cli import app as cli
from tests.conftest import Collector
from tests.pdf_helpers import assert_renders
from tests.test_report_breach import Env, env_of

NOTICE_ID = "ntc_testnotice1"


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    yield from env_of(collector)


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def _register(env: Env) -> dict[str, Any]:
    """A notice sent to acme and a decision, as the case register stores them (the notice
    signed as the register signs it: ``<id>.json`` under ``notice:<id>``)."""
    now = datetime.now(UTC)
    notice = {
        "notice_id": NOTICE_ID,
        "incident_id": env.incident_id,
        "tenant": "acme",
        "kind": "exposed",
        "what_happened": "another customer's request read KV pages of your request",
        "measures": {"done": ["containment"], "open": ["engine upgrade"]},
    }
    data = report_json_bytes(notice)
    ring = KeyRing(key_dir(env.c.db_url, None))
    sig = ring.sign(
        statement(
            sub=f"notice:{NOTICE_ID}",
            iat=now,
            files={f"{NOTICE_ID}.json": sha256_bytes(data)},
            conclusions={"tenant": "acme", "kind": "exposed", "measures.open": ["engine upgrade"]},
        ),
        now=now,
    )
    us = to_micros(now)
    with env.db.write() as conn:
        conn.execute(
            insert(m.IncidentNotification).values(
                incident_id=env.incident_id,
                party_kind="exposed",
                party="acme",
                notice_id=NOTICE_ID,
                notice_sha256=sha256_bytes(data),
                notice=json.dumps(notice),
                signature=sig,
                state="sent",
                prepared_at=us,
                prepared_by="dpo",
                approved_at=us,
                approved_by="dpo",
                sent_at=us,
                sent_by="dpo",
                channel="email",
            )
        )
        audit.append(
            conn,
            now_us=us,
            actor="dpo",
            action="notice.send",
            subject=f"notice:{NOTICE_ID}",
            detail={"channel": "email"},
        )
        conn.execute(
            insert(m.IncidentDecision).values(
                incident_id=env.incident_id,
                ts=us,
                actor="oncall",
                kind="containment",
                status="done",
                what="prefix cache disabled on glm-prod",
                why="stop further cross-tenant reads",
            )
        )
    return notice


def _export(env: Env, out: Path) -> list[Path]:
    code, output = _run(
        *("incidents", "export", str(env.incident_id), "--out", str(out)),
        *("--by", "dpo", "--database-url", env.c.db_url),
    )
    assert code == 0, output
    return [Path(x) for x in output.split() if x.startswith(str(out))]


def test_the_case_file_round_trips_and_verifies_offline(env: Env, tmp_path: Path) -> None:
    r = env.admin.post("/v1/reports", json={"kind": "breach", "incident_id": env.incident_id})
    assert r.status_code == 201, r.text
    rid = r.json()["report_id"]
    notice = _register(env)
    out = tmp_path / "case"
    files = _export(env, out)
    names = {p.name for p in files}
    assert {f"breach-{rid}.{x}" for x in ("json", "csv", "pdf", "sig")} <= names
    assert {
        f"{NOTICE_ID}.json",
        f"{NOTICE_ID}.sig",
        "decisions.json",
        "notifications.json",
    } <= names
    assert {"audit-extract.jsonl", "keys.jwks", "manifest.json", "manifest.sig"} <= names
    assert json.loads((out / f"{NOTICE_ID}.json").read_text()) == notice
    decisions = json.loads((out / "decisions.json").read_text())["decisions"]
    assert [(d["kind"], d["by"], d["what"]) for d in decisions] == [
        ("containment", "oncall", "prefix cache disabled on glm-prod")
    ]
    (party,) = json.loads((out / "notifications.json").read_text())["notifications"]
    assert (party["party"], party["state"], party["channel"]) == ("acme", "sent", "email")
    extract = [json.loads(x) for x in (out / "audit-extract.jsonl").read_text().splitlines()]
    subjects = {e["subject"] for e in extract if e["detail"] is not None}
    assert {f"incident:{env.incident_id}", f"report:{rid}", f"notice:{NOTICE_ID}"} <= subjects
    assert extract[-1]["action"] == "audit.checkpoint"
    # the export is itself in the audit log
    with env.db.read() as conn:
        (detail,) = conn.execute(
            select(m.AuditEntry.detail).where(m.AuditEntry.action == "case.export")
        ).one()
    assert json.loads(detail)["report_id"] == rid

    # the signed PDF, as a person sees it
    pdf = (out / f"breach-{rid}.pdf").read_bytes()
    assert assert_renders(pdf, min_pages=3) >= 3
    doc = pypdfium2.PdfDocument(pdf)
    try:
        first = doc[0].get_textpage().get_text_range()
    finally:
        doc.close()
    assert rid in first and "Art. 33 deadline" in first

    # offline, with the bundle's own key set: intact, with a warning to compare key ids
    code, output = _run("report", "verify", "--bundle", str(out))
    print(output)
    assert code == 0, output
    kid = json.loads((out / "keys.jwks").read_text())["keys"][0]["kid"]
    assert "no --keys given" in output and kid in output
    assert f"intact: {NOTICE_ID}.json" in output and f"intact: breach-{rid}.pdf" in output
    assert "audit-extract.jsonl" in output and "signed through entry" in output
    # against the published set: no warning
    pub = tmp_path / "pub.jwks"
    assert _run("keys", "public", "--out", str(pub), "--database-url", env.c.db_url)[0] == 0
    code, output = _run("report", "verify", "--bundle", str(out), "--keys", str(pub))
    assert code == 0 and "no --keys given" not in output, output


def test_a_tampered_case_file_fails(env: Env, tmp_path: Path) -> None:
    _register(env)
    out = tmp_path / "case"
    _export(env, out)
    pub = tmp_path / "pub.jwks"
    pub.write_text(json.dumps(KeyRing(key_dir(env.c.db_url, None)).public_set()))

    def verify_copy(change: Any) -> str:
        copy = tmp_path / f"copy-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, copy)
        change(copy)
        code, output = _run("report", "verify", "--bundle", str(copy), "--keys", str(pub))
        print(output)
        assert code == 1 and "ALTERED" in output, output
        return output

    # the notice's measures edited: named path by path
    def notice(d: Path) -> None:
        doc = json.loads((d / f"{NOTICE_ID}.json").read_text())
        doc["measures"]["open"] = []
        (d / f"{NOTICE_ID}.json").write_bytes(report_json_bytes(doc))

    output = verify_copy(notice)
    assert 'measures.open: signed ["engine upgrade"], file says []' in output
    assert f"{NOTICE_ID}.json: SHA-256" in output

    # a decision edited
    def decision(d: Path) -> None:
        p = d / "decisions.json"
        p.write_text(p.read_text().replace("prefix cache disabled", "nothing done"))

    assert "decisions.json: SHA-256" in verify_copy(decision)

    # the assessment's Art. 34 answer flipped
    def art34(d: Path) -> None:
        (p,) = d.glob("breach-*.json")
        doc = json.loads(p.read_text())
        doc["art34"]["verdict"] = "no"
        p.write_bytes(report_json_bytes(doc))

    assert 'art34.verdict: signed "yes", file says "no"' in verify_copy(art34)

    # an audit entry edited and the extract re-hashed: the signed checkpoint no longer matches
    def rehash(d: Path) -> None:
        p = d / "audit-extract.jsonl"
        rows = [json.loads(x) for x in p.read_text().splitlines()]
        rows[0]["actor"] = "someone-else"
        prev = rows[0]["prev_hash"]
        for r in rows:
            r["prev_hash"] = prev
            covered = r["detail_sha256"] if r["detail_sha256"] is not None else r["detail"]
            r["hash"] = prev = audit._digest(
                prev, r["ts"], r["actor"], r["action"], r["subject"], covered
            )
        p.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))

    output = verify_copy(rehash)
    assert (
        "audit-extract.jsonl: SHA-256" in output and "rewritten without the signing key" in output
    )

    # a file added, one removed
    assert "extra.txt: in the case file but not signed" in verify_copy(
        lambda d: (d / "extra.txt").write_text("x")
    )
    assert "decisions.json: signed but missing" in verify_copy(
        lambda d: (d / "decisions.json").unlink()
    )
    # not a case file at all: exit 2
    code, output = _run("report", "verify", "--bundle", str(tmp_path / "nope"), "--keys", str(pub))
    assert code == 2 and "not a case file" in output


def test_export_refuses_what_it_cannot_do_cleanly(env: Env, tmp_path: Path) -> None:
    db = ["--database-url", env.c.db_url]
    code, out = _run("incidents", "export", "999", "--out", str(tmp_path / "none"), *db)
    assert code == 2 and "no incident 999" in out and not (tmp_path / "none").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    code, out = _run("incidents", "export", str(env.incident_id), "--out", str(full), *db)
    assert code == 2 and "not an empty directory" in out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
