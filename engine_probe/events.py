"""The wire contract between every producer (probes, gateway, scraper, verifier) and the collector.

One typed, versioned schema. Every event carries ``schema_version``, ``probe_id``, a
per-probe strictly increasing ``seq`` (idempotency and gap detection), ``ts`` (timezone-aware,
stored as UTC) and ``deployment_id``; ``kind`` selects the event type.

Events describe token counts, pool occupancy and page movements. None of them has a field for
prompt or completion text, and unknown fields are rejected, so a producer cannot smuggle text
into the collector by accident.

Versions: ``schema_version`` changes only for a change that events already sent, or decoders
already deployed, cannot follow (a field removed, retyped, narrowed or made required). An
optional field with a default is added within the version: older producers' events decode
as before. Since unknown fields are refused, a collector must know a field before any
producer sets it: upgrade collectors first. Optional fields added within version 1 since
this note: ``request.admitted``'s ``prompt_shared_with``, ``request.finished``'s
``limit_tokens``, ``cached_tokens`` and ``cache_write_tokens``; ``engine.config``'s
``kv_connector``, ``kv_connector_version`` and ``kv_tiers``; and two kinds, ``kv.turnover``
and ``source.gap`` (a kind a collector does not know is refused, like a field: upgrade
collectors first).

Decoding uses msgspec: it validates types, ranges, lengths and enums in C while decoding,
which is what an ingest path taking hundreds of thousands of events per second needs (about
five times pydantic's ``validate_json`` on the same schema). This module never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from operator import attrgetter
from typing import Annotated, Any, Final, Literal, TypeVar, cast, get_type_hints

import msgspec

from engine_probe.errors import ProbeError

SCHEMA_VERSION: Final = 1

# Limits shared by the decoder and the database column sizes (collector.models uses them).
ID_MAX: Final = 128
NAME_MAX: Final = 256
MAX_PAGE_IDS: Final = 4096
MAX_CATEGORIES: Final = 16
MAX_TOKENS: Final = 2**40  # far past any context window, well inside BIGINT
MAX_SEQ: Final = 2**62

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$"
_ID_RULE = "ids start with a letter or digit and use only letters, digits and ._:/@+=-"
# fullmatch, not match with "$": "$" also matches before a trailing newline.
_ID_RE = re.compile(_ID_PATTERN[1:-1])

# A probe id is "{root}-{pid}-{6 hex}" (engine_probe.settings.derive_probe_id): the root is the
# configured KVWATCH_PROBE_ID or the host name, the same across an engine's restarts.
_PROBE_ID_RE = re.compile(r"(?P<root>.+)-\d{1,10}-[0-9a-f]{6}")


def probe_root(probe_id: str) -> str | None:
    """The root of a probe id the probe derived (shared by an engine's successive probes
    on one host), or None for an id of another shape (e.g. a scrape target's)."""
    m = _PROBE_ID_RE.fullmatch(probe_id)
    return m.group("root") if m else None


# The id pattern is checked after decoding (``_check_ids``), not by msgspec: a regex per
# field per event was most of the decode time, and ids repeat, so known-good ones are cached.
# The JSON Schema still states the pattern.
Id = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=ID_MAX, extra_json_schema={"pattern": _ID_PATTERN}),
]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX)]
ShortName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
PositiveTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
Seq = Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)]
UtcTime = Annotated[datetime, msgspec.Meta(tz=True)]
PageId = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
PageIds = Annotated[list[PageId], msgspec.Meta(max_length=MAX_PAGE_IDS)]
Category = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, extra_json_schema={"pattern": _ID_PATTERN})
]
Categories = Annotated[list[Category], msgspec.Meta(max_length=MAX_CATEGORIES)]

