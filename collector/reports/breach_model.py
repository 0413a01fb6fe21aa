"""The breach report as types: what :meth:`BreachService.build` returns and every renderer
(the JSON document, the CSV, the PDF, the tenant notices) reads.

The JSON document is a public format (``schema_version``; docs/reports.md): it is
:func:`to_document` of the report, and a stored or written document is read back with
:func:`from_document`. The types are frozen ``msgspec`` structs: the wire contract's own
library, which writes a report as JSON in field order (so the document's key order is the
types' field order) and reads a document back with every field checked, naming the one that
is wrong.

Times are ISO 8601 UTC text (:func:`collector.timefmt.iso`), as the document carries them.

Versions: 3 names tenants by one vocabulary, exposed (whose KV was read) and receiving (who
read it), in ``tenants`` and its rows. 2 also had ``victims``/``victim_count`` (the receiving
tenants) and rows' ``readers``/``sources``; :func:`from_document` reads a schema-2 document as
a schema-3 report (its ``schema_version`` stays 2). 1 listed every affected request in the
JSON and had no figures to recount its CSV against: it is not read (its JSON still verifies,
:func:`evidence_digest` needs no types). Schema 3 later added ``data_categories.population``
(a default, so the shape only grew): a document written before it read its data map's
population into ``data_subjects``, and :func:`from_document` reads that number as the
population, the persons concerned unknown.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from collector.errors import Conflict
from collector.reports.breach_rows import AffectedRequest
from collector.reports.stored import canonical
from policies.limits import LimitInForce

SCHEMA_VERSION = 3
READS = (2, 3)  # the schema versions from_document reads
# The evidence set: the document's sections hashed into evidence_sha256.
EVIDENCE_KEYS = (
    "scope",
    "affected_requests",
    "tenants",
    "data_categories",
    "stale_reads",
    "deployments",
    "cause",
)


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """What the report covers: an incident (``since``/``until``: its own window, an open side
    None) or a window of one model's requests."""

    incident_id: int | None
    model_id: str | None
    since: str | None
    until: str | None
    min_prompt_tokens: int | None
    deployment_id: str | None


