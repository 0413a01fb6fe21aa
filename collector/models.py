"""SQLAlchemy 2 models: the collector's schema. Alembic migrations must produce exactly this.

Times are stored as integer microseconds since the Unix epoch (UTC) in every table: the same
representation on SQLite and PostgreSQL, cheap to write from the ingest fast path, and
sortable/range-scannable with plain B-tree indexes. ``UtcMicros`` turns them back into aware
datetimes for ORM reads, with :mod:`collector.timefmt`'s conversions (import them from
there).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    and_,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from collector.timefmt import from_micros, to_micros
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


def requests_since(cols: Any, since: datetime | int) -> Any:
    """``first_ts >= since`` over requests (``cols``: the model or its table's ``.c``), with
    the bound on ``part_ts`` it implies (part_ts >= first_ts): PostgreSQL then skips the
    months of requests before ``since`` instead of searching each one's index."""
    us = since if isinstance(since, int) else to_micros(since)
    return and_(cols.first_ts >= since, cols.part_ts >= us)


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


class RetentionPolicy(Base):
    """How long a deployment's request, pool and page data is kept (``kvwatch retention``);
    deployments without a row keep ``KVWATCH_RETENTION_DAYS`` (unset: forever)."""

    __tablename__ = "retention_policies"

    deployment_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    keep_days: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UtcMicros)
    updated_by: Mapped[str] = mapped_column(String(NAME_MAX))


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
    #: where KV goes past the pool (``engine.config``'s fields; NULL before 0026 or when
    #: the producer did not say); ``kv_tiers`` is a JSON array of ``events.KvTier``
    kv_connector: Mapped[str | None] = mapped_column(String(64))
    kv_connector_version: Mapped[str | None] = mapped_column(String(64))
    kv_tiers: Mapped[str | None] = mapped_column(Text)
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
        Index(None, "model_id", "first_ts"),
        Index(None, "model_id", "prompt_tokens"),
        # Partial, so each holds only the few rows it serves: the requests still open (what
        # closing a gone probe's requests updates, ``collector.lost``) and the lost ones
        # (what the fleet counts); neither grows with history.
        Index(
            "ix_requests_open",
            "probe_id",
            "node",
            sqlite_where=text("status = 'admitted'"),
            postgresql_where=text("status = 'admitted'"),
        ),
        Index(
            "ix_requests_lost",
            "deployment_id",
            "first_ts",
            sqlite_where=text("status = 'lost'"),
            postgresql_where=text("status = 'lost'"),
        ),
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
    #: the request (same deployment) whose prompt this one shares, from its admission (vLLM's
    #: parallel-sampling children 1..n-1 name child 0); NULL for a prompt of its own
    prompt_shared_with: Mapped[str | None] = mapped_column(String(ID_MAX))
    #: how many of prompt_tokens a prefix cache served (from the request's finish), or NULL
    cached_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: how many of prompt_tokens were written to a prompt cache (the finish's
    #: ``cache_write_tokens``), or NULL
    cache_write_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: the probe and node of the request's admission (``request.admitted``); NULL when no
    #: admission was stored (a gateway's rows) or before 0019. A request still ``admitted``
    #: when this probe is known gone is closed as ``lost`` (``collector.lost``).
    probe_id: Mapped[str | None] = mapped_column(String(ID_MAX))
    node: Mapped[str | None] = mapped_column(String(ID_MAX))
    #: why the request is ``lost`` (probe_stopped, probe_replaced, probe_silent); NULL for
    #: every other status (a finish arriving later clears it with the status)
    lost_reason: Mapped[str | None] = mapped_column(String(32))
    first_ts: Mapped[datetime] = mapped_column(UtcMicros)
    last_ts: Mapped[datetime] = mapped_column(UtcMicros)
    #: µs; the request's first_ts when it was first stored, never changed afterwards: the
    #: partition key on PostgreSQL (first_ts moves earlier when an earlier event arrives
    #: late, and a row must not change partitions under a concurrent upsert). Always
    #: >= first_ts, so ``first_ts >= t`` implies ``part_ts >= t`` (how queries prune).
    part_ts: Mapped[int] = mapped_column(BigInteger)


class OtlpSpan(Base):
    """Every span ``POST /v1/traces`` stored as a request, by its trace and span id, with the
    request id it was stored under.

    Invariants: one row per (deployment_id, span_key); written in the transaction that
    stores the span's request, so a span is here exactly when its request was stored (an
    exporter's retry of it is then a duplicate). ``request_id`` is the span's own request id,
    or, for a later span naming a request id already stored (vLLM's parallel-sampling
    children all name one), that id with the span id appended. Ids only: no tenant, no text.
    Deleted with the deployment's requests by retention."""

    __tablename__ = "otlp_spans"
    __table_args__ = (Index(None, "deployment_id", "seen_at"),)

    deployment_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    #: trace id + span id, in hex (the request id for a span without them)
    span_key: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(ID_MAX))
    #: µs, when the collector stored it
    seen_at: Mapped[int] = mapped_column(BigInteger)