Role = Literal["prefill", "decode", "both"]
RejectReason = Literal[
    "context_length_exceeded",  # prompt longer than the advertised context
    "pool_exhausted",  # prompt longer than the KV pool (the incident's path)
    "invalid_request",
    "rate_limited",
    "other",
]
FinishStatus = Literal["completed", "length", "error", "aborted"]
# How a producer counted a prompt itself before admitting it (the gateway's safe-context
# guard): the upstream engine's tokenizer endpoint, a configured tokenizer ("bytes": one
# token per UTF-8 byte), or a conservative over-estimate.
PromptCountMethod = Literal["tokenize_endpoint", "bytes", "estimate"]
LatencyMs = Annotated[float, msgspec.Meta(ge=0, le=1e12)]
ReadKind = Literal["decode", "prefill", "transfer"]
CanaryDetector = Literal["paint", "text"]
# What a producer watches from outside an engine (``source.gap``): the engine's KV-events
# stream (``kvwatch kv-events``) or its Prometheus /metrics (``kvwatch scrape``).
SourceName = Literal["kv_events", "metrics"]
# Why a silent source is a gap and not an idle engine (``source.gap``): nothing accepts the
# subscriber's connection; messages arrive on another topic than the one subscribed; the
# engine itself does not answer; the engine answers and served requests meanwhile.
GapCause = Literal["not_connected", "other_topic", "engine_down", "engine_served"]
DropReason = Literal[
    "buffer_full", "spool_full", "spool_error", "rejected_by_collector", "shutdown"
]


class Event(
    msgspec.Struct,
    kw_only=True,
    frozen=True,
    forbid_unknown_fields=True,
    tag_field="kind",
    gc=False,
):
    """Fields every event carries."""

    schema_version: Literal[1]
    probe_id: Id
    seq: Seq
    ts: UtcTime
    deployment_id: Id


KvMedium = Literal["cpu", "disk", "remote"]
MAX_KV_TIERS: Final = 8


class KvTier(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """One place outside the engine's KV pool that KV pages leave to and come back from (an
    offload tier): ``medium`` where it is; ``backend`` what holds it, as the connector names
    it (``native`` for an engine's own offloading, ``lmcache``, ``file``, ``mooncake``...);
    ``capacity_bytes`` its configured size where known; ``salted`` whether the tier's key
    for a page includes the request's ``cache_salt`` (None: the producer cannot tell). A
    tier that is not salted serves one tenant's prefix to another however the pool is
    salted."""

    medium: KvMedium
    backend: ShortName | None = None
    capacity_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**60)] | None = None
    salted: bool | None = None


_TIERS_DECODER = msgspec.json.Decoder(tuple[KvTier, ...])


def decode_tiers(raw: str | bytes | None) -> tuple[KvTier, ...]:
    """Offload tiers from their JSON array (as ``msgspec.json`` encodes ``kv_tiers``);
    nothing for ``None``."""
    return _TIERS_DECODER.decode(raw) if raw else ()


class EngineConfig(Event, tag="engine.config", kw_only=True, frozen=True):
    """What one engine node is configured with; emitted at start and on every change.

    ``dtype`` is the KV cache's dtype (``auto``: the model's). Where KV goes past the pool
    (added within version 1): ``kv_connector`` the KV connector as the engine's
    configuration names it (vLLM's ``kv_transfer_config.kv_connector``, e.g.
    ``LMCacheConnectorV1``, ``OffloadingConnector``; SGLang's ``hicache``), with
    ``kv_connector_version`` the version of the package that implements it when it is not
    the engine itself (LMCache's), and ``kv_tiers`` the offload tiers it writes to."""

    engine: ShortName
    engine_version: ShortName
    model_id: Name
    node: Id = "node-0"
    role: Role = "both"
    advertised_context: PositiveTokens
    pool_capacity_tokens: Tokens
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    dtype: ShortName
    quantization: ShortName | None = None
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    cuda_graphs: bool = False
    disaggregated: bool = False
    prefix_caching: bool = False
    prefix_cache_salting: bool = False
    kv_connector: ShortName | None = None
    kv_connector_version: ShortName | None = None
    kv_tiers: Annotated[tuple[KvTier, ...], msgspec.Meta(max_length=MAX_KV_TIERS)] = ()


