"""Alembic environment: the URL comes from the caller (``kvwatch db upgrade`` passes the
collector's ``KVWATCH_DATABASE_URL``), the target schema from ``collector.models``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from collector.db import sqlite_explicit_transactions
from collector.models import Base
from collector.partitions import pg_only
from collector.settings import Settings

config = context.config
url = config.attributes.get("kvwatch_url") or config.get_main_option("sqlalchemy.url")
if not url:
    url = Settings().database_url

# Several collector replicas may start together: one migrates, the others wait for it.
_PG_LOCK = 0x6B7677617463  # "kvwatc"


def _include(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    # Monthly partitions are made at run time, not by the models.
    return not pg_only(_DIALECT[0], type_, name, obj)


_DIALECT = [""]


# How long a process waits for another one's SQLite migration (sqlite3's busy timeout).
_SQLITE_WAIT_S = 600.0


def run_migrations_online() -> None:
    sqlite = url.startswith("sqlite")
    engine = create_engine(url, connect_args={"timeout": _SQLITE_WAIT_S} if sqlite else {})
    _DIALECT[0] = engine.dialect.name
    if sqlite:
        # All migrations in one real transaction: killed half-way, nothing was applied.
        sqlite_explicit_transactions(engine)
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK})
            conn.commit()
        elif sqlite:
            # The write lock before alembic reads the version: two processes migrating one
            # new file (a collector and a dashboard started together) take turns, and the
            # second finds the schema current. A deferred BEGIN let both read "empty" and the
            # second fail on a column the first had added, or on "database is locked".
            conn = conn.execution_options(kvwatch_immediate=True)
            conn.begin()
        try:
            context.configure(
                connection=conn,
                target_metadata=Base.metadata,
                render_as_batch=conn.dialect.name == "sqlite",
                compare_type=True,
                include_object=_include,
            )
            with context.begin_transaction():
                context.run_migrations()
            if conn.in_transaction():  # the SQLite transaction begun above is ours to commit
                conn.commit()
        finally:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK})
                conn.commit()
    engine.dispose()


if context.is_offline_mode():
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