class RequestKey(Base):
    """PostgreSQL: the partition (``part_ts``) of each stored request, fixed at first sight.

    Invariant: one row per (deployment_id, request_id) in ``requests``, holding that row's
    ``part_ts``. PostgreSQL's unique indexes on a partitioned table must hold the partition
    key, so this table is what keeps (deployment_id, request_id) unique across months;
    ingest reads the key's ``part_ts`` before its upsert. Unused (empty) on SQLite.
    """

    __tablename__ = "request_keys"

    deployment_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    part_ts: Mapped[int] = mapped_column(BigInteger)


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


class RollupDirty(Base):
    """A bucket whose rollup rows must be recomputed from the raw rows.

    Ingest inserts a mark (``ON CONFLICT DO NOTHING``) for every bucket a batch touched, in
    the batch's transaction; the rollup refresher deletes the mark and recomputes the bucket
    in one transaction. Invariant: a bucket without a mark has rollup rows equal to the
    aggregate of its raw rows as of the refresher's last pass over it.
    """

    __tablename__ = "rollup_dirty"

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # requests | pool
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    marked_at: Mapped[int] = mapped_column(BigInteger)  # µs; the first mark since the last pass


class _RequestRollupColumns:
    """The columns of both request rollup tiers (see :class:`RequestRollup`)."""

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    bucket_start: Mapped[int] = mapped_column(BigInteger)
    model_id: Mapped[str | None] = mapped_column(String(NAME_MAX))
    route: Mapped[str | None] = mapped_column(String(NAME_MAX))
    tenant: Mapped[str] = mapped_column(String(ID_MAX))
    prompt_bin: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(BigInteger)
    rejected: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens_max: Mapped[int | None] = mapped_column(BigInteger)
    prompt_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    #: of ``requests``, those sharing another request's prompt (``prompt_shared_with`` set),
    #: and the sum of their prompt tokens: usage subtracts them to count each prompt once
    shared_prompts: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shared_prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")


class RequestRollup(_RequestRollupColumns, Base):
    """Requests per 5-minute bucket (by ``first_ts``), deployment, model, route, tenant and
    prompt-size bin: what the dashboard charts instead of raw requests.

    ``prompt_bin`` is ``floor(8 * log2(max(prompt_tokens, 1)))`` (bins 9% wide), or -1 when
    the prompt size is unknown; ``prompt_tokens_max`` is exact.

    Invariant: each (deployment, bucket) holds one row per (model, route, tenant, bin) with
    requests, and also the same figures summed over tenants under ``tenant = '*'`` (not a
    valid tenant id): an operator's chart reads those, never every tenant's rows. A reader
    therefore always filters on one tenant value, ``'*'`` or a tenant's.
    """

    __tablename__ = "request_rollups"
    __table_args__ = (
        Index(None, "deployment_id", "bucket_start"),
        Index(None, "bucket_start"),
        Index(None, "tenant", "bucket_start"),
    )


