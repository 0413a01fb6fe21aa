"""Scheduled verifications, through real processes: ``kvwatch verify schedule add`` registers
one, a real ``kvwatch serve`` runs it against a real refengine and records the verdict
exactly as a manual upload (alert included), a config drift makes it run again at once, and
the tenant keys are never stored nor printed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from collector import migrate
from collector import models as m
from collector.alerting.service import AlertingService
from collector.db import Database
from collector.verify_schedules import Reach, VerifyScheduleService
from kvwatch.cli import app
from kvwatch.embedded import free_port
from policies import RuleSet
from tests import factories as f
from tests.conftest import SCHEDULE_ENDPOINT, SCHEDULE_KEYS, Collector, make_token
from tests.test_verify import KEYS, MODEL, refengine

PAIR = {k: KEYS[k] for k in ("acme", "globex")}
KEYS_TEXT = " ".join(f"{name}={key}" for name, key in PAIR.items())


def _cli(db_url: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, [*args, "--database-url", db_url], env=env)


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """``kvwatch serve`` on a fresh SQLite database, its environment holding the keys."""
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch.cli", "serve", "--port", str(port)],
        env=os.environ
        | {
            "KVWATCH_DATABASE_URL": db_url,
            "KVWATCH_VERIFY_SCHEDULE_TICK_S": "0.2",
            "KVWATCH_POLICY_TIMER_S": "1",
            "VERIFY_KEYS_LAB": KEYS_TEXT,
            "KVWATCH_VERIFY_ENDPOINTS": "*",
            "PYTHONUNBUFFERED": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait("the collector", lambda: _healthy(url), 60)
        yield url, db_url, proc
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_schedule_runs_records_alerts_and_reruns_on_drift(
    served: tuple[str, str, subprocess.Popen[str]], tmp_path: Path
) -> None:
    url, db_url, proc = served
    admin = httpx.Client(
        base_url=url,
        headers={"Authorization": f"Bearer {make_token(db_url, 'admin')}"},
        timeout=30,
    )
    deployment = "lab-scheduled"
    with refengine("legacy", PAIR) as (endpoint, _):
        added = _cli(
            db_url,
            "verify", "schedule", "add", "--endpoint", endpoint, "--model", MODEL,
            "--deployment", deployment, "--every", "6h", "--keys-from", "env:VERIFY_KEYS_LAB",
            "--budget", "60",
            env={"VERIFY_KEYS_LAB": KEYS_TEXT, "KVWATCH_VERIFY_ENDPOINTS": "*"},
        )  # fmt: skip
        assert added.exit_code == 0, added.output
        sid = int(added.stdout.strip())

        def verifications() -> list[dict[str, Any]]:
            r = admin.get("/v1/verifications", params={"deployment_id": deployment})
            assert r.status_code == 200, r.text
            # lists carry summaries: each record with its evidence from its own path
            return [admin.get(v["links"]["self"]).json() for v in r.json()]

        (first,) = _wait("the first scheduled run", verifications)
        assert first["created_by"] == f"schedule:{sid}" and first["result"] == "fail"
        assert first["evidence"]["trigger"] == "added" and first["evidence"]["leaks"] > 0
        # evaluated at once, or by the timer's pass that held the lock then, or the next one
        alerts = _wait(
            "the verification_failed alert",
            lambda: admin.get("/v1/alerts", params={"rule": "verification_failed"}).json(),
            timeout_s=40,
        )
        assert [(a["deployment_id"], a["state"]) for a in alerts] == [(deployment, "firing")]

        # the deployment's engine changes version: config_drift, then a run at once
        ingest = make_token(db_url, "ingest")
        events = [
            f.as_json(f.config(1, dep=deployment, probe="p-s", model_id=MODEL)),
            f.as_json(
                f.config(2, dep=deployment, probe="p-s", model_id=MODEL, engine_version="0.5.22")
            ),
        ]
        r = httpx.post(
            f"{url}/v1/events",
            json=events,
            headers={"Authorization": f"Bearer {ingest}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text

        def two() -> list[dict[str, Any]] | None:
            got = verifications()
            return got if len(got) >= 2 else None

        both = _wait("the drift re-run", two)
        assert both[0]["evidence"]["trigger"] == "drift"
        assert both[0]["engine_version"] == "0.5.22"  # tied to the config now running

    listed = _cli(db_url, "verify", "schedule", "list", "--json")
    assert listed.exit_code == 0, listed.output
    assert '"last_trigger": "drift"' in listed.stdout and '"runs": 2' in listed.stdout
    assert '"keys_from": "env:VERIFY_KEYS_LAB"' in listed.stdout
    table = _cli(db_url, "verify", "schedule", "list")
    assert "env:VERIFY_KEYS_LAB" in table.stdout and f"verification {both[0]['id']}" in table.stdout

    # the API: admin only, bad input names the field, nothing half-stored
    reader = make_token(db_url, "read")
    r = httpx.get(
        f"{url}/v1/verify-schedules", headers={"Authorization": f"Bearer {reader}"}, timeout=30
    )
    assert r.status_code == 403
    body = {
        "endpoint": "http://127.0.0.1:9/v1",
        "model_id": MODEL,
        "deployment_id": "other",
        "every": "1h",
        "keys_from": "env:NOT_THERE",
    }
    r = admin.post("/v1/verify-schedules", json=body)
    assert r.status_code == 422 and "keys_from" in r.json()["error"]["message"], r.text
    lab = {"keys_from": "env:VERIFY_KEYS_LAB"}
    r = admin.post("/v1/verify-schedules", json=body | lab | {"every": "5s"})
    assert r.status_code == 422 and "every" in r.json()["error"]["message"], r.text
    r = admin.post(
        "/v1/verify-schedules",
        json=body | {"keys_from": "env:VERIFY_KEYS_LAB", "endpoint": "http://u:p@h/v1"},
    )
    assert r.status_code == 422 and "credentials" in r.json()["error"]["message"], r.text
    assert [s["id"] for s in admin.get("/v1/verify-schedules").json()] == [sid]

    removed = _cli(db_url, "verify", "schedule", "remove", str(sid))
    assert removed.exit_code == 0, removed.output
    assert admin.get("/v1/verify-schedules").json() == []
    assert _cli(db_url, "verify", "schedule", "remove", str(sid)).exit_code == 2
    db = Database(db_url)
    with db.read() as conn:
        actions = set(conn.execute(select(m.AuditEntry.action)).scalars())
    db.dispose()
    assert {"verify_schedule.add", "verify_schedule.remove"} <= actions
    admin.close()

    proc.terminate()
    out = proc.communicate(timeout=30)[0]
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("kv.db*"))
    for key in PAIR.values():
        assert key.encode() not in stored  # never in the database
        assert key not in out and key not in listed.stdout + table.stdout  # nor printed


def test_a_schedule_needs_readable_keys_and_a_sane_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    monkeypatch.setenv("KVWATCH_VERIFY_ENDPOINTS", "http://127.0.0.1:9")
    monkeypatch.setenv("KVWATCH_VERIFY_KEYS_DIR", str(tmp_path))
    args = ["verify", "schedule", "add", "--endpoint", "http://127.0.0.1:9/v1", "--model", MODEL,
            "--deployment", "d", "--every", "1h"]  # fmt: skip
    r = _cli(db_url, *args, "--keys-from", "env:VERIFY_KEYS_NOT_SET")
    assert r.exit_code == 2 and "VERIFY_KEYS_NOT_SET" in r.output
    keys = tmp_path / "keys"
    keys.write_text("acme=only-one\n")
    r = _cli(db_url, *args, "--keys-from", "file:keys")
    assert r.exit_code == 2 and "at least two tenants" in r.output and "only-one" not in r.output
    keys.write_text(KEYS_TEXT.replace(" ", "\n"))
    r = _cli(db_url, *args[:-1], "10s", "--keys-from", "file:keys")
    assert r.exit_code == 2 and "every" in r.output
    r = _cli(db_url, *args, "--keys-from", "file:keys")
    assert r.exit_code == 0, r.output
    assert "sk-" not in r.output
    # a path in the directory, as schedules named them before the directory was required
    r = _cli(db_url, *args, "--keys-from", f"file:{keys}")
    assert r.exit_code == 0, r.output


def test_every_is_bounded_above_too(collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most MAX_EVERY_S (366 days) between runs: longer is a 422 naming `every` on the API
    and exit 2 naming --every on the CLI. A period past PostgreSQL's BIGINT (or past a float)
    is the same mistake, never a 500 or a traceback; nothing of a refused schedule is kept."""
    monkeypatch.setenv("KVWATCH_VERIFY_ENDPOINTS", "http://127.0.0.1:9")
    body = {
        "endpoint": SCHEDULE_ENDPOINT,
        "model_id": MODEL,
        "deployment_id": "d",
        "keys_from": SCHEDULE_KEYS,
    }
    huge = ["367d", "53w", "999999999999999d", "9" * 400 + "d"]
    with collector.client(collector.admin) as admin:
        for every in huge:
            r = admin.post("/v1/verify-schedules", json=body | {"every": every})
            assert r.status_code == 422, (every, r.status_code, r.text[:300])
            assert "every" in r.json()["error"]["message"] and "366d" in r.text, r.text
        args = ["verify", "schedule", "add", "--endpoint", "http://127.0.0.1:9/v1",
                "--model", MODEL, "--deployment", "d", "--keys-from", SCHEDULE_KEYS]  # fmt: skip
        for every in huge:
            res = _cli(collector.db_url, *args, "--every", every)
            assert res.exit_code == 2, (every, res.output)
            assert not isinstance(res.exception, Exception) or isinstance(
                res.exception, SystemExit
            ), res.exception
            assert "--every" in res.output and "366d" in res.output, res.output
        assert admin.get("/v1/verify-schedules").json() == []
        r = admin.post("/v1/verify-schedules", json=body | {"every": "366d"})
        assert r.status_code == 201 and r.json()["every_s"] == 366 * 86400, r.text


