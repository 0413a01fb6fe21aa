"""SQLAlchemy 2 models: the collector's schema. Alembic migrations must produce exactly this.

Times are stored as integer microseconds since the Unix epoch (UTC) in every table: the same
representation on SQLite and PostgreSQL, cheap to write from the ingest fast path, and
sortable/range-scannable with plain B-tree indexes. ``UtcMicros`` turns them back into aware
datetimes for ORM reads.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from engine_probe.events import ID_MAX, NAME_MAX

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL wants BIGINT identities.
BigId = BigInteger().with_variant(Integer(), "sqlite")


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def to_micros(dt: datetime) -> int:
    if dt.tzinfo is None:
        raise ValueError("naive datetime: kvwatch stores UTC instants only")
    return (dt - EPOCH) // _US


def from_micros(us: int) -> datetime:
    return EPOCH + timedelta(microseconds=us)


class UtcMicros(TypeDecorator[datetime]):
    """An aware datetime stored as BIGINT microseconds since the epoch."""

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> int | None:
        if value is None or isinstance(value, int):
            return value
        return to_micros(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        return None if value is None else from_micros(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Deployment(Base):
    """One served model deployment, as named by its probes' ``deployment_id``."""

    __tablename__ = "deployments"

    id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    first_seen: Mapped[datetime] = mapped_column(UtcMicros)
    last_seen: Mapped[datetime] = mapped_column(UtcMicros)


class DeploymentConfig(Base):
    """Config history: one row per distinct config of a (deployment, node, role).

    Invariant: consecutive rows of one (deployment_id, node, role) differ in ``config_hash``.
    """

    __tablename__ = "deployment_configs"
    __table_args__ = (Index(None, "deployment_id", "node", "role", "ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(
        String(ID_MAX), ForeignKey("deployments.id", ondelete="CASCADE")
    )
    probe_id: Mapped[str] = mapped_column(String(ID_MAX))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    node: Mapped[str] = mapped_column(String(ID_MAX))
    role: Mapped[str] = mapped_column(String(16))
    engine: Mapped[str] = mapped_column(String(64))
    engine_version: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str] = mapped_column(String(NAME_MAX))
    advertised_context: Mapped[int] = mapped_column(BigInteger)
    pool_capacity_tokens: Mapped[int] = mapped_column(BigInteger)
    page_size: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(64))
    quantization: Mapped[str | None] = mapped_column(String(64))
    tp_size: Mapped[int] = mapped_column(Integer)
    cuda_graphs: Mapped[bool] = mapped_column(Boolean)
    disaggregated: Mapped[bool] = mapped_column(Boolean)
    prefix_caching: Mapped[bool] = mapped_column(Boolean)
    prefix_cache_salting: Mapped[bool] = mapped_column(Boolean)
    config_hash: Mapped[str] = mapped_column(String(64))


