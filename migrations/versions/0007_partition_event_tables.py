"""PostgreSQL: pool_samples and page_events become monthly range partitions of ``ts``.

Rows, indexes and id sequences are kept; the primary key becomes (id, ts), as PostgreSQL
requires the partition key in it. SQLite: nothing changes. See ``collector.partitions``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from datetime import UTC, datetime

from alembic import op

from collector import partitions

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TABLES = ("pool_samples", "page_events")  # requests follow in 0010


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return
    now = datetime.now(UTC)
    for table in TABLES:
        if not partitions.is_partitioned(conn, table):
            partitions.convert(conn, table, now)


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return
    for table in TABLES:
        if partitions.is_partitioned(conn, table):
            partitions.unconvert(conn, table)
