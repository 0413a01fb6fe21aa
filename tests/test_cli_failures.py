"""Failures a person can read. A database the CLI cannot use: every command that needs one
ends with one line naming the database (password hidden) and what to check, and exit 2;
``--debug`` adds the traceback. Real subprocesses of the CLI, real closed ports, real files.
And a client that goes away mid-upload (a probe's batch, or any other body): one INFO line in
the collector's log, no traceback, nothing stored."""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvwatch.embedded import free_port
from tests.conftest import PG_ADMIN_URL, Collector, pg_available

pytestmark = pytest.mark.slow

PASSWORD = "hunter2-not-for-eyes"
EXIT_COULD_NOT_RUN = 2  # docs/using.md, "Exit codes"


def kvwatch(*args: str, url: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"KVWATCH_DATABASE_URL": url}
    env.pop("KVWATCH_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _commands() -> list[list[str]]:
    # serve gets a free port so that the only thing that can stop it is the database.
    return [
        ["db", "upgrade"],
        ["serve", "--port", str(free_port())],
        ["alerts", "list"],
        ["audit", "verify"],
        ["report", "limits", "--deployment", "glm-prod"],
        ["retention", "show"],
        ["webhooks", "list"],
        ["incidents", "list"],
    ]


COMMANDS = pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c[:2]))


def assert_one_line(r: subprocess.CompletedProcess[str], *expected: str) -> str:
    """The failure is one line on stderr holding ``expected``, with no traceback and no
    password, and exit 2; returns the line."""
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_COULD_NOT_RUN, out
    assert "Traceback" not in out, out
    assert PASSWORD not in out
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, out
    line = lines[0]
    assert line.startswith("error: "), line
    for text in expected:
        assert text in line, line
    return line


def _closed_port() -> int:
    return free_port()  # bound, then released: nothing listens there


@COMMANDS
def test_postgresql_on_a_closed_port(command: list[str]) -> None:
    port = _closed_port()
    url = f"postgresql://kvwatch:{PASSWORD}@127.0.0.1:{port}/kvwatch"
    started = time.monotonic()
    r = kvwatch(*command, url=url)
    line = assert_one_line(
        r,
        f"cannot reach the database postgresql+psycopg://kvwatch:***@127.0.0.1:{port}/kvwatch",
        "connection refused",
        "KVWATCH_DATABASE_URL",
        "server runs",
    )
    assert line.count("***") == 1
    # serve fails before it would start serving, not after a wait
    assert time.monotonic() - started < 60


@COMMANDS
def test_sqlite_whose_directory_cannot_be_made(command: list[str], tmp_path: Path) -> None:
    # A regular file where the database's directory should be: serve creates a missing
    # directory, but nothing can create this one.
    (tmp_path / "not-a-dir").write_text("")
    path = tmp_path / "not-a-dir" / "sub" / "kvwatch.db"
    r = kvwatch(*command, url=f"sqlite:///{path}")
    assert_one_line(
        r,
        f"cannot open the database sqlite:///{path}: ",
        "directory exists and is writable",
    )


@pytest.mark.parametrize(
    "command", [c for c in _commands() if c[0] != "serve"], ids=lambda c: " ".join(c[:2])
)
def test_sqlite_in_a_directory_that_does_not_exist(command: list[str], tmp_path: Path) -> None:
    path = tmp_path / "missing" / "kvwatch.db"
    r = kvwatch(*command, url=f"sqlite:///{path}")
    assert_one_line(r, f"cannot open the database sqlite:///{path}: unable to open database file")
    assert not path.exists()


@pytest.mark.postgres
@pytest.mark.parametrize(
    "command",
    [["db", "upgrade"], ["serve", "--port", str(free_port())], ["audit", "verify"]],
    ids=lambda c: " ".join(c[:2]),
)
def test_postgresql_database_that_does_not_exist(command: list[str]) -> None:
    if not pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}")
        pytest.skip("PostgreSQL not reachable")
    name = f"kvw_missing_{uuid.uuid4().hex[:12]}"
    url = f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    r = kvwatch(*command, url=url)
    assert_one_line(r, "cannot reach the database postgresql+psycopg://", f'database "{name}"')


