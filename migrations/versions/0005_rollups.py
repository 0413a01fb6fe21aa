"""Rollups for the dashboard: requests per 5 minutes, pool samples per minute, and the marks
of buckets to recompute. Existing data is marked, so the refresher backfills it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
REQUEST_BUCKET_US = 300_000_000
POOL_BUCKET_US = 60_000_000


def upgrade() -> None:
    op.create_table(
        "rollup_dirty",
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("marked_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "kind", "deployment_id", "bucket_start", name=op.f("pk_rollup_dirty")
        ),
    )
    op.create_table(
        "request_rollups",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("model_id", sa.String(length=256), nullable=True),
        sa.Column("route", sa.String(length=256), nullable=True),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("prompt_bin", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("rejected", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens_max", sa.BigInteger(), nullable=True),
        sa.Column("prompt_tokens_sum", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_request_rollups")),
    )
    with op.batch_alter_table("request_rollups", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_request_rollups_deployment_id_bucket_start"),
            ["deployment_id", "bucket_start"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_request_rollups_bucket_start"), ["bucket_start"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_request_rollups_tenant_bucket_start"),
            ["tenant", "bucket_start"],
            unique=False,
        )
    op.create_table(
        "pool_rollups",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("used_sum", sa.BigInteger(), nullable=False),
        sa.Column("used_max", sa.BigInteger(), nullable=False),
        sa.Column("free_min", sa.BigInteger(), nullable=False),
        sa.Column("capacity_max", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pool_rollups")),
    )
    with op.batch_alter_table("pool_rollups", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_pool_rollups_deployment_id_bucket_start"),
            ["deployment_id", "bucket_start"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_pool_rollups_bucket_start"), ["bucket_start"], unique=False
        )
    # Backfill: mark every bucket that holds data; the refresher computes them.
    op.execute(
        "INSERT INTO rollup_dirty (kind, deployment_id, bucket_start, marked_at) "
        f"SELECT DISTINCT 'requests', deployment_id, (first_ts / {REQUEST_BUCKET_US}) "
        f"* {REQUEST_BUCKET_US}, 0 FROM requests"
    )
    op.execute(
        "INSERT INTO rollup_dirty (kind, deployment_id, bucket_start, marked_at) "
        f"SELECT DISTINCT 'pool', deployment_id, (ts / {POOL_BUCKET_US}) * {POOL_BUCKET_US}, 0 "
        "FROM pool_samples"
    )


def downgrade() -> None:
    op.drop_table("pool_rollups")
    op.drop_table("request_rollups")
    op.drop_table("rollup_dirty")
