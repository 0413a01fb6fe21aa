"""POST /v1/traces: spans exported by the real OpenTelemetry SDK (its OTLP/HTTP protobuf and
JSON exporters) become request records, on SQLite and PostgreSQL, with the guarantees
POST /v1/events gives: the token and its scope, one transaction, idempotency, policies."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests import otlp_helpers as oh
from tests.conftest import Collector, make_token

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _requests(c: Collector, **params: Any) -> list[dict[str, Any]]:
    with c.client(c.admin) as h:
        r = h.get("/v1/requests", params={"limit": 1000, **params})
        assert r.status_code == 200, r.text
        return list(r.json()["items"])


def _spans_metric(c: Collector, result: str) -> float:
    text = httpx.get(f"{c.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(f'kvwatch_otlp_spans_total{{result="{result}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no kvwatch_otlp_spans_total{{result={result!r}}} in /metrics")


def _body(*spans_kw: dict[str, Any], service: str = "glm-prod") -> bytes:
    """An ExportTraceServiceRequest made by the SDK's own protobuf encoder."""
    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=oh.Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    t = provider.get_tracer("kvwatch-tests")
    for kw in spans_kw:
        oh.genai_span(t, **kw)
    provider.shutdown()
    return bytes(encode_spans(mem.get_finished_spans()).SerializeToString())


def _post(c: Collector, token: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{c.url}/v1/traces",
        content=body,
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/x-protobuf",
            **headers,
        },
        timeout=30,
    )


@pytest.mark.parametrize(("encoding", "zipped"), [("protobuf", False), ("protobuf", True),
                                                  ("json", False), ("json", True)])  # fmt: skip
def test_sdk_spans_become_request_records(
    collector: Collector, encoding: oh.Encoding, zipped: bool
) -> None:
    with oh.tracer(collector.url, collector.ingest, encoding, gzip=zipped) as t:
        cache = {"gen_ai.usage.cache_read.input_tokens": 1000}
        oh.genai_span(t, request_id="chatcmpl-1", prompt=1234, completion=56, **cache)
        reasons = {"gen_ai.response.finish_reasons": ["length"]}
        oh.genai_span(t, request_id="chatcmpl-2", old_names=True, prompt=700, completion=7,
                      tenant="globex", **reasons)  # fmt: skip
        oh.genai_span(t, request_id="chatcmpl-3", error=True, completion=None)
        with t.start_as_current_span("GET /healthz"):  # not a GenAI span
            pass
    rows = {r["request_id"]: r for r in _requests(collector)}
    assert set(rows) == {"chatcmpl-1", "chatcmpl-2", "chatcmpl-3"}
    one = rows["chatcmpl-1"]
    assert (one["deployment_id"], one["tenant"], one["model_id"]) == ("glm-prod", "acme", "glm-5.3")
    assert (one["prompt_tokens"], one["completion_tokens"], one["status"]) == (
        1234,
        56,
        "completed",
    )
    # the span's start and end, 1.5 s apart, are the request's first and last times
    assert one["first_ts"] < one["last_ts"]
    two = rows["chatcmpl-2"]  # vLLM's older names read the same
    assert (two["tenant"], two["prompt_tokens"], two["completion_tokens"]) == ("globex", 700, 7)
    assert two["status"] == "length"
    assert rows["chatcmpl-3"]["status"] == "error"
    assert _spans_metric(collector, "accepted") == 3
    assert _spans_metric(collector, "not_genai") == 1
    # what the probe bookkeeping says of the collector's own numbering of them
    with collector.client(collector.admin) as h:
        probes = [p for p in h.get("/v1/probes").json() if p["probe_id"].startswith("otlp.")]
    assert [p["accepted"] for p in probes] == [6]  # admitted + finished per span


def test_cached_token_names_of_other_instrumentations_read_the_same(
    collector: Collector,
) -> None:
    """Sentry's and pre-2026 OpenLLMetry's names for cached prompt tokens count as the
    current one does, and the tokens written to a cache are stored beside them; both are
    part of the prompt, so together they cannot exceed it."""
    body = _body(
        {"request_id": "semconv", "prompt": 900, "gen_ai.usage.cache_read.input_tokens": 500,
         "gen_ai.usage.cache_creation.input_tokens": 300},
        {"request_id": "sentry", "prompt": 900, "gen_ai.usage.input_tokens.cached": 400,
         "gen_ai.usage.input_tokens.cache_write": 50},
        {"request_id": "openllmetry", "prompt": 900,
         "gen_ai.usage.cache_read_input_tokens": 200,
         "gen_ai.usage.cache_creation_input_tokens": 100},
        {"request_id": "too-much", "prompt": 900, "gen_ai.usage.cache_read.input_tokens": 500,
         "gen_ai.usage.cache_creation.input_tokens": 401},
    )  # fmt: skip
    r = _post(collector, collector.ingest, body)
    assert r.status_code == 200, r.text
    partial = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert partial.rejected_spans == 1
    assert (
        "gen_ai.usage.cache_creation.input_tokens (401) plus "
        "gen_ai.usage.cache_read.input_tokens (500) is more than gen_ai.usage.input_tokens (900)"
    ) in partial.error_message
    rows = {r["request_id"]: r for r in _requests(collector)}
    assert {k: (v["cached_tokens"], v["cache_write_tokens"]) for k, v in rows.items()} == {
        "semconv": (500, 300),
        "sentry": (400, 50),
        "openllmetry": (200, 100),
    }


