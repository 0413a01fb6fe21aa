"""Shared fixtures: real databases (SQLite files and fresh PostgreSQL databases) and a real
collector served over HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.embedded import free_port, serve_in_thread

__all__ = ["free_port"]

# What the CLI prints is read by tests at a wide terminal's width: pytest hands its children
# COLUMNS=80, where kvwatch's tables fold long names onto several lines (a test of the narrow
# layout passes its own COLUMNS: tests/test_cli_tables.py, tests/test_cli_help.py).
os.environ["COLUMNS"] = "200"

# A test's own HTTP calls wait up to 30 s, not httpx's 5 s: on a busy CI machine a collector
# answers late, not wrong, and a 5 s ReadTimeout failed a CI run. Product code passes its own
# timeouts (and runs in its own processes here too); a test that means a shorter wait says so.
_PATIENT = httpx.Timeout(30.0)
for _call in (
    httpx.get, httpx.post, httpx.put, httpx.patch, httpx.delete, httpx.request, httpx.head,
    httpx.options, httpx.Client.__init__, httpx.AsyncClient.__init__,
):  # fmt: skip
    if _call.__kwdefaults__ and "timeout" in _call.__kwdefaults__:
        _call.__kwdefaults__["timeout"] = _PATIENT

PG_ADMIN_URL = os.environ.get("KVWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3):
            return True
    except Exception:
        return False


_PG_OK: bool | None = None


def pg_available() -> bool:
    global _PG_OK
    if _PG_OK is None:
        _PG_OK = _pg_available()
    return _PG_OK


def _sa_url(name: str) -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}"


@pytest.fixture(scope="session")
def _pg_template() -> Iterator[str]:
    """A database migrated to head once per run: each test's database is a copy of it
    (CREATE DATABASE ... TEMPLATE: ~0.1 s instead of ~1.8 s of migrations per test)."""
    import psycopg

    from collector import migrate

    name = f"kvw_tmpl_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        migrate.upgrade(_sa_url(name))
        yield name
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards: already migrated to head, unless the
    test is marked ``empty_db`` (tests of the migrations themselves)."""
    if not pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}")
        pytest.skip("PostgreSQL not reachable")
    import psycopg

    template = None
    if request.node.get_closest_marker("empty_db") is None:
        template = request.getfixturevalue("_pg_template")
    name = f"kvw_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    try:
        yield _sa_url(name)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """An empty SQLite file's URL (no migrations run)."""
    return f"sqlite:///{tmp_path / 'kvwatch.db'}"


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once per run (per worker): each test's file is a copy
    of it, as each PostgreSQL test's database is of ``_pg_template`` (a copy takes
    milliseconds; the migrations take about a second, in hundreds of tests)."""
    import sqlite3

    from collector import migrate

    path = tmp_path_factory.mktemp("sqlite-template") / "kvwatch.db"
    migrate.upgrade(f"sqlite:///{path}")
    # fold the WAL into the file and leave rollback mode, so the file alone is the database
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A SQLite file or a PostgreSQL database, migrated to head unless the test is marked
    ``empty_db``."""
    if request.param == "sqlite":
        path = tmp_path / "kvwatch.db"
        if request.node.get_closest_marker("empty_db") is None:
            shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        return f"sqlite:///{path}"
    # Its signing keys its own, as a SQLite test's are beside its file (collector.signing.key_dir)
    request.getfixturevalue("monkeypatch").setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return str(request.getfixturevalue("pg_url"))


@dataclass
class Collector:
    url: str
    db_url: str
    admin: str
    ingest: str

    def client(self, token: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def token(self, kind: str, **kw: str | None) -> str:
        return make_token(self.db_url, kind, **kw)


def make_token(db_url: str, kind: str, **kw: str | None) -> str:
    from collector.db import Database
    from collector.timefmt import to_micros
    from collector.tokens import create_token
    from engine_probe.events import utcnow

    db = Database(db_url)
    try:
        with db.write() as conn:
            return create_token(conn, kind=kind, now_us=to_micros(utcnow()), **kw)[1]  # type: ignore[arg-type]
    finally:
        db.dispose()


DPO_CONTACT = "Data protection officer, dpo@operator.example"


# what a schedule added through the test collector may reach (collector.verify_schedules.Reach):
# the unreachable endpoint the tests name, and keys in a variable with the default prefix
SCHEDULE_ENDPOINT = "http://127.0.0.1:9/v1"
SCHEDULE_KEYS = "env:VERIFY_KEYS_TEST"


@pytest.fixture
def collector(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Collector]:
    """The real collector app, served by uvicorn on 127.0.0.1 in a thread."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings

    migrate.upgrade(db_url)
    settings = Settings(
        database_url=db_url,
        max_batch_events=1000,
        max_body_bytes=1024 * 1024,
        auto_migrate=False,
        rollup_interval_s=0.2,
        # as an operator sets it: a notice without a contact point is a draft, never sent
        dpo_contact=DPO_CONTACT,
        verify_endpoints=["http://127.0.0.1:9"],
    )
    monkeypatch.setenv("VERIFY_KEYS_TEST", "acme=k-acme globex=k-globex")
    with serve_in_thread(create_app(settings)) as url:
        yield Collector(url, db_url, make_token(db_url, "admin"), make_token(db_url, "ingest"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors: intra-op threads only add synchronisation. Modules that run refengine
    use it (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``); torch is imported
    here, not at the top, so torch-free test modules never load it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wait_rollups(db_url: str, timeout_s: float = 20.0) -> None:
    """Wait for the collector's rollup refresher to have recomputed every marked bucket."""
    from collector.db import Database
    from collector.rollups.refresh import RollupRefresher

    db = Database(db_url)
    try:
        deadline = time.monotonic() + timeout_s
        while RollupRefresher(db).pending():
            assert time.monotonic() < deadline, "the rollup refresher did not catch up"
            time.sleep(0.05)
    finally:
        db.dispose()


@pytest.fixture
def probes() -> Iterator[list[Any]]:
    """Probes (``engine_probe.probe.Probe``) a test made, shut down after it whatever
    happened, their exporter threads gone."""
    from tests.probe_helpers import exporter_threads, wait_for

    made: list[Any] = []
    yield made
    for probe in made:
        probe.shutdown(2.0)
    wait_for(lambda: not exporter_threads(), 5.0, "exporter threads to end")
