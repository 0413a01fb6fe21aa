"""Verification runs: a verification announces itself before its first prompt, so its own
traffic on the endpoint it tests is stored but never evaluated by the rules.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "verification_runs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("deployment_id", sa.String(128), nullable=False),
        sa.Column("tenants", sa.Text(), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("ends_at", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("created_by", sa.String(256), nullable=False),
        sa.Column("verification_id", sa.BigInteger(), nullable=True),
    )
    op.create_index(
        "ix_verification_runs_deployment_id_started_at",
        "verification_runs",
        ["deployment_id", "started_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_verification_runs_deployment_id_started_at", table_name="verification_runs")
    op.drop_table("verification_runs")
