"""Requests lost with their probe: ``requests.probe_id`` and ``requests.node`` (the probe and
node of a request's admission), ``requests.lost_reason``, and ``probes.gone_at`` /
``probes.gone_reason`` / ``probes.lost_requests``; two partial indexes, one over the requests
still open (what closing a gone probe's requests updates) and one over the lost ones (what
the fleet counts).

Rows already stored keep NULL: nobody recorded which probe admitted them, so a request left
``admitted`` before this revision stays so.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # On PostgreSQL requests is partitioned: columns and indexes reach every partition.
    op.add_column("requests", sa.Column("probe_id", sa.String(128), nullable=True))
    op.add_column("requests", sa.Column("node", sa.String(128), nullable=True))
    op.add_column("requests", sa.Column("lost_reason", sa.String(32), nullable=True))
    op.add_column("probes", sa.Column("gone_at", sa.BigInteger(), nullable=True))
    op.add_column("probes", sa.Column("gone_reason", sa.String(32), nullable=True))
    op.add_column(
        "probes",
        sa.Column("lost_requests", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.create_index(
        "ix_requests_open",
        "requests",
        ["probe_id", "node"],
        sqlite_where=sa.text("status = 'admitted'"),
        postgresql_where=sa.text("status = 'admitted'"),
    )
    op.create_index(
        "ix_requests_lost",
        "requests",
        ["deployment_id", "first_ts"],
        sqlite_where=sa.text("status = 'lost'"),
        postgresql_where=sa.text("status = 'lost'"),
    )


def downgrade() -> None:
    op.drop_index("ix_requests_lost", table_name="requests")
    op.drop_index("ix_requests_open", table_name="requests")
    with op.batch_alter_table("probes") as batch:
        batch.drop_column("lost_requests")
        batch.drop_column("gone_reason")
        batch.drop_column("gone_at")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("lost_reason")
        batch.drop_column("node")
        batch.drop_column("probe_id")
