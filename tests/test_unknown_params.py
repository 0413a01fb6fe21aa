"""One rule for query parameters (issue 21, item 8): every endpoint behind a token refuses one
it does not declare with a 422 naming it, as inventory and review did while /v1/requests
silently ignored a misspelt filter."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import Collector

# no caller route (or its own rules: the producer routes read only their bodies)
OPEN = {"/metrics", "/healthz", "/readyz", "/v1/events", "/v1/traces"}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # parameters, not storage
def test_every_endpoint_names_an_unknown_query_parameter(collector: Collector) -> None:
    doc = httpx.get(f"{collector.url}/openapi.json").json()
    tried = 0
    with collector.client(collector.admin) as c:
        for path, item in doc["paths"].items():
            if path in OPEN:
                continue
            # values that match each path's converters (a report id is rpt_...)
            concrete = re.sub(r"\{[^}]+\}", "1", path.replace("{report_id}", "rpt_x"))
            for method in item:
                r = c.request(method.upper(), concrete, params={"zz_unknwon": "1"}, json={})
                assert r.status_code == 422, (method, path, r.status_code, r.text[:200])
                err = r.json()["error"]
                assert "zz_unknwon" in err["message"], (method, path, err)
                assert err["details"][0]["field"] == "zz_unknwon"
                tried += 1
        # a declared one still works
        assert c.get("/v1/requests", params={"limit": 5}).status_code == 200
    assert tried >= 35