class RequestAdmitted(Event, tag="request.admitted", kw_only=True, frozen=True):
    """A request accepted for prefill. ``prompt_tokens``/``model_id`` may be missing when
    the producer cannot see them; telemetry hygiene rules flag that.

    ``prompt_shared_with``: the request id, in the same deployment, whose prompt this request
    shares (the same prompt tokens), or None. vLLM fans a request with ``n > 1`` out into n
    requests (parallel sampling); children 1..n-1 name child 0, so usage counts the shared
    prompt once while each child still counts as a request (each occupies the context). A
    request never names itself. Added within version 1 (see the module's "Versions").
    """

    request_id: Id
    tenant: Id
    route: Name | None = None
    model_id: Name | None
    prompt_tokens: Tokens | None
    max_tokens: Tokens | None = None
    node: Id | None = None
    data_categories: Categories = []
    prompt_shared_with: Id | None = None

    def __post_init__(self) -> None:
        if self.prompt_shared_with is not None and self.prompt_shared_with == self.request_id:
            raise ValueError(
                "prompt_shared_with: names the request itself; it must name another request "
                "whose prompt this one shares"
            )


class RequestRejected(Event, tag="request.rejected", kw_only=True, frozen=True):
    """A request refused; ``limit_tokens`` is the limit it crossed. ``prompt_count_method``
    and ``latency_ms`` as in :class:`RequestFinished`."""

    request_id: Id
    tenant: Id
    route: Name | None = None
    model_id: Name | None
    reason: RejectReason
    prompt_tokens: Tokens | None
    limit_tokens: Tokens | None = None
    node: Id | None = None
    data_categories: Categories = []
    prompt_count_method: PromptCountMethod | None = None
    latency_ms: LatencyMs | None = None


class RequestFinished(Event, tag="request.finished", kw_only=True, frozen=True):
    """A request that produced an answer (or failed while producing one).

    ``prompt_count_method``: how the producer counted the prompt itself before sending it on
    (None when it did not); ``prompt_tokens`` is still the engine's own count when it reported
    one. ``latency_ms``: from receipt to the answer's last byte, where the producer sees both.
    ``limit_tokens``: the safe context the producer held the prompt to (the gateway's guard),
    where it held it to one; added within version 1. ``cached_tokens``: how many of
    ``prompt_tokens`` a prefix cache served instead of prefill (vLLM's
    ``usage.prompt_tokens_details.cached_tokens``, OpenTelemetry's
    ``gen_ai.usage.cache_read.input_tokens``), where the producer knows; added within version 1.
    ``cache_write_tokens``: how many of ``prompt_tokens`` were written to a prompt cache for
    later requests (OpenTelemetry's ``gen_ai.usage.cache_creation.input_tokens``), where the
    producer knows; added within version 1.
    """

    request_id: Id
    tenant: Id
    route: Name | None = None
    model_id: Name | None = None
    prompt_tokens: Tokens | None = None
    completion_tokens: Tokens | None
    status: FinishStatus
    node: Id | None = None
    prompt_count_method: PromptCountMethod | None = None
    latency_ms: LatencyMs | None = None
    limit_tokens: Tokens | None = None
    cached_tokens: Tokens | None = None
    cache_write_tokens: Tokens | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens is None:
            return
        if self.cached_tokens is not None and self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                "cached_tokens: more than prompt_tokens (cached tokens are part of the prompt)"
            )
        if (
            self.cache_write_tokens is not None
            and (self.cached_tokens or 0) + self.cache_write_tokens > self.prompt_tokens
        ):
            raise ValueError(
                "cache_write_tokens: with cached_tokens, more than prompt_tokens (tokens "
                "read from and written to a cache are both part of the prompt)"
            )


class PoolSample(Event, tag="pool.sample", kw_only=True, frozen=True):
    """KV pool occupancy of one node at ``ts``."""

    node: Id = "node-0"
    role: Role = "both"
    capacity_tokens: Tokens
    used_tokens: Tokens
    free_tokens: Tokens

    def __post_init__(self) -> None:
        if self.used_tokens + self.free_tokens > self.capacity_tokens:
            raise ValueError("used_tokens: used_tokens + free_tokens exceeds capacity_tokens")


