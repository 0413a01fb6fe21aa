"""Cached prompt tokens per request: ``requests.cached_tokens``, how many of a request's
prompt tokens a prefix cache served (from its ``request.finished``: vLLM's ``cached_tokens``,
OpenTelemetry's ``gen_ai.usage.cache_read.input_tokens``). NULL for what is already stored:
nobody said.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # On PostgreSQL requests is partitioned: the column reaches every partition.
    op.add_column("requests", sa.Column("cached_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("cached_tokens")
