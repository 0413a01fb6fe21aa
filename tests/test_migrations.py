"""Alembic migrations produce exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from collector import migrate
from collector.models import Base


def test_migrations_match_models(db_url: str) -> None:
    migrate.upgrade(db_url)
    migrate.upgrade(db_url)  # idempotent: a second run is a no-op
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert diff == []
    assert set(Base.metadata.tables) <= tables
    assert migrate.current_heads(db_url) == {"0001"}
