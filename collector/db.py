"""Engine construction and transactions for SQLite (embedded default) and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

from collector.errors import Unavailable


class Database:
    """One SQLAlchemy engine plus the transaction discipline the collector relies on.

    SQLite: WAL journal (readers never block the writer), ``synchronous=NORMAL`` (a process
    crash loses nothing committed), a busy timeout, and write transactions opened with
    ``BEGIN IMMEDIATE`` so two writers queue instead of failing with "database is locked"
    half-way through a batch. PostgreSQL: a pre-pinged pool; writers serialise per probe
    with row locks (see ``collector.store``).
    """

    def __init__(self, url: str, *, pool_size: int = 5, echo: bool = False):
        self.url = make_url(url)
        self.dialect = self.url.get_backend_name()
        kwargs: dict[str, Any] = {"echo": echo}
        if self.dialect == "sqlite":
            if self.url.database and self.url.database != ":memory:":
                Path(self.url.database).parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            # One connection per checkout; SQLite connections are cheap and WAL needs no pool.
            kwargs["poolclass"] = NullPool
        else:
            kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.dialect == "sqlite":
            _sqlite_discipline(self.engine)

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction: commits on success, rolls back on any exception."""
        with self._translate(), self.engine.connect() as conn:
            conn = conn.execution_options(kvwatch_immediate=True)
            with conn.begin():
                yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self._translate(), self.engine.connect() as conn, conn.begin():
            yield conn

    def ping(self) -> None:
        with self.read() as conn:
            conn.exec_driver_sql("SELECT 1")

    def dispose(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _translate(self) -> Iterator[None]:
        # An unreachable or restarting database is an outage, not a bug: answer 503 so
        # producers keep their data and retry.
        try:
            yield
        except OperationalError as exc:
            raise Unavailable(f"database unavailable: {_short(exc)}") from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise Unavailable(f"database connection lost: {_short(exc)}") from exc
            raise


def _short(exc: DBAPIError) -> str:
    return str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__


def _sqlite_discipline(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from pysqlite so BEGIN IMMEDIATE can be issued.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("kvwatch_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