class KvTransfer(Event, tag="kv.transfer", kw_only=True, frozen=True):
    """KV pages moved between nodes (disaggregated prefill → decode)."""

    request_id: Id
    tenant: Id
    from_node: Id
    to_node: Id
    pages: Count
    tokens: Tokens = 0
    prefill_rejected: bool = False


class PageReuse(Event, tag="page.reuse", kw_only=True, frozen=True):
    """Pages handed to a new owner during one engine step, aggregated."""

    node: Id = "node-0"
    role: Role = "both"
    step: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
    reused_pages: Count
    cross_tenant_pages: Count
    zeroized_pages: Count = 0

    def __post_init__(self) -> None:
        if self.cross_tenant_pages > self.reused_pages:
            raise ValueError("cross_tenant_pages: cross_tenant_pages exceeds reused_pages")


def crosses_tenants(
    reader: str, other: str | None, *, zeroized: bool = False, unknown_is_foreign: bool = False
) -> bool:
    """The one definition of *cross-tenant*: another tenant's data reached the reader.

    The stored ``page_events.cross_tenant``, the alerts' ``cross_tenant`` label, the
    dashboard and every report use it (through the events' ``cross_tenant`` properties):

    - a stale read crosses when the pages' last writer is a known tenant other than the
      reader's, and the pages were not zeroized (zeros carry nobody's data; pages never
      written since the pool was made carry nobody's either);
    - a canary hit crosses unless the canary is known to be the reader's own: a canary is
      always somebody's, and one whose owner is unknown is treated as foreign;
    - a prefix-cache hit crosses when the blocks' owner is a known other tenant (a side
      channel: the reader got its own answer faster, not the other's data).
    """
    if zeroized:
        return False
    if other is None:
        return unknown_is_foreign
    return other != reader


class PageStaleRead(Event, tag="page.stale_read", kw_only=True, frozen=True):
    """A read of pages not written by the reader's own request in their current generation.

    ``previous_*`` name the last writer of those pages (the exposed tenant); both are None
    when the pages were never written since the pool was created.
    """

    node: Id = "node-0"
    role: Role = "both"
    read_kind: ReadKind = "decode"
    reader_request_id: Id
    reader_tenant: Id
    page_ids: PageIds
    previous_request_id: Id | None
    previous_tenant: Id | None
    zeroized: bool = False

    @property
    def cross_tenant(self) -> bool:
        return crosses_tenants(self.reader_tenant, self.previous_tenant, zeroized=self.zeroized)


class PrefixCacheHit(Event, tag="prefix_cache.hit", kw_only=True, frozen=True):
    """A request admitted with KV blocks another request computed (a prefix-cache hit).

    A legitimate receipt, not a stale read: the engine matched the blocks by the hash of
    their tokens (and, when ``salted``, of a per-request cache salt). Across tenants without
    a salt it is still a side channel: hit timing tells one tenant what another sent.
    ``owner_*`` name the request that computed the blocks; None when it is not known (it was
    computed before the probe attached).

    Added within version 1: ``tier``, the offload tier the blocks were loaded back from
    (None: found in the pool); ``salt_mismatch``, the reader's cache salt is not the one the
    owner's blocks were stored under: keys that carry salts cannot match so, and a cache or
    tier that served them dropped the salt (same tenant or not).
    """

    node: Id = "node-0"
    role: Role = "both"
    reader_request_id: Id
    reader_tenant: Id
    owner_request_id: Id | None
    owner_tenant: Id | None
    pages: Count
    tokens: Tokens = 0
    salted: bool
    tier: KvMedium | None = None
    salt_mismatch: bool = False

    @property
    def cross_tenant(self) -> bool:
        return crosses_tenants(self.reader_tenant, self.owner_tenant)


