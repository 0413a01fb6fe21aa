"""The CLI as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


# One intra-op thread for torch (the demo's reference engine): its tensors are tiny, and
# beside another test worker on a 2-core machine a second thread only spins. The demo's
# CPU time there: ~28-37 s with torch's default, ~11.5 s with one thread.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def kvwatch(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", *args],
        capture_output=True,
        text=True,
        env=os.environ | ONE_THREAD | (env or {}),
        cwd=cwd,
        timeout=300,
    )


def test_demo_replays_the_incident_and_leaves_database_summary_and_commands(
    tmp_path: Path,
) -> None:
    out = tmp_path / "demo"
    r = kvwatch("demo", "--dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["events_dropped"] == 0
    assert summary["events_delivered"] == summary["events_emitted"] > 0
    legacy, hardened = summary["modes"]["legacy"], summary["modes"]["hardened"]
    # legacy: the over-pool prompt is answered with another tenant's text, and the probe
    # saw the stale read naming that tenant
    assert legacy["long_prompt_outcome"] == "answered"
    assert legacy["answer_carried_text_of"]
    assert set(legacy["answer_carried_text_of"]) <= set(legacy["exposed_tenants"])
    assert legacy["readers"] == ["massive-dynamic"]
    # hardened: a clean refusal, nothing read that should not be
    assert "maximum context length" in hardened["long_prompt_outcome"]
    assert hardened["answer_carried_text_of"] == [] and hardened["stale_reads"] == 0
    assert legacy["own_answers_exact"] and hardened["own_answers_exact"]
    # the default rule pack saw the chain on legacy, and only the small pool on hardened
    fired = summary["alerts_firing"]
    assert {"stale_page_read", "rejected_prefill_kv_transfer", "pool_below_advertised"} <= set(
        fired[legacy["deployment"]]
    )
    assert not {"stale_page_read", "rejected_prefill_kv_transfer"} & set(
        fired.get(hardened["deployment"], [])
    )
    # the hardened engine verified from outside: its own prompts raised nothing, and the two
    # engines side by side, as the fleet decides them: legacy red, hardened amber (its
    # context overstated, refusals past the pool verified), nothing critical on it
    assert summary["verification"]["result"] == "pass" and summary["verification"]["recorded"]
    side = summary["fleet"]
    assert side[legacy["deployment"]]["status"] == "red"
    assert side[legacy["deployment"]]["open_incidents"] == 1
    assert side[hardened["deployment"]]["status"] == "amber", side
    assert side[hardened["deployment"]]["limits"][0].startswith("10,640 tokens (verified")
    assert "Side by side" in r.stdout
    (incident,) = summary["incidents"]
    assert incident["deployment_id"] == legacy["deployment"] and incident["state"] == "open"
    pdf = Path(summary["artefacts"]["breach_report_pdf"])
    assert pdf.parent == out and pdf.read_bytes().startswith(b"%PDF")
    assert str(pdf) in r.stdout.replace("\n", "")
    assert Path(summary["artefacts"]["database"]) == out / "kvwatch.db"
    # the incident's case file, signed, verifies offline (against its own keys, with a warning)
    case = kvwatch("report", "verify", "--bundle", summary["artefacts"]["case_file"])
    assert case.returncode == 0, case.stdout + case.stderr
    assert "intact: case file" in case.stdout and "no --keys given" in case.stderr
    with sqlite3.connect(out / "kvwatch.db") as conn:
        (stale,) = conn.execute(
            "SELECT count(*) FROM page_events WHERE kind = 'page.stale_read'"
        ).fetchone()
        assert stale == legacy["stale_reads"] > 0
        (rejected,) = conn.execute(
            "SELECT count(*) FROM requests WHERE reject_reason = 'pool_exhausted' "
            "AND tenant NOT LIKE 'verifier-%'"
        ).fetchone()
        assert rejected == 2  # the long prompt, in both modes
        # no text anywhere: the requests table has counts and labels only
        cols = {row[1] for row in conn.execute("PRAGMA table_info(requests)")}
        assert not cols & {"prompt", "completion", "text"}
        dump = "\n".join(conn.iterdump())
    assert "merger with Initech" not in dump  # a tenant's prompt text is stored nowhere
    assert "kvwatch serve" in r.stdout or " serve" in r.stdout
    # a day of a healthy deployment's synthetic traffic, labelled so, whose alerts resolved
    synthetic = summary["synthetic"]
    assert synthetic["label"].startswith("synthetic") and synthetic["requests"] > 5000
    assert synthetic["deployment"] not in fired
    assert synthetic["deployment"] in r.stdout
    _the_demos_incident_as_a_dpo_reads_it(out, incident["id"], tmp_path)
    # a second run replaces the first instead of piling onto it
    (out / "breach-rpt_previous.pdf").write_bytes(b"%PDF-1.4 an earlier run's")
    again = kvwatch("demo", "--dir", str(out))
    assert again.returncode == 0
    second = json.loads((out / "summary.json").read_text())
    with sqlite3.connect(out / "kvwatch.db") as conn:
        per_deployment = dict(
            conn.execute(
                "SELECT deployment_id, count(*) FROM requests "
                "WHERE tenant NOT LIKE 'verifier-%' GROUP BY deployment_id"
            )
        )
    assert per_deployment == {
        legacy["deployment"]: 6,
        hardened["deployment"]: 6,
        synthetic["deployment"]: second["synthetic"]["requests"],
    }
    assert [p.name for p in out.glob("breach-*.pdf")] == [
        Path(second["artefacts"]["breach_report_pdf"]).name
    ]


def _the_demos_incident_as_a_dpo_reads_it(out: Path, incident_id: int, tmp: Path) -> None:
    """The demo's incident (hooli's prompt read by massive-dynamic): the assessment counts
    one exposed tenant and request and one receiving tenant, data subjects unknown and Art. 34
    undetermined; a data map declaring health data for hooli's route makes it high risk; two
    generations cite one evidence hash; each tenant's notice names no one else."""
    env = {"KVWATCH_DATABASE_URL": f"sqlite:///{out / 'kvwatch.db'}"}
    reports = []
    for n in (1, 2):
        r = kvwatch(
            "report",
            "breach",
            "--incident",
            str(incident_id),
            "--out",
            str(tmp / f"gen{n}"),
            env=env,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        (path,) = (tmp / f"gen{n}").glob("breach-*.json")
        reports.append(json.loads(path.read_text()))
    first, second = reports
    assert first["evidence_sha256"] == second["evidence_sha256"]
    assert first["report_id"] != second["report_id"]
    tenants = first["tenants"]
    assert [t["tenant"] for t in tenants["exposed"]] == ["hooli"]
    assert tenants["exposed_count"] == 1 and tenants["exposed_requests"] == 1
    assert [t["tenant"] for t in tenants["receiving"]] == ["massive-dynamic"]
    assert tenants["receiving_count"] == 1
    assert first["data_categories"]["data_subjects"] is None
    assert first["art34"]["verdict"] == "undetermined"
    # the records concerned: hooli's one exposed request, not massive-dynamic's own as well
    checklist = {x["key"]: x["value"] for x in first["checklist"]}
    assert checklist["records"].startswith("1 exposed request (")
    assert "Counted apart: 1 receiving request" in checklist["records"]
    # the nature: the pages that held hooli's data apart from those that held no one's
    reads = first["stale_reads"]["items"]
    crossed = sum(s["page_count"] for s in reads if s["cross_tenant"])
    no_one = sum(s["page_count"] for s in reads if not s["previous_tenant"])
    assert crossed and no_one  # the demo's reader read both
    assert f"covered {crossed:,} pages that held another tenant's data" in checklist["nature"]
    assert f"covered {no_one:,} pages that held no one's data" in checklist["nature"]
    assert f"{crossed + no_one:,} pages" not in checklist["nature"]
    assert "carried" not in json.dumps(first) and "may contain" in checklist["nature"]

    (route,) = {i["route"] for i in first["affected_requests"]["items"] if i["tenant"] == "hooli"}
    datamap = tmp / "datamap.yaml"
    datamap.write_text(f"entries:\n  - tenant: hooli\n    route: {route}\n    special: [health]\n")
    r = kvwatch(
        "report",
        "breach",
        "--incident",
        str(incident_id),
        "--out",
        str(tmp / "mapped"),
        env={**env, "KVWATCH_DATA_MAP": str(datamap)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = (tmp / "mapped").glob("breach-*.json")
    mapped = json.loads(path.read_text())
    assert mapped["art34"]["verdict"] == "yes"
    assert "health" in " ".join(mapped["art34"]["reasons"])

    # hooli's route declared as HR records for 1,200 persons: the leaked HR complaint's risk
    # stays undetermined (categories cannot rule out sensitive content), and 1,200 is the
    # population, not the persons concerned
    datamap.write_text(
        f"entries:\n  - tenant: hooli\n    route: {route}\n    categories: [hr_records]\n"
        "    population: 1200\n"
    )
    r = kvwatch(
        "report",
        "breach",
        "--incident",
        str(incident_id),
        "--out",
        str(tmp / "hr"),
        env={**env, "KVWATCH_DATA_MAP": str(datamap)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = (tmp / "hr").glob("breach-*.json")
    hr = json.loads(path.read_text())
    assert hr["art34"]["verdict"] == "undetermined"
    assert "cannot rule out special or sensitive content" in " ".join(hr["art34"]["reasons"])
    cats = hr["data_categories"]
    assert (cats["population"], cats["data_subjects"]) == (1200, None)

    for tenant, other in (("hooli", "massive-dynamic"), ("massive-dynamic", "hooli")):
        notice = tmp / f"notice-{tenant}.json"
        r = kvwatch(
            "report",
            "notice",
            "--incident",
            str(incident_id),
            "--tenant",
            tenant,
            "--out",
            str(notice),
            env=env,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        text = notice.read_text()
        assert tenant in text and other not in text
        for outsider in ("acme", "globex", "initech"):
            assert outsider not in text
        doc = json.loads(text)
        assert bool(doc["please_delete"]) == (tenant == "massive-dynamic")


def test_tokens_create_prints_the_token_alone_on_the_last_line(tmp_path: Path) -> None:
    env = {"KVWATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"}
    assert kvwatch("db", "upgrade", env=env).returncode == 0
    r = kvwatch("tokens", "create", "--kind", "read", "--tenant", "acme", env=env)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip().splitlines()[-1]
    assert token.startswith("kvw_read_") and " " not in token
    with sqlite3.connect(tmp_path / "k.db") as conn:
        rows = conn.execute("SELECT kind, tenant, token_hash FROM api_tokens").fetchall()
        audit = conn.execute("SELECT action FROM audit_log").fetchall()
    assert rows[0][:2] == ("read", "acme")
    assert token not in repr(rows)  # stored hashed only
    assert audit == [("token.create",)]


def test_cli_errors_are_clear(tmp_path: Path) -> None:
    env = {"KVWATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"}
    r = kvwatch("tokens", "create", "--kind", "root", env=env)
    assert r.returncode == 2 and "'root' is not one of 'ingest', 'read', 'admin'" in " ".join(
        r.stderr.replace("│", " ").split()
    ), r.stderr
    r = kvwatch("tokens", "create", "--kind", "admin", "--tenant", "acme", env=env)
    assert r.returncode == 2 and "scopes read tokens only" in r.stderr
    r = kvwatch("db", "upgrade", env={"KVWATCH_DATABASE_URL": "mysql://nope"})
    assert r.returncode == 2 and "KVWATCH_DATABASE_URL" in r.stderr


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_acknowledging_or_closing_twice_changes_nothing_and_says_so(collector: Any) -> None:
    """One rule for repeated operator actions: the first stands, the second exits 0 saying
    nothing changed (acking twice used to overwrite silently, closing twice to exit 2)."""
    from engine_probe.events import utcnow
    from tests import factories as f

    # a read of now: one at the factories' fixed past would be resolved by the next policy
    # tick (its resolve_after counts from the event's own time), maybe between the two acks
    with collector.client(collector.ingest) as c:
        fresh = f.stale_read(1, ts=utcnow())
        assert c.post("/v1/events", json=[f.as_json(fresh)]).status_code == 200
    with collector.client(collector.admin) as c:
        (alert,) = c.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
        (incident,) = c.get("/v1/incidents").json()
    db = ["--database-url", collector.db_url]
    first = kvwatch("alerts", "ack", str(alert["id"]), "--by", "dana", *db)
    assert first.returncode == 0 and "acknowledged by dana" in first.stderr, first.stderr
    again = kvwatch("alerts", "ack", str(alert["id"]), "--by", "lee", *db)
    assert again.returncode == 0, again.stderr
    assert "already acknowledged by dana" in again.stderr and "nothing changed" in again.stderr
    closed = kvwatch("incidents", "close", str(incident["id"]), "--by", "dana",
                     "--reason", "contained", *db)  # fmt: skip
    assert closed.returncode == 0 and "closed by dana" in closed.stderr, closed.stderr
    twice = kvwatch("incidents", "close", str(incident["id"]), "--by", "lee",
                    "--reason", "again", *db)  # fmt: skip
    assert twice.returncode == 0, twice.stderr
    assert "already closed by dana" in twice.stderr and "nothing changed" in twice.stderr
