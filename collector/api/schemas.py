"""Response shapes, so the served OpenAPI document says what the API really returns."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    code: str
    message: str
    details: Any = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class IngestResponse(BaseModel):
    accepted: int
    duplicates: int
    gaps: list[list[int]]


class ConfigOut(BaseModel):
    node: str
    role: str
    ts: datetime
    engine: str
    engine_version: str
    model_id: str
    advertised_context: int
    pool_capacity_tokens: int
    page_size: int
    dtype: str
    quantization: str | None
    tp_size: int
    cuda_graphs: bool
    disaggregated: bool
    prefix_caching: bool
    prefix_cache_salting: bool
    kv_connector: str | None = Field(
        None, description="The KV connector as the engine names it (engine.config)"
    )
    kv_connector_version: str | None = Field(
        None, description="The version of the package implementing the connector (LMCache's)"
    )
    kv_tiers: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Offload tiers past the pool: medium, backend, capacity_bytes, salted",
    )
    config_hash: str


class DeploymentOut(BaseModel):
    deployment_id: str
    first_seen: datetime
    last_seen: datetime
    config: list[ConfigOut]


class RequestOut(BaseModel):
    deployment_id: str
    request_id: str
    tenant: str
    route: str | None
    model_id: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    max_tokens: int | None
    status: str = Field(
        description="admitted (still open), rejected, completed, length, aborted, error, or "
        "lost: the probe that admitted it is gone and never said how it ended (see "
        "lost_reason); a finish arriving later replaces lost"
    )
    reject_reason: str | None
    limit_tokens: int | None
    data_categories: list[str]
    prompt_shared_with: str | None = Field(
        None,
        description="The request (same deployment) whose prompt this one shares, e.g. vLLM's "
        "parallel-sampling children 1..n-1 name child 0; null for a prompt of its own",
    )
    cached_tokens: int | None = Field(
        None,
        description="How many of prompt_tokens a prefix cache served (vLLM's cached_tokens, "
        "OpenTelemetry's gen_ai.usage.cache_read.input_tokens); null when the producer did not "
        "say",
    )
    cache_write_tokens: int | None = Field(
        None,
        description="How many of prompt_tokens were written to a prompt cache "
        "(OpenTelemetry's gen_ai.usage.cache_creation.input_tokens); null when the producer "
        "did not say",
    )
    lost_reason: str | None = Field(
        None,
        description="Why the request is lost: probe_stopped (its probe said it stopped), "
        "probe_replaced (a new probe announced itself on its node), probe_silent (its probe "
        "sent nothing for KVWATCH_PROBE_LOST_AFTER_S); null unless status is lost",
    )
    probe_id: str | None = Field(
        None, description="The probe that admitted it; null when no admission was stored"
    )
    node: str | None = Field(None, description="The node that admitted it, where it said")
    first_ts: datetime
    last_ts: datetime


class RequestPage(BaseModel):
    items: list[RequestOut]
    next_cursor: str | None


class PoolBucket(BaseModel):
    deployment_id: str
    node: str
    role: str
    bucket_start_us: int
    samples: int
    used_avg: float
    used_max: int
    free_min: int
    capacity: int


class PoolSeries(BaseModel):
    since: datetime
    until: datetime
    bucket_seconds: float
    items: list[PoolBucket]


class PageEventOut(BaseModel):
    deployment_id: str
    kind: str
    ts: datetime
    node: str | None
    request_id: str | None
    tenant: str | None
    other_request_id: str | None
    other_tenant: str | None
    page_count: int
    cross_tenant: bool
    detail: dict[str, Any]


class PageEventPage(BaseModel):
    items: list[PageEventOut]
    next_cursor: str | None


class ProbeOut(BaseModel):
    probe_id: str
    deployment_id: str
    max_seq: int
    accepted: int
    duplicates: int
    missing: int
    gaps: list[list[int]]
    reported_drops: dict[str, int]
    first_seen: datetime
    last_seen: datetime
    stopped_at: datetime | None = Field(
        None, description="When the probe said it shut down cleanly (probe.stopped)"
    )
    superseded_by: str | None = Field(
        None, description="The probe that took its place when its engine restarted"
    )
    gone_at: datetime | None = Field(
        None,
        description="When the collector knew it gone and closed its open requests as lost; "
        "null while it runs (a silent probe heard from again runs again)",
    )
    gone_reason: str | None = Field(
        None, description="probe_stopped, probe_replaced or probe_silent; null while it runs"
    )
    lost_requests: int = Field(
        0, description="How many of its requests the collector closed as lost, ever"
    )


class Health(BaseModel):
    status: str
    detail: str | None = None