class Incident(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    deployment_id: str
    title: str
    state: str
    cause_rule: str | None
    opened_at: str
    closed_at: str | None


class AffectedRequests(msgspec.Struct, frozen=True, kw_only=True):
    """Exact figures over every affected request (computed in SQL), and a sample of them."""

    count: int
    listed: int
    truncated: bool
    max_prompt_tokens: int | None
    by_tenant: dict[str, int]
    by_route: dict[str, int]
    by_deployment: dict[str, int]
    #: per status; ``lost``: the probe that admitted it went away before it finished
    #: (``collector.lost``). Reports stored before it was added have none.
    by_status: dict[str, int] = msgspec.field(default_factory=dict)
    sample: str  # what ``items`` holds, in words; the CSV lists all ``count`` of them
    items: tuple[AffectedRequest, ...]


class ExposedTenant(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant whose requests' KV another tenant's request read."""

    tenant: str
    stale_reads: int
    requests: int
    receiving_tenants: tuple[str, ...]  # who read it


class ReceivingTenant(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant whose requests read another tenant's KV (their answers may hold it)."""

    tenant: str
    stale_reads: int
    requests: int
    exposed_tenants: tuple[str, ...]  # whose KV it read


class Tenants(msgspec.Struct, frozen=True, kw_only=True):
    """Tenants are customers (controllers), not data subjects."""

    exposed: tuple[ExposedTenant, ...]
    receiving: tuple[ReceivingTenant, ...]
    exposed_count: int
    exposed_requests: int
    receiving_count: int
    receiving_requests: int
    involved_count: int


class DataCategories(msgspec.Struct, frozen=True, kw_only=True):
    affected: dict[str, int]
    exposed: dict[str, int]
    exposed_undeclared: int  # exposed requests that declare no category: their data is unknown
    special: tuple[str, ...]
    data_map: str | None
    #: persons the exposed data concerns: None (unknown) unless determinable; the data map's
    #: population is never this figure (a route serving 1,200 persons may carry one of them)
    data_subjects: int | None
    #: the declared population behind the exposed requests (the data map's ``population`` of
    #: every entry they match, summed), None unless it declares one for every exposed request.
    #: Documents written before it carried the population as ``data_subjects``: read back here.
    population: int | None = None


class StaleRead(msgspec.Struct, frozen=True, kw_only=True):
    """A request read KV pages it did not write; ``previous_*``: the request (and tenant) that
    last wrote them, None when none did since the pool was made."""

    ts: str
    deployment_id: str
    node: str | None
    reader_request_id: str | None
    reader_tenant: str | None
    previous_request_id: str | None
    previous_tenant: str | None
    page_count: int
    pages: tuple[int, ...]
    read_kind: str | None
    cross_tenant: bool


class StaleReads(msgspec.Struct, frozen=True, kw_only=True):
    count: int
    cross_tenant: int
    pages: int  # every page read, whatever it held: see :func:`page_split`
    items: tuple[StaleRead, ...]


class PageSplit(msgspec.Struct, frozen=True, kw_only=True):
    """The pages stale reads covered, by what they held: another tenant's data (a
    cross-tenant read), the reader's own tenant's, or no one's (never written since the pool
    was made)."""

    other_tenant: int
    same_tenant: int
    no_one: int


def page_split(sr: StaleReads) -> PageSplit:
    """The one count of what the pages read held, from the stale reads themselves (every
    stale read in scope is listed): the nature statement, the account and the PDF read it."""
    items = sr.items
    return PageSplit(
        other_tenant=sum(s.page_count for s in items if s.cross_tenant),
        same_tenant=sum(s.page_count for s in items if not s.cross_tenant and s.previous_tenant),
        no_one=sum(s.page_count for s in items if not s.cross_tenant and not s.previous_tenant),
    )


class ConfigEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One config a node of the deployment reported (configs are stored when they change)."""

    ts: str
    node: str
    role: str
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
    config_hash: str


class VerificationEntry(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    passed: bool
    verified_safe_context: int | None
    engine_version: str | None
    pool_capacity_tokens: int | None
    verified_at: str
    created_by: str


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """A deployment in scope: its config and verification history, oldest first, and the
    limit in force of each of the report's models there (``policies.limits``, as the rule,
    the card and the gateway have it). ``safe_context``, ``safe_context_source``, ``limit``
    (in words), ``advertised_context`` and ``min_pool_capacity_tokens`` are the strictest
    one's; None when none is known, and in a schema-2 report written before the limits in
    force, those of the rule it had then (``limit`` None, ``limits_in_force`` empty)."""

    deployment_id: str
    configs: tuple[ConfigEntry, ...]
    verifications: tuple[VerificationEntry, ...]
    safe_context: int | None
    safe_context_source: str | None
    limit: str | None
    limits_in_force: tuple[LimitInForce, ...]
    advertised_context: int | None
    min_pool_capacity_tokens: int | None


class CauseStep(msgspec.Struct, frozen=True, kw_only=True):
    at: str | None
    step: str  # pool_below_advertised, prefill_rejected, rejected_kv_transfer, stale_read…
    text: str


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    first_event_at: str | None
    last_event_at: str | None
    first_stale_read_at: str | None
    last_stale_read_at: str | None
    awareness_at: str | None
    deadline_at: str | None
    deadline_rule: str
    late: bool
    late_reason: str | None


class Point(msgspec.Struct, frozen=True, kw_only=True):
    ts: str
    value: float


class ChartWindow(msgspec.Struct, frozen=True, kw_only=True):
    from_: str = msgspec.field(name="from")
    until: str


class Series(msgspec.Struct, frozen=True, kw_only=True):
    """The charts' points: bucketed over the charts' time axis (``window``)."""

    since: str
    until: str
    prompt_tokens_max: tuple[Point, ...]
    pool_occupancy_max: tuple[Point, ...]
    stale_reads: tuple[Point, ...]
    window: ChartWindow
    bucket_seconds: float


FilledBy = Literal["data", "partial", "person"]


class ChecklistItem(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    article: str
    title: str
    value: str
    filled_by: FilledBy
    needs_person: bool
    note: str | None


class Art34(msgspec.Struct, frozen=True, kw_only=True):
    """Decision support for Art. 34: ``high_risk`` True, False or None (undetermined)."""

    high_risk: bool | None
    verdict: Literal["yes", "no", "undetermined"]
    communicate_to_subjects: bool | None
    reasons: tuple[str, ...]
    rule: str
    needs_person: bool
    note: str


class Notice(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant notice the incident implies: ``kind`` exposed, received (the tenant is a
    receiving tenant) or both, as the notice itself says."""

    tenant: str
    kind: Literal["exposed", "received", "both"]
    command: str


class BreachReport(msgspec.Struct, frozen=True, kw_only=True):
    """A breach assessment. Fields in the document's order; the evidence sections are
    :data:`EVIDENCE_KEYS`. A report from :meth:`BreachService.build` has ``account``,
    ``notices`` and ``evidence_sha256`` filled from its own sections."""

    mode: Literal["incident", "window"]
    scope: Scope
    incident: Incident | None
    model_ids: tuple[str, ...]
    affected_requests: AffectedRequests
    tenants: Tenants
    data_categories: DataCategories
    stale_reads: StaleReads
    deployments: tuple[Deployment, ...]
    cause: tuple[CauseStep, ...]
    timeline: Timeline
    series: Series
    report_id: str
    kind: Literal["breach"]
    generated_at: str
    schema_version: int
    checklist: tuple[ChecklistItem, ...]
    art34: Art34
    account: str
    notices: tuple[Notice, ...]
    involved_deployments: tuple[str, ...]
    evidence_sha256: str


class UnreadableReport(Conflict):
    """A stored or written breach report this kvwatch cannot read: a schema it does not read,
    or a document that is not a breach report of its schema."""


def to_document(report: BreachReport) -> dict[str, Any]:
    """The report as its JSON document: JSON types only (lists, not the structs' tuples),
    keys in the types' field order; a limit in force in its served form (``as_json``, as
    ``GET /v1/limits`` has it, which adds ``stale``, ``verified`` and ``text``)."""
    doc: dict[str, Any] = msgspec.to_builtins(report)
    for d, dep in zip(doc["deployments"], report.deployments, strict=True):
        d["limits_in_force"] = [lim.as_json() for lim in dep.limits_in_force]
    out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(doc))
    return out


