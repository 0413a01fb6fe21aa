"""Fuzz the collector's HTTP API from its own OpenAPI document (schemathesis): no 5xx, no
status code the document does not list, no response that breaks its documented schema or
content type, and every JSON error in the ``{"error": {"code", "message", "details"}}`` shape.

One real collector on SQLite, served over HTTP on 127.0.0.1, seeded so that path parameters can
name real objects (a deployment, an alert, an incident, a silence, a report). The schema is
loaded from the running collector's ``/openapi.json``; every operation is fuzzed with an admin
token, valid (positive) and invalid (negative) data; ``POST /v1/events`` also with an ingest
token. Generation is derandomized so CI is repeatable; ``KVWATCH_FUZZ_RANDOM=1`` draws fresh
examples and ``KVWATCH_FUZZ_EXAMPLES=N`` changes how many per operation and mode.

The fuzz must never disarm itself: a revoke or rotate of its own admin (or ingest) token
would turn every later case into a 401 that still "conforms". A case whose ``ref`` could name
one of them (by id or name) is pointed at a spare token instead, the admin's own id is drawn
on purpose so that guard is exercised, and every run ends by checking both tokens still work.

The bugs this fuzzing found (ids beyond 64 bits answering 500, 400s the document did not
list) are pinned request by request by the tests at the end.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import Failure, FailureGroup

from collector import migrate
from collector.app import create_app
from collector.settings import Settings
from kvwatch.embedded import serve_in_thread
from tests import factories as f
from tests.conftest import make_token

EXAMPLES = int(os.environ.get("KVWATCH_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("KVWATCH_FUZZ_RANDOM", "") != "1"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
I64 = 2**63 - 1


def _operations_offline() -> list[str]:
    """Every operation's label ("GET /v1/alerts"), from an app that is built, never served,
    and never opens its database: pytest needs the list before any collector runs."""
    never_opened = Path(tempfile.gettempdir()) / "kvwatch-openapi-only.db"
    app = create_app(Settings(database_url=f"sqlite:///{never_opened}", auto_migrate=False))
    try:
        doc = app.openapi()
    finally:
        app.state.db.dispose()
    return [f"{method.upper()} {path}" for path, item in doc["paths"].items() for method in item]


OPERATIONS = _operations_offline()


@dataclass
class Live:
    url: str
    admin: str
    ingest: str
    schema: Any
    path_ids: dict[str, Any]
    own: dict[str, int]  # the fuzzing tokens' ids by name: never revoked nor rotated

    def names_a_fuzzer(self, ref: Any) -> bool:
        """Whether a generated ``ref`` could resolve to one of the fuzz's own tokens. Wider
        than the collector's lookup on purpose (any text ``int()`` reads, names stripped):
        a false alarm only sends the case to the spare token."""
        text = str(ref)
        return text.strip() in self.own or _as_int(text) in self.own.values()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    db_url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    app = create_app(
        Settings(
            database_url=db_url,
            max_batch_events=1000,
            max_body_bytes=1024 * 1024,
            auto_migrate=False,
            rollup_interval_s=0.2,
            token_cache_s=0.0,  # a revocation shows at once: _still_armed's check is exact
        )
    )
    server_log = logging.getLogger("uvicorn.error")
    one_line = _OneLineErrors()
    with serve_in_thread(app) as url:
        server_log.addFilter(one_line)
        try:
            admin = make_token(db_url, "admin", name=FUZZ_ADMIN)
            ingest = make_token(db_url, "ingest", name=FUZZ_INGEST)
            ids = _seed(url, admin, ingest)
            schema = schemathesis.openapi.from_url(
                f"{url}/openapi.json", headers={"Authorization": f"Bearer {admin}"}
            )
            yield Live(url, admin, ingest, schema, ids, _own_tokens(url, admin))
        finally:
            server_log.removeFilter(one_line)


FUZZ_ADMIN, FUZZ_INGEST = "fuzz-admin", "fuzz-ingest"


def _own_tokens(url: str, admin: str) -> dict[str, int]:
    auth = {"Authorization": f"Bearer {admin}"}
    listed = httpx.get(f"{url}/v1/tokens", headers=auth, timeout=30).json()
    own = {d["name"]: d["id"] for d in listed if d["name"] in (FUZZ_ADMIN, FUZZ_INGEST)}
    assert len(own) == 2, listed
    return own


def _still_armed(live: Live, label: str) -> None:
    """Both fuzzing tokens still work after ``label``'s run: otherwise every case after it
    would have been a 401, which conforms to the document and proves nothing."""
    for token, path in ((live.admin, "/v1/tokens"), (live.ingest, "/v1/verifications")):
        r = httpx.get(f"{live.url}{path}", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, f"after {label}, GET {path} -> {r.status_code} {r.text}"


class _OneLineErrors(logging.Filter):
    """Log the server's unhandled exceptions as one line, without the traceback. Python 3.11
    formats a traceback's carets with ``ast.parse``, whose recursion-depth bookkeeping is not
    thread-safe: the server thread formatting a 500's traceback while pytest formats a test's
    (an xfail's, say) can fail with ``SystemError: AST constructor recursion depth mismatch``
    and take the whole session down (INTERNALERROR). The fuzz reports every 500 itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage().strip()} {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
        return True


def _seed(url: str, admin: str, ingest: str) -> dict[str, Any]:
    """A deployment's traffic with a cross-tenant stale read (an alert and an incident), a
    silence, a verification, a breach report and a spare token; returns their ids by path
    parameter name."""
    t = datetime.now(UTC) - timedelta(minutes=10)
    events = [
        f.config(1, ts=t),
        f.pool(2, used=200_000, ts=t),
        f.admitted(3, "r-exposed", tenant="acme", prompt=5_000, ts=t),
        f.finished(4, "r-exposed", tenant="acme", ts=t),
        f.rejected(5, "r-victim", tenant="globex", ts=t),
        f.stale_read(6, ts=t),
    ]

    def ok(r: httpx.Response, status: int) -> Any:
        assert r.status_code == status, r.text
        return r.json()

    auth = {"Authorization": f"Bearer {admin}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as c:
        ok(
            c.post(
                "/v1/events",
                json=[f.as_json(e) for e in events],
                headers={"Authorization": f"Bearer {ingest}"},
            ),
            200,
        )
        alert, *_ = ok(c.get("/v1/alerts"), 200)
        incident, *_ = ok(c.get("/v1/incidents"), 200)
        silence = ok(
            c.post(
                "/v1/silences",
                json={
                    "matchers": [{"name": "alertname", "value": "x"}],
                    "duration": "1h",
                    "comment": "seed",
                },
            ),
            201,
        )
        verification = {"deployment_id": "glm-prod", "model_id": "glm-5.3", "passed": True}
        verification_id = ok(c.post("/v1/verifications", json=verification), 201)["id"]
        token = ok(c.post("/v1/tokens", json={"kind": "read", "name": "fuzzed"}), 201)
        report = ok(
            c.post("/v1/reports", json={"kind": "breach", "incident_id": incident["id"]}), 201
        )
    return {
        "deployment_id": "glm-prod",
        "alert_id": alert["id"],
        "incident_id": incident["id"],
        "silence_id": silence["id"],
        "report_id": report["report_id"],
        "verification_id": verification_id,
        "ref": token["token"]["id"],
    }


# ----------------------------------------------------------------------------- the checks


def _as_int(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def _error_code(text: str) -> str | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else None


def _shape_problem(status: int, content_type: str, path: str, text: str) -> str | None:
    """Every JSON error answer has the documented shape (``/readyz`` documents its own)."""
    if status < 400 or "json" not in content_type or path == "/readyz":
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return f"a JSON error body that does not parse: {text[:300]!r}"
    if not (
        isinstance(doc, dict)
        and set(doc) == {"error"}
        and isinstance(doc["error"], dict)
        and set(doc["error"]) == {"code", "message", "details"}
        and isinstance(doc["error"]["code"], str)
        and isinstance(doc["error"]["message"], str)
    ):
        return f'not the {{"error": {{"code", "message", "details"}}}} shape: {text[:300]!r}'
    return None


def _check(case: Any, headers: dict[str, str]) -> None:
    response = case.call(headers=headers, timeout=30)
    failures: list[Failure] = []
    try:
        case.validate_response(response, checks=CHECKS, headers=headers)
    except FailureGroup as group:
        failures = list(group.exceptions)
    unexplained = failures
    ctype = (response.headers.get("content-type") or [""])[0]
    path = urlsplit(response.request.url or "").path
    shape = _shape_problem(response.status_code, ctype, path, response.text_lossy())
    if unexplained or shape:
        what = [f"{type(x).__name__}: {x.title}: {x.message}" for x in unexplained]
        what += [shape] if shape else []
        raise AssertionError(
            f"{case.method} {case.formatted_path} query={case.query!r} body={case.body!r}\n"
            f"-> {response.status_code} {response.text_lossy()[:500]!r}\n" + "\n".join(what)
        )


def _fuzz(live: Live, label: str, token: str) -> None:
    op = live.schema.find_operation_by_label(label)
    assert op is not None, f"{label} is not in the live document"
    headers = {"Authorization": f"Bearer {token}"}
    names = {p.name for p in op.path_parameters}
    real = {k: v for k, v in live.path_ids.items() if k in names}
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategy = op.as_strategy(generation_mode=mode)
        if real and mode is GenerationMode.POSITIVE:  # half the cases name real objects
            strategies = [strategy, op.as_strategy(generation_mode=mode, path_parameters=real)]
            if "ref" in names:  # and, for the token routes, the fuzz's own admin on purpose
                own = {"ref": str(live.own[FUZZ_ADMIN])}
                strategies.append(op.as_strategy(generation_mode=mode, path_parameters=own))
            strategy = st.one_of(*strategies)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=DERANDOMIZE,
            database=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run(case: Any) -> None:
            if "ref" in case.path_parameters and live.names_a_fuzzer(case.path_parameters["ref"]):
                case.path_parameters = {**case.path_parameters, "ref": live.path_ids["ref"]}
            _check(case, headers)

        run()
    _still_armed(live, label)


# ----------------------------------------------------------------------------- the tests


def test_the_live_document_lists_every_fuzzed_operation(live: Live) -> None:
    with httpx.Client(base_url=live.url) as c:
        doc = c.get("/openapi.json").json()
    served = {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item}
    assert served == set(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzz_as_admin(live: Live, label: str) -> None:
    _fuzz(live, label, live.admin)


def test_fuzz_ingest_with_an_ingest_token(live: Live) -> None:
    _fuzz(live, "POST /v1/events", live.ingest)


def test_fuzz_otlp_traces_with_an_ingest_token(live: Live) -> None:
    """Arbitrary OTLP/JSON objects and protobuf bytes: a 400 naming what is wrong (or a 200
    whose partial success counts the spans refused), never a 5xx."""
    _fuzz(live, "POST /v1/traces", live.ingest)


# ----------------------------------------------- bugs it found, pinned request by request

BIG = 2**64


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/v1/alerts/{BIG}"),
        ("POST", f"/v1/alerts/{BIG}/ack"),
        ("DELETE", f"/v1/silences/{BIG}"),
        ("GET", f"/v1/incidents/{BIG}"),
        ("POST", f"/v1/incidents/{BIG}/close"),
        ("GET", f"/v1/alerts/-{BIG}"),
        ("GET", f"/v1/alerts?before_id={BIG}"),
    ],
)
def test_an_id_beyond_64_bits_is_a_clean_4xx(live: Live, method: str, path: str) -> None:
    body = {"reason": "fuzz"} if path.endswith("/close") else None
    # a fresh connection: after a 500 the server closes the one it answered on
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {live.admin}"}) as c:
        r = c.request(method, path, json=body)
    assert r.status_code in (404, 422), f"{method} {path} -> {r.status_code} {r.text[:200]}"
    assert _shape_problem(r.status_code, "json", path, r.text) is None


_UNDOCUMENTED_400 = [
    pytest.param(
        "GET",
        "/v1/requests",
        {"cursor": "not-a-cursor"},
        None,
        id="requests-bad-cursor",
    ),
    pytest.param(
        "GET",
        "/v1/page-events",
        {"cursor": "not-a-cursor"},
        None,
        id="page-events-bad-cursor",
    ),
    pytest.param(
        "GET",
        "/v1/pool-samples",
        {"since": "2026-08-27T12:00:00Z", "until": "2026-08-27T12:00:00Z"},
        None,
        id="pool-samples-empty-window",
    ),
    pytest.param(
        "GET",
        "/v1/requests",
        {"tenant": "a\x00b"},
        None,
        id="nul-in-query",
    ),
    pytest.param(
        "GET",
        "/v1/deployments/a%00b/config-history",  # the server decodes %00 to NUL
        {},
        None,
        id="nul-in-path",
    ),
    pytest.param(
        "POST",
        "/v1/events",
        {"x": "\x00"},
        None,
        id="nul-in-ingest-query",
    ),
    *(
        pytest.param(
            "POST",
            path,
            {},
            b'{"reason": "\xff"}',
            id=f"non-utf8-body-{path.strip('/').replace('/', '-')}",
        )
        for path in (
            "/v1/silences",
            "/v1/verifications",
            "/v1/reports",
            "/v1/incidents/1/close",
            "/v1/alerts/1/ack",
        )
    ),
]


@pytest.mark.parametrize(("method", "path", "query", "body"), _UNDOCUMENTED_400)
def test_every_answer_is_a_documented_status(
    live: Live, method: str, path: str, query: dict[str, str], body: bytes | None
) -> None:
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {live.admin}"}) as c:
        doc = c.get("/openapi.json").json()
        r = c.request(
            method,
            path,
            params=query,
            content=body,
            headers={"content-type": "application/json"} if body is not None else {},
        )
    assert 400 <= r.status_code < 500, r.text
    assert _shape_problem(r.status_code, "json", path, r.text) is None
    template = next(
        p for p in doc["paths"] if _matches(p, path) and method.lower() in doc["paths"][p]
    )
    documented = set(doc["paths"][template][method.lower()]["responses"])
    assert str(r.status_code) in documented, (
        f"{method} {path} {query} -> {r.status_code} {r.text[:200]}; documented: "
        f"{sorted(documented)}"
    )


def _matches(template: str, path: str) -> bool:
    a, b = template.split("/"), path.split("/")
    return len(a) == len(b) and all(x == y or x.startswith("{") for x, y in zip(a, b, strict=True))
