"""On-call: the installation's identity (``installation``, one generated ``instance_id`` per
database, so every replica of one installation sends the same identity and two
installations never share one), and an incident's acknowledgement and owner; an alert an
operator unlinked from an incident remembers which, so it is not linked back; the audit
log is indexed by subject (an incident's timeline reads it so).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-04
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    installation = op.create_table(
        "installation",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
    )
    # Generated once, here: a database copied to a second installation keeps it, which is
    # why KVWATCH_INSTANCE exists to name that one differently.
    op.bulk_insert(installation, [{"key": "instance_id", "value": f"kvw-{secrets.token_hex(5)}"}])
    with op.batch_alter_table("incidents") as batch:
        batch.add_column(sa.Column("acked_at", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("acked_by", sa.String(256), nullable=True))
        batch.add_column(sa.Column("owner", sa.String(256), nullable=True))
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("unlinked_from", sa.BigInteger(), nullable=True))
    # An incident's timeline reads its entries by subject: without this, a scan of the whole
    # log, which grows with every token use and report.
    op.create_index("ix_audit_log_subject", "audit_log", ["subject"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_subject", table_name="audit_log")
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("unlinked_from")
    with op.batch_alter_table("incidents") as batch:
        batch.drop_column("owner")
        batch.drop_column("acked_by")
        batch.drop_column("acked_at")
    op.drop_table("installation")
