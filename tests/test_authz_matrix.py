"""Who may do what: every endpoint of the live OpenAPI document, by every kind of token, against
the answer this table expects; and tenant isolation, by every filter and every id.

The table below must name every operation the collector serves: a new endpoint that is not in
it fails ``test_every_operation_has_an_expectation`` until someone decides who may call it.
Two tenants' traffic (acme and globex) is seeded through ``POST /v1/events``, with a
cross-tenant stale read (globex read acme's pages), so an alert, an incident, a silence, a
verification and a breach report exist and every path parameter names a real object.
Runs over SQLite and PostgreSQL (the ``collector`` fixture's parametrisation).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from sqlalchemy import MetaData, select

from collector import models as m
from collector.db import Database
from engine_probe import events as ev
from tests import factories as f
from tests import oidc_world
from tests.conftest import SCHEDULE_ENDPOINT, SCHEDULE_KEYS, Collector, wait_rollups
from tests.oidc_provider import OidcProvider

ACME, GLOBEX = "acme", "globex"
DEP, MODEL, ROUTE = "glm-prod", "glm-5.3", "/v1/chat/completions"
PROBE = "probe-authz"

# The token kinds every operation is tried with. "read" is an operator's read token (no
# tenant); "read:acme" and "read:globex" are scoped to one tenant each. "operator",
# "auditor" and "person:acme" are people signed in at a real OIDC provider (their ID tokens),
# with those roles from their groups (tests/oidc_world.py).
KINDS = (
    "none",
    "wrong",
    "ingest",
    "read",
    "read:acme",
    "read:globex",
    "auditor",
    "person:acme",
    "operator",
    "admin",
)
TENANT_KINDS = {"read:acme": ACME, "read:globex": GLOBEX, "person:acme": ACME}
PEOPLE = {"operator": "olive", "auditor": "audrey", "person:acme": "tess"}

# ------------------------------------------------------------------ the expectation table

Expect = dict[str, int]


def _allow(status: int, *kinds: str) -> Expect:
    """``status`` for these kinds, 403 for every other token, 401 without a valid token."""
    out = {k: (status if k in kinds else 403) for k in KINDS}
    out["none"] = out["wrong"] = 401
    return out


PUBLIC: Expect = dict.fromkeys(KINDS, 200)  # no token needed; a bad one is ignored
# tenant-scoped reads filter to the tenant
READERS = ("read", "read:acme", "read:globex", "auditor", "person:acme", "operator", "admin")
# alerts and incidents name tenants: not for a tenant's token
OPERATORS = ("read", "auditor", "operator", "admin")
RESPONDERS = ("operator", "admin")  # acknowledge, silence, work incidents
REPORTERS = ("auditor", "operator", "admin")  # reports, notices, evidence, the audit check

EXPECTED: dict[tuple[str, str], Expect] = {
    ("POST", "/v1/events"): _allow(200, "ingest"),
    ("POST", "/v1/traces"): _allow(200, "ingest"),
    ("GET", "/v1/deployments"): _allow(200, *READERS),
    ("GET", "/v1/deployments/{deployment_id}/config-history"): _allow(200, *READERS),
    ("GET", "/v1/deployments/{deployment_id}/limits-card"): _allow(200, *READERS),
    ("GET", "/v1/requests"): _allow(200, *READERS),
    ("GET", "/v1/pool-samples"): _allow(200, *READERS),
    ("GET", "/v1/page-events"): _allow(200, *READERS),
    ("GET", "/v1/probes"): _allow(200, "admin"),
    ("GET", "/v1/alerts"): _allow(200, *OPERATORS),
    ("GET", "/v1/alerts/{alert_id}"): _allow(200, *OPERATORS),
    ("POST", "/v1/alerts/{alert_id}/ack"): _allow(200, *RESPONDERS),
    ("GET", "/v1/silences"): _allow(200, *OPERATORS),
    ("POST", "/v1/silences"): _allow(201, *RESPONDERS),
    ("DELETE", "/v1/silences/{silence_id}"): _allow(200, *RESPONDERS),
    # a tenant's token sees the incidents that concern it, its own side only
    ("GET", "/v1/incidents"): _allow(200, *READERS),
    ("GET", "/v1/incidents/{incident_id}"): _allow(200, *READERS),
    ("POST", "/v1/incidents/{incident_id}/close"): _allow(200, *RESPONDERS),
    # the on-call workflow: operators read the timeline, only admin acts. The matrix runs
    # the operations in the API's order, so the world's incident is closed (by .../close,
    # above) before these: past the token check, admin gets the refusal that acknowledging,
    # owning and linking are for open incidents; a note is taken on a closed one too.
    ("POST", "/v1/incidents/{incident_id}/ack"): _allow(409, *RESPONDERS),
    ("POST", "/v1/incidents/{incident_id}/owner"): _allow(409, *RESPONDERS),
    ("POST", "/v1/incidents/{incident_id}/notes"): _allow(200, *RESPONDERS),
    ("POST", "/v1/incidents/{incident_id}/links"): _allow(409, *RESPONDERS),
    ("DELETE", "/v1/incidents/{incident_id}/links/{alert_id}"): _allow(409, *RESPONDERS),
    ("GET", "/v1/incidents/{incident_id}/timeline"): _allow(200, *OPERATORS),
    ("GET", "/v1/incidents/{incident_id}/assessment"): _allow(200, *OPERATORS),
    ("GET", "/v1/incidents/{incident_id}/notice"): _allow(200, *REPORTERS),
    # the case register names tenants: operators read it, only admin changes it
    ("GET", "/v1/incidents/{incident_id}/case"): _allow(200, *OPERATORS),
    ("POST", "/v1/incidents/{incident_id}/facts"): _allow(200, "admin"),
    ("POST", "/v1/incidents/{incident_id}/decisions"): _allow(201, "admin"),
    ("POST", "/v1/incidents/{incident_id}/notifications"): _allow(201, "admin"),
    ("POST", "/v1/incidents/{incident_id}/notifications/steps"): _allow(200, "admin"),
    ("GET", "/v1/verifications"): _allow(200, "ingest", *READERS),
    # the limit in force: the gateway reads it with its ingest token
    ("GET", "/v1/limits"): _allow(200, "ingest", *READERS),
    ("POST", "/v1/verifications"): _allow(201, "ingest", "admin"),
    # a verification announces its run with the token it uploads with
    ("POST", "/v1/verification-runs"): _allow(201, "ingest", "admin"),
    ("POST", "/v1/verification-runs/{run_id}/end"): _allow(200, "ingest", "admin"),
    # the evidence names tenants: admin only
    ("GET", "/v1/verifications/{verification_id}"): _allow(200, *REPORTERS),
    ("GET", "/v1/verify-schedules"): _allow(200, "admin"),
    ("POST", "/v1/verify-schedules"): _allow(201, "admin"),
    ("DELETE", "/v1/verify-schedules/{schedule_id}"): _allow(200, "admin"),
    ("GET", "/v1/rules"): _allow(200, *OPERATORS),
    # a runbook names no tenant: any reader
    ("GET", "/v1/runbooks/{kind}"): _allow(200, *READERS),
    # every caller may ask who it is
    ("GET", "/v1/whoami"): _allow(200, "ingest", *READERS),
    ("GET", "/v1/tokens"): _allow(200, "admin"),
    ("POST", "/v1/tokens"): _allow(201, "admin"),
    ("POST", "/v1/tokens/{ref}/revoke"): _allow(200, "admin"),
    ("POST", "/v1/tokens/{ref}/rotate"): _allow(201, "admin"),
    ("POST", "/v1/reports"): _allow(201, *REPORTERS),
    ("GET", "/v1/reports"): _allow(200, *REPORTERS),
    ("GET", "/v1/reports/{report_id}"): _allow(200, *REPORTERS),
    ("GET", "/v1/reports/{report_id}/signature"): _allow(200, *REPORTERS),
    ("GET", "/v1/signing-keys"): _allow(200, *READERS),
    ("GET", "/v1/review"): _allow(200, *OPERATORS),
    ("GET", "/v1/inventory"): _allow(200, *READERS),
    ("GET", "/v1/audit/verify"): _allow(200, *REPORTERS),
    ("GET", "/v1/fleet"): _allow(200, *READERS),
    ("GET", "/v1/stats/prompt-tokens"): _allow(200, *READERS),
    ("GET", "/v1/stats/top-prompts"): _allow(200, *READERS),
    ("GET", "/v1/stats/page-events"): _allow(200, *READERS),
    ("GET", "/metrics"): PUBLIC,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
}

# ------------------------------------------------------------------------- the seeded world


@dataclass
class World:
    c: Collector
    now: datetime
    tokens: dict[str, str | None]
    alert_id: int
    incident_id: int
    silence_id: int
    report_id: str
    schedule_id: int
    verification_id: int
    run_id: int
    spare_tokens: dict[str, int]  # a token for the matrix to revoke, one to rotate
    request_ids: dict[str, set[str]]
    seq: int = 0
    clients: dict[str, httpx.Client] = field(default_factory=dict)

    def client(self, kind: str) -> httpx.Client:
        if kind not in self.clients:
            self.clients[kind] = self.c.client(self.tokens[kind])
        return self.clients[kind]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @property
    def since(self) -> str:
        return (self.now - timedelta(hours=2)).isoformat()

    @property
    def until(self) -> str:
        return (self.now + timedelta(minutes=5)).isoformat()


def _traffic(now: datetime) -> list[ev.Event]:
    """Both tenants' requests, then globex reading acme's stale pages (the incident)."""
    t = now - timedelta(minutes=30)

    def at(seq: int) -> dict[str, Any]:
        return {"probe": PROBE, "ts": t + timedelta(seconds=seq)}

    out: list[ev.Event] = [
        f.config(1, **at(1)),
        f.config(2, role="decode", node="decode-0", pool_tokens=2_000_000, **at(2)),
        f.pool(3, used=200_000, **at(3)),
    ]
    seq = 3
    for tenant in (ACME, GLOBEX):
        for i in range(3):
            rid = f"r-{tenant}-{i}"
            out.append(f.admitted(seq + 1, rid, tenant=tenant, prompt=5_000 + 1000 * i, **at(seq)))
            out.append(f.finished(seq + 2, rid, tenant=tenant, **at(seq)))
            seq += 2
    out += [
        f.rejected(seq + 1, f"r-{GLOBEX}-victim", tenant=GLOBEX, **at(seq)),
        f.rejected(seq + 2, f"r-{ACME}-long", tenant=ACME, **at(seq)),
        ev.KvTransfer(
            **f.base(seq + 3, **at(seq)),
            request_id=f"r-{GLOBEX}-victim",
            tenant=GLOBEX,
            from_node="prefill-0",
            to_node="decode-0",
            pages=3,
            prefill_rejected=True,
        ),
        f.stale_read(
            seq + 4,
            reader_request_id=f"r-{GLOBEX}-victim",
            reader_tenant=GLOBEX,
            previous_request_id=f"r-{ACME}-0",
            previous_tenant=ACME,
            **at(seq),
        ),
        ev.CanaryHit(
            **f.base(seq + 5, **at(seq)),
            detector="paint",
            reader_request_id=f"r-{GLOBEX}-victim",
            reader_tenant=GLOBEX,
            canary_tenant=ACME,
            page_ids=[3],
        ),
    ]
    return out


def _ok(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    return r.json()


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    """A real OIDC provider whose people (operator, auditor, acme's contact) the collector
    trusts; their ID tokens last the module."""
    with oidc_world.provider(tmp_path_factory.mktemp("oidc"), id_token_ttl_s=3600) as op:
        yield op


@pytest.fixture
def collector(
    db_url: str, provider: OidcProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Collector]:
    """conftest's collector, trusting ``provider``'s people too."""
    monkeypatch.setenv("VERIFY_KEYS_TEST", "acme=k-acme globex=k-globex")
    with oidc_world.collector(
        db_url,
        provider,
        tmp_path,
        max_batch_events=1000,
        max_body_bytes=1024 * 1024,
        verify_endpoints=["http://127.0.0.1:9"],
    ) as c:
        yield c


@pytest.fixture
def world(collector: Collector, provider: OidcProvider) -> Iterator[World]:
    now = datetime.now(UTC)
    tokens: dict[str, str | None] = {
        "none": None,
        "wrong": f"kvw_admin_{secrets.token_urlsafe(32)}",
        "ingest": collector.ingest,
        "read": collector.token("read"),
        "read:acme": collector.token("read", tenant=ACME),
        "read:globex": collector.token("read", tenant=GLOBEX),
        "admin": collector.admin,
    }
    for kind, login in PEOPLE.items():
        tokens[kind] = str(provider.login(oidc_world.CLIENT_ID, login)["id_token"])
    traffic = _traffic(now)
    with collector.client(collector.ingest) as ingest, collector.client(collector.admin) as admin:
        got = _ok(ingest.post("/v1/events", json=[f.as_json(e) for e in traffic]))
        assert got["accepted"] == len(traffic)
        alert, *_ = _ok(admin.get("/v1/alerts", params={"rule": "stale_page_read"}))
        incident, *_ = _ok(admin.get("/v1/incidents"))
        silence = _ok(
            admin.post(
                "/v1/silences",
                json={
                    "matchers": [{"name": "alertname", "value": "nothing_real"}],
                    "duration": "1h",
                    "comment": "seeded",
                },
            ),
            201,
        )
        verification = _ok(
            ingest.post(
                "/v1/verifications",
                json={
                    "deployment_id": DEP,
                    "model_id": MODEL,
                    "passed": True,
                    "verified_safe_context": 600_000,
                    "evidence": {"leak_pairs": [f"{GLOBEX}->{ACME}"]},
                },
            ),
            201,
        )
        report = _ok(
            admin.post("/v1/reports", json={"kind": "breach", "incident_id": incident["id"]}), 201
        )
        schedule = _ok(admin.post("/v1/verify-schedules", json=_schedule_body()), 201)
        # tenants of no traffic here: the run hides nothing the matrix reads
        run = _ok(ingest.post("/v1/verification-runs", json=_run_body()), 201)
        spares = {
            op: _ok(admin.post("/v1/tokens", json={"kind": "read"}), 201)["token"]["id"]
            for op in ("revoke", "rotate")
        }
    wait_rollups(collector.db_url)
    w = World(
        c=collector,
        now=now,
        tokens=tokens,
        alert_id=int(alert["id"]),
        incident_id=int(incident["id"]),
        silence_id=int(silence["id"]),
        report_id=str(report["report_id"]),
        schedule_id=int(schedule["id"]),
        verification_id=int(verification["id"]),
        run_id=int(run["id"]),
        spare_tokens=spares,
        seq=max(e.seq for e in traffic),
        request_ids={
            t: {
                e.request_id
                for e in traffic
                if isinstance(e, ev.RequestAdmitted | ev.RequestRejected) and e.tenant == t
            }
            for t in (ACME, GLOBEX)
        },
    )
    yield w
    for c in w.clients.values():
        c.close()


# ------------------------------------------------------------- operations of the live doc


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    doc: dict[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path

    def query_params(self) -> list[dict[str, Any]]:
        return [p for p in self.doc.get("parameters", []) if p.get("in") == "query"]


def live_operations(c: Collector) -> list[Operation]:
    with c.client(None) as anon:
        doc = _ok(anon.get("/openapi.json"))
    return [
        Operation(method.upper(), path, op)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]


def _schedule_body() -> dict[str, Any]:
    return {
        "endpoint": SCHEDULE_ENDPOINT,
        "model_id": MODEL,
        "deployment_id": DEP,
        "every": "6h",
        "keys_from": SCHEDULE_KEYS,
    }


def _path(w: World, op: Operation) -> str:
    return op.path.format(
        deployment_id=DEP,
        alert_id=w.alert_id,
        incident_id=w.incident_id,
        silence_id=w.silence_id,
        report_id=w.report_id,
        schedule_id=w.schedule_id,
        verification_id=w.verification_id,
        run_id=w.run_id,
        kind="stale_page_read",
        ref=w.spare_tokens["rotate" if op.path.endswith("/rotate") else "revoke"],
    )


def _required_query(w: World, op: Operation) -> dict[str, str]:
    values = {"model_id": MODEL, "since": w.since, "until": w.until, "tenant": ACME}
    out = {}
    for p in op.query_params():
        if p.get("required"):
            assert p["name"] in values, f"{op.key}: no value for required {p['name']!r}"
            out[p["name"]] = values[p["name"]]
    return out


def _body(w: World, op: Operation) -> Any:
    """A valid body for each mutating operation, so an allowed token gets the real answer."""
    bodies: dict[tuple[str, str], Callable[[], Any]] = {
        ("POST", "/v1/events"): lambda: [
            f.as_json(f.pool(w.next_seq(), probe=PROBE, ts=w.now - timedelta(seconds=1)))
        ],
        ("POST", "/v1/traces"): lambda: _otlp_json(w),
        ("POST", "/v1/alerts/{alert_id}/ack"): lambda: {"comment": "authz matrix"},
        ("POST", "/v1/silences"): lambda: {
            "matchers": [{"name": "alertname", "value": "authz_matrix"}],
            "duration": "1h",
            "comment": "authz matrix",
        },
        ("POST", "/v1/incidents/{incident_id}/close"): lambda: {"reason": "authz matrix"},
        ("POST", "/v1/incidents/{incident_id}/ack"): lambda: {"by": "authz matrix"},
        ("POST", "/v1/incidents/{incident_id}/owner"): lambda: {"owner": "authz matrix"},
        ("POST", "/v1/incidents/{incident_id}/notes"): lambda: {"text": "authz matrix"},
        ("POST", "/v1/incidents/{incident_id}/links"): lambda: {"alert_id": w.alert_id},
        ("POST", "/v1/incidents/{incident_id}/facts"): lambda: {
            "field": "deadline_at",
            "at": (w.now + timedelta(days=3)).isoformat(),
            "why": "authz matrix",
        },
        ("POST", "/v1/incidents/{incident_id}/decisions"): lambda: {
            "kind": "other",
            "status": "open",
            "what": "authz matrix",
            "why": "authz matrix",
        },
        ("POST", "/v1/incidents/{incident_id}/notifications"): lambda: {"party": ACME},
        ("POST", "/v1/incidents/{incident_id}/notifications/steps"): lambda: {
            "notice_id": _prepared_notice(w),
            "step": "approve",
        },
        ("POST", "/v1/verifications"): lambda: {
            "deployment_id": DEP,
            "model_id": MODEL,
            "passed": True,
            "verified_safe_context": 600_000,
        },
        ("POST", "/v1/verification-runs"): _run_body,
        ("POST", "/v1/verification-runs/{run_id}/end"): lambda: None,
        ("POST", "/v1/reports"): lambda: {"kind": "breach", "incident_id": w.incident_id},
        ("POST", "/v1/verify-schedules"): _schedule_body,
        ("POST", "/v1/tokens"): lambda: {"kind": "read"},
        ("POST", "/v1/tokens/{ref}/revoke"): lambda: None,
        ("POST", "/v1/tokens/{ref}/rotate"): lambda: {"grace": "1h"},
    }
    if op.method in {"GET", "DELETE"}:
        return None
    assert op.key in bodies, f"no valid body for {op.key}: add one to _body()"
    return bodies[op.key]()


def _run_body() -> dict[str, Any]:
    return {"deployment_id": DEP, "tenants": ["authz-verifier-a", "authz-verifier-b"]}


def _prepared_notice(w: World) -> str:
    """A notice just prepared (by admin), for a step to approve: with a measure recorded,
    so that it is not a draft (a draft is not approved)."""
    measure = {"kind": "containment", "status": "done", "what": "refused", "why": "stop it"}
    r = w.client("admin").post(f"/v1/incidents/{w.incident_id}/decisions", json=measure)
    assert r.status_code == 201, r.text
    r = w.client("admin").post(f"/v1/incidents/{w.incident_id}/notifications", json={"party": ACME})
    assert r.status_code == 201, r.text
    return str(r.json()["notice_id"])


def _otlp_json(w: World) -> dict[str, Any]:
    """One GenAI span of DEP as OTLP/JSON (its request id fresh each call)."""
    start = int((w.now - timedelta(seconds=2)).timestamp() * 1e9)
    seq = w.next_seq()

    def kv(key: str, value: dict[str, Any]) -> dict[str, Any]:
        return {"key": key, "value": value}

    span = {
        "traceId": f"{seq:032x}",
        "spanId": f"{seq:016x}",
        "name": "chat",
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + 10**9),
        "attributes": [
            kv("gen_ai.request.model", {"stringValue": MODEL}),
            kv("gen_ai.usage.input_tokens", {"intValue": "100"}),
            kv("gen_ai.usage.output_tokens", {"intValue": "10"}),
            kv("tenant.id", {"stringValue": ACME}),
        ],
    }
    resource = {"attributes": [kv("service.name", {"stringValue": DEP})]}
    return {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]}


def _call(
    w: World, kind: str, op: Operation, query: dict[str, str] | None = None
) -> httpx.Response:
    body = _body(w, op)
    return w.client(kind).request(
        op.method,
        _path(w, op),
        params={**_required_query(w, op), **(query or {})},
        **({} if body is None else {"json": body}),
    )


def _error_shape(r: httpx.Response) -> str:
    """The error code of a JSON error body, after checking it has the documented shape."""
    doc = r.json()
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) == {"code", "message", "details"}, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"], doc
    return str(doc["error"]["code"])


# --------------------------------------------------------------------------------- tests


def test_every_operation_has_an_expectation(collector: Collector) -> None:
    live = {op.key for op in live_operations(collector)}
    missing = sorted(live - set(EXPECTED))
    stale = sorted(set(EXPECTED) - live)
    assert not missing, f"operations with no row in EXPECTED (who may call them?): {missing}"
    assert not stale, f"rows in EXPECTED for operations the collector no longer serves: {stale}"


def test_authorisation_matrix(world: World) -> None:
    """Every operation with every token kind; the allowed calls carry valid bodies, so an allowed
    mutation really happens (admin goes last, after everyone else was turned away)."""
    ops = live_operations(world.c)
    wrong: list[str] = []
    for kind in KINDS:
        for op in ops:
            expected = EXPECTED.get(op.key, {}).get(kind)
            r = _call(world, kind, op)
            if r.status_code != expected:
                got = f"{r.status_code}, expected {expected}: {r.text[:300]}"
                wrong.append(f"{kind:12} {op.method} {op.path}: {got}")
                continue
            if r.status_code in (401, 403):
                code = _error_shape(r)
                assert code == {401: "unauthorized", 403: "forbidden"}[r.status_code], r.text
    assert not wrong, "authorisation answers differ from the table:\n" + "\n".join(wrong)


def _enum_values(schema: dict[str, Any]) -> list[Any]:
    if "enum" in schema:
        return list(schema["enum"])
    return [v for sub in schema.get("anyOf", []) for v in _enum_values(sub)]


def _filter_values(w: World, op: Operation, tenant: str, other: str) -> list[dict[str, str]]:
    """Every filter of ``op`` on its own, with values that name seeded objects (and, for
    ``tenant``, both tenants); the required ones always present."""
    kinds = ["page.stale_read", "kv.transfer", "canary.hit", "page.reuse"]
    candidates: dict[str, list[str]] = {
        "tenant": [tenant, other],
        "deployment_id": [DEP],
        "model_id": [MODEL],
        "route": [ROUTE],
        "node": ["prefill-0", "decode-0"],
        "since": [w.since],
        "until": [w.until],
        "kind": kinds,
        "min_prompt_tokens": ["0", "6000"],
        "limit": ["1"],
        "rule": ["stale_page_read"],
    }
    variants: list[dict[str, str]] = [{}]
    for p in op.query_params():
        name = p["name"]
        values = [str(v) for v in _enum_values(p.get("schema", {}))] or candidates.get(name, [])
        variants += [{name: v} for v in values]
    if any(p["name"] in {"since", "until"} for p in op.query_params()):
        variants.append({"since": w.since, "until": w.until})
    return variants


def _follow(w: World, kind: str, r: httpx.Response) -> Iterator[httpx.Response]:
    """``r`` and every further page its ``next_cursor`` leads to (bounded)."""
    yield r
    for _ in range(50):
        if r.status_code != 200 or "json" not in r.headers.get("content-type", ""):
            return
        doc = r.json()
        cursor = doc.get("next_cursor") if isinstance(doc, dict) else None
        if not cursor:
            return
        params = dict(r.request.url.params)
        params["cursor"] = cursor
        r = w.client(kind).get(r.request.url.path, params=params)
        yield r


@pytest.mark.parametrize("kind", sorted(TENANT_KINDS))
def test_a_tenant_token_never_sees_the_other_tenant(world: World, kind: str) -> None:
    """Every GET of the live document (ids of real alerts, incidents and reports included),
    with every filter it takes and every page a cursor leads to: no answer to acme's token
    names globex or any of its request ids, and the other way round."""
    tenant = TENANT_KINDS[kind]
    other = GLOBEX if tenant == ACME else ACME
    secrets_of_other = {other, *world.request_ids[other]}
    seen_ok = 0
    for op in live_operations(world.c):
        if op.method != "GET":
            continue
        for query in _filter_values(world, op, tenant, other):
            first = _call(world, kind, op, query)
            for r in _follow(world, kind, first):
                assert r.status_code < 500, f"{r.request.url}: {r.status_code} {r.text[:300]}"
                asked = unquote(str(r.request.url))  # an error may echo what was asked
                leaked = sorted(s for s in secrets_of_other if s in r.text and s not in asked)
                assert not leaked, (
                    f"{kind} GET {r.request.url} answered {r.status_code} naming {leaked}: "
                    f"{r.text[:500]}"
                )
                seen_ok += r.status_code == 200
    assert seen_ok > 50  # the walk really read data, not only refusals


@pytest.mark.parametrize("kind", sorted(TENANT_KINDS))
def test_a_tenant_token_is_refused_the_other_tenant_by_filter_and_id(
    world: World, kind: str
) -> None:
    tenant = TENANT_KINDS[kind]
    other = GLOBEX if tenant == ACME else ACME
    c = world.client(kind)
    # asking for the other tenant by name is refused, not silently narrowed
    for path in ("/v1/requests", "/v1/page-events"):
        r = c.get(path, params={"tenant": other})
        assert r.status_code == 403 and _error_shape(r) == "forbidden", r.text
    # alerts, assessments and reports name tenants: refused by list and by id, in every format
    refused = [
        "/v1/alerts",
        f"/v1/alerts/{world.alert_id}",
        f"/v1/incidents/{world.incident_id}/assessment",
        "/v1/reports",
        *(f"/v1/reports/{world.report_id}?format={x}" for x in ("json", "csv", "pdf")),
        "/v1/silences",
        "/v1/rules",
        "/v1/review",
    ]
    for path in refused:
        r = c.get(path)
        assert r.status_code == 403 and _error_shape(r) == "forbidden", (path, r.text)

    # ... while its own data is there: the checks above are not vacuous
    items = _ok(c.get("/v1/requests", params={"limit": 1000}))["items"]
    assert {x["request_id"] for x in items} == world.request_ids[tenant]
    assert {x["tenant"] for x in items} == {tenant}
    (stale,) = _ok(c.get("/v1/page-events", params={"kind": "page.stale_read"}))["items"]
    if tenant == GLOBEX:  # the reader: its own side, the exposed party redacted
        assert (stale["tenant"], stale["other_tenant"], stale["other_request_id"]) == (
            GLOBEX,
            None,
            None,
        )
    else:  # the exposed: told its pages were read, not by whom
        assert (stale["tenant"], stale["request_id"], stale["other_tenant"]) == (None, None, ACME)
    # the incident concerns both: each is told so, and sees its own side of it
    (inc,) = _ok(c.get("/v1/incidents"))
    side = "received" if tenant == GLOBEX else "exposed"
    assert (inc["id"], inc["concerns"]) == (world.incident_id, side)
    assert inc["summary"].startswith(
        "This incident concerns "
        + ("data your requests received" if side == "received" else "your data")
    )
    view = _ok(c.get(f"/v1/incidents/{world.incident_id}"))
    assert view["tenant"] == tenant and view["concerns"] == side
    key = "read_by_another" if side == "exposed" else "that_read_another"
    mine = view[f"your_requests_{key}"]
    assert {x["request_id"] for x in mine} <= world.request_ids[tenant] and mine
    window = {"since": world.since, "until": world.until}
    inventory = _ok(c.get("/v1/inventory", params={"model_id": MODEL, **window}))
    assert {row["tenant"] for row in inventory["rows"]} == {tenant}
    top = _ok(c.get("/v1/stats/top-prompts", params=window))["items"]
    assert {x["tenant"] for x in top} == {tenant}
    assert {x["request_id"] for x in top} == world.request_ids[tenant]


def _all_values(db: Database) -> Iterator[tuple[str, str, str]]:
    """(table, column, value as text) of every value in every table."""
    meta = MetaData()
    meta.reflect(bind=db.engine)
    with db.read() as conn:
        for table in meta.sorted_tables:
            for row in conn.execute(select(table)):
                for col, value in row._mapping.items():
                    if value is not None:
                        yield table.name, str(col), str(value)


def test_tokens_are_stored_hashed_only(world: World) -> None:
    """Every token has been used (the matrix above did the same); no table holds any of them,
    nor the secret part past the prefix that names a token in logs."""
    for kind in KINDS:
        world.client(kind).get("/v1/deployments")
    raw = {t for t in world.tokens.values() if t}
    tails = {t[16:] for t in raw}  # the prefix (kind and 6 characters) is a token's label
    db = Database(world.c.db_url)
    try:
        hits = [
            (table, col)
            for table, col, value in _all_values(db)
            if any(t in value for t in raw | tails)
        ]
        with db.read() as conn:
            stored = conn.execute(select(m.ApiToken.token_hash, m.ApiToken.prefix)).all()
    finally:
        db.dispose()
    assert hits == [], f"raw token material stored in {hits}"
    # the wrong one was never created; people's ID tokens are verified, never stored
    assert len(stored) >= len([t for t in raw if t.startswith("kvw_")]) - 1
    assert all(len(h) == 64 and len(p) <= 16 for h, p in stored)


def test_token_creation_and_use_are_in_the_audit_log(world: World) -> None:
    for kind in KINDS:  # every token is used (ingest and admin seeded the world too)
        world.client(kind).get("/v1/deployments")
    db = Database(world.c.db_url)
    try:
        with db.read() as conn:
            tokens = conn.execute(select(m.ApiToken.id)).scalars().all()
            entries = conn.execute(select(m.AuditEntry.action, m.AuditEntry.subject)).all()
    finally:
        db.dispose()
    # none and wrong are not tokens, nor are people; the two spares (for revoke and rotate)
    # are never used
    spares = set(world.spare_tokens.values())
    assert len(tokens) == len(KINDS) - 2 - len(PEOPLE) + len(spares)
    people = {s for a, s in entries if a == "person.use"}
    assert people == {f"person:{login}" for login in PEOPLE.values()}, people
    tokens = [t for t in tokens if t not in spares]
    created = {s for a, s in entries if a == "token.create"}
    assert {f"token:{t}" for t in tokens} <= created  # creation: audited today
    used = {s for a, s in entries if a == "token.use"}
    assert {f"token:{t}" for t in tokens} <= used, (
        f"a token's use is missing from the audit log; actions: {sorted({a for a, _ in entries})}"
    )
