"""Probes that shut down cleanly: ``probes.stopped_at``, from their ``probe.stopped`` event.

A stopped probe is not "silent" (``telemetry_gap``): an engine that was shut down or
restarted must not leave an alert behind.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("probes", sa.Column("stopped_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("probes") as batch:
        batch.drop_column("stopped_at")
