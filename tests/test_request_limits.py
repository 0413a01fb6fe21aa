"""Scopes and sizes (issue 20, items 1 and 2): an ingest token reads back only its own
deployment's verifications and never their evidence; every endpoint that takes a body has a
limit (413, nothing stored); stored evidence is bounded at write time; lists carry
summaries, the evidence sits on the record's own path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from tests.conftest import Collector

LIMIT = 1024 * 1024  # KVWATCH_MAX_REQUEST_BYTES' default
EVIDENCE_LIMIT = 256 * 1024  # KVWATCH_MAX_EVIDENCE_BYTES' default


def _verification(dep: str, **evidence: Any) -> dict[str, Any]:
    return {
        "deployment_id": dep,
        "model_id": "glm-5.3",
        "passed": False,
        "evidence": {"result": "fail", "leak_pairs": ["globex->acme"], **evidence},
    }


def test_an_ingest_token_reads_only_its_deployment_and_no_evidence(
    collector: Collector,
) -> None:
    a_token = collector.token("ingest", deployment_id="dep-a")
    b_token = collector.token("ingest", deployment_id="dep-b")
    with (
        collector.client(a_token) as a,
        collector.client(b_token) as b,
        collector.client(collector.admin) as admin,
    ):
        ids = {}
        for http, dep in ((a, "dep-a"), (b, "dep-b")):
            r = http.post(
                "/v1/verifications", json=_verification(dep, smallest_leaking_prompt_tokens=900)
            )
            assert r.status_code == 201, r.text
            ids[dep] = r.json()["id"]
        mine = b.get("/v1/verifications").json()
        assert [v["deployment_id"] for v in mine] == ["dep-b"]
        assert "evidence" not in mine[0] and "globex" not in str(mine)
        # the one figure a gateway needs from the evidence is in the summary
        assert mine[0]["smallest_leaking_prompt_tokens"] == 900
        assert mine[0]["links"]["self"] == f"/v1/verifications/{ids['dep-b']}"
        r = b.get("/v1/verifications", params={"deployment_id": "dep-a"})
        assert r.status_code == 403 and "dep-b" in r.json()["error"]["message"], r.text
        for http in (a, b, collector.client(collector.token("read"))):
            r = http.get(f"/v1/verifications/{ids['dep-a']}")
            assert r.status_code == 403, r.text
        full = admin.get(f"/v1/verifications/{ids['dep-a']}").json()
        assert full["evidence"]["leak_pairs"] == ["globex->acme"]
        assert admin.get("/v1/verifications/999999").status_code == 404


def test_an_unscoped_ingest_token_lists_every_deployments_summaries(
    collector: Collector,
) -> None:
    """The documented choice (docs/using.md, docs/verify.md): an ingest token without a
    deployment may write verifications for every deployment, so it may list every
    deployment's summaries (what it could have uploaded itself: no evidence, no tenant
    names); a deployment-scoped one lists only its own. Neither reads a record's evidence."""
    scoped = collector.token("ingest", deployment_id="dep-b")
    with collector.client(collector.ingest) as anyone, collector.client(scoped) as b:
        ids = {}
        for dep in ("dep-a", "dep-b"):
            r = anyone.post("/v1/verifications", json=_verification(dep, tenant_keys="acme"))
            assert r.status_code == 201, r.text
            ids[dep] = r.json()["id"]
        listed = anyone.get("/v1/verifications").json()
        assert sorted(v["deployment_id"] for v in listed) == ["dep-a", "dep-b"]
        assert anyone.get("/v1/verifications", params={"deployment_id": "dep-a"}).status_code == 200
        text = str(listed)
        assert "evidence" not in {k for v in listed for k in v}
        assert "globex" not in text and "acme" not in text
        assert [v["deployment_id"] for v in b.get("/v1/verifications").json()] == ["dep-b"]
        for dep, vid in ids.items():
            for http in (anyone, b):
                r = http.get(f"/v1/verifications/{vid}")
                assert r.status_code == 403, (dep, r.text)


def _chunks(n: int) -> Iterator[bytes]:
    """A JSON body of ``n`` bytes sent without a Content-Length (chunked)."""
    yield b'{"reason": "'
    left = n - 14
    while left > 0:
        step = min(left, 64 * 1024)
        yield b"x" * step
        left -= step
    yield b'"}'


