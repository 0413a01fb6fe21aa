"""Initial schema: deployments, configs, requests, pool samples, page events, ingest, tokens, audit.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "api_tokens",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("deployment_id", sa.String(length=128), nullable=True),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("prefix", sa.String(length=24), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("revoked_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "audit_log",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("subject", sa.String(length=256), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
        sa.UniqueConstraint("hash", name=op.f("uq_audit_log_hash")),
    )
    op.create_table(
        "deployments",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("first_seen", sa.BigInteger(), nullable=False),
        sa.Column("last_seen", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
    )
    op.create_table(
        "page_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("other_request_id", sa.String(length=128), nullable=True),
        sa.Column("other_tenant", sa.String(length=128), nullable=True),
        sa.Column("page_count", sa.BigInteger(), nullable=False),
        sa.Column("cross_tenant", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_page_events")),
    )
    with op.batch_alter_table("page_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_page_events_deployment_id_ts"), ["deployment_id", "ts"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_page_events_kind_ts"), ["kind", "ts"], unique=False)

    op.create_table(
        "pool_samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("capacity_tokens", sa.BigInteger(), nullable=False),
        sa.Column("used_tokens", sa.BigInteger(), nullable=False),
        sa.Column("free_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pool_samples")),
    )
    with op.batch_alter_table("pool_samples", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_pool_samples_deployment_id_ts"), ["deployment_id", "ts"], unique=False
        )

    op.create_table(
        "probe_drops",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_probe_drops")),
    )
    with op.batch_alter_table("probe_drops", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_probe_drops_probe_id_ts"), ["probe_id", "ts"], unique=False
        )

    op.create_table(
        "requests",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("route", sa.String(length=256), nullable=True),
        sa.Column("model_id", sa.String(length=256), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=True),
        sa.Column("max_tokens", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reject_reason", sa.String(length=32), nullable=True),
        sa.Column("limit_tokens", sa.BigInteger(), nullable=True),
        sa.Column("data_categories", sa.Text(), nullable=True),
        sa.Column("first_ts", sa.BigInteger(), nullable=False),
        sa.Column("last_ts", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint(
            "deployment_id", "request_id", name=op.f("uq_requests_deployment_id_request_id")
        ),
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_requests_first_ts"), ["first_ts"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_requests_tenant_first_ts"), ["tenant", "first_ts"], unique=False
        )

    op.create_table(
        "deployment_configs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("engine", sa.String(length=64), nullable=False),
        sa.Column("engine_version", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.String(length=256), nullable=False),
        sa.Column("advertised_context", sa.BigInteger(), nullable=False),
        sa.Column("pool_capacity_tokens", sa.BigInteger(), nullable=False),
        sa.Column("page_size", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=64), nullable=False),
        sa.Column("quantization", sa.String(length=64), nullable=True),
        sa.Column("tp_size", sa.Integer(), nullable=False),
        sa.Column("cuda_graphs", sa.Boolean(), nullable=False),
        sa.Column("disaggregated", sa.Boolean(), nullable=False),
        sa.Column("prefix_caching", sa.Boolean(), nullable=False),
        sa.Column("prefix_cache_salting", sa.Boolean(), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_deployment_configs_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployment_configs")),
    )
    with op.batch_alter_table("deployment_configs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_deployment_configs_deployment_id_node_role_ts"),
            ["deployment_id", "node", "role", "ts"],
            unique=False,
        )

    op.create_table(
        "probes",
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("token_id", sa.BigInteger(), nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("max_seq", sa.BigInteger(), nullable=False),
        sa.Column("accepted", sa.BigInteger(), nullable=False),
        sa.Column("duplicates", sa.BigInteger(), nullable=False),
        sa.Column("first_seen", sa.BigInteger(), nullable=False),
        sa.Column("last_seen", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"], ["api_tokens.id"], name=op.f("fk_probes_token_id_api_tokens")
        ),
        sa.PrimaryKeyConstraint("probe_id", name=op.f("pk_probes")),
    )
    op.create_table(
        "seq_gaps",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("detected_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["probe_id"],
            ["probes.probe_id"],
            name=op.f("fk_seq_gaps_probe_id_probes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_seq_gaps")),
    )
    with op.batch_alter_table("seq_gaps", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_seq_gaps_probe_id_first_seq"), ["probe_id", "first_seq"], unique=False
        )


def downgrade() -> None:

    with op.batch_alter_table("seq_gaps", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_seq_gaps_probe_id_first_seq"))

    op.drop_table("seq_gaps")
    op.drop_table("probes")
    with op.batch_alter_table("deployment_configs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_deployment_configs_deployment_id_node_role_ts"))

    op.drop_table("deployment_configs")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_requests_tenant_first_ts"))
        batch_op.drop_index(batch_op.f("ix_requests_first_ts"))

    op.drop_table("requests")
    with op.batch_alter_table("probe_drops", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_probe_drops_probe_id_ts"))

    op.drop_table("probe_drops")
    with op.batch_alter_table("pool_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_pool_samples_deployment_id_ts"))

    op.drop_table("pool_samples")
    with op.batch_alter_table("page_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_page_events_kind_ts"))
        batch_op.drop_index(batch_op.f("ix_page_events_deployment_id_ts"))

    op.drop_table("page_events")
    op.drop_table("deployments")
    op.drop_table("audit_log")
    op.drop_table("api_tokens")