def test_an_exporters_retry_stores_nothing_twice(collector: Collector) -> None:
    body = _body({"request_id": "r-1"}, {"request_id": "r-2"})
    for _ in range(2):
        r = _post(collector, collector.ingest, body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/x-protobuf")
        resp = ExportTraceServiceResponse.FromString(r.content)
        assert not resp.HasField("partial_success")  # a full success
    assert sorted(r["request_id"] for r in _requests(collector)) == ["r-1", "r-2"]
    assert (_spans_metric(collector, "accepted"), _spans_metric(collector, "duplicate")) == (2, 2)
    # the same span twice in one export is one request
    once = _body({"request_id": "r-3"})
    twice = ExportTraceServiceRequest.FromString(once)
    twice.MergeFromString(once)
    r = _post(collector, collector.ingest, twice.SerializeToString())
    assert r.status_code == 200
    assert sorted(r["request_id"] for r in _requests(collector)) == ["r-1", "r-2", "r-3"]


def test_context_pressure_alerts_on_an_otlp_fed_request(collector: Collector) -> None:
    """The rule sees a span's prompt exactly as a probe's: 80% of the verified safe context
    warns, 100% is critical."""
    with collector.client(collector.admin) as h:
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": "glm-5.3",
                "passed": True,
                "verified_safe_context": 10_000,
            },
        )
        assert r.status_code == 201, r.text
    with oh.tracer(collector.url, collector.ingest, "protobuf") as t:
        oh.genai_span(t, request_id="fine", prompt=5_000)
        oh.genai_span(t, request_id="near", prompt=8_500, **{"http.route": "/v1/chat/completions"})
        oh.genai_span(t, request_id="over", prompt=12_000, **{"http.route": "/v1/chat/completions"})
    with collector.client(collector.admin) as h:
        alerts = h.get("/v1/alerts", params={"rule": "context_pressure"}).json()
    by_severity = {a["severity"]: a for a in alerts}
    assert set(by_severity) == {"warning", "critical"}, alerts
    for a in alerts:
        assert a["labels"]["deployment_id"] == "glm-prod"
        assert a["labels"]["model_id"] == "glm-5.3"
        assert a["labels"]["route"] == "/v1/chat/completions"
        assert a["labels"]["verified"] == "true"
        assert a["state"] == "firing"
    assert by_severity["critical"]["annotations"]["max_prompt_tokens"] == "12000"
    assert by_severity["warning"]["annotations"]["max_prompt_tokens"] == "8500"


def test_spans_that_cannot_be_stored_are_otlps_partial_success(collector: Collector) -> None:
    body = _body(
        {"request_id": "good"},
        {"request_id": "negative", "prompt": -5},
        {"request_id": "has space"},
        {"request_id": "float", "completion": 2.5},  # type: ignore[dict-item]
        {"request_id": "cache", "prompt": 10, "gen_ai.usage.cache_read.input_tokens": 11},
    )
    r = _post(collector, collector.ingest, body)
    assert r.status_code == 200, r.text
    partial = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert partial.rejected_spans == 4
    msg = partial.error_message
    assert "4 spans rejected" in msg
    assert "gen_ai.usage.input_tokens: -5 is negative" in msg
    assert "gen_ai.response.id" in msg and "'has space' is not a valid id" in msg
    assert "gen_ai.usage.output_tokens: expected a whole number of tokens" in msg
    assert "(and 1 more)" in msg  # three reasons quoted, the rest counted
    assert [r["request_id"] for r in _requests(collector)] == ["good"]
    assert _spans_metric(collector, "rejected") == 4
    # JSON answers in JSON, 64-bit integers as strings
    js = json.loads(oh_json_export(collector, collector.ingest, prompt=-1))
    assert js["partialSuccess"]["rejectedSpans"] == "1"


