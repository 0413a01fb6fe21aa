"""An index on the outbox by endpoint and creation time: each alert notification counts
its endpoint's messages of the current minute (collector.notify.outbox: at most
KVWATCH_NOTIFY_MAX_PER_MINUTE, then a digest), which must not scan the delivered history.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_outbox_endpoint_id_created_at", "outbox", ["endpoint_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_endpoint_id_created_at", table_name="outbox")
