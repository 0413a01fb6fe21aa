"""Engine construction and transactions for SQLite (embedded default) and PostgreSQL."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from collector.errors import InvalidInput, TransientConflict, Unavailable
from collector.rollups.buckets import UNKNOWN_BIN, bin_of


class Database:
    """One SQLAlchemy engine plus the transaction discipline the collector relies on.

    SQLite: WAL journal (readers never block the writer), ``synchronous=NORMAL`` (a process
    crash loses nothing committed), pooled connections (opening one per batch costs more
    than the insert), and one writer at a time: a thread lock plus an ``flock`` on
    ``<db>.writelock`` queue writers of this and other processes (``kvwatch serve
    --workers``) without SQLite's sleep-and-retry busy handler, and ``BEGIN IMMEDIATE``
    takes the write lock before reading, so a batch never fails half-way with "database is
    locked". PostgreSQL: a pre-pinged pool; writers serialise per probe with row locks (see
    ``collector.store``).
    """

    def __init__(self, url: str, *, pool_size: int = 5, echo: bool = False):
        self.url = make_url(url)
        self.dialect = self.url.get_backend_name()
        kwargs: dict[str, Any] = {"echo": echo}
        self._thread_lock = threading.Lock()
        self._lock_path: Path | None = None
        self._lock_file: IO[str] | None = None
        self._lock_pid = 0
        if self.dialect == "sqlite":
            if self.url.database and self.url.database != ":memory:":
                db_file = Path(self.url.database)
                db_file.parent.mkdir(parents=True, exist_ok=True)
                self._lock_path = db_file.with_name(db_file.name + ".writelock")
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            kwargs.update(pool_size=pool_size, max_overflow=2 * pool_size)
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
        with self._translate(), ExitStack() as stack:
            if self.is_sqlite:
                stack.enter_context(self._sqlite_writer())
            conn = stack.enter_context(self.engine.connect())
            conn = conn.execution_options(kvwatch_immediate=True)
            with conn.begin():
                yield conn

    @contextmanager
    def _sqlite_writer(self) -> Iterator[None]:
        with self._thread_lock:
            if self._lock_path is None:
                yield
                return
            fd = self._lock_fd()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _lock_fd(self) -> int:
        # flock belongs to the open file description: a forked child must open its own.
        if self._lock_file is None or self._lock_pid != os.getpid():
            assert self._lock_path is not None
            self._lock_file = self._lock_path.open("a")
            self._lock_pid = os.getpid()
        return self._lock_file.fileno()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self._translate(), self.engine.connect() as conn, conn.begin():
            yield conn

    def ping(self) -> None:
        with self.read() as conn:
            conn.exec_driver_sql("SELECT 1")

    def dispose(self) -> None:
        self.engine.dispose()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @contextmanager
    def _translate(self) -> Iterator[None]:
        # An unreachable or restarting database is an outage, not a bug: answer 503 so
        # producers keep their data and retry.
        # The ingest path talks to the driver directly, so driver exceptions arrive here
        # unwrapped as well as wrapped by SQLAlchemy.
        try:
            yield
        except DBAPIError as exc:
            if (mapped := _translated(exc.orig, exc)) is None:
                raise
            raise mapped from exc
        except DRIVER_ERRORS as exc:
            if (mapped := _translated(exc, None)) is None:
                raise
            raise mapped from exc
        except OverflowError as exc:
            # sqlite3 refuses to bind an int beyond 64 bits: bad input that a route's bounds
            # missed, never a 500.
            raise InvalidInput(f"a number is out of range: {exc}") from exc


def _psycopg_errors() -> tuple[type[Exception], ...]:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return ()
    return (psycopg.Error,)


DRIVER_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, *_psycopg_errors())
_RETRYABLE_SQLSTATES = {"40001", "40P01"}  # serialization failure, deadlock detected


def _translated(orig: BaseException | None, wrapped: DBAPIError | None) -> Exception | None:
    """Map a driver error to what the caller should see: a retryable conflict, an outage
    (503), or the original error (a bug: a 500 that tests must never see)."""
    text = str(orig).strip().splitlines()[0] if orig else type(wrapped).__name__
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in _RETRYABLE_SQLSTATES:
        return TransientConflict(f"concurrent write conflict, retry: {text}")
    outage = isinstance(wrapped, OperationalError) or (
        wrapped is not None and wrapped.connection_invalidated
    )
    if orig is not None:
        name = type(orig).__name__
        outage = (
            outage
            or name in ("OperationalError", "InterfaceError")
            or (sqlstate is not None and sqlstate[:2] in ("08", "53", "57"))
        )
    return Unavailable(f"database unavailable: {text}") if outage else None


def sqlite_explicit_transactions(engine: Engine) -> None:
    """Take transaction control from pysqlite, which never BEGINs before DDL (so a migration
    killed half-way left half a schema) and cannot BEGIN IMMEDIATE. SQLAlchemy's BEGIN
    becomes a real one; ``kvwatch_immediate=True`` makes it take the write lock at once."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("kvwatch_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _prompt_bin(tokens: int | None) -> int:
    return UNKNOWN_BIN if tokens is None else bin_of(tokens)


def _sqlite_discipline(engine: Engine) -> None:
    sqlite_explicit_transactions(engine)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # The rollups' prompt-size bin; SQLite may lack log2 (math functions are optional).
        dbapi_conn.create_function("kvw_prompt_bin", 1, _prompt_bin, deterministic=True)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()
