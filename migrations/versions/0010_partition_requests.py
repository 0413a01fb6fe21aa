"""Requests get ``part_ts`` (their first_ts when first stored, never changed) and, on
PostgreSQL, become monthly range partitions of it, with ``request_keys`` keeping
(deployment_id, request_id) unique across months. See ``collector.partitions``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from collector import partitions

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    conn = op.get_bind()
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("part_ts", sa.BigInteger(), nullable=True))
    op.execute("UPDATE requests SET part_ts = first_ts")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.alter_column("part_ts", existing_type=sa.BigInteger(), nullable=False)
    op.create_table(
        "request_keys",
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("part_ts", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("deployment_id", "request_id", name=op.f("pk_request_keys")),
    )
    if conn.dialect.name != "postgresql":
        return
    op.execute(
        "INSERT INTO request_keys (deployment_id, request_id, part_ts) "
        "SELECT deployment_id, request_id, part_ts FROM requests"
    )
    if not partitions.is_partitioned(conn, "requests"):
        partitions.convert(conn, "requests", datetime.now(UTC))


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "postgresql" and partitions.is_partitioned(conn, "requests"):
        partitions.unconvert(conn, "requests")
    op.drop_table("request_keys")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_column("part_ts")