def test_one_run_at_a_time_per_endpoint(collector: Collector) -> None:
    """Two schedules of one endpoint: while one is claimed the other waits, on either
    database (PostgreSQL settles the race under an advisory lock)."""
    db = Database(collector.db_url)
    seen: list[str] = []

    def verifier(run: Any, keys: dict[str, str]) -> Any:
        seen.append(run.model_id)
        # while this run holds its claim, the other schedule of the endpoint is not due
        assert service._claim(datetime.now(UTC)) is None
        from collector.verify_schedules import RunOutcome

        return RunOutcome(None, "not run in this test")

    service = VerifyScheduleService(
        db,
        AlertingService(db, RuleSet()),
        verifier,
        environ=lambda: {"VERIFY_KEYS_K": KEYS_TEXT},
        reach=Reach(endpoints=("http://127.0.0.1:9",)),
    )
    try:
        for model in ("m1", "m2"):
            service.add(
                {
                    "endpoint": "http://127.0.0.1:9/v1",
                    "model_id": model,
                    "deployment_id": "d1",
                    "every_s": 3600,
                    "keys_from": "env:VERIFY_KEYS_K",
                },
                "test",
                datetime.now(UTC),
            )
        assert service.run_due() == 2 and sorted(seen) == ["m1", "m2"]
        docs = service.list()
        assert [d["last_result"] for d in docs] == ["error", "error"]
        assert [d["last_error"] for d in docs] == ["not run in this test"] * 2
        assert service.run_due() == 0  # next due in an hour
    finally:
        db.dispose()