def test_debug_shows_the_traceback_then_the_line(tmp_path: Path) -> None:
    url = f"postgresql://kvwatch:{PASSWORD}@127.0.0.1:{_closed_port()}/kvwatch"
    r = kvwatch("--debug", "alerts", "list", url=url)
    assert r.returncode == EXIT_COULD_NOT_RUN, r.stderr
    assert "Traceback (most recent call last)" in r.stderr
    assert "OperationalError" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach the database postgresql+psycopg://kvwatch:***@")
    assert PASSWORD not in r.stderr

    env = os.environ | {"KVWATCH_DATABASE_URL": url, "KVWATCH_DEBUG": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "audit", "verify"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == EXIT_COULD_NOT_RUN and "Traceback" in r.stderr


def test_a_url_that_does_not_parse_is_named_without_echoing_it() -> None:
    r = kvwatch("alerts", "list", url=f"postgresql://kv:{PASSWORD}@127.0.0.1:notaport/db")
    assert_one_line(r, "KVWATCH_DATABASE_URL", "not a usable SQLAlchemy URL")


def test_a_database_migrated_by_a_newer_kvwatch(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('from_the_future')")
    r = kvwatch("alerts", "list", url=f"sqlite:///{path}")
    assert_one_line(r, f"cannot migrate the database sqlite:///{path}", "from_the_future")


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are not the pages you are looking for\n" * 100)
    r = kvwatch("audit", "verify", url=f"sqlite:///{path}")
    assert_one_line(r, f"cannot open the database sqlite:///{path}: file is not a database")


# ------------------------------------------------------------ the collector's side


@pytest.mark.parametrize(
    ("path", "start"),
    [
        # a probe's batch: the ingest route streams its own (larger) limit
        ("/v1/events", b'[{"kind": "request.admitted", '),
        # every other body goes through the shared body limit first
        ("/v1/verifications", b'{"deployment_id": "glm-prod", "model_id": "m", "passed": '),
    ],
    ids=["events", "verifications"],
)
def test_a_client_that_leaves_mid_upload_is_one_info_line(
    collector: Collector, caplog: pytest.LogCaptureFixture, path: str, start: bytes
) -> None:
    # uvicorn's loggers do not propagate to the root: listen to them directly, so that an
    # ERROR with a traceback ("Exception in ASGI application") would be seen here too.
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    try:
        host, port = collector.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: kvwatch\r\n".encode()
                + f"Authorization: Bearer {collector.ingest}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                + start
            )
            time.sleep(0.3)  # the route is reading the body when the client goes
        deadline = time.monotonic() + 20
        while not [r for r in caplog.records if "disconnected" in r.getMessage()]:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        time.sleep(0.2)  # anything logged after it (an ERROR, a traceback) arrives too
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    ours = [r for r in caplog.records if r.name.startswith(("uvicorn", "kvwatch", "collector"))]
    (gone,) = [r for r in ours if "disconnected" in r.getMessage()]
    assert gone.levelno == logging.INFO
    assert gone.exc_info is None and not gone.exc_text
    assert f"POST {path}" in gone.getMessage() and "nothing stored" in gone.getMessage()
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []
    assert "Traceback" not in caplog.text
    with collector.client(collector.admin) as admin:
        assert admin.get("/v1/verifications").json() == []
        assert admin.get("/v1/probes").json() == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_rule_pack_that_does_not_load_stops_serve_without_a_traceback(
    tmp_path: Path, workers: str
) -> None:
    """An operator pack naming a rule the default pack defines already: the collector refuses
    to start, naming the file, the line and the clash, in lines a person reads. With worker
    processes too (each died with a traceback, and was started again, and again)."""
    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "ops.yaml").write_text(
        "pack: ops\nrules:\n  - name: bus_lag\n    kind: bus_lag\n    params: {lag_after: 2s}\n"
    )
    env = os.environ | {
        "KVWATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'kv.db'}",
        "KVWATCH_POLICY_PACKS_DIR": str(packs),
    }
    env.pop("KVWATCH_DEBUG", None)
    r = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "serve", "--port", str(free_port()),
         "--workers", workers],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_COULD_NOT_RUN, out
    assert "Traceback" not in out, out
    assert "error: the rule packs do not load (KVWATCH_POLICY_PACKS_DIR):" in r.stderr
    assert f"{packs / 'ops.yaml'}:3" in r.stderr and "already defined" in r.stderr