def test_every_body_has_a_limit_and_nothing_partial_is_stored(collector: Collector) -> None:
    with collector.client(collector.admin) as admin:
        before = admin.get("/v1/verifications").json()
        posts = [
            "/v1/verifications",
            "/v1/silences",
            "/v1/reports",
            "/v1/verify-schedules",
            "/v1/alerts/1/ack",
            "/v1/incidents/1/close",
            "/v1/tokens",
            "/v1/tokens/1/revoke",
            "/v1/tokens/1/rotate",
        ]
        tokens_before = admin.get("/v1/tokens").json()
        big = {"deployment_id": "d", "model_id": "m", "passed": True,
               "evidence": {"blob": "x" * (LIMIT + 10)}}  # fmt: skip
        for path in posts:
            r = admin.post(path, json=big)  # declared Content-Length over the limit
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["code"] == "payload_too_large" and str(LIMIT) in err["message"]
            assert "KVWATCH_MAX_REQUEST_BYTES" in err["message"]
            r = admin.post(  # no Content-Length: counted as it streams
                path,
                content=_chunks(LIMIT + 100),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
        assert admin.get("/v1/verifications").json() == before
        assert admin.get("/v1/tokens").json() == tokens_before
        # ... and every one of them says so in the OpenAPI document
        doc = admin.get("/openapi.json").json()
        for path in posts:
            template = next(t for t in doc["paths"] if _matches(t, path))
            assert "413" in doc["paths"][template]["post"]["responses"], template
        for template, item in doc["paths"].items():
            for method, op in item.items():
                if "requestBody" in op or method != "get":
                    assert "413" in op["responses"], (method, template)
        # a body under the limit still reaches its route
        r = admin.post(
            "/v1/silences",
            json={"matchers": [{"name": "a", "value": "b"}], "duration": "1h", "comment": "ok"},
        )
        assert r.status_code == 201, r.text


def _matches(template: str, path: str) -> bool:
    a, b = template.split("/"), path.split("/")
    return len(a) == len(b) and all(x == y or x.startswith("{") for x, y in zip(a, b, strict=True))


def test_stored_evidence_is_bounded_and_lists_stay_small(collector: Collector) -> None:
    with collector.client(collector.ingest) as ingest, collector.client(collector.admin) as admin:
        over = _verification("dep-a", blob="x" * EVIDENCE_LIMIT)
        r = ingest.post("/v1/verifications", json=over)
        assert r.status_code == 413, r.text
        assert "KVWATCH_MAX_EVIDENCE_BYTES" in r.json()["error"]["message"]
        assert r.json()["error"]["details"]["field"] == "evidence"
        assert admin.get("/v1/verifications").json() == []
        near = _verification("dep-a", blob="x" * (EVIDENCE_LIMIT - 1000))
        for _ in range(5):
            assert ingest.post("/v1/verifications", json=near).status_code == 201
        listed = admin.get("/v1/verifications")
        assert len(listed.json()) == 5 and len(listed.content) < 10_000
        assert all(v["evidence_bytes"] > EVIDENCE_LIMIT - 1100 for v in listed.json())
        one = admin.get(listed.json()[0]["links"]["self"])
        assert len(one.json()["evidence"]["blob"]) == EVIDENCE_LIMIT - 1000


def test_the_limit_is_a_setting(tmp_path: Any) -> None:
    """KVWATCH_MAX_REQUEST_BYTES moves it."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import serve_in_thread
    from tests.conftest import make_token

    db_url = f"sqlite:///{tmp_path / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, max_request_bytes=4096)
    with serve_in_thread(create_app(settings)) as url:
        token = make_token(db_url, "admin")
        body = {"matchers": [{"name": "a", "value": "b"}], "duration": "1h", "comment": "y" * 1500}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
            assert c.post("/v1/silences", json=body).status_code == 201
            body["matchers"] = [{"name": "a", "value": "v" * 900}] * 5
            r = c.post("/v1/silences", json=body)
            assert r.status_code == 413 and "4096" in r.json()["error"]["message"], r.text
