"""A webhook secret's rotation grace: after ``kvwatch webhooks rotate-secret``, the previous
secret keeps signing beside the new one (a second ``v1,`` entry of ``webhook-signature``, as
Standard Webhooks provides for rotation) until ``previous_secret_until`` (µs since the
epoch), so a receiver can switch secrets without refusing a message in between. Both
nullable: no rotation, or one without grace, leaves them empty.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("notify_endpoints", sa.Column("previous_secret", sa.Text(), nullable=True))
    op.add_column(
        "notify_endpoints", sa.Column("previous_secret_until", sa.BigInteger(), nullable=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("notify_endpoints") as batch:
        batch.drop_column("previous_secret_until")
        batch.drop_column("previous_secret")
