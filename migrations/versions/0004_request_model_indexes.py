"""Requests indexed by model: breach windows (model, time) and the prompts nearest a limit.

A breach window and the dashboard's context-pressure page select one model's requests by
time, and "the requests nearest the threshold" is a model's largest prompts: without these
both scan every request of every model.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_requests_model_id_first_ts"), ["model_id", "first_ts"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_requests_model_id_prompt_tokens"),
            ["model_id", "prompt_tokens"],
            unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_requests_model_id_prompt_tokens"))
        batch_op.drop_index(batch_op.f("ix_requests_model_id_first_ts"))
