"""The collector's configuration: every field is an environment variable ``KVWATCH_<NAME>``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine_probe.events import is_valid_id

if TYPE_CHECKING:
    from collector.signing import KeyRing


class ScrapeTarget(BaseModel):
    """One engine server the collector scrapes (an entry of ``KVWATCH_SCRAPE_TARGETS``).

    ``token``: the ingest token its events are stored under (as if POSTed with it; a
    deployment-scoped token must match); unset, the collector makes one for the target.
    ``api_key``: a bearer key for the engine's own API (vLLM's ``/v1/models``).

    This model is the setting's syntax: the list, each entry's fields and the values the
    collector itself uses (deployment, interval, token). ``url``, ``node`` and ``role`` say
    where and how to read the engine, which is the scraper's to know (its ``make_target``
    is the one reading of them, for ``kvwatch scrape`` too); the collector hands each target
    to the scraper it was built with at startup, which refuses what it cannot read
    (:func:`collector.scrape.open_targets`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    engine: Literal["vllm", "sglang"]
    deployment_id: str
    interval_s: float | None = Field(default=None, gt=0, le=86_400)
    token: str | None = Field(default=None, repr=False)
    api_key: str | None = Field(default=None, repr=False)
    node: str | None = None
    role: Literal["prefill", "decode", "both"] | None = None

    @field_validator("deployment_id")
    @classmethod
    def _check_deployment(cls, v: str) -> str:
        if not is_valid_id(v):
            raise ValueError(f"{v!r} is not a valid id")
        return v


_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def secure_url(url: str) -> bool:
    """https, or http to this machine only (a test identity provider): signing keys read in
    the clear from elsewhere could be anyone's."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return bool(parts.hostname)
    return parts.scheme == "http" and parts.hostname in {"127.0.0.1", "localhost", "::1"}


def _entry(index: object, url: object) -> str:
    """How a message names an entry of the setting: its index and the server it points at,
    as scheme, host and port only (credentials, a path or a query may hold secrets)."""
    name = f"entry {index}"
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
    except ValueError:
        parts = None
    if parts is None or not parts.netloc:
        return name
    return f"{name} ({parts.scheme}://{parts.netloc.rpartition('@')[2]})"


_TARGETS = TypeAdapter(list[ScrapeTarget])
#: KVWATCH_PROBE_REPLACED_QUIET_S's default (see ``collector.lost``)
REPLACED_QUIET_S = 10.0


def origin_of(url: str) -> str | None:
    """``scheme://host[:port]`` of an http(s) URL, lower-cased; None for anything else."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
        return None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


class Settings(BaseSettings):
    """Collector settings. Built once and passed to ``create_app(settings)``."""

    # Inputs stay out of error messages: URLs and scrape targets may hold secrets.
    model_config = SettingsConfigDict(
        env_prefix="KVWATCH_", extra="ignore", hide_input_in_errors=True
    )

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
    max_request_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Largest body of every other request (verifications, silences, reports, "
        "schedules, ...), in bytes; over it: 413.",
    )
    max_evidence_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="Largest verification evidence stored, in bytes of compact JSON; over it: 413.",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="If set, GET /metrics needs 'Authorization: Bearer <this>' (Prometheus: "
        "authorization.credentials). Unset: /metrics is open, and carries no figure of a "
        "single request.",
    )
    metrics_max_deployments: int = Field(
        default=200,
        ge=1,
        description="Per-deployment series on /metrics for at most this many deployments "
        "(the most recently seen); the rest are counted in "
        "kvwatch_metrics_deployments_omitted.",
    )
    metrics_min_requests: int = Field(
        default=10,
        ge=1,
        description="kvwatch_deployment_max_prompt_tokens_1h is published only for a "
        "deployment with at least this many requests in the hour.",
    )
    max_new_deployments_per_hour: int = Field(
        default=20,
        ge=1,
        description="New deployment ids one ingest token (with its rotations) may name per "
        "hour; a batch over it gets 429 and nothing is stored.",
    )
    max_new_nodes_per_hour: int = Field(
        default=200, ge=1, description="New nodes one ingest token may name per hour (429)."
    )
    max_new_models_per_hour: int = Field(
        default=50, ge=1, description="New model ids one ingest token may name per hour (429)."
    )
    max_new_routes_per_hour: int = Field(
        default=200, ge=1, description="New routes one ingest token may name per hour (429)."
    )
    max_new_probes_per_hour: int = Field(
        default=300,
        ge=1,
        description="New probe ids one ingest token may name per hour (429): a probe id is "
        "new at each engine process start, so size it to the restarts of the engines behind "
        "one token.",
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
    verify_schedule_tick_s: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="How often due scheduled verifications (and re-verifications after a "
        "config drift) are looked for.",
    )
    # What a scheduled verification may reach (docs/verify.md): an admin token names where a
    # schedule sends tenant keys and where they are read, so the operator bounds both here.
    verify_endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Scheduled verifications: the origins (http[s]://host[:port], comma-"
        "separated) their endpoints may be on; '*' allows any. Unset: no schedule can be "
        "added (a schedule sends tenant keys to its endpoint).",
    )
    verify_keys_dir: Path | None = Field(
        default=None,
        description="Scheduled verifications: the directory keys_from=file:NAME reads "
        "tenant keys from (a file directly in it); unset: file: is refused.",
    )
    verify_keys_env_prefix: str = Field(
        default="VERIFY_KEYS_",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Scheduled verifications: keys_from=env:NAME reads only variables "
        "whose names start with this (never the collector's own settings or secrets).",
    )
    retention_days: int | None = Field(
        default=None,
        ge=1,
        le=36_500,
        description="Days of request, pool and page data kept for deployments without their "
        "own policy (kvwatch retention set); unset: kept until deleted.",
    )
    probe_lost_after_s: float = Field(
        default=300.0,
        gt=0,
        description="How long a probe may send nothing before it is gone: its requests still "
        "open (admitted, neither finished nor rejected) are then closed as lost "
        "(reason probe_silent), checked every tenth of this, at most every minute, and only "
        "once the collector has been up with its database this long (after an outage the "
        "probes were buffering, not silent). A probe that said it stopped, or that a new "
        "probe replaced on its node, is gone at once. A finish arriving later still replaces "
        "the lost status.",
    )
    probe_replaced_quiet_s: float = Field(
        default=REPLACED_QUIET_S,
        ge=0,
        description="A new probe announcing itself (engine.config) on a node of a deployment "
        "replaces the older probes of that node quiet for at least this long before it was "
        "first heard from: their requests still open are closed as lost (reason "
        "probe_replaced). An engine's restart takes longer (the model loads); probes sending "
        "side by side are replicas reporting one node id, and never replace each other.",
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
    notify_max_per_minute: int = Field(
        default=30,
        ge=1,
        le=10_000,
        description="Alert notifications one endpoint gets per minute; past it, the minute's "
        "further alerts go out as one alert.digest when the minute ends (incidents are never "
        "held back).",
    )
    notify_lease_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a dispatcher holds an endpoint before another replica may take "
        "it over (a crashed replica's endpoints resume after this).",
    )
    data_map: Path | None = Field(
        default=None,
        description="A YAML data map declaring data categories (and data subjects) per "
        "tenant, route, model or deployment (policies/datamap.py); breach reports use it "
        "and say 'unknown' where nothing is declared.",
    )
    operator_role: Literal["processor", "controller"] = Field(
        default="processor",
        description="Your role under the GDPR for the tenants' data: 'processor' (you serve "
        "your customers' apps: you notify each affected customer, the controller, without "
        "undue delay, Art. 33(2)) or 'controller' (first-party apps). Shapes tenant notices.",
    )
    audit_checkpoint_s: float = Field(
        default=3600.0,
        gt=0,
        description="How often the collector signs the audit chain's head (an audit.checkpoint "
        "entry holding a JWS over the last entry's id and hash, when anything was appended "
        "since). `kvwatch audit verify` fails a chain with an entry older than twice this "
        "that no checkpoint covers (checkpoints deleted, or no collector running).",
    )
    controller_notice_target_h: float = Field(
        default=24.0,
        gt=0,
        le=72,
        description="Hours from awareness within which each affected customer (controller) "
        "is to be notified: kvwatch's measure of Art. 33(2)'s 'without undue delay' "
        "(collector/cases/status.py). A notice sent later is 'late' in breach reports, the "
        "CLI and the dashboard.",
    )
    supervisory_authority: str = Field(
        default="supervisory authority",
        min_length=1,
        max_length=128,
        description="The name of the supervisory authority notified under Art. 33(1) when "
        "KVWATCH_OPERATOR_ROLE=controller (its notification is due at the incident's "
        "deadline).",
    )
    signing_key_dir: Path | None = Field(
        default=None,
        description="The directory of the Ed25519 keys that sign reports, notices, audit "
        "exports and case files (collector/signing.py): keys.jwks, the public key set to "
        "publish, and the current private key (0600). Unset: beside an embedded SQLite "
        "database (<db dir>/signing-keys), else $XDG_STATE_HOME/kvwatch/signing-keys. Every "
        "collector replica must see the same directory. A key is made on first use.",
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
    dashboard_url: str | None = Field(
        default=None,
        description="The dashboard's URL as people reach it: every notification links to "
        "the dashboard's page for its alert (/alerts?id=N) or incident (/incident?id=N), and "
        "to the rule's runbook (/runbook?kind=K). Unset: notifications link to the API "
        "(public_url) and carry no runbook link unless a rule names one.",
    )
    instance: str | None = Field(
        default=None,
        description="This installation's name in everything it sends out (the "
        "kvwatch_instance label of alerts and incidents, their fingerprints, the 'instance' "
        "of webhook documents), so two installations never merge or resolve each other's "
        "alerts in Alertmanager or a pager. Unset: the id generated for the database when it "
        "was created (every replica of one database shares it); set it when two "
        "installations started from a copy of one database. Letters, digits, '._-', at "
        "most 64.",
    )

    scrape_targets: Annotated[list[ScrapeTarget], NoDecode] = Field(
        default_factory=list,
        description="Engine servers whose /metrics the collector scrapes into engine.config and "
        'pool.sample events: a JSON list of {"url", "engine" (vllm|sglang), "deployment_id", '
        'optional "interval_s", "token", "api_key", "node", "role"}. One replica scrapes each '
        "target per interval.",
    )
    scrape_interval_s: float = Field(
        default=15.0, gt=0, le=86_400, description="Interval of targets without interval_s."
    )
    scrape_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="HTTP timeout of one scrape request."
    )

    otlp_tenant_attributes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["tenant.id", "kvwatch.tenant"],
        description="POST /v1/traces: the span or resource attributes (comma-separated, the "
        "first present wins, a span's own before its resource's) that name a GenAI span's "
        "tenant; none present: the tenant is 'unknown'.",
    )
    otlp_deployment_attributes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["kvwatch.deployment", "service.name"],
        description="POST /v1/traces: the span or resource attributes (comma-separated, the "
        "first present wins) that name a span's deployment. The SDKs' default service.name "
        "(unknown_service...) names none; a deployment-scoped token's spans then belong to "
        "its deployment, and an unscoped token's are refused.",
    )

    # The ingest bus (docs/scaling.md): unset, collectors store what they accept themselves.
    bus_url: SecretStr | None = Field(
        default=None,
        description="NATS server(s) of the ingest bus, comma-separated "
        "(`nats://host:4222,nats://host2:4222`; `tls://` for TLS). Set, `kvwatch serve` "
        "publishes every accepted batch to a JetStream stream and `kvwatch writer` "
        "processes store it. Never printed (a URL may hold a user and password).",
    )
    bus_stream: str = Field(
        default="KVWATCH_INGEST",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="The JetStream stream accepted batches are published to.",
    )
    bus_subject: str = Field(
        default="kvwatch.ingest",
        pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$",
        description="Subject prefix; a batch goes to `<prefix>.<partition>`.",
    )
    bus_partitions: int = Field(
        default=4,
        ge=1,
        le=256,
        description="Partitions of the stream: a deployment's batches all go to one "
        "(in order); up to this many are written at once. Change it only while the stream "
        "is drained.",
    )
    bus_replicas: int | None = Field(
        default=None,
        ge=1,
        le=5,
        description="Replicas of the stream; unset: 3 where the cluster has 3 nodes or "
        "more, else as many as it has.",
    )
    bus_max_bytes: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description="Bytes the stream holds unwritten before ingest answers 503 "
        "(Retry-After) and probes spool.",
    )
    bus_max_msgs: int | None = Field(
        default=None,
        ge=1,
        description="Batches the stream holds unwritten before ingest answers 503; unset: "
        "no count limit (bytes still apply).",
    )
    bus_max_age_s: float | None = Field(
        default=None,
        gt=0,
        description="Age after which the stream drops an unwritten batch; unset: never "
        "(a batch waits for a writer however long it takes).",
    )
    bus_dedupe_window_s: float = Field(
        default=120.0,
        gt=0,
        description="How long the stream remembers a batch's message id to drop a retried "
        "publish; a retry later than this is a duplicate the store drops.",
    )
    bus_connect_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a collector or writer starting up tries to reach the bus (and "
        "have its stream set up) before it gives up with an error.",
    )
    bus_publish_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="How long ingest waits for the stream's acknowledgement before answering 503.",
    )
    bus_retry_after_s: int = Field(
        default=5,
        ge=1,
        description="Retry-After of the 503 ingest answers when the stream is full or unreachable.",
    )
    bus_ack_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a batch fetched by a writer stays its own before the stream "
        "hands it to another writer (a writer killed mid-batch).",
    )
    bus_user: str | None = Field(default=None, description="NATS user name.")
    bus_password: SecretStr | None = Field(
        default=None, description="NATS password. Never printed."
    )
    bus_nkey_seed_file: Path | None = Field(
        default=None, description="File holding the NATS nkey seed (nkey authentication)."
    )
    bus_creds_file: Path | None = Field(
        default=None, description="NATS credentials file (JWT and nkey seed)."
    )
    bus_tls_ca_file: Path | None = Field(
        default=None, description="CA bundle that signed the NATS servers' certificates."
    )
    bus_tls_cert_file: Path | None = Field(
        default=None, description="Client certificate for NATS (mutual TLS)."
    )
    bus_tls_key_file: Path | None = Field(
        default=None, description="Client certificate's key for NATS (mutual TLS)."
    )
    bus_auth_grace_s: float = Field(
        default=600.0,
        ge=0,
        description="With the bus, how long a token already known stays valid while the "
        "database is unreachable, so an outage does not reach the probes (revocation waits "
        "for the database).",
    )
    bus_status_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often a collector reads the stream's and consumers' state "
        "(/metrics, the bus_lag rule).",
    )

    oidc_issuer: str | None = Field(
        default=None,
        description="OpenID Connect issuer whose signed-in people the collector and the "
        "dashboard accept (its /.well-known/openid-configuration is read; docs/sign-in.md); "
        "unset: bearer tokens only.",
    )
    oidc_client_id: str | None = Field(
        default=None,
        description="The dashboard's client id at the issuer: the audience of the ID tokens "
        "the dashboard forwards, so the one audience the collector accepts unless "
        "KVWATCH_OIDC_AUDIENCE says otherwise.",
    )
    oidc_audience: str | None = Field(
        default=None,
        description="Audience a forwarded token must name; unset: KVWATCH_OIDC_CLIENT_ID.",
    )
    oidc_roles_claim: str = Field(
        default="groups",
        min_length=1,
        max_length=256,
        description="ID-token claim holding a person's groups or roles (a list, or a "
        "string); a dotted path reaches into objects (realm_access.roles).",
    )
    oidc_role_map: Path | None = Field(
        default=None,
        description="YAML file mapping claim values to kvwatch roles (admin, operator, "
        "auditor, tenant:<name>); unset: a claim value kvwatch:<role> is that role.",
    )
    oidc_clock_skew_s: float = Field(
        default=60.0,
        ge=0,
        le=300,
        description="How far a token's nbf and iat may be ahead of this clock (its exp "
        "stands as the issuer set it).",
    )
    oidc_jwks_cache_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long the issuer's signing keys are kept before they are read again.",
    )
    oidc_jwks_refetch_s: float = Field(
        default=30.0,
        ge=0,
        description="A token signed by a key not yet known makes the collector read the "
        "keys again (a rotation), at most once per this many seconds.",
    )
    oidc_http_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=120,
        description="Timeout of the collector's requests to the issuer (discovery, keys).",
    )

    @field_validator("otlp_tenant_attributes", "otlp_deployment_attributes", mode="before")
    @classmethod
    def _attribute_list(cls, v: Any) -> list[str]:
        """Comma-separated text (the environment) or a list of attribute names."""
        names = [p.strip() for p in v.split(",")] if isinstance(v, str) else v
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("must be attribute names, separated by commas")
        names = [n.strip() for n in names if n.strip()]
        if not names:
            raise ValueError("must name at least one attribute")
        if bad := [n for n in names if len(n) > 256 or any(c.isspace() for c in n)]:
            raise ValueError(f"{bad[0]!r} is not an attribute name")
        return names

    @field_validator("verify_endpoints", mode="before")
    @classmethod
    def _origins(cls, v: Any) -> list[str]:
        """Comma-separated origins (the environment) or a list of them; '*' for any."""
        items = [p.strip() for p in v.split(",")] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(n, str) for n in items):
            raise ValueError("must be origins (http[s]://host[:port]), separated by commas")
        out = []
        for item in (i.strip() for i in items if i.strip()):
            if item == "*":
                out.append(item)
                continue
            origin = origin_of(item)
            if origin is None or origin != item.rstrip("/").lower():
                raise ValueError(f"{item!r} is not an origin (http[s]://host[:port])")
            out.append(origin)
        return out

    @field_validator("scrape_targets", mode="before")
    @classmethod
    def _parse_targets(cls, v: Any) -> list[ScrapeTarget]:
        """JSON text (the environment) or a list; errors name the entry and the field."""
        if isinstance(v, str):
            if not v.strip():
                return []
            try:
                v = json.loads(v)
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(v, list):
            raise ValueError("must be a JSON list of targets")
        try:
            targets = _TARGETS.validate_python(v)
        except ValidationError as exc:
            e = exc.errors()[0]
            index, *where = e["loc"] or ("?",)
            entry = v[index] if isinstance(index, int) and index < len(v) else None
            name = _entry(index, entry.get("url") if isinstance(entry, dict) else None)
            field = ".".join(str(p) for p in where) or "entry"
            msg = str(e["msg"]).removeprefix("Value error, ")
            raise ValueError(f"{name}, field {field}: {msg}") from None
        seen: dict[tuple[str, str, str], int] = {}
        for i, t in enumerate(targets):
            key = (t.engine, t.url, t.deployment_id)
            if key in seen:
                raise ValueError(f"{_entry(i, t.url)} repeats entry {seen[key]}")
            seen[key] = i
        return targets

    @field_validator("dashboard_url", mode="before")
    @classmethod
    def _dashboard_url(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        v = v.strip().rstrip("/")
        if not v:
            return None
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v

    @field_validator("instance", mode="before")
    @classmethod
    def _instance(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        v = v.strip()
        if not v:
            return None
        if not _INSTANCE.fullmatch(v):
            raise ValueError("use letters, digits, '.', '_' or '-', at most 64 characters")
        return v

    @field_validator("oidc_issuer", "oidc_client_id", "oidc_audience", mode="before")
    @classmethod
    def _oidc_text(cls, v: Any) -> Any:
        # an exported-but-empty variable means "not set"
        return (v.strip() or None) if isinstance(v, str) else v

    @field_validator("oidc_issuer")
    @classmethod
    def _oidc_issuer(cls, v: str | None) -> str | None:
        if v is not None and not secure_url(v):
            raise ValueError(
                "must be the issuer's https:// URL (http:// only to this machine: keys read "
                "in the clear from elsewhere could be anyone's)"
            )
        return v

    @model_validator(mode="after")
    def _oidc_complete(self) -> Settings:
        if self.oidc_issuer is not None and (self.oidc_audience or self.oidc_client_id) is None:
            raise ValueError(
                "KVWATCH_OIDC_ISSUER is set without KVWATCH_OIDC_CLIENT_ID (or "
                "KVWATCH_OIDC_AUDIENCE): the collector must know whose ID tokens to accept"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if not v.startswith(("sqlite", "postgresql")):
            raise ValueError("database_url must be a sqlite:// or postgresql:// URL")
        if v.startswith("postgresql://"):
            # Bare postgresql:// means psycopg2 to SQLAlchemy; we ship psycopg 3.
            v = "postgresql+psycopg://" + v[len("postgresql://") :]
        return v

    def key_ring(self) -> KeyRing:
        """The signing keys these settings name (:func:`collector.signing.key_dir`)."""
        from collector.signing import KeyRing, key_dir

        return KeyRing(key_dir(self.database_url, self.signing_key_dir))
