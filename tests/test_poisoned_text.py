"""Text that cannot be stored and served back is refused at the door, and text an older
version stored never takes a view down (issue 40, finding 1).

The attack: a verification upload, with an ingest token, whose evidence held a lone surrogate
(``\\ud800``). It was answered 500 *and stored*; from then on the admin alert list, the
limits card and ``kvwatch alerts list`` failed until someone edited the database. NUL in a
free-text field answered 500 on PostgreSQL."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pypdf
import pytest
from sqlalchemy import func, insert, select

from collector import models as m
from collector.db import Database
from tests.conftest import Collector

# (what the body's text holds, as JSON source; the field the 422 names; what it says)
POISONS = [
    ('"a\\ud800b"', "contains a lone surrogate (U+D800)"),
    ('"\\udfff"', "contains a lone surrogate (U+DFFF)"),
    ('"a\\u0000b"', "contains a NUL character"),
    ('"bell\\u0007"', "contains the control character U+0007"),
    ("NaN", "is not a finite number"),
    ("1e400", "is not a finite number"),
    ("123456789012345678901234567890", "is out of range"),
]


def _post(client: httpx.Client, path: str, source: str) -> httpx.Response:
    return client.post(path, content=source, headers={"content-type": "application/json"})


def _count(db_url: str, *tables: Any) -> list[int]:
    db = Database(db_url)
    try:
        with db.read() as conn:
            return [conn.execute(select(func.count()).select_from(t)).scalar_one() for t in tables]
    finally:
        db.dispose()


@pytest.mark.parametrize(("poison", "says"), POISONS)
def test_poison_anywhere_in_a_body_is_a_422_naming_the_field_and_nothing_is_stored(
    collector: Collector, poison: str, says: str
) -> None:
    ingest, admin = collector.client(collector.ingest), collector.client(collector.admin)
    tables = (m.Verification, m.Silence, m.Deployment, m.AuditEntry)
    before = _count(collector.db_url, *tables)
    cases = [
        (
            ingest,
            "/v1/verifications",
            '{"deployment_id":"d1","model_id":"m","passed":false,"verified_safe_context":100,'
            f'"evidence":{{"result":"fail","leaks":1,"leak_pairs":["ok",{poison}]}}}}',
            "evidence.leak_pairs.1",
        ),
        (
            admin,
            "/v1/silences",
            '{"matchers":[{"name":"deployment_id","value":"d1"}],"duration":"1h",'
            f'"comment":"fine","extra":{{"deep":[{{"x":{poison}}}]}}}}',
            "extra.deep.0.x",
        ),
    ]
    if not poison[0].isdigit() and poison not in ("NaN",):
        cases.append(
            (
                admin,
                "/v1/silences",
                '{"matchers":[{"name":"deployment_id","value":"d1"}],"duration":"1h",'
                f'"comment":{poison}}}',
                "comment",
            )
        )
    for client, path, body, field in cases:
        r = _post(client, path, body)
        assert r.status_code == 422, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["details"] == {"field": field}, err
        assert err["message"].startswith(f"{field}: {says}"), err
    assert _count(collector.db_url, *tables) == before


def test_a_key_holding_a_nul_is_named_and_a_clean_body_still_works(collector: Collector) -> None:
    admin = collector.client(collector.admin)
    r = _post(admin, "/v1/silences", '{"comment":"x","a\\u0000":1,"matchers":[]}')
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(
        "body: a key contains a NUL character"
    ), r.text
    # tab and newline are text: a multi-line comment is stored as written
    r = admin.post(
        "/v1/silences",
        json={
            "matchers": [{"name": "deployment_id", "value": "d1"}],
            "duration": "1h",
            "comment": "line one\n\tline two",
        },
    )
    assert r.status_code == 201, r.text
    assert r.json()["comment"] == "line one\n\tline two"


def _store_as_an_older_version_did(db_url: str) -> None:
    """A failed verification whose evidence holds lone surrogates, JSON-escaped as the
    collector stored them before the check."""
    evidence = (
        '{"result": "fail", "leaks": 1, "leak_pairs": ["acme\\ud800->globex"], '
        '"prefix_cache": {"verdict": "shared\\udfff", "shared_pairs": '
        '[{"owner": "\\ud800", "reader": "globex"}]}}'
    )
    assert json.loads(evidence)["leak_pairs"] == ["acme\ud800->globex"]
    now = datetime.now(UTC)
    db = Database(db_url)
    try:
        with db.write() as conn:
            conn.execute(
                insert(m.Verification).values(
                    deployment_id="d1",
                    model_id="m",
                    passed=False,
                    verified_safe_context=None,
                    verified_at=now,
                    created_at=now,
                    created_by="token:ingest#0",
                    evidence=evidence,
                )
            )
    finally:
        db.dispose()


def _wait_for(admin: httpx.Client, rule: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = admin.get("/v1/alerts", params={"state": "firing"})
        assert r.status_code == 200, r.text
        found = [a for a in r.json() if a["rule"] == rule]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no {rule} alert fired")


def test_rows_an_older_version_stored_are_shown_with_replacement_characters(
    collector: Collector,
) -> None:
    admin = collector.client(collector.admin)
    # a clean record first: the deployment exists, as it did when the old rows were written
    r = admin.post(
        "/v1/verifications",
        json={
            "deployment_id": "d1",
            "model_id": "m",
            "passed": True,
            "verified_safe_context": 100,
            "verified_at": (datetime.now(UTC) - timedelta(minutes=5)).isoformat(),
        },
    )
    assert r.status_code == 201, r.text
    _store_as_an_older_version_did(collector.db_url)
    alert = _wait_for(admin, "verification_failed")
    shown = json.dumps(alert, ensure_ascii=False)
    assert "acme\ufffd->globex" in shown, shown
    # every view that carries the text answers, with U+FFFD where the surrogate was
    for path in ("/v1/alerts", "/v1/verifications", "/v1/fleet", "/v1/limits"):
        assert admin.get(path).status_code == 200, path
    (latest, *_) = admin.get("/v1/verifications").json()
    one = admin.get(f"/v1/verifications/{latest['id']}")
    assert one.status_code == 200, one.text
    assert one.json()["evidence"]["leak_pairs"] == ["acme\ufffd->globex"]
    card = admin.get("/v1/deployments/d1/limits-card")
    assert card.status_code == 200, card.text
    md = admin.get("/v1/deployments/d1/limits-card", params={"format": "md"})
    assert md.status_code == 200, md.text
    pdf = admin.get("/v1/deployments/d1/limits-card", params={"format": "pdf"})
    assert pdf.status_code == 200 and pdf.content.startswith(b"%PDF")
    shown_pdf = "".join(
        p.extract_text() or "" for p in pypdf.PdfReader(io.BytesIO(pdf.content)).pages
    )
    assert "acme\ufffd->globex" in shown_pdf, shown_pdf[:2000]
    ack = admin.post(f"/v1/alerts/{alert['id']}/ack", json={"comment": "looking"})
    assert ack.status_code == 200, ack.text
    assert "acme\ufffd->globex" in json.dumps(ack.json(), ensure_ascii=False)
    # and the CLI, which reads the database itself
    env = os.environ | {"KVWATCH_DATABASE_URL": collector.db_url, "COLUMNS": "200"}
    env.pop("KVWATCH_DEBUG", None)
    for extra in (["--wide"], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "kvwatch.cli", "alerts", "list", *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "verification_failed" in done.stdout
        assert "Traceback" not in done.stderr


# -- every write route, fuzzed from the collector's own OpenAPI document ----------------------

_POISON_TEXT = ["a\ud800b", "\udfff", "a\x00b", "\x07", "x\x1by"]
FUZZ_EXAMPLES = int(os.environ.get("KVWATCH_FUZZ_EXAMPLES", "8"))


def _string_leaves(doc: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    if isinstance(doc, str):
        return [path]
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _string_leaves(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _string_leaves(v, (*path, i))]
    return []


_NOT_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def _clean(doc: Any) -> Any:
    """The generated body with the characters the test poisons with taken out, so that the
    one poisoned string is the only one refused."""
    if isinstance(doc, str):
        return _NOT_TEXT.sub("_", doc)
    if isinstance(doc, dict):
        return {_clean(k): _clean(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_clean(v) for v in doc]
    if isinstance(doc, int) and not isinstance(doc, bool) and abs(doc) >= 2**63:
        return 0
    if isinstance(doc, float) and not math.isfinite(doc):
        return 0.0
    return doc


def _poisoned(doc: Any, path: tuple[str | int, ...], poison: str) -> Any:
    if not path:
        return poison
    head, *rest = path
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[head] = _poisoned(doc[head], tuple(rest), poison)  # type: ignore[index]
    return copy


# written by the collector's own timer pass (each rule's health, once a pass), not by requests
_BACKGROUND = {"rule_health"}


def _all_counts(db_url: str) -> dict[str, int]:
    db = Database(db_url)
    try:
        with db.read() as conn:
            return {
                t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                for t in m.Base.metadata.sorted_tables
                if t.name not in _BACKGROUND
            }
    finally:
        db.dispose()


def _json_body_operations(schema: Any) -> list[Any]:
    out = []
    for result in schema.get_all_operations():
        op = result.ok()
        body = (op.definition.raw.get("requestBody") or {}).get("content") or {}
        if op.method.upper() != "GET" and "application/json" in body:
            out.append(op)
    return out


def test_poison_in_any_field_of_any_write_route_is_refused_and_nothing_is_stored(
    collector: Collector,
) -> None:
    """Every write route that takes JSON, bodies drawn from its own schema (schemathesis),
    one string in each replaced by text that cannot be stored: a 4xx (a 422 naming the
    field, for every route but the two ingest routes, which answer as they document), never
    a 5xx, and no table gains or loses a row."""
    import schemathesis

    auth = {"Authorization": f"Bearer {collector.admin}"}
    schema = schemathesis.openapi.from_url(f"{collector.url}/openapi.json", headers=auth)
    operations = _json_body_operations(schema)
    assert len(operations) >= 15, [o.label for o in operations]
    # each token's use is audited once (token.use), whatever the request: used before counting
    assert collector.client(collector.admin).get("/v1/alerts").status_code == 200
    assert collector.client(collector.ingest).get("/v1/verifications").status_code == 200
    before = _all_counts(collector.db_url)
    tried: dict[str, int] = {}
    for op in operations:
        _fuzz_one(collector, op, tried)
    assert _all_counts(collector.db_url) == before
    assert len(tried) >= 15, tried
    print(f"poison fuzz: {sum(tried.values())} requests over {len(tried)} write operations")


def _fuzz_one(collector: Collector, op: Any, tried: dict[str, int]) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    ingest = op.path in ("/v1/events", "/v1/traces")
    token = collector.ingest if op.path == "/v1/events" else collector.admin
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if True:

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(
            case=op.as_strategy(generation_mode=GenerationMode.POSITIVE),
            poison=st.sampled_from(_POISON_TEXT),
            pick=st.integers(min_value=0),
        )
        def run(case: Any, poison: str, pick: int) -> None:
            body = _clean(case.body)
            leaves = _string_leaves(body)
            if leaves:
                where = leaves[pick % len(leaves)]
                body = _poisoned(body, where, poison)
            elif isinstance(body, dict):
                where = ("note",)
                body = {**body, "note": poison}
            else:
                return  # nothing to carry text: nothing to poison
            source = json.dumps(body)  # escapes the surrogate and the controls, as a client would
            path = case.formatted_path
            r = httpx.request(
                op.method.upper(),
                f"{collector.url}{path}",
                content=source,
                headers=headers,
                params=case.query,
                timeout=30,
            )
            tried[op.label] = tried.get(op.label, 0) + 1
            assert 400 <= r.status_code < 500, (op.label, source, r.status_code, r.text)
            if not ingest:
                field = ".".join(str(p) for p in where)
                err = r.json()["error"]
                assert (r.status_code, err["details"]) == (422, {"field": field}), (
                    op.label,
                    source,
                    r.text,
                )

        run()
