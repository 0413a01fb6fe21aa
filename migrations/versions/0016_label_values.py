"""Label values: every deployment, node, model and route the collector has been told of,
with the token lineage that first named it and when, so new names per token per hour can be
limited (a batch naming thousands of deployments grew /metrics and /v1/fleet without bound).
What is already stored is backfilled as named by no token, long ago.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "label_values",
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("deployment_id", sa.String(128), primary_key=True),
        sa.Column("value", sa.String(256), primary_key=True),
        sa.Column("token_lineage", sa.BigInteger(), nullable=True),
        sa.Column("first_seen", sa.BigInteger(), nullable=False),
    )
    op.create_index(
        "ix_label_values_token_lineage_first_seen", "label_values", ["token_lineage", "first_seen"]
    )
    for sql in (
        "INSERT INTO label_values (kind, deployment_id, value, first_seen) "
        "SELECT 'deployment', id, id, 0 FROM deployments",
        "INSERT INTO label_values (kind, deployment_id, value, first_seen) "
        "SELECT DISTINCT 'node', deployment_id, node, 0 FROM deployment_configs",
        "INSERT INTO label_values (kind, deployment_id, value, first_seen) "
        "SELECT DISTINCT 'model', deployment_id, model_id, 0 FROM ("
        " SELECT deployment_id, model_id FROM deployment_configs"
        " UNION SELECT deployment_id, model_id FROM request_rollups_hourly"
        " WHERE model_id IS NOT NULL) AS m",
        "INSERT INTO label_values (kind, deployment_id, value, first_seen) "
        "SELECT DISTINCT 'route', deployment_id, route, 0 FROM request_rollups_hourly "
        "WHERE route IS NOT NULL",
    ):
        op.execute(sql)


def downgrade() -> None:
    op.drop_index("ix_label_values_token_lineage_first_seen", table_name="label_values")
    op.drop_table("label_values")
