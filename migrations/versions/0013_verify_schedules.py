"""Scheduled verifications: ``verify_schedules`` (``kvwatch verify schedule add``).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "verify_schedules",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("model_id", sa.String(256), nullable=False),
        sa.Column("deployment_id", sa.String(128), nullable=False),
        sa.Column("every_s", sa.BigInteger(), nullable=False),
        sa.Column("keys_ref", sa.Text(), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("max_context", sa.BigInteger(), nullable=True),
        sa.Column("timeout_s", sa.Float(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("created_by", sa.String(256), nullable=False),
        sa.Column("next_at", sa.BigInteger(), nullable=False),
        sa.Column("claimed_until", sa.BigInteger(), nullable=True),
        sa.Column("last_started_at", sa.BigInteger(), nullable=True),
        sa.Column("last_finished_at", sa.BigInteger(), nullable=True),
        sa.Column("last_trigger", sa.String(16), nullable=True),
        sa.Column("last_result", sa.String(16), nullable=True),
        sa.Column("last_verification_id", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("runs", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("verify_schedules")