class KvTurnover(Event, tag="kv.turnover", kw_only=True, frozen=True):
    """What an engine's own KV-cache events said of its prefix cache over one interval,
    aggregated (``kvwatch kv-events``: vLLM's ``--kv-events-config`` stream). Added within
    version 1.

    ``stored_blocks``: blocks the engine reported storing (a full block of some request's
    KV entering the prefix cache; in vLLM's ``kv_cache_report_mode: full`` also a request's
    prefix-cache hits, reported again); ``removed_blocks``: cached blocks it reported
    evicting (their pages handed to new allocations); ``cleared``: whole-cache resets (the
    engine's own, or a restarted engine). Of the
    stored: ``unsalted_blocks`` chain from a first block stored without a cache salt,
    ``salted_blocks`` from one with a salt (the rest chain from blocks stored before the
    consumer joined: unknown). ``restored_blocks``: stored while already cached (a hit
    reported in full mode, or the same prefix computed twice); ``cross_session_blocks``: of
    those, stored by a session other than the one that first stored the block (both session
    ids known). ``lost_batches``: the engine's event batches that could be neither received
    nor replayed in the interval, so its counts are lower bounds.

    The engine's events name no tenant and no request: nothing here is cross-tenant by
    itself (see docs/vllm.md, "KV cache events").
    """

    node: Id = "node-0"
    role: Role = "both"
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=1e9)]
    stored_blocks: Count
    removed_blocks: Count
    cleared: Count = 0
    unsalted_blocks: Count = 0
    salted_blocks: Count = 0
    restored_blocks: Count = 0
    cross_session_blocks: Count = 0
    lost_batches: Count = 0

    def __post_init__(self) -> None:
        if self.unsalted_blocks + self.salted_blocks > self.stored_blocks:
            raise ValueError("unsalted_blocks: unsalted + salted blocks exceed stored_blocks")
        if self.restored_blocks > self.stored_blocks:
            raise ValueError("restored_blocks: restored_blocks exceeds stored_blocks")
        if self.cross_session_blocks > self.restored_blocks:
            raise ValueError("cross_session_blocks: cross_session_blocks exceeds restored_blocks")


class SourceGap(Event, tag="source.gap", kw_only=True, frozen=True):
    """A source a producer watches from outside an engine gave nothing for ``silent_s``
    seconds while something says it should have (``cause``): sent *instead of* the interval's
    figures (``interval_s``), so that an interval nobody could observe is never stored as an
    interval in which nothing happened (zeros). Added within version 1.

    ``source``: ``kv_events`` (``kvwatch kv-events``: no batch from the engine's publisher)
    or ``metrics`` (``kvwatch scrape``: its /metrics failed). ``cause``: ``not_connected``
    (nothing accepts the subscriber's connection at the endpoint: no publisher binds there),
    ``other_topic`` (messages arrive, on another topic than the one subscribed),
    ``engine_down`` (the engine's own HTTP endpoint does not answer either),
    ``engine_served`` (the engine answers and its counters say it served ``requests``
    requests meanwhile, yet published nothing). ``reason``: the producer's one line for a
    person, naming the likely cause (no prompt text: endpoints, topics, counts).
    """

    node: Id = "node-0"
    source: SourceName
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=1e9)]
    silent_s: Annotated[float, msgspec.Meta(ge=0, le=1e10)]
    cause: GapCause
    requests: Count | None = None
    reason: Name


class CanaryHit(Event, tag="canary.hit", kw_only=True, frozen=True):
    """A canary (painted page pattern or planted text) found where it must not be."""

    node: Id = "node-0"
    detector: CanaryDetector
    reader_request_id: Id
    reader_tenant: Id
    canary_tenant: Id | None = None
    page_ids: PageIds = []

    @property
    def cross_tenant(self) -> bool:
        return crosses_tenants(self.reader_tenant, self.canary_tenant, unknown_is_foreign=True)


class ProbeDrops(Event, tag="probe.drops", kw_only=True, frozen=True):
    """Events a probe had to drop since its previous report, by reason. Never silent."""

    counts: dict[DropReason, Count]


class ProbeStopped(Event, tag="probe.stopped", kw_only=True, frozen=True):
    """A probe's last event: it shut down cleanly (``Probe.shutdown``). The collector stops
    expecting it: a stopped probe is not "silent". Sent by the probe itself, never by an
    adapter."""


AnyEvent = (
    EngineConfig
    | RequestAdmitted
    | RequestRejected
    | RequestFinished
    | PoolSample
    | KvTransfer
    | PageReuse
    | PageStaleRead
    | PrefixCacheHit
    | KvTurnover
    | SourceGap
    | CanaryHit
    | ProbeDrops
    | ProbeStopped
)

