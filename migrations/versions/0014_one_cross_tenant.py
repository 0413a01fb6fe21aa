"""One definition of cross-tenant (``engine_probe.events.crosses_tenants``): stored rows made
to agree with it. A stale read of zeroized pages carried nobody's data (it was stored as
cross-tenant when its last writer was another tenant); a canary hit whose owner is unknown is
foreign (it was stored as not cross-tenant, while its alert said it was).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # detail is msgspec's compact JSON: "zeroized":true with no space
    op.get_bind().execute(
        sa.text(
            "UPDATE page_events SET cross_tenant = false WHERE kind = 'page.stale_read' "
            "AND cross_tenant = true AND detail LIKE :zeroized"
        ),
        {"zeroized": '%"zeroized":true%'},
    )
    op.execute(
        "UPDATE page_events SET cross_tenant = true WHERE kind = 'canary.hit' "
        "AND other_tenant IS NULL AND cross_tenant = false"
    )


def downgrade() -> None:
    # the old definitions, for a collector that still uses them
    op.execute(
        "UPDATE page_events SET cross_tenant = true WHERE kind = 'page.stale_read' "
        "AND other_tenant IS NOT NULL AND other_tenant <> tenant"
    )
    op.execute(
        "UPDATE page_events SET cross_tenant = false WHERE kind = 'canary.hit' "
        "AND other_tenant IS NULL"
    )
