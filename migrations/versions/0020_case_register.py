"""The case register: ``reports.signature`` (a JWS over a report's statement), and the
incident's notifications per party and its decision register (GDPR Art. 33(2), 33(5)).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("reports", sa.Column("signature", sa.Text(), nullable=True))
    op.create_table(
        "incident_notifications",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("incident_id", sa.BigInteger(), nullable=False),
        sa.Column("party_kind", sa.String(16), nullable=False),
        sa.Column("party", sa.String(128), nullable=False),
        sa.Column("notice_id", sa.String(64), nullable=False, unique=True),
        sa.Column("notice_sha256", sa.String(64), nullable=False),
        sa.Column("notice", sa.Text(), nullable=False),
        sa.Column("signature", sa.Text(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("prepared_at", sa.BigInteger(), nullable=False),
        sa.Column("prepared_by", sa.String(256), nullable=False),
        sa.Column("approved_at", sa.BigInteger(), nullable=True),
        sa.Column("approved_by", sa.String(256), nullable=True),
        sa.Column("sent_at", sa.BigInteger(), nullable=True),
        sa.Column("sent_by", sa.String(256), nullable=True),
        sa.Column("channel", sa.String(256), nullable=True),
        sa.Column("acknowledged_at", sa.BigInteger(), nullable=True),
        sa.Column("acknowledged_by", sa.String(256), nullable=True),
        sa.Column("deletion_confirmed_at", sa.BigInteger(), nullable=True),
    )
    op.create_index(
        "ix_incident_notifications_incident_id_party_kind_party",
        "incident_notifications",
        ["incident_id", "party_kind", "party"],
    )
    op.create_table(
        "incident_decisions",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("incident_id", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("what", sa.Text(), nullable=False),
        sa.Column("why", sa.Text(), nullable=False),
        sa.Column("supersedes", sa.BigInteger(), nullable=True),
    )
    op.create_index(
        "ix_incident_decisions_incident_id_ts", "incident_decisions", ["incident_id", "ts"]
    )


def downgrade() -> None:
    op.drop_index("ix_incident_decisions_incident_id_ts", table_name="incident_decisions")
    op.drop_table("incident_decisions")
    op.drop_index(
        "ix_incident_notifications_incident_id_party_kind_party",
        table_name="incident_notifications",
    )
    op.drop_table("incident_notifications")
    with op.batch_alter_table("reports") as batch:
        batch.drop_column("signature")