EVENT_TYPES: Final[tuple[type[Event], ...]] = (
    EngineConfig,
    RequestAdmitted,
    RequestRejected,
    RequestFinished,
    PoolSample,
    KvTransfer,
    PageReuse,
    PageStaleRead,
    PrefixCacheHit,
    KvTurnover,
    SourceGap,
    CanaryHit,
    ProbeDrops,
    ProbeStopped,
)
KINDS: Final[tuple[str, ...]] = tuple(str(t.__struct_config__.tag) for t in EVENT_TYPES)


def _names_a_request(field: str) -> bool:
    """Fields holding a request id: unique per request, so never cached as known-good."""
    return field.endswith("request_id") or field == "prompt_shared_with"


def _id_fields(t: type[Event]) -> tuple[Callable[[Event], Any], tuple[str, ...], tuple[str, ...]]:
    """(getter of the low-cardinality id values, their names, request-id fields) of a type."""
    hints = get_type_hints(t, include_extras=True)
    ids = [n for n in t.__struct_fields__ if hints[n] in (Id, Id | None)]
    repeating = tuple(n for n in ids if not _names_a_request(n))
    unique = tuple(n for n in ids if _names_a_request(n))
    # attrgetter of one name returns the value, of several a tuple: always make it a tuple.
    getter = attrgetter(*repeating, repeating[0]) if len(repeating) == 1 else attrgetter(*repeating)
    return getter, repeating, unique


_ID_FIELDS: Final = {t: _id_fields(t) for t in EVENT_TYPES}
_known_ids: set[tuple[Any, ...]] = set()
_KNOWN_IDS_MAX: Final = 65_536


def _check_ids(events: Sequence[Event]) -> list[FieldError]:
    """Check every id field against the id pattern. The low-cardinality ids of an event
    (probe, deployment, tenant, node) repeat across a batch: their tuple is cached once seen
    valid. Request ids are unique, so each is checked."""
    known = _known_ids
    if len(known) > _KNOWN_IDS_MAX:
        known.clear()
    match = _ID_RE.fullmatch
    errors: list[FieldError] = []
    for i, e in enumerate(events):
        getter, repeating, unique = _ID_FIELDS[type(e)]
        values = getter(e)
        if values not in known:
            bad = False
            for name, v in zip(repeating, values, strict=False):
                if v is not None and match(v) is None:
                    bad = True
                    errors.append(FieldError(i, name, f"{v!r} is not a valid id: {_ID_RULE}"))
            if not bad:
                known.add(values)
        for name in unique:
            v = getattr(e, name)
            if v is not None and match(v) is None:
                errors.append(FieldError(i, name, f"{v!r} is not a valid id: {_ID_RULE}"))
        cats = getattr(e, "data_categories", None)
        if cats:
            for j, c in enumerate(cats):
                if match(c) is None:
                    msg = f"{c!r} is not a valid category: {_ID_RULE}"
                    errors.append(FieldError(i, f"data_categories[{j}]", msg))
    return errors


# A JSON escape that decodes to a control character (\u0000-\u001f, \u007f, \n, \t, ...), or
# a raw DEL (valid inside a JSON string, unlike the other controls). Matching the raw body is
# a C-speed pre-check; only a match pays for scanning the decoded strings, which settles false
# alarms such as an escaped backslash followed by "n".
_CONTROL_ESCAPE = re.compile(rb"\\(?:u00[01][0-9a-fA-F]|u007[fF]|[nrtbf])|\x7f")
_CONTROL_CHAR = re.compile(r"[\x00-\x1f\x7f]")


def _may_hold_control(raw: bytes | msgspec.Raw) -> bool:
    """Whether ``raw`` JSON may decode to a control character. Most bodies hold no backslash
    and no DEL at all, which ``in`` (memchr) settles at memory speed: the regex alone, with no
    literal to skip to, stepped through every byte (13 ms of a 1.8 MB batch, measured)."""
    data = raw if isinstance(raw, bytes) else bytes(raw)
    return (b"\\" in data or b"\x7f" in data) and _CONTROL_ESCAPE.search(data) is not None


