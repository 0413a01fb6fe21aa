"""Shared prompts (vLLM's parallel sampling): ``requests.prompt_shared_with``, from the
``request.admitted`` field of that name, and the rollups' ``shared_prompts`` and
``shared_prompt_tokens``, so usage can count a prompt that n requests share once.

On PostgreSQL ``requests`` is partitioned (0010): ADD COLUMN on the parent reaches every
partition. Existing rollup rows get 0: no request stored before this revision names another.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

ROLLUPS = ("request_rollups", "request_rollups_hourly")
COUNTS = ("shared_prompts", "shared_prompt_tokens")


def upgrade() -> None:
    op.add_column("requests", sa.Column("prompt_shared_with", sa.String(length=128), nullable=True))
    for table in ROLLUPS:
        for col in COUNTS:
            op.add_column(
                table, sa.Column(col, sa.BigInteger(), server_default="0", nullable=False)
            )


def downgrade() -> None:
    for table in ROLLUPS:
        with op.batch_alter_table(table) as batch:
            for col in reversed(COUNTS):
                batch.drop_column(col)
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("prompt_shared_with")
