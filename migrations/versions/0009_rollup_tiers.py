"""Rollup tiers: all-tenant rows in the 5-minute rollups (``tenant = '*'``) and an hourly
table, so an operator's week-long chart reads about 1/(12 x tenants) of the rows it did.
Every existing request bucket is marked, so the refresher rebuilds both.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "request_rollups_hourly",
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
        sa.PrimaryKeyConstraint("id", name=op.f("pk_request_rollups_hourly")),
    )
    with op.batch_alter_table("request_rollups_hourly", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_request_rollups_hourly_deployment_id_bucket_start"),
            ["deployment_id", "bucket_start"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_request_rollups_hourly_tenant_bucket_start"),
            ["tenant", "bucket_start"],
            unique=False,
        )
    op.execute(
        "INSERT INTO rollup_dirty (kind, deployment_id, bucket_start, marked_at) "
        "SELECT DISTINCT 'requests', deployment_id, bucket_start, 0 FROM request_rollups "
        "WHERE true ON CONFLICT (kind, deployment_id, bucket_start) DO NOTHING"
    )


def downgrade() -> None:
    op.execute("DELETE FROM request_rollups WHERE tenant = '*'")
    with op.batch_alter_table("request_rollups_hourly", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_request_rollups_hourly_tenant_bucket_start"))
        batch_op.drop_index(batch_op.f("ix_request_rollups_hourly_deployment_id_bucket_start"))
    op.drop_table("request_rollups_hourly")