class Request(Base):
    """One inference request, upserted from its admitted/rejected/finished events.

    Holds counts and labels only — never prompt or completion text. ``first_ts`` is the
    earliest event seen for the request, ``last_ts`` the latest.
    """

    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("deployment_id", "request_id"),
        Index(None, "first_ts"),
        Index(None, "tenant", "first_ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    request_id: Mapped[str] = mapped_column(String(ID_MAX))
    tenant: Mapped[str] = mapped_column(String(ID_MAX))
    route: Mapped[str | None] = mapped_column(String(NAME_MAX))
    model_id: Mapped[str | None] = mapped_column(String(NAME_MAX))
    prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    completion_tokens: Mapped[int | None] = mapped_column(BigInteger)
    max_tokens: Mapped[int | None] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    reject_reason: Mapped[str | None] = mapped_column(String(32))
    limit_tokens: Mapped[int | None] = mapped_column(BigInteger)
    data_categories: Mapped[str | None] = mapped_column(Text)  # JSON array, or NULL
    first_ts: Mapped[datetime] = mapped_column(UtcMicros)
    last_ts: Mapped[datetime] = mapped_column(UtcMicros)


class PoolSample(Base):
    __tablename__ = "pool_samples"
    __table_args__ = (Index(None, "deployment_id", "ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    probe_id: Mapped[str] = mapped_column(String(ID_MAX))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    node: Mapped[str] = mapped_column(String(ID_MAX))
    role: Mapped[str] = mapped_column(String(16))
    capacity_tokens: Mapped[int] = mapped_column(BigInteger)
    used_tokens: Mapped[int] = mapped_column(BigInteger)
    free_tokens: Mapped[int] = mapped_column(BigInteger)


class PageEvent(Base):
    """kv.transfer, page.reuse, page.stale_read and canary.hit events.

    ``tenant``/``request_id`` name the reader (or transfer owner), ``other_tenant`` /
    ``other_request_id`` the previous owner of the pages (the exposed party).
    """

    __tablename__ = "page_events"
    __table_args__ = (Index(None, "deployment_id", "ts"), Index(None, "kind", "ts"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    probe_id: Mapped[str] = mapped_column(String(ID_MAX))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    kind: Mapped[str] = mapped_column(String(32))
    node: Mapped[str | None] = mapped_column(String(ID_MAX))
    request_id: Mapped[str | None] = mapped_column(String(ID_MAX))
    tenant: Mapped[str | None] = mapped_column(String(ID_MAX))
    other_request_id: Mapped[str | None] = mapped_column(String(ID_MAX))
    other_tenant: Mapped[str | None] = mapped_column(String(ID_MAX))
    page_count: Mapped[int] = mapped_column(BigInteger)
    cross_tenant: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(Text)  # JSON object with the kind's other fields


class Probe(Base):
    """Ingest bookkeeping per probe.

    Invariant: every seq in 1..max_seq is either stored or inside one of the probe's
    ``seq_gaps`` rows; a seq <= max_seq outside every gap is a duplicate.
    """

    __tablename__ = "probes"

    probe_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    token_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("api_tokens.id"))
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    max_seq: Mapped[int] = mapped_column(BigInteger)
    accepted: Mapped[int] = mapped_column(BigInteger)
    duplicates: Mapped[int] = mapped_column(BigInteger)
    first_seen: Mapped[datetime] = mapped_column(UtcMicros)
    last_seen: Mapped[datetime] = mapped_column(UtcMicros)


class SeqGap(Base):
    """A run of seqs a probe skipped: events lost (or not yet arrived). Shrinks as late
    events fill it; a row that remains means the probe lost those events."""

    __tablename__ = "seq_gaps"
    __table_args__ = (Index(None, "probe_id", "first_seq"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    probe_id: Mapped[str] = mapped_column(
        String(ID_MAX), ForeignKey("probes.probe_id", ondelete="CASCADE")
    )
    first_seq: Mapped[int] = mapped_column(BigInteger)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    detected_at: Mapped[datetime] = mapped_column(UtcMicros)


class ProbeDrop(Base):
    """What probes reported dropping (probe.drops events)."""

    __tablename__ = "probe_drops"
    __table_args__ = (Index(None, "probe_id", "ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    probe_id: Mapped[str] = mapped_column(String(ID_MAX))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    reason: Mapped[str] = mapped_column(String(32))
    count: Mapped[int] = mapped_column(BigInteger)


class ApiToken(Base):
    """A bearer token, stored as its SHA-256 (tokens are 256-bit random, so a fast hash is
    enough: there is nothing to brute-force). ``tenant`` scopes read tokens."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str | None] = mapped_column(String(ID_MAX))
    deployment_id: Mapped[str | None] = mapped_column(String(ID_MAX))
    name: Mapped[str | None] = mapped_column(String(NAME_MAX))
    prefix: Mapped[str] = mapped_column(String(24))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcMicros)


class AuditEntry(Base):
    """Append-only, hash-chained: ``hash = sha256(prev_hash || canonical(entry))``."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    actor: Mapped[str] = mapped_column(String(NAME_MAX))
    action: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str | None] = mapped_column(String(NAME_MAX))
    detail: Mapped[str] = mapped_column(Text)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
