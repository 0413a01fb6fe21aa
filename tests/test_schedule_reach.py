"""A schedule cannot make the collector read the machine (issue 40, finding 2).

The attack: ``POST /v1/verify-schedules`` with ``keys_from=file:`` naming any ``NAME=KEY``
file the collector could open, and an endpoint of the caller's choosing: the collector read
the file and sent each value, as a bearer key, to that endpoint (the test receiver got the
database password). Now the operator sets, at start, the origins a schedule may send keys to
(``KVWATCH_VERIFY_ENDPOINTS``), the one directory key files are read from
(``KVWATCH_VERIFY_KEYS_DIR``) and the prefix of key variables
(``KVWATCH_VERIFY_KEYS_ENV_PREFIX``); each is checked when a schedule is added and again
before every run."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert

from collector import migrate
from collector import models as m
from collector.alerting.service import AlertingService
from collector.app import create_app
from collector.db import Database
from collector.settings import Settings
from collector.timefmt import to_micros
from collector.verify_schedules import Reach, RunOutcome, ScheduledRun, VerifyScheduleService
from kvwatch.embedded import serve_in_thread
from policies import RuleSet
from tests.conftest import make_token

SECRET = "hunter2-the-database-password"
ALLOWED = "http://127.0.0.1:9"


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, Path]]:
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    (keys_dir / "lab").write_text("acme=sk-acme globex=sk-globex\n")
    secret = tmp_path / "db.env"  # a NAME=KEY file the collector can read, outside the dir
    secret.write_text(f"DBPASS={SECRET} OTHER=x\n")
    (keys_dir / "linked").symlink_to(secret)
    monkeypatch.setenv("KVWATCH_TEST_DB_PASSWORD", f"A={SECRET} B=y")
    monkeypatch.setenv("VERIFY_KEYS_LAB", "acme=sk-acme globex=sk-globex")
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    settings = Settings(
        database_url=db_url,
        auto_migrate=False,
        verify_endpoints=[ALLOWED],
        verify_keys_dir=keys_dir,
    )
    with serve_in_thread(create_app(settings)) as url:
        yield url, keys_dir, secret


def _body(**kw: str) -> dict[str, Any]:
    return {
        "endpoint": f"{ALLOWED}/v1",
        "model_id": "m",
        "deployment_id": "d",
        "every": "6h",
        "keys_from": "file:lab",
    } | kw


def test_an_admin_token_cannot_name_a_file_a_variable_or_an_endpoint_outside_the_reach(
    setup: tuple[str, Path, Path],
) -> None:
    url, _, secret = setup
    db_url = f"sqlite:///{secret.parent / 'kv.db'}"
    admin = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {make_token(db_url, 'admin')}"}
    )
    refused = {
        "keys_from": [
            f"file:{secret}",  # an absolute path elsewhere
            "file:../db.env",  # out of the directory by ..
            "file:linked",  # a link in the directory to a file elsewhere
            "file:missing",
            "env:KVWATCH_TEST_DB_PASSWORD",  # a variable without the prefix
            "env:KVWATCH_DATABASE_URL",
        ],
        "endpoint": [
            "http://127.0.0.1:8/v1",  # another port
            "https://127.0.0.1:9/v1",  # another scheme
            "http://attacker.example:9/v1",
        ],
    }
    for field, values in refused.items():
        for value in values:
            r = admin.post("/v1/verify-schedules", json=_body(**{field: value}))
            assert r.status_code == 422, (value, r.text)
            assert r.json()["error"]["details"] == {"field": field}, r.text
            assert SECRET not in r.text
    assert admin.get("/v1/verify-schedules").json() == []
    # whether a file exists outside the directory is not the caller's to learn

    def said(ref: str) -> str:
        r = admin.post("/v1/verify-schedules", json=_body(keys_from=ref))
        return str(r.json()["error"]["message"]).replace(ref, "REF")

    assert said(f"file:{secret}") == said(f"file:{secret}.not-there") == said("file:/etc/passwd")
    # within the reach: a file in the directory, a variable with the prefix
    for ref in ("file:lab", f"file:{setup[1] / 'lab'}", "env:VERIFY_KEYS_LAB"):
        r = admin.post("/v1/verify-schedules", json=_body(keys_from=ref))
        assert r.status_code == 201, (ref, r.text)
    listed = admin.get("/v1/verify-schedules").json()
    assert len(listed) == 3 and "sk-acme" not in str(listed)


def test_a_schedule_stored_before_the_reach_was_narrowed_never_sends_what_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "db.env"
    secret.write_text(f"DBPASS={SECRET} OTHER=x\n")
    monkeypatch.setenv("PGPASSWORD_PAIRS", f"A={SECRET} B=y")
    db_url = f"sqlite:///{tmp_path / 'kv.db'}"
    migrate.upgrade(db_url)
    db = Database(db_url)
    sent: list[dict[str, str]] = []

    def verifier(run: ScheduledRun, keys: dict[str, str]) -> RunOutcome:
        sent.append(keys)
        return RunOutcome(None, "not run")

    now = to_micros(datetime.now(UTC))
    rows = [
        ("http://127.0.0.1:9/v1", f"file:{secret}"),
        ("http://127.0.0.1:9/v1", "env:PGPASSWORD_PAIRS"),
        ("http://attacker.example/v1", "env:VERIFY_KEYS_LAB"),
    ]
    try:
        with db.write() as conn:
            for i, (endpoint, ref) in enumerate(rows):
                conn.execute(
                    insert(m.VerifySchedule).values(
                        endpoint=endpoint,
                        model_id=f"m{i}",
                        deployment_id="d",
                        every_s=3600,
                        keys_ref=ref,
                        budget=10,
                        timeout_s=5.0,
                        created_at=now,
                        created_by="an older version",
                        next_at=now,
                        runs=0,
                    )
                )
        monkeypatch.setenv("VERIFY_KEYS_LAB", "acme=sk-acme globex=sk-globex")
        service = VerifyScheduleService(
            db,
            AlertingService(db, RuleSet()),
            verifier,
            reach=Reach(endpoints=("http://127.0.0.1:9",), keys_dir=tmp_path / "nowhere"),
        )
        assert service.run_due() == 3
        assert sent == []
        errors = sorted(d["last_error"] for d in service.list())
        assert all(e and SECRET not in e for e in errors), errors
        assert any("KVWATCH_VERIFY_ENDPOINTS" in e for e in errors), errors
        assert any("VERIFY_KEYS_" in e for e in errors), errors
        assert any("KVWATCH_VERIFY_KEYS_DIR" in e for e in errors), errors
    finally:
        db.dispose()


def test_the_reach_is_refused_when_it_is_not_origins() -> None:
    for bad in ("127.0.0.1:9", "http://h:9/v1", "ftp://h", "http://u:p@h"):
        with pytest.raises(ValueError, match="origin"):
            Settings(database_url="sqlite://", verify_endpoints=bad)
    s = Settings(database_url="sqlite://", verify_endpoints="http://H:9, https://x.example")
    assert s.verify_endpoints == ["http://h:9", "https://x.example"]