def _check_text(events: Sequence[Event]) -> list[FieldError]:
    """Refuse control characters in every string field (PostgreSQL cannot store NUL, and
    no label needs a newline). Only called when the body contains such an escape."""
    errors: list[FieldError] = []
    for i, e in enumerate(events):
        for name in e.__struct_fields__:
            v = getattr(e, name)
            values = v if isinstance(v, list) else [v]
            for j, item in enumerate(values):
                if isinstance(item, str) and _CONTROL_CHAR.search(item):
                    where = f"{name}[{j}]" if isinstance(v, list) else name
                    errors.append(FieldError(i, where, "control characters are not allowed"))
    return errors


def is_valid_id(value: str) -> bool:
    """The id rule every id field follows (probe, deployment, tenant, node, request)."""
    return 0 < len(value) <= ID_MAX and _ID_RE.fullmatch(value) is not None


def kind_of(event: Event) -> str:
    return str(event.__struct_config__.tag)


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem in a batch: which event (``index``; None for the body itself), which
    field (a dotted path inside that event; None when it is the whole event), and why."""

    index: int | None
    field: str | None
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "field": self.field, "message": self.message}


class DecodeError(ProbeError, ValueError):
    """A batch that cannot be accepted, with every problem found in it (the collector's
    ingest answers it as 422, listing ``errors``)."""

    def __init__(self, errors: Sequence[FieldError]):
        self.errors = list(errors)
        first = self.errors[0] if self.errors else None
        where = "" if first is None else _describe(first)
        more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        super().__init__(f"invalid event batch: {where}{more}")


def _describe(err: FieldError) -> str:
    parts = []
    if err.index is not None:
        parts.append(f"event {err.index}")
    if err.field:
        parts.append(f"field {err.field!r}")
    return (", ".join(parts) + ": " if parts else "") + err.message


_batch_decoder = msgspec.json.Decoder(list[AnyEvent])
_event_decoder = msgspec.json.Decoder(AnyEvent)
_raw_list_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_encoder = msgspec.json.Encoder()

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"(?:missing required|contains unknown) field `([^`]+)`")
_IDX = re.compile(r"^\[(\d+)\]")
# Cross-field checks in ``__post_init__`` start their message with the field they blame.
_BLAME = re.compile(r"^(?P<field>[a-z_]+): (?P<msg>.*)$", re.S)


def _field_error(index: int | None, exc: msgspec.MsgspecError) -> FieldError:
    """Turn msgspec's ``"<message> - at `$[3].seq`"`` into (index, field, message)."""
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any string
    message, path = m.group("msg"), m.group("path") or ""
    if index is None and (im := _IDX.match(path)):
        index, path = int(im.group(1)), path[im.end() :]
    field = path.lstrip(".") or None
    if (missing := _MISSING.search(message)) is not None:
        field = f"{field}.{missing.group(1)}" if field else missing.group(1)
    elif field is None and (blame := _BLAME.match(message)) is not None:
        field, message = blame.group("field"), blame.group("msg")
    return FieldError(index, field, message)


def decode_json_batch(body: bytes, *, max_events: int | None = None) -> list[Event]:
    """Decode a JSON array of events, validating every field.

    Raises :class:`DecodeError` naming every bad event's index and field. The common case (a
    valid batch) is one typed decode; only a bad batch pays for per-event diagnosis.
    """
    try:
        events = cast("list[Event]", _batch_decoder.decode(body))
    except msgspec.ValidationError:
        pass  # diagnose every event below
    except msgspec.DecodeError as exc:
        raise DecodeError([FieldError(None, None, f"malformed JSON: {exc}")]) from None
    except RecursionError:
        raise DecodeError([FieldError(None, None, "JSON nested too deeply")]) from None
    else:
        if max_events is not None and len(events) > max_events:
            raise BatchTooLarge(len(events), max_events)
        errors = _check_ids(events)
        if _may_hold_control(body):
            errors += _check_text(events)
        if errors:
            raise DecodeError(_distinct(errors))
        return events
    try:
        raws = _raw_list_decoder.decode(body)
    except msgspec.ValidationError:
        raise DecodeError([FieldError(None, None, "expected a JSON array of events")]) from None
    except msgspec.DecodeError as exc:
        # The typed pass can stop at a bad field before reaching malformed bytes later on.
        raise DecodeError([FieldError(None, None, f"malformed JSON: {exc}")]) from None
    except RecursionError:
        raise DecodeError([FieldError(None, None, "JSON nested too deeply")]) from None
    if max_events is not None and len(raws) > max_events:
        raise BatchTooLarge(len(raws), max_events)
    return _decode_each(raws, offset=0)


