"""Alembic migrations produce exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect

from collector import migrate
from collector.models import Base
from collector.partitions import pg_only

pytestmark = pytest.mark.empty_db  # the migrations themselves, from an empty database


def test_migrations_match_models(db_url: str) -> None:
    migrate.upgrade(db_url)
    migrate.upgrade(db_url)  # idempotent: a second run is a no-op
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    # monthly partitions (PostgreSQL) are made at run time, not by the models
                    "include_object": lambda o, name, type_, r, c: (
                        not pg_only(conn.dialect.name, type_, name, o)
                    ),
                },
            )
            diff = compare_metadata(ctx, Base.metadata)
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert diff == []
    assert set(Base.metadata.tables) <= tables
    script = ScriptDirectory.from_config(migrate.alembic_config(db_url))
    assert migrate.current_heads(db_url) == set(script.get_heads())
    assert len(script.get_heads()) == 1, "the migrations must form one line"


def test_each_migration_downgrades_and_upgrades_again(db_url: str) -> None:
    """Every revision can be undone and redone (an operator rolling back a release)."""
    cfg = migrate.alembic_config(db_url)
    migrate.upgrade(db_url)
    command.downgrade(cfg, "0001")
    assert migrate.current_heads(db_url) == {"0001"}
    migrate.upgrade(db_url)
    script = ScriptDirectory.from_config(cfg)
    assert migrate.current_heads(db_url) == set(script.get_heads())
