"""Token names held by one valid token, enforced by the database: two replicas creating the
same name at once could both pass the application's check. ``name_held`` is the name while
the token holds it (released on revocation, on expiry when a new token claims the name, and
passed on by a rotation); a unique index makes the second claim fail.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("name_held", sa.String(256), nullable=True))
    # the newest unrevoked token of each name holds it (a pair made by the old race keeps
    # working; only the newest answers to the name)
    op.execute(
        """
        UPDATE api_tokens SET name_held = name
        WHERE name IS NOT NULL AND revoked_at IS NULL AND id = (
            SELECT max(t.id) FROM api_tokens t
            WHERE t.name = api_tokens.name AND t.revoked_at IS NULL
        )
        """
    )
    op.create_index("ux_api_tokens_name_held", "api_tokens", ["name_held"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_api_tokens_name_held", table_name="api_tokens")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("name_held")
