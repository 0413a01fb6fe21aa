"""Alembic migrations produce exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from collector import migrate
from collector.models import Base
from collector.partitions import partitions, pg_only

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


def test_0012_keeps_old_rows_and_gives_their_rollups_no_shared_prompts(db_url: str) -> None:
    """Requests and rollups stored before 0012 keep their figures: no request names another's
    prompt, and each rollup row gets shared_prompts = shared_prompt_tokens = 0. On PostgreSQL
    the column reaches every monthly partition of requests."""
    migrate.upgrade(db_url, "0011")
    engine = create_engine(db_url)
    rollup = (
        "(deployment_id, bucket_start, model_id, route, tenant, prompt_bin, requests, "
        "rejected, prompt_tokens_max, prompt_tokens_sum) VALUES "
        "('d', 0, 'm', '/x', 't', 82, 2, 0, 1234, 2400), ('d', 0, 'm', '/x', '*', 82, 2, 0, "
        "1234, 2400)"
    )
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO requests (deployment_id, request_id, tenant, route, model_id, "
                    "prompt_tokens, status, first_ts, last_ts, part_ts) VALUES "
                    "('d', 'r1', 't', '/x', 'm', 1234, 'completed', 1000000, 1000000, 1000000), "
                    "('d', 'r2', 't', '/x', 'm', 1166, 'completed', 2000000, 2000000, 2000000)"
                )
            )
            conn.execute(text(f"INSERT INTO request_rollups {rollup}"))
            conn.execute(text(f"INSERT INTO request_rollups_hourly {rollup}"))
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            reqs = conn.execute(
                text("SELECT request_id, prompt_shared_with FROM requests ORDER BY request_id")
            ).all()
            rollups = {
                t: conn.execute(
                    text(
                        f"SELECT tenant, requests, prompt_tokens_sum, shared_prompts, "
                        f"shared_prompt_tokens FROM {t} ORDER BY tenant"
                    )
                ).all()
                for t in ("request_rollups", "request_rollups_hourly")
            }
            parts: list[str] = []
            if conn.dialect.name == "postgresql":
                parts = [p.name for p in partitions(conn, "requests")]
                with_col = {
                    r[0]
                    for r in conn.execute(
                        text(
                            "SELECT table_name FROM information_schema.columns "
                            "WHERE column_name = 'prompt_shared_with'"
                        )
                    )
                }
    finally:
        engine.dispose()
    assert [tuple(r) for r in reqs] == [("r1", None), ("r2", None)]
    for rows in rollups.values():
        assert [tuple(r) for r in rows] == [("*", 2, 2400, 0, 0), ("t", 2, 2400, 0, 0)]
    if parts:
        assert len(parts) > 2 and with_col == {"requests", *parts}


def test_0014_makes_stored_rows_agree_with_the_one_cross_tenant(db_url: str) -> None:
    """A zeroized stale read stored as cross-tenant becomes not cross-tenant; a canary hit of
    unknown owner stored as not cross-tenant becomes cross-tenant; the rest stay."""
    migrate.upgrade(db_url, "0013")
    engine = create_engine(db_url)
    cols = (
        "(deployment_id, probe_id, seq, ts, kind, node, request_id, tenant, other_request_id, "
        "other_tenant, page_count, cross_tenant, detail)"
    )
    rows = [
        ("zeroed", "page.stale_read", "'acme'", "true", '{"zeroized":true}'),
        ("written", "page.stale_read", "'acme'", "true", '{"zeroized":false}'),
        ("unknown", "canary.hit", "NULL", "false", '{"detector":"paint"}'),
        ("own", "canary.hit", "'globex'", "false", '{"detector":"paint"}'),
    ]
    try:
        with engine.begin() as conn:
            for seq, (node, kind, other, crossed, detail) in enumerate(rows, 1):
                conn.execute(
                    text(
                        f"INSERT INTO page_events {cols} VALUES ('d', 'p', {seq}, {seq}, "
                        f"'{kind}', '{node}', 'r', 'globex', NULL, {other}, 1, {crossed}, "
                        ":detail)"
                    ),
                    {"detail": detail},
                )
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT node, cross_tenant FROM page_events")).all())
    finally:
        engine.dispose()
    assert {k: bool(v) for k, v in got.items()} == {
        "zeroed": False,
        "written": True,
        "unknown": True,
        "own": False,
    }


def test_processes_migrating_one_new_database_at_once_take_turns(db_url: str) -> None:
    """A collector and a dashboard started together on a new database: three processes
    upgrade at once, each exits 0 and the schema is applied once (on SQLite a deferred BEGIN
    let two read 'empty': 'duplicate column name' or 'database is locked')."""
    import subprocess
    import sys

    code = "import sys; from collector import migrate; migrate.upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, db_url], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for p in procs:
        _, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-2000:]
    assert migrate.current_heads(db_url) == {ScriptDirectory.from_config(
        migrate.alembic_config(db_url)).get_current_head()}  # fmt: skip
