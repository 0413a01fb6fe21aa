"""The collector's configuration: every field is an environment variable ``KVWATCH_<NAME>``."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Collector settings. Built once and passed to ``create_app(settings)``."""

    model_config = SettingsConfigDict(env_prefix="KVWATCH_", extra="ignore")

    database_url: str = Field(
        default="sqlite:///kvwatch.db",
        description="SQLAlchemy URL. SQLite (WAL) is the embedded default; use "
        "postgresql+psycopg://user@host/db in production.",
    )
    host: str = Field(default="127.0.0.1", description="Address `kvwatch serve` binds.")
    port: int = Field(default=8700, ge=1, le=65535, description="Port `kvwatch serve` binds.")
    max_batch_events: int = Field(
        default=10_000, ge=1, le=1_000_000, description="Most events one POST /v1/events may hold."
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest POST /v1/events body, in bytes."
    )
    max_clock_skew_s: float = Field(
        default=3600.0, ge=0, description="How far in the future an event's ts may lie."
    )
    token_cache_s: float = Field(
        default=5.0, ge=0, description="How long a valid token is remembered (revocation lag)."
    )
    token_use_audit_s: float = Field(
        default=3600.0,
        gt=0,
        description="A token's use is written to the audit log at most once per this many "
        "seconds (token.use).",
    )
    workers: int = Field(default=1, ge=1, le=64, description="`kvwatch serve` processes.")
    db_pool_size: int = Field(default=5, ge=1, description="PostgreSQL connection pool size.")
    auto_migrate: bool = Field(
        default=True,
        description="Run Alembic migrations to head when the collector starts.",
    )

    policies_enabled: bool = Field(
        default=True, description="Evaluate the policy packs on ingest and on a timer."
    )
    policy_packs_dir: str | None = Field(
        default=None,
        description="A directory of operator rule packs (*.yaml), loaded beside the default "
        "pack; a pack with a name already loaded replaces it.",
    )
    policy_timer_s: float = Field(
        default=15.0,
        gt=0,
        description="How often absence and windowed rules run, and alerts are resolved, "
        "repeated and incidents reminded.",
    )
    retention_days: int | None = Field(
        default=None,
        ge=1,
        le=36_500,
        description="Days of request, pool and page data kept for deployments without their "
        "own policy (kvwatch retention set); unset: kept until deleted.",
    )
    rollup_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="How often the dashboard's rollups are brought up to date with ingested "
        "requests and pool samples (how far behind the dashboard's long-window charts may be).",
    )
    notify_enabled: bool = Field(
        default=True, description="Run the notification dispatcher in the collector."
    )
    notify_poll_s: float = Field(
        default=0.5, gt=0, description="How often the dispatcher looks for due notifications."
    )
    notify_timeout_s: float = Field(
        default=10.0, gt=0, description="HTTP timeout of one delivery attempt."
    )
    notify_backoff_base_s: float = Field(
        default=1.0, gt=0, description="First retry delay; doubles per failed attempt."
    )
    notify_backoff_max_s: float = Field(
        default=600.0, gt=0, description="Longest retry delay (before jitter)."
    )
    notify_lease_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a dispatcher holds an endpoint before another replica may take "
        "it over (a crashed replica's endpoints resume after this).",
    )
    dpo_contact: str = Field(
        default="",
        description="The data protection officer's (or other contact point's) name and "
        "details, for GDPR Art. 33(3)(b) in breach reports; empty: a person must fill it in.",
    )
    public_url: str = Field(
        default="",
        description="The collector's URL as people reach it (links in notifications).",
    )

    @field_validator("database_url")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if not v.startswith(("sqlite", "postgresql")):
            raise ValueError("database_url must be a sqlite:// or postgresql:// URL")
        if v.startswith("postgresql://"):
            # Bare postgresql:// means psycopg2 to SQLAlchemy; we ship psycopg 3.
            v = "postgresql+psycopg://" + v[len("postgresql://") :]
        return v