def oh_json_export(c: Collector, token: str, **span: Any) -> bytes:
    """One span in OTLP/JSON as the SDK's JSON exporter encodes it."""
    from opentelemetry.exporter.otlp.json.common._internal.trace_encoder import (
        encode_spans as encode_json,
    )

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=oh.Resource.create({"service.name": "glm-prod"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    oh.genai_span(provider.get_tracer("t"), request_id="json-1", **span)
    provider.shutdown()
    body = encode_json(mem.get_finished_spans()).to_json().encode()
    r = httpx.post(
        f"{c.url}/v1/traces",
        content=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.content


@pytest.mark.parametrize(
    ("headers", "body", "status", "says"),
    [
        ({"Content-Type": "text/plain"}, b"x", 415, "application/x-protobuf"),
        ({"Content-Encoding": "br"}, b"x", 415, "gzip"),
        ({}, b"\xff\xff\xff\xff", 400, "ExportTraceServiceRequest"),
        ({"Content-Encoding": "gzip"}, b"not gzip", 400, "gzip"),
        ({"Content-Type": "application/json"}, b'{"resourceSpans": 7}', 400, "resourceSpans"),
        ({"Content-Type": "application/json"}, b"{", 400, "malformed JSON"),
    ],
)
def test_bad_bodies_are_refused_naming_what_is_wrong(
    collector: Collector, headers: dict[str, str], body: bytes, status: int, says: str
) -> None:
    r = _post(collector, collector.ingest, body, **headers)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    assert _requests(collector) == []


def test_a_gzip_bomb_is_refused_before_it_inflates_past_the_limit(collector: Collector) -> None:
    bomb = gzip.compress(b"\0" * (4 * 1024 * 1024))  # the fixture's limit is 1 MiB
    assert len(bomb) < 10_000
    r = _post(collector, collector.ingest, bomb, **{"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "inflates past the limit" in r.text


def test_tokens_and_scope(collector: Collector) -> None:
    body = _body({"request_id": "r-1"}, service="glm-prod")
    assert _post(collector, "nope", body).status_code == 401
    assert _post(collector, collector.token("read"), body).status_code == 403
    other = collector.token("ingest", deployment_id="glm-staging")
    r = _post(collector, other, body)
    assert r.status_code == 403 and "glm-staging" in r.text
    assert _requests(collector) == []
    # The SDK's default service.name names no deployment: a scoped token's spans are its own,
    # an unscoped token's are refused as spans (partial success), not as a request.
    default = _body({"request_id": "r-2"}, service="unknown_service:python")
    assert _post(collector, other, default).status_code == 200
    (row,) = _requests(collector)
    assert (row["deployment_id"], row["request_id"]) == ("glm-staging", "r-2")
    r = _post(collector, collector.ingest, _body({"request_id": "r-3"}, service="unknown_service"))
    partial = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert partial.rejected_spans == 1 and "no deployment" in partial.error_message


def test_a_request_refused_by_the_new_name_limit_stores_nothing(collector: Collector) -> None:
    """429 (the token's new-deployment limit), as on /v1/events: all or nothing."""
    # The fixture's limit is the default, 20 new deployments an hour.
    token = collector.token("ingest")
    parts = [_body({"request_id": f"r-{i}"}, service=f"dep-{i}") for i in range(21)]
    req = ExportTraceServiceRequest()
    for p in parts:
        req.MergeFromString(p)
    r = _post(collector, token, req.SerializeToString())
    assert r.status_code == 429, r.text
    assert _requests(collector) == []


@pytest.fixture
def custom(db_url: str) -> Iterator[Collector]:
    """A collector told to read the tenant and deployment from attributes of its own."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings

    migrate.upgrade(db_url)
    settings = Settings(
        database_url=db_url,
        auto_migrate=False,
        otlp_tenant_attributes="org.id, tenant.id",  # type: ignore[arg-type]
        otlp_deployment_attributes="kvwatch.deployment",  # type: ignore[arg-type]
    )
    with serve_in_thread(create_app(settings)) as url:
        yield Collector(url, db_url, make_token(db_url, "admin"), make_token(db_url, "ingest"))


def test_tenant_and_deployment_attributes_are_configurable(custom: Collector) -> None:
    with oh.tracer(
        custom.url,
        custom.ingest,
        resource={"org.id": "initech", "kvwatch.deployment": "lab"},
        service="ignored-here",
    ) as t:
        oh.genai_span(t, request_id="by-resource", tenant=None)
        oh.genai_span(t, request_id="by-span-order", **{"org.id": "globex"})
        oh.genai_span(t, request_id="span-first", tenant="acme")
    rows = {r["request_id"]: r for r in _requests(custom)}
    assert rows["by-resource"]["tenant"] == "initech"
    # the span has both: the list's order decides
    assert rows["by-span-order"]["tenant"] == "globex"
    # a span's own attribute before its resource's, whatever the list's order
    assert rows["span-first"]["tenant"] == "acme"
    assert {r["deployment_id"] for r in rows.values()} == {"lab"}


def test_spans_naming_one_request_are_requests_sharing_its_prompt(collector: Collector) -> None:
    """vLLM sends one span per parallel-sampling child (n > 1), every one under the parent's
    request id: each is a request of its own that names the first, and a retry of any of them
    stores nothing more. A request a probe stored first is named likewise."""
    body = _body(*({"request_id": "cmpl-n3", "completion": c} for c in (5, 7, 9)))
    for _ in range(2):  # the second time: an exporter's retry
        assert _post(collector, collector.ingest, body).status_code == 200
    rows = _requests(collector, deployment_id="glm-prod")
    assert len(rows) == 3
    (parent,) = [r for r in rows if r["request_id"] == "cmpl-n3"]
    children = [r for r in rows if r is not parent]
    assert parent["prompt_shared_with"] is None
    assert all(r["request_id"].startswith("cmpl-n3.") for r in children)
    assert all(r["prompt_shared_with"] == "cmpl-n3" for r in children)
    assert sorted(r["completion_tokens"] for r in rows) == [5, 7, 9]
    assert (_spans_metric(collector, "accepted"), _spans_metric(collector, "duplicate")) == (3, 3)
    with collector.client(collector.ingest) as h:
        assert h.post("/v1/events", json=[f.as_json(f.admitted(1, "probed"))]).status_code == 200
    assert _post(collector, collector.ingest, _body({"request_id": "probed"})).status_code == 200
    probed = [r for r in _requests(collector) if r["request_id"].startswith("probed")]
    assert sorted(r["prompt_shared_with"] or "" for r in probed) == ["", "probed"]


# -- issue 40, low findings --------------------------------------------------------------------


def test_a_time_past_what_a_datetime_holds_is_a_rejected_span_not_a_lost_export(
    collector: Collector,
) -> None:
    """startTimeUnixNano of 10^23 had answered 500, losing the export's other spans."""
    from opentelemetry.exporter.otlp.json.common._internal.trace_encoder import (
        encode_spans as encode_json,
    )

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=oh.Resource.create({"service.name": "glm-prod"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    for rid in ("far-future", "fine"):
        oh.genai_span(provider.get_tracer("t"), request_id=rid)
    provider.shutdown()
    doc = json.loads(encode_json(mem.get_finished_spans()).to_json())
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    far = next(s for s in spans if "far-future" in json.dumps(s))
    far["startTimeUnixNano"] = str(10**23)
    r = httpx.post(
        f"{collector.url}/v1/traces",
        content=json.dumps(doc).encode(),
        headers={"Authorization": f"Bearer {collector.ingest}", "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    partial = r.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "1" and "between 1970 and 2200" in partial["errorMessage"]
    assert [x["request_id"] for x in _requests(collector)] == ["fine"]


def test_a_gzip_body_of_two_members_is_read_whole(collector: Collector) -> None:
    """RFC 1952 allows several members; the second had been dropped with a 200."""
    first = _body({"request_id": "member-1"})
    second = _body({"request_id": "member-2"})  # protobuf messages concatenated merge
    body = gzip.compress(first) + gzip.compress(second)
    r = _post(collector, collector.ingest, body, **{"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    assert sorted(x["request_id"] for x in _requests(collector)) == ["member-1", "member-2"]
    r = _post(
        collector, collector.ingest, gzip.compress(first) + b"junk", **{"Content-Encoding": "gzip"}
    )
    assert r.status_code == 400 and "gzip" in r.text


def test_the_ingest_routes_refuse_a_query_parameter_they_do_not_take(collector: Collector) -> None:
    for path, body, ctype in (
        ("/v1/traces", _body({"request_id": "q-1"}), "application/x-protobuf"),
        ("/v1/events", json.dumps([]).encode(), "application/json"),
    ):
        r = httpx.post(
            f"{collector.url}{path}?dry_run=1",
            content=body,
            headers={"Authorization": f"Bearer {collector.ingest}", "Content-Type": ctype},
        )
        assert r.status_code == 422, (path, r.text)
        assert "unknown parameter 'dry_run'" in r.json()["error"]["message"]
    assert _requests(collector) == []


def test_a_request_id_two_tenants_send_is_a_collision_never_a_link(collector: Collector) -> None:
    """A later span naming a stored request id was linked to it as sharing its prompt, even
    when it came from another tenant: one tenant's request tied to another's."""
    for tenant in ("acme", "globex"):
        body = _body({"request_id": "chat-1", "tenant": tenant})
        assert _post(collector, collector.ingest, body).status_code == 200
    assert _post(collector, collector.ingest, _body({"request_id": "chat-1"})).status_code == 200
    rows = {(r["tenant"], r["prompt_shared_with"]) for r in _requests(collector)}
    assert rows == {("acme", None), ("globex", None), ("acme", "chat-1")}, rows
