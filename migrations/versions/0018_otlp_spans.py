"""OTLP spans stored: ``otlp_spans``, each span POST /v1/traces stored as a request, by trace
and span id, so an exporter's retry stores nothing twice and parallel-sampling siblings
(one request id, several spans) each keep a request of their own.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "otlp_spans",
        sa.Column("deployment_id", sa.String(128), primary_key=True),
        sa.Column("span_key", sa.String(128), primary_key=True),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("seen_at", sa.BigInteger(), nullable=False),
    )
    op.create_index(
        "ix_otlp_spans_deployment_id_seen_at", "otlp_spans", ["deployment_id", "seen_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_otlp_spans_deployment_id_seen_at", table_name="otlp_spans")
    op.drop_table("otlp_spans")
