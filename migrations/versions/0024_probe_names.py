"""Probe ids join the names a token may introduce per hour (collector.cardinality): the
probes already known are recorded as names from before the limit (no lineage, first seen 0),
so an upgrade does not count a fleet's running probes as new.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        INSERT INTO label_values (kind, deployment_id, value, token_lineage, first_seen)
        SELECT 'probe', p.deployment_id, p.probe_id, NULL, 0 FROM probes p
        WHERE NOT EXISTS (
            SELECT 1 FROM label_values l
            WHERE l.kind = 'probe' AND l.deployment_id = p.deployment_id
              AND l.value = p.probe_id
        )
        """
    )


def downgrade() -> None:
    op.execute("DELETE FROM label_values WHERE kind = 'probe'")