class RequestRollupHourly(_RequestRollupColumns, Base):
    """:class:`RequestRollup` summed per hour: long windows read 12x fewer rows.

    Invariant: an hour's rows are the sum of its twelve 5-minute buckets' rows, recomputed
    in the same transaction whenever one of those buckets is.
    """

    __tablename__ = "request_rollups_hourly"
    __table_args__ = (
        Index(None, "deployment_id", "bucket_start"),
        Index(None, "tenant", "bucket_start"),
    )


class PoolRollup(Base):
    """Pool samples per minute, deployment, node and role: long-window occupancy charts."""

    __tablename__ = "pool_rollups"
    __table_args__ = (Index(None, "deployment_id", "bucket_start"), Index(None, "bucket_start"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    bucket_start: Mapped[int] = mapped_column(BigInteger)
    node: Mapped[str] = mapped_column(String(ID_MAX))
    role: Mapped[str] = mapped_column(String(16))
    samples: Mapped[int] = mapped_column(BigInteger)
    used_sum: Mapped[int] = mapped_column(BigInteger)
    used_max: Mapped[int] = mapped_column(BigInteger)
    free_min: Mapped[int] = mapped_column(BigInteger)
    capacity_max: Mapped[int] = mapped_column(BigInteger)


class PageEvent(Base):
    """kv.transfer, page.reuse, page.stale_read, prefix_cache.hit, kv.turnover, source.gap and
    canary.hit events.

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
    #: when the probe said it shut down cleanly (its probe.stopped event); None while it runs
    stopped_at: Mapped[datetime | None] = mapped_column(UtcMicros, nullable=True)
    #: when the collector knew it gone and closed its open requests as ``lost``, and why
    #: (probe_stopped, probe_replaced, probe_silent: see ``collector.lost``); None while it
    #: runs. A silent probe heard from again is running again (both cleared); a stopped or
    #: replaced one stays gone, and requests its later batches open (a replayed journal)
    #: are closed as they arrive.
    gone_at: Mapped[datetime | None] = mapped_column(UtcMicros, nullable=True)
    gone_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    #: how many of its requests the collector closed as lost, ever (a finish arriving later
    #: still replaces a lost status; this count stays: it says what was closed)
    lost_requests: Mapped[int] = mapped_column(BigInteger, server_default="0")


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
    # one valid token answers to a name, whichever replica created it
    __table_args__ = (Index("ux_api_tokens_name_held", "name_held", unique=True),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str | None] = mapped_column(String(ID_MAX))
    deployment_id: Mapped[str | None] = mapped_column(String(ID_MAX))
    name: Mapped[str | None] = mapped_column(String(NAME_MAX))
    prefix: Mapped[str] = mapped_column(String(24))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    # when a token.use audit entry was last written for it (at most one per interval)
    last_used_at: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    # the token a rotation chain started from (NULL: this one); probes belong to a lineage
    lineage_id: Mapped[int | None] = mapped_column(BigInteger)
    # the name while this token holds it (collector.tokens keeps it; NULL once released)
    name_held: Mapped[str | None] = mapped_column(String(NAME_MAX))


class AuditEntry(Base):
    """Append-only, hash-chained: ``hash = sha256(prev_hash || canonical(entry))``, where the
    entry carries its detail's SHA-256 so an erased detail leaves the chain intact (see
    :mod:`collector.audit`)."""

    __tablename__ = "audit_log"
    # an incident's timeline and its logged facts read its entries by subject
    __table_args__ = (Index(None, "subject"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    actor: Mapped[str] = mapped_column(String(NAME_MAX))
    action: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str | None] = mapped_column(String(NAME_MAX))
    detail: Mapped[str] = mapped_column(Text)
    # NULL on entries written before 0006: their hash covers the detail itself.
    detail_sha256: Mapped[str | None] = mapped_column(String(64))
    redacted_by: Mapped[int | None] = mapped_column(BigInteger)  # the erasure entry's id
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64), unique=True)


# ---------------------------------------------------------------------- policies and alerts


class Verification(Base):
    """A deployment's verified safe context for a model, as `kvwatch verify` (or an operator)
    established it, with the engine settings it was measured under: a change to any of them
    makes it stale."""

    __tablename__ = "verifications"
    __table_args__ = (Index(None, "deployment_id", "model_id", "verified_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    model_id: Mapped[str] = mapped_column(String(NAME_MAX))
    passed: Mapped[bool] = mapped_column(Boolean)
    verified_safe_context: Mapped[int | None] = mapped_column(BigInteger)
    engine_version: Mapped[str | None] = mapped_column(String(64))
    pool_capacity_tokens: Mapped[int | None] = mapped_column(BigInteger)
    quantization: Mapped[str | None] = mapped_column(String(64))
    tp_size: Mapped[int | None] = mapped_column(Integer)
    cuda_graphs: Mapped[bool | None] = mapped_column(Boolean)
    verified_at: Mapped[datetime] = mapped_column(UtcMicros)
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    created_by: Mapped[str] = mapped_column(String(NAME_MAX))
    evidence: Mapped[str] = mapped_column(Text)  # JSON object


class VerificationRun(Base):
    """A verification announced before it sends its first prompt (``kvwatch verify``, a
    scheduled run): its requests on ``deployment_id`` between ``started_at`` and its end
    (``finished_at``, else ``ends_at``) whose tenants are all among ``tenants`` (a JSON list)
    are verification traffic, stored like any other and never evaluated by the rules (a
    verification's probe prompts are the run's own finding, ``verification_failed``, not an
    alert or an incident of the endpoint they test).

    Invariant: ``started_at <= ends_at``; ``finished_at`` is set once, by the run's upload
    (``POST /v1/verifications`` with its ``run_id``), and never after ``ends_at``: a run
    announced but never finished stops counting at ``ends_at``.
    """

    __tablename__ = "verification_runs"
    __table_args__ = (Index(None, "deployment_id", "started_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    tenants: Mapped[str] = mapped_column(Text)  # JSON list of tenant names
    started_at: Mapped[datetime] = mapped_column(UtcMicros)
    ends_at: Mapped[datetime] = mapped_column(UtcMicros)
    finished_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    created_by: Mapped[str] = mapped_column(String(NAME_MAX))
    verification_id: Mapped[int | None] = mapped_column(BigInteger)


class DeploymentTenant(Base):
    """Which tenants a deployment has served (kept on ingest: what a batch adds, never a
    scan of the requests)."""

    __tablename__ = "deployment_tenants"

    deployment_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    first_seen: Mapped[datetime] = mapped_column(UtcMicros)


class LabelValue(Base):
    """Every deployment, node, model and route named to the collector (``kind``; a
    deployment's own row has ``deployment_id == value``), with the token lineage that first
    named it and when: new names per token per hour are limited (``collector.cardinality``).
    Rows stored before this table existed have no lineage and ``first_seen`` 0."""

    __tablename__ = "label_values"
    __table_args__ = (
        Index("ix_label_values_token_lineage_first_seen", "token_lineage", "first_seen"),
    )

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX), primary_key=True)
    value: Mapped[str] = mapped_column(String(NAME_MAX), primary_key=True)
    token_lineage: Mapped[int | None] = mapped_column(BigInteger)
    first_seen: Mapped[int] = mapped_column(BigInteger)


class Alert(Base):
    """One alert per fingerprint (the hash of its labels); its state history is in
    ``alert_transitions``. A resolved alert that fires again is the same row, re-opened."""

    __tablename__ = "alerts"
    __table_args__ = (Index(None, "state", "updated_at"), Index(None, "deployment_id"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(64), unique=True)
    rule: Mapped[str] = mapped_column(String(NAME_MAX))
    kind: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(16))
    mode: Mapped[str] = mapped_column(String(16))  # "state" or "event"
    deployment_id: Mapped[str | None] = mapped_column(String(ID_MAX))
    labels: Mapped[str] = mapped_column(Text)  # JSON object
    annotations: Mapped[str] = mapped_column(Text)  # JSON object
    value: Mapped[float | None] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))  # pending | firing | resolved
    active_since: Mapped[datetime] = mapped_column(UtcMicros)
    fired_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    resolved_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    last_seen_at: Mapped[datetime] = mapped_column(UtcMicros)
    occurrences: Mapped[int] = mapped_column(BigInteger)
    last_notified_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    acked_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    acked_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    ack_comment: Mapped[str | None] = mapped_column(Text)
    incident_id: Mapped[int | None] = mapped_column(BigInteger)
    # The incident an operator unlinked this alert from: not linked back to it automatically.
    unlinked_from: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UtcMicros)


class AlertTransition(Base):
    """Every state change of an alert, and every acknowledgement: the full history."""

    __tablename__ = "alert_transitions"
    __table_args__ = (Index(None, "alert_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("alerts.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UtcMicros)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    value: Mapped[float | None] = mapped_column(Float)
    actor: Mapped[str | None] = mapped_column(String(NAME_MAX))
    detail: Mapped[str] = mapped_column(Text)  # JSON object


class Silence(Base):
    """Notifications for alerts whose labels match every matcher are held back until
    ``ends_at``; the alerts themselves are still evaluated and stored."""

    __tablename__ = "silences"
    __table_args__ = (Index(None, "ends_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    matchers: Mapped[str] = mapped_column(Text)  # JSON list of {"name", "value", "regex"}
    starts_at: Mapped[datetime] = mapped_column(UtcMicros)
    ends_at: Mapped[datetime] = mapped_column(UtcMicros)
    created_by: Mapped[str] = mapped_column(String(NAME_MAX))
    comment: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    expired_at: Mapped[datetime | None] = mapped_column(UtcMicros)


class RuleHealth(Base):
    """The last evaluation of each rule: ok, or the error it raised (which never breaks
    ingest)."""

    __tablename__ = "rule_health"

    rule: Mapped[str] = mapped_column(String(NAME_MAX), primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    health: Mapped[str] = mapped_column(String(16))  # ok | error
    last_error: Mapped[str | None] = mapped_column(Text)
    last_error_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    last_evaluated_at: Mapped[datetime] = mapped_column(UtcMicros)
    errors: Mapped[int] = mapped_column(BigInteger)


class Incident(Base):
    """A suspected personal-data breach: opened by a critical isolation alert, with the
    moment kvwatch became aware and the GDPR Art. 33 notification deadline (72 hours later);
    closed only by a person, with a reason."""

    __tablename__ = "incidents"
    __table_args__ = (Index(None, "state", "deadline_at"), Index(None, "deployment_id"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    title: Mapped[str] = mapped_column(String(NAME_MAX))
    state: Mapped[str] = mapped_column(String(16))  # open | closed
    cause_rule: Mapped[str] = mapped_column(String(NAME_MAX))
    first_alert_id: Mapped[int] = mapped_column(BigInteger)
    opened_at: Mapped[datetime] = mapped_column(UtcMicros)
    awareness_at: Mapped[datetime] = mapped_column(UtcMicros)
    deadline_at: Mapped[datetime] = mapped_column(UtcMicros)
    reminders_sent: Mapped[str] = mapped_column(Text)  # JSON list of seconds-before-deadline
    closed_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    closed_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    close_reason: Mapped[str | None] = mapped_column(Text)
    # On-call: who acknowledged it (the first acknowledgement stands) and who owns it now.
    acked_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    acked_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    owner: Mapped[str | None] = mapped_column(String(NAME_MAX))


class Installation(Base):
    """Facts about the installation as a whole, by key: ``instance_id``, generated by the
    migration that made this table (every replica of one database shares it)."""

    __tablename__ = "installation"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


# ---------------------------------------------------------------------- notifications


class NotifyEndpoint(Base):
    """Where notifications go. ``kind``: ``webhook`` (signed POSTs; ``format`` ``kvwatch`` or
    ``alertmanager`` for the Alertmanager webhook v4 body) or ``alertmanager`` (POSTs to an
    Alertmanager's ``/api/v2/alerts``). ``secret`` signs webhooks (``whsec_`` + base64); it
    must be kept to sign, so it is stored as is. A receiver answering 410 disables it.

    Invariant: ``previous_secret`` and ``previous_secret_until`` are both set or both empty;
    set, the secret a rotation replaced signs beside ``secret`` until that time."""

    __tablename__ = "notify_endpoints"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(ID_MAX), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(16))
    secret: Mapped[str | None] = mapped_column(Text)
    min_severity: Mapped[str] = mapped_column(String(16))
    enabled: Mapped[bool] = mapped_column(Boolean)
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[int | None] = mapped_column(BigInteger)  # µs since the epoch
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    previous_secret: Mapped[str | None] = mapped_column(Text)
    previous_secret_until: Mapped[int | None] = mapped_column(BigInteger)  # µs since the epoch


class OutboxMessage(Base):
    """One notification for one endpoint, written in the transaction that caused it and
    delivered in id order per endpoint, at least once, always under the same ``msg_id``."""

    __tablename__ = "outbox"
    __table_args__ = (
        Index(None, "endpoint_id", "status", "id"),
        Index(None, "endpoint_id", "created_at"),  # this minute's messages (the digest)
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    msg_id: Mapped[str] = mapped_column(String(64), unique=True)
    endpoint_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("notify_endpoints.id", ondelete="CASCADE")
    )
    event_type: Mapped[str] = mapped_column(String(32))
    data: Mapped[str] = mapped_column(Text)  # JSON: the notification (see collector.notify)
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    status: Mapped[str] = mapped_column(String(16))  # pending | delivered
    attempts: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[int] = mapped_column(BigInteger)  # µs since the epoch
    delivered_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    last_error: Mapped[str | None] = mapped_column(Text)


class DeliveryAttempt(Base):
    """Every attempt to deliver an outbox message, successful or not."""

    __tablename__ = "delivery_attempts"
    __table_args__ = (Index(None, "outbox_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    outbox_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("outbox.id", ondelete="CASCADE"))
    endpoint_id: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(UtcMicros)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[float] = mapped_column(Float)


# ---------------------------------------------------------------------- reports


class Report(Base):
    """A generated report (a breach assessment), kept as its JSON body with the SHA-256 of
    its evidence set so it can be reproduced and checked later."""

    __tablename__ = "reports"
    __table_args__ = (Index(None, "kind", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    report_id: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    scope: Mapped[str] = mapped_column(Text)  # JSON object
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    created_by: Mapped[str] = mapped_column(String(NAME_MAX))
    sha256: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)  # JSON object: the whole report
    # A JWS (collector.signing) over the report's statement: its conclusions and the SHA-256
    # of each file written from it. NULL for reports stored before signing existed.
    signature: Mapped[str | None] = mapped_column(Text)


# ---------------------------------------------------------------------- the case register


class IncidentNotification(Base):
    """One party's notification about an incident (GDPR Art. 33(2) to each controller, or
    Art. 33(1) to the supervisory authority when the operator is the controller): prepared,
    approved, sent and acknowledged are separate steps, each with who and when, each written
    to the audit log. ``notice_id`` and ``notice_sha256`` name the exact notice; ``signature``
    is the JWS over it (collector.signing).

    Invariant: the steps' times only move forward (prepared <= approved <= sent <=
    acknowledged), and a later step is never set without the earlier ones."""

    __tablename__ = "incident_notifications"
    __table_args__ = (Index(None, "incident_id", "party_kind", "party"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    incident_id: Mapped[int] = mapped_column(BigInteger)
    party_kind: Mapped[str] = mapped_column(String(16))  # exposed | received | both | authority
    party: Mapped[str] = mapped_column(String(ID_MAX))  # the tenant, or the authority's name
    notice_id: Mapped[str] = mapped_column(String(64), unique=True)
    notice_sha256: Mapped[str] = mapped_column(String(64))
    notice: Mapped[str] = mapped_column(Text)  # JSON object: the notice as prepared
    signature: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))  # prepared|approved|sent|acknowledged
    prepared_at: Mapped[datetime] = mapped_column(UtcMicros)
    prepared_by: Mapped[str] = mapped_column(String(NAME_MAX))
    approved_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    approved_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    sent_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    sent_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    channel: Mapped[str | None] = mapped_column(String(NAME_MAX))
    acknowledged_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    acknowledged_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    # A receiving party's confirmation that it deleted what it received.
    deletion_confirmed_at: Mapped[datetime | None] = mapped_column(UtcMicros)


class IncidentDecision(Base):
    """A decision or measure recorded against an incident (GDPR Art. 33(5)): containment,
    engine upgrade, deletion request, the Art. 34 decision, ... with who, when and why.
    ``status`` ``done`` or ``open`` (a measure decided, not yet carried out). Append-only: a
    change of mind is a new decision that ``supersedes`` the earlier one."""

    __tablename__ = "incident_decisions"
    __table_args__ = (Index(None, "incident_id", "ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    incident_id: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[datetime] = mapped_column(UtcMicros)
    actor: Mapped[str] = mapped_column(String(NAME_MAX))
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # done | open
    what: Mapped[str] = mapped_column(Text)
    why: Mapped[str] = mapped_column(Text)
    supersedes: Mapped[int | None] = mapped_column(BigInteger)


# ---------------------------------------------------------------------- scheduled scrapes


class ScrapeTarget(Base):
    """One engine ``/metrics`` target of the collector's scheduled scraper (see
    ``collector.scrape``). Replicas share the row: whoever moves ``next_at`` past now scrapes
    the target for that interval; ``seq`` is the last seq handed out under ``probe_id``.

    Invariant: seqs 1..seq of ``probe_id`` were each reserved by exactly one scrape.
    """

    __tablename__ = "scrape_targets"

    target_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    probe_id: Mapped[str] = mapped_column(String(ID_MAX), unique=True)
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    engine: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(Text)
    next_at: Mapped[int] = mapped_column(BigInteger)
    seq: Mapped[int] = mapped_column(BigInteger)
    token_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("api_tokens.id"))
    config_hash: Mapped[str | None] = mapped_column(String(64))
    claimed_by: Mapped[str | None] = mapped_column(String(NAME_MAX))
    last_ok_at: Mapped[int | None] = mapped_column(BigInteger)
    last_error: Mapped[str | None] = mapped_column(Text)
    failures: Mapped[int] = mapped_column(BigInteger)


class VerifySchedule(Base):
    """A verification the collector runs by itself (``kvwatch verify schedule add``): every
    ``every_s``, and at once when a ``config_drift`` alert of the deployment is seen after the
    run last started. ``keys_ref`` names where the tenant keys are read at run time
    (``env:NAME`` or ``file:PATH``); the keys themselves are never stored.

    Invariant: a row whose ``claimed_until`` lies in the future is being run by one replica;
    no two rows of one endpoint are claimed at once (one run at a time per endpoint).
    """

    __tablename__ = "verify_schedules"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    endpoint: Mapped[str] = mapped_column(Text)
    model_id: Mapped[str] = mapped_column(String(NAME_MAX))
    deployment_id: Mapped[str] = mapped_column(String(ID_MAX))
    every_s: Mapped[int] = mapped_column(BigInteger)
    keys_ref: Mapped[str] = mapped_column(Text)
    budget: Mapped[int] = mapped_column(Integer)
    max_context: Mapped[int | None] = mapped_column(BigInteger)
    timeout_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UtcMicros)
    created_by: Mapped[str] = mapped_column(String(NAME_MAX))
    next_at: Mapped[datetime] = mapped_column(UtcMicros)
    claimed_until: Mapped[datetime | None] = mapped_column(UtcMicros)
    last_started_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    last_finished_at: Mapped[datetime | None] = mapped_column(UtcMicros)
    last_trigger: Mapped[str | None] = mapped_column(String(16))
    last_result: Mapped[str | None] = mapped_column(String(16))
    last_verification_id: Mapped[int | None] = mapped_column(BigInteger)
    last_error: Mapped[str | None] = mapped_column(Text)
    runs: Mapped[int] = mapped_column(BigInteger)
