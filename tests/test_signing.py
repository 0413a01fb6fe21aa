"""Signed reports end to end: a breach report generated through the CLI and the API is
signed (Ed25519 JWS beside its files), and `kvwatch report verify` catches a forged JSON, CSV
and PDF, naming what changed; keys rotate without breaking old signatures; an unknown key
fails; the signing key set is served to a reader."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pypdfium2
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from collector import models as m
from collector.db import Database
from collector.reports.breach_model import from_document
from collector.reports.breach_pdf import render_pdf
from collector.signing import KeyRing, key_dir, load_key_set, sha256_bytes, verify
from collector.timefmt import iso, parse_iso
from kvwatch.cli import app as cli
from tests.conftest import Collector
from tests.pdf_helpers import assert_renders
from tests.test_report_breach import Env, env_of

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    """A real incident (globex read acme's KV pages), as the breach report tests make it."""
    yield from env_of(collector)


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def _breach(env: Env, out: Path) -> dict[str, Path]:
    code, output = _run(
        "report",
        "breach",
        "--incident",
        str(env.incident_id),
        "--out",
        str(out),
        "--database-url",
        env.c.db_url,
    )
    assert code == 0, output
    paths = {Path(x).suffix: Path(x) for x in output.split()}
    assert set(paths) == {".json", ".csv", ".pdf", ".sig"}
    return paths


def _verify(env: Env, *paths: Path, keys: Path | None = None) -> tuple[int, str]:
    where = ["--keys", str(keys)] if keys else ["--database-url", env.c.db_url]
    return _run("report", "verify", *map(str, paths), *where)


def _keys(env: Env) -> KeyRing:
    return KeyRing(key_dir(env.c.db_url, None))


def test_a_signed_report_verifies_and_its_forgeries_do_not(env: Env, tmp_path: Path) -> None:
    p = _breach(env, tmp_path)
    code, out = _verify(env, p[".json"], p[".csv"], p[".pdf"])
    assert code == 0, out
    assert out.count("intact:") == 3 and "signed by key" in out and "(current)" in out
    doc = json.loads(p[".json"].read_text())
    claims = verify(p[".sig"].read_text(), _keys(env).public_set()).claims
    assert claims["sub"] == f"report:{doc['report_id']}"
    assert claims["conclusions"]["timeline.deadline_at"] == doc["timeline"]["deadline_at"]
    assert claims["conclusions"]["art34.verdict"] == doc["art34"]["verdict"]
    assert claims["conclusions"]["account"] == doc["account"]

    # the signed PDF as a person sees it: every page rendered, the signed deadline on page 1
    signed_pdf = p[".pdf"].read_bytes()
    assert assert_renders(signed_pdf, min_pages=3) >= 3
    pdfium = pypdfium2.PdfDocument(signed_pdf)
    try:
        page = pdfium[0]
        page.render(scale=1.0).to_pil().save(tmp_path / "signed-page-1.png")
        assert f"Art. 33 deadline {doc['timeline']['deadline_at']}" in " ".join(
            page.get_textpage().get_text_range().split()
        )
    finally:
        pdfium.close()

    # the API serves the same bytes the signature covers, and the signature itself
    rid = doc["report_id"]
    api = tmp_path / "api"
    api.mkdir()
    for fmt in ("json", "csv", "pdf"):
        r = env.admin.get(f"/v1/reports/{rid}", params={"format": fmt})
        assert r.status_code == 200, r.text
        (api / f"breach-{rid}.{fmt}").write_bytes(r.content)
    r = env.admin.get(f"/v1/reports/{rid}/signature")
    assert r.status_code == 200 and r.text == p[".sig"].read_text()
    (api / f"breach-{rid}.sig").write_text(r.text)
    code, out = _verify(env, *sorted(api.glob("*.[jcp][sd]*")))
    assert code == 0 and out.count("intact:") == 3, out

    # forged JSON: deadline moved three days later, Art. 34 flipped to "no"
    deadline = doc["timeline"]["deadline_at"]
    later = iso(parse_iso(deadline) + timedelta(days=3))
    forged = json.loads(p[".json"].read_text())
    forged["timeline"]["deadline_at"] = later
    forged["art34"]["verdict"] = "no"
    p[".json"].write_text(json.dumps(forged, indent=2, sort_keys=True) + "\n")
    code, out = _verify(env, p[".json"])
    print(out)
    assert code == 1 and "ALTERED" in out
    assert f'timeline.deadline_at: signed "{deadline}", file says "{later}"' in out
    assert f'art34.verdict: signed "{doc["art34"]["verdict"]}", file says "no"' in out

    # forged PDF: rendered again from the forged JSON
    p[".pdf"].write_bytes(render_pdf(from_document(forged)))
    code, out = _verify(env, p[".pdf"])
    print(out)
    assert code == 1 and "ALTERED" in out
    assert f"timeline.deadline_at: the PDF no longer shows 'Art. 33 deadline {deadline}'" in out
    assert "art34.verdict: the PDF no longer shows" in out
    assert f"it shows 'Art. 33 deadline {later}' instead" in out
    assert "it shows 'Art. 34 high risk no' instead" in out

    # forged CSV: one row deleted (with the JSON put back, the rows are recounted)
    p[".json"].write_bytes(
        json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n"
    )
    lines = p[".csv"].read_text().splitlines(keepends=True)
    gone = lines.pop(-1)
    p[".csv"].write_text("".join(lines))
    code, out = _verify(env, p[".csv"])
    print(out)
    assert code == 1 and "ALTERED" in out
    assert f"request(s) the report lists are missing or changed: {gone.split(',')[1]}" in out
    assert "rows differ (file" in out


def test_keys_rotate_and_old_signatures_stay_verifiable(env: Env, tmp_path: Path) -> None:
    db = ["--database-url", env.c.db_url]
    code, out = _run("keys", "generate", "--by", "dpo", *db)
    assert code == 0 and out.split()[-1] == _keys(env).current_kid(), out
    code, out = _run("keys", "generate", *db)
    assert code == 2 and "rotate it instead" in out
    first = _breach(env, tmp_path / "first")
    old_kid = _keys(env).current_kid()
    code, out = _run("keys", "rotate", "--by", "dpo", *db)
    assert code == 0, out
    new_kid = out.split()[-1]
    assert new_kid != old_kid and _keys(env).current_kid() == new_kid
    code, out = _run("keys", "list", *db)
    assert code == 0 and old_kid in out and new_kid in out and "retired" in out, out

    # the audit log names who rotated which key
    with env.db.read() as conn:
        rows = conn.execute(
            select(m.AuditEntry.actor, m.AuditEntry.subject, m.AuditEntry.detail).where(
                m.AuditEntry.action == "signing_key.rotate"
            )
        ).all()
    assert [(a, s) for a, s, _ in rows] == [("dpo", f"signing_key:{new_kid}")]
    assert json.loads(rows[0][2])["retired"] == old_kid

    # the published set (file, API) has both; the old report still verifies, by the retired key
    pub = tmp_path / "published.jwks"
    code, out = _run("keys", "public", "--out", str(pub), *db)
    assert code == 0
    served = env.admin.get("/v1/signing-keys").json()
    assert served == load_key_set(pub)
    assert [k["kid"] for k in served["keys"]] == [old_kid, new_kid]
    assert all("d" not in k for k in served["keys"])  # never a private half
    code, out = _verify(env, first[".json"], first[".pdf"], keys=pub)
    assert code == 0 and out.count("intact:") == 2, out
    assert f"key {old_kid} (retired " in out
    second = _breach(env, tmp_path / "second")
    code, out = _verify(env, second[".pdf"], keys=pub)
    assert code == 0 and f"key {new_kid} (current)" in out, out

    # a key set without the signing key: the signature is not accepted
    only_new = tmp_path / "only-new.jwks"
    only_new.write_text(json.dumps({"keys": [k for k in served["keys"] if k["kid"] == new_kid]}))
    code, out = _verify(env, first[".json"], keys=only_new)
    assert code == 1 and f"signed with key {old_kid}, which is not in the published key set" in out


def test_a_file_signed_by_an_unknown_key_fails(env: Env, tmp_path: Path) -> None:
    p = _breach(env, tmp_path)
    # a forger signs a forged JSON with a key of their own, beside the real files
    forged = json.loads(p[".json"].read_text())
    forged["art34"]["verdict"] = "no"
    p[".json"].write_text(json.dumps(forged))
    theirs = KeyRing(tmp_path / "forger")
    claims = verify(p[".sig"].read_text(), _keys(env).public_set()).claims
    claims["files"][p[".json"].name] = sha256_bytes(p[".json"].read_bytes())
    claims["conclusions"]["art34.verdict"] = "no"
    p[".sig"].write_text(theirs.sign(claims, now=datetime.now(UTC)))
    code, out = _verify(env, p[".json"])
    assert code == 1 and "ALTERED" in out
    assert f"signed with key {theirs.current_kid()}, which is not in the published key set" in out
    # a signature made unreadable: exit 1 too (it does not verify), never a traceback
    p[".sig"].write_text("garbage")
    code, out = _verify(env, p[".json"])
    assert code == 1 and "not a JWS compact signature" in out
    # a missing file: unreadable
    code, out = _verify(env, tmp_path / "breach-nope.pdf")
    assert code == 2


def _rewrite(db_url: str, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    """Rewrite the database's audit chain as a forger without the key would: change the
    entries, then recompute every hash so the chain itself verifies."""
    from sqlalchemy import delete, insert

    from collector import audit
    from collector import models as m
    from collector.db import Database

    db = Database(db_url)
    try:
        with db.write() as conn:
            rows = change(list(audit.entries(conn)))
            _rehash(rows)
            conn.execute(delete(m.AuditEntry))
            for r in rows:
                conn.execute(insert(m.AuditEntry).values(**r))
    finally:
        db.dispose()


def _rehash(rows: list[dict[str, Any]]) -> None:
    from collector import audit

    prev = audit.GENESIS
    for r in rows:
        r["detail_sha256"] = audit._sha(r["detail"])
        r["prev_hash"] = prev
        r["hash"] = prev = audit._digest(
            prev, r["ts"], r["actor"], r["action"], r["subject"], r["detail_sha256"]
        )


def test_a_chain_rewritten_without_the_key_fails(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = ["--database-url", env.c.db_url]
    _breach(env, tmp_path)
    code, out = _run("audit", "checkpoint", *db)
    assert code == 0, out
    code, out = _run("audit", "verify", *db)
    assert code == 0 and "signed through entry" in out, out

    # an entry edited (the report's recorded evidence hash), every later hash recomputed
    def edit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in rows:
            if r["action"] == "report.generate":
                r["detail"] = r["detail"].replace('"kind":"breach"', '"kind":"review"')
        return rows

    _rewrite(env.c.db_url, edit)
    code, out = _run("audit", "verify", *db)
    print(out)
    assert code == 1 and "rewritten without the signing key" in out

    # the checkpoints deleted too, the rest re-hashed: once twice the checkpoint period has
    # passed since the key was made, entries that old with no checkpoint fail (a collector
    # would have signed them)
    monkeypatch.setenv("KVWATCH_AUDIT_CHECKPOINT_S", "0.5")
    time.sleep(1.1)

    def drop(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r["action"] != "audit.checkpoint"]

    _rewrite(env.c.db_url, drop)
    code, out = _run("audit", "verify", *db)
    print(out)
    assert code == 1 and "no signed checkpoint covers it" in out


def test_a_rehashed_bundle_fails(env: Env, tmp_path: Path) -> None:
    _breach(env, tmp_path / "r")
    bundle = tmp_path / "bundle"
    code, out = _run("audit", "export", "--out", str(bundle), "--database-url", env.c.db_url)
    assert code == 0, out
    assert (bundle / "manifest.sig").is_file() and (bundle / "keys.jwks").is_file()
    pub = tmp_path / "pub.jwks"
    pub.write_text(json.dumps(_keys(env).public_set()))
    code, out = _run("audit", "verify", "--bundle", str(bundle), "--keys", str(pub))
    assert code == 0 and "signed through entry" in out, out

    # an entry edited, the chain and the manifest recomputed: manifest.sig no longer matches
    entries = [json.loads(x) for x in (bundle / "entries.jsonl").read_text().splitlines()]
    for r in entries:
        if r["action"] == "report.generate":
            r["actor"] = "someone-else"
    _rehash(entries)
    (bundle / "entries.jsonl").write_text(
        "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in entries)
    )
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["entries.jsonl"] = sha256_bytes((bundle / "entries.jsonl").read_bytes())
    manifest["head"] = entries[-1]["hash"]
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    code, out = _run("audit", "verify", "--bundle", str(bundle), "--keys", str(pub))
    print(out)
    assert code == 1 and "is not the file manifest.sig signs" in out
    # ... and without manifest.sig at all
    (bundle / "manifest.sig").unlink()
    code, out = _run("audit", "verify", "--bundle", str(bundle), "--keys", str(pub))
    print(out)
    assert code == 1 and "manifest.sig is missing" in out


def test_the_collector_signs_the_chain_head_every_period(db_url: str) -> None:
    """The periodic pass appends a signed checkpoint once something was appended since the
    last one, and never one after another checkpoint (a quiet log does not grow)."""
    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import serve_in_thread
    from tests.conftest import make_token

    make_token(db_url, "admin")  # an audit entry to sign
    settings = Settings(database_url=db_url, auto_migrate=False, audit_checkpoint_s=0.2)
    db = Database(db_url)
    try:
        with serve_in_thread(create_app(settings)):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with db.read() as conn:
                    actions = list(
                        conn.execute(
                            select(m.AuditEntry.action).order_by(m.AuditEntry.id)
                        ).scalars()
                    )
                if actions and actions[-1] == "audit.checkpoint":
                    break
                time.sleep(0.1)
            time.sleep(0.6)  # three more periods: nothing new, so no new checkpoint
        with db.read() as conn:
            after = list(
                conn.execute(select(m.AuditEntry.action).order_by(m.AuditEntry.id)).scalars()
            )
    finally:
        db.dispose()
    assert actions[-1] == "audit.checkpoint", actions
    assert after.count("audit.checkpoint") == 1, after
    ring = KeyRing(key_dir(db_url, None))
    code, out = _run("audit", "verify", "--database-url", db_url)
    assert code == 0 and "signed through entry" in out and ring.current_kid() in out, out
