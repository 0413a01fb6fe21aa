"""Data lifecycle: per-deployment retention, an audit log whose details can be erased, and
when each token was last recorded as used.

The audit chain now covers each detail's SHA-256 (``detail_sha256``), so erasing a tenant
can replace a detail that names it without breaking the chain; ``redacted_by`` names the
erasure entry. Existing entries keep hashing their detail (``detail_sha256`` NULL).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "retention_policies",
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("keep_days", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_by", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("deployment_id", name=op.f("pk_retention_policies")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.add_column(sa.Column("detail_sha256", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("redacted_by", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_used_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_column("last_used_at")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_column("redacted_by")
        batch_op.drop_column("detail_sha256")
    op.drop_table("retention_policies")