# What a deployment section concludes rather than records: the limit in force, decided when
# the report is made (a verification passing its maximum age changes it with nothing new
# recorded). Schema 3 leaves it out of the evidence set, so the same evidence hashes the same
# whenever the report is generated; schema 2 hashed the rule it had then, and still does.
DEPLOYMENT_CONCLUSIONS = (
    "safe_context",
    "safe_context_source",
    "limit",
    "limits_in_force",
    "advertised_context",
    "min_pool_capacity_tokens",
)


def evidence_digest(doc: Mapping[str, Any]) -> str:
    """SHA-256 of a report document's evidence set, as it is written (any schema)."""
    evidence = {k: doc[k] for k in EVIDENCE_KEYS}
    if doc.get("schema_version", 1) >= 3:
        evidence["deployments"] = [
            {k: v for k, v in d.items() if k not in DEPLOYMENT_CONCLUSIONS}
            for d in doc["deployments"]
        ]
    return hashlib.sha256(canonical(evidence)).hexdigest()


def from_document(doc: Mapping[str, Any]) -> BreachReport:
    """A report's JSON document (as stored, or as ``kvwatch report breach`` wrote it) as a
    report: schema 3, or schema 2 read as 3. Raises :class:`UnreadableReport` naming the
    schema version, or the field that is wrong."""
    rid = doc.get("report_id", "?")
    version = doc.get("schema_version", 1)
    if doc.get("kind", "breach") != "breach":
        raise UnreadableReport(f"report {rid} is a {doc.get('kind')!r} report, not a breach one")
    if version not in READS:
        raise UnreadableReport(
            f"report {rid} is a schema-{version} breach report; this kvwatch reads schema "
            f"{', '.join(map(str, READS))}: generate a new report (its JSON still verifies "
            "with kvwatch report verify)",
            {"schema_version": version, "reads": list(READS)},
        )
    try:
        body = dict(doc)
        cats = doc.get("data_categories")
        if isinstance(cats, Mapping) and "population" not in cats:
            # written before the population was told apart: its data_subjects was the data
            # map's population, never a count of the persons concerned
            body["data_categories"] = {
                **cats,
                "population": cats.get("data_subjects"),
                "data_subjects": None,
            }
        if version == 2:  # in schema 3's words; written before the limits in force, or after
            body["tenants"] = _tenants_from_v2(doc["tenants"])
            body["deployments"] = [
                {"limit": None, "limits_in_force": [], **d} for d in doc["deployments"]
            ]
        return msgspec.convert(body, BreachReport)
    except (msgspec.ValidationError, KeyError, TypeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise UnreadableReport(
            f"report {rid} is not a readable schema-{version} breach report: {what}",
            {"schema_version": version},
        ) from None


def _tenants_from_v2(t: Mapping[str, Any]) -> dict[str, Any]:
    """Schema 2's tenants in schema 3's words: ``victims`` are the receiving tenants, a row's
    ``readers`` its receiving tenants and ``sources`` its exposed ones; ``victim_count`` was
    ``receiving_count`` twice."""
    return {
        "exposed": [{**_row(x), "receiving_tenants": x["readers"]} for x in t["exposed"]],
        "receiving": [{**_row(x), "exposed_tenants": x["sources"]} for x in t["victims"]],
        **{
            k: t[k]
            for k in (
                "exposed_count",
                "exposed_requests",
                "receiving_count",
                "receiving_requests",
                "involved_count",
            )
        },
    }


def _row(x: Mapping[str, Any]) -> dict[str, Any]:
    return {"tenant": x["tenant"], "stale_reads": x["stale_reads"], "requests": x["requests"]}


# What a breach report's signature states, section by section (docs/signing.md): the
# conclusion whole (awareness, deadline, lateness, Art. 34 answer and reasons, checklist,
# narrative, figures, notices) and, through evidence_sha256, the evidence sections. The
# sample rows (``items``) are evidence, covered by the hash, not restated one by one.
SIGNED_SECTIONS = (
    "report_id",
    "kind",
    "schema_version",
    "generated_at",
    "mode",
    "scope",
    "incident",
    "timeline",
    "art34",
    "checklist",
    "account",
    "affected_requests",
    "tenants",
    "data_categories",
    "stale_reads",
    "notices",
    "involved_deployments",
    "evidence_sha256",
)
_NOT_RESTATED = frozenset({"affected_requests.items", "stale_reads.items"})


def flatten(value: Any, prefix: str, out: dict[str, Any], skip: frozenset[str]) -> None:
    """``value`` as dotted paths (``timeline.deadline_at``, ``checklist.3.value``): one entry
    per scalar, an empty list or object as itself."""
    if prefix in skip:
        return
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}", out, skip)
    elif isinstance(value, list | tuple) and value:
        for i, v in enumerate(value):
            flatten(v, f"{prefix}.{i}", out, skip)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value


def signed_conclusions(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The one list of what a breach report's signature states: dotted JSON path -> value,
    over :data:`SIGNED_SECTIONS` of the document. A verifier computes the same from a file
    and names every path whose value is not the signed one."""
    out: dict[str, Any] = {}
    for key in SIGNED_SECTIONS:
        if key in doc:
            flatten(doc[key], key, out, _NOT_RESTATED)
    return out
