"""Where KV goes past the engine's pool: each stored config's KV connector, its version and
its offload tiers (``engine.config``'s ``kv_connector``, ``kv_connector_version`` and
``kv_tiers``, a JSON array), and each request's ``cache_write_tokens`` (OpenTelemetry's
``gen_ai.usage.cache_creation.input_tokens``). All nullable: rows stored before say nothing.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN on both backends (no table copy); on PostgreSQL requests is
    # partitioned and the column reaches every partition.
    op.add_column("deployment_configs", sa.Column("kv_connector", sa.String(64), nullable=True))
    op.add_column(
        "deployment_configs", sa.Column("kv_connector_version", sa.String(64), nullable=True)
    )
    op.add_column("deployment_configs", sa.Column("kv_tiers", sa.Text(), nullable=True))
    op.add_column("requests", sa.Column("cache_write_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("cache_write_tokens")
    with op.batch_alter_table("deployment_configs") as batch:
        batch.drop_column("kv_tiers")
        batch.drop_column("kv_connector_version")
        batch.drop_column("kv_connector")
