"""Scheduled scrapes: one row per engine /metrics target the collector scrapes.

Replicas claim a target for an interval by moving ``next_at`` (an UPDATE ... WHERE
``next_at`` <= now), and reserve the seqs of its events from ``seq``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "scrape_targets",
        sa.Column("target_key", sa.String(length=64), nullable=False),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("engine", sa.String(length=16), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("next_at", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("token_id", sa.BigInteger(), nullable=True),
        sa.Column("config_hash", sa.String(length=64), nullable=True),
        sa.Column("claimed_by", sa.String(length=256), nullable=True),
        sa.Column("last_ok_at", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("failures", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["api_tokens.id"],
            name=op.f("fk_scrape_targets_token_id_api_tokens"),
        ),
        sa.PrimaryKeyConstraint("target_key", name=op.f("pk_scrape_targets")),
        sa.UniqueConstraint("probe_id", name=op.f("uq_scrape_targets_probe_id")),
    )


def downgrade() -> None:
    op.drop_table("scrape_targets")