def _distinct(errors: list[FieldError]) -> list[FieldError]:
    """One error per (event, field), in event order."""
    seen: dict[tuple[int | None, str | None], FieldError] = {}
    for err in errors:
        seen.setdefault((err.index, err.field), err)
    return sorted(seen.values(), key=lambda e: (-1 if e.index is None else e.index, e.field or ""))


def decode_ndjson_batch(body: bytes, *, max_events: int | None = None) -> list[Event]:
    """Decode newline-delimited JSON events (one event per non-blank line)."""
    lines = [line for line in body.split(b"\n") if line.strip()]
    if max_events is not None and len(lines) > max_events:
        raise BatchTooLarge(len(lines), max_events)
    return _decode_each(lines, offset=0)


def _decode_each(items: Iterable[bytes | msgspec.Raw], *, offset: int) -> list[Event]:
    events: list[Event] = []
    errors: list[FieldError] = []
    for i, item in enumerate(items, start=offset):
        try:
            event = _event_decoder.decode(item)
        except msgspec.ValidationError as exc:
            errors.append(_field_error(i, exc))
        except msgspec.DecodeError as exc:
            errors.append(FieldError(i, None, f"malformed JSON: {exc}"))
        except RecursionError:
            errors.append(FieldError(i, None, "JSON nested too deeply"))
        else:
            events.append(event)
            found = _check_ids([event])
            if _may_hold_control(item):
                found += _check_text([event])
            errors += [replace(err, index=i) for err in found]
    if errors:
        raise DecodeError(_distinct(errors))
    return events


def decode_event(data: bytes) -> Event:
    """Decode one event (tests, spool replay)."""
    return _decode_each([data], offset=0)[0]


E = TypeVar("E", bound=Event)


def _has_control(value: Any) -> bool:
    if isinstance(value, str):
        return _CONTROL_CHAR.search(value) is not None
    return isinstance(value, list) and any(_has_control(v) for v in value)


def convert_event(event_type: type[E], fields: dict[str, Any]) -> E:
    """One event of ``event_type`` from plain Python values (no ``kind``), validated exactly
    as :func:`decode_json_batch` validates a decoded one: types, ranges, lengths, ids and
    control characters. For producers that build events from another format (the
    collector's OTLP ingest); constructing a Struct directly checks none of that. (The
    concrete type, not the union: msgspec converts to one type some twenty times faster.)

    Raises :class:`DecodeError` (index None) naming the field."""
    try:
        event = msgspec.convert(fields, event_type)
    except msgspec.ValidationError as exc:
        raise DecodeError([_field_error(None, exc)]) from None
    errors = _check_ids([event])
    # the struct-wide scan only when some string holds a control character (rarely)
    if any(_has_control(v) for v in fields.values()):
        errors += _check_text([event])
    if errors:
        raise DecodeError([replace(err, index=None) for err in errors])
    return event


class BatchTooLarge(ProbeError, ValueError):
    """A batch with more events than the decoder was told to take (the collector's ingest
    answers it as 413)."""

    def __init__(self, count: int, limit: int):
        self.count, self.limit = count, limit
        super().__init__(f"batch holds {count} events; the limit is {limit}")


def encode_batch(events: Sequence[Event]) -> bytes:
    """Encode events as a JSON array (what producers send)."""
    return _encoder.encode(events)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_builtins(event: Event) -> dict[str, Any]:
    """The event as plain JSON-compatible values, ``kind`` included."""
    out: dict[str, Any] = msgspec.to_builtins(event)
    return out
