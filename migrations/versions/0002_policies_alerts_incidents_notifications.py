"""Policies, alerts, incidents and notifications: verifications, deployment tenants, alerts and
their history, silences, rule health, incidents, notify endpoints, the outbox, delivery attempts.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("rule", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=True),
        sa.Column("labels", sa.Text(), nullable=False),
        sa.Column("annotations", sa.Text(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("active_since", sa.BigInteger(), nullable=False),
        sa.Column("fired_at", sa.BigInteger(), nullable=True),
        sa.Column("resolved_at", sa.BigInteger(), nullable=True),
        sa.Column("last_seen_at", sa.BigInteger(), nullable=False),
        sa.Column("occurrences", sa.BigInteger(), nullable=False),
        sa.Column("last_notified_at", sa.BigInteger(), nullable=True),
        sa.Column("acked_at", sa.BigInteger(), nullable=True),
        sa.Column("acked_by", sa.String(length=256), nullable=True),
        sa.Column("ack_comment", sa.Text(), nullable=True),
        sa.Column("incident_id", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_alerts_fingerprint")),
    )
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_alerts_deployment_id"), ["deployment_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_alerts_state_updated_at"), ["state", "updated_at"], unique=False
        )

    op.create_table(
        "deployment_tenants",
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("first_seen", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("deployment_id", "tenant", name=op.f("pk_deployment_tenants")),
    )
    op.create_table(
        "incidents",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("title", sa.String(length=256), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("cause_rule", sa.String(length=256), nullable=False),
        sa.Column("first_alert_id", sa.BigInteger(), nullable=False),
        sa.Column("opened_at", sa.BigInteger(), nullable=False),
        sa.Column("awareness_at", sa.BigInteger(), nullable=False),
        sa.Column("deadline_at", sa.BigInteger(), nullable=False),
        sa.Column("reminders_sent", sa.Text(), nullable=False),
        sa.Column("closed_at", sa.BigInteger(), nullable=True),
        sa.Column("closed_by", sa.String(length=256), nullable=True),
        sa.Column("close_reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incidents")),
    )
    with op.batch_alter_table("incidents", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_incidents_deployment_id"), ["deployment_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_incidents_state_deadline_at"), ["state", "deadline_at"], unique=False
        )

    op.create_table(
        "notify_endpoints",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("secret", sa.Text(), nullable=True),
        sa.Column("min_severity", sa.String(length=16), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notify_endpoints")),
        sa.UniqueConstraint("name", name=op.f("uq_notify_endpoints_name")),
    )
    op.create_table(
        "rule_health",
        sa.Column("rule", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("health", sa.String(length=16), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_error_at", sa.BigInteger(), nullable=True),
        sa.Column("last_evaluated_at", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("rule", name=op.f("pk_rule_health")),
    )
    op.create_table(
        "silences",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("matchers", sa.Text(), nullable=False),
        sa.Column("starts_at", sa.BigInteger(), nullable=False),
        sa.Column("ends_at", sa.BigInteger(), nullable=False),
        sa.Column("created_by", sa.String(length=256), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expired_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_silences")),
    )
    with op.batch_alter_table("silences", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_silences_ends_at"), ["ends_at"], unique=False)

    op.create_table(
        "verifications",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("model_id", sa.String(length=256), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("verified_safe_context", sa.BigInteger(), nullable=True),
        sa.Column("engine_version", sa.String(length=64), nullable=True),
        sa.Column("pool_capacity_tokens", sa.BigInteger(), nullable=True),
        sa.Column("quantization", sa.String(length=64), nullable=True),
        sa.Column("tp_size", sa.Integer(), nullable=True),
        sa.Column("cuda_graphs", sa.Boolean(), nullable=True),
        sa.Column("verified_at", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("created_by", sa.String(length=256), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_verifications")),
    )
    with op.batch_alter_table("verifications", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_verifications_deployment_id_model_id_verified_at"),
            ["deployment_id", "model_id", "verified_at"],
            unique=False,
        )

    op.create_table(
        "alert_transitions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("alert_id", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.BigInteger(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("actor", sa.String(length=256), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["alert_id"],
            ["alerts.id"],
            name=op.f("fk_alert_transitions_alert_id_alerts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_transitions")),
    )
    with op.batch_alter_table("alert_transitions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_alert_transitions_alert_id_id"), ["alert_id", "id"], unique=False
        )

    op.create_table(
        "outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("msg_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.String(length=32), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.BigInteger(), nullable=False),
        sa.Column("delivered_at", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["notify_endpoints.id"],
            name=op.f("fk_outbox_endpoint_id_notify_endpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
        sa.UniqueConstraint("msg_id", name=op.f("uq_outbox_msg_id")),
    )
    with op.batch_alter_table("outbox", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_outbox_endpoint_id_status_id"),
            ["endpoint_id", "status", "id"],
            unique=False,
        )

    op.create_table(
        "delivery_attempts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("outbox_id", sa.BigInteger(), nullable=False),
        sa.Column("endpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.BigInteger(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["outbox_id"],
            ["outbox.id"],
            name=op.f("fk_delivery_attempts_outbox_id_outbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delivery_attempts")),
    )
    with op.batch_alter_table("delivery_attempts", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_delivery_attempts_outbox_id"), ["outbox_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("delivery_attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_delivery_attempts_outbox_id"))

    op.drop_table("delivery_attempts")
    with op.batch_alter_table("outbox", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_outbox_endpoint_id_status_id"))

    op.drop_table("outbox")
    with op.batch_alter_table("alert_transitions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alert_transitions_alert_id_id"))

    op.drop_table("alert_transitions")
    with op.batch_alter_table("verifications", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_verifications_deployment_id_model_id_verified_at"))

    op.drop_table("verifications")
    with op.batch_alter_table("silences", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_silences_ends_at"))

    op.drop_table("silences")
    op.drop_table("rule_health")
    op.drop_table("notify_endpoints")
    with op.batch_alter_table("incidents", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_incidents_state_deadline_at"))
        batch_op.drop_index(batch_op.f("ix_incidents_deployment_id"))

    op.drop_table("incidents")
    op.drop_table("deployment_tenants")
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alerts_state_updated_at"))
        batch_op.drop_index(batch_op.f("ix_alerts_deployment_id"))

    op.drop_table("alerts")
