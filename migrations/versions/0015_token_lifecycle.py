"""Token lifecycle: an expiry per token, and the rotation lineage (the first token a rotated
one descends from), so a probe's events keep their owner across a rotation.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as t:
        t.add_column(sa.Column("expires_at", sa.BigInteger(), nullable=True))
        t.add_column(sa.Column("lineage_id", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as t:
        t.drop_column("lineage_id")
        t.drop_column("expires_at")
