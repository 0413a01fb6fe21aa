"""POST /v1/events and the read API, through real HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import msgspec
from sqlalchemy import create_engine, func, select

from collector import models as m
from engine_probe import events as ev
from tests import factories as f
from tests.conftest import Collector


def post(c: Collector, events: list[ev.Event] | bytes, token: str | None = None, **kw: Any):
    body = events if not isinstance(events, list) else ev.encode_batch(events)
    headers = {"Content-Type": "application/json"} | kw.pop("headers", {})
    with c.client(token if token is not None else c.ingest) as client:
        return client.post("/v1/events", content=body, headers=headers, **kw)


def count(c: Collector, model: Any) -> int:
    eng = create_engine(c.db_url)
    try:
        with eng.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(model)).scalar_one())
    finally:
        eng.dispose()


def all_counts(c: Collector) -> dict[str, int]:
    return {
        t.__tablename__: count(c, t)
        for t in (m.Request, m.PoolSample, m.PageEvent, m.DeploymentConfig, m.Probe, m.Deployment)
    }


def workload() -> list[ev.Event]:
    return [
        f.config(1),
        f.admitted(2, "r1", "acme", 900_000, data_categories=["source_code"]),
        f.pool(3, used=600_000),
        f.admitted(4, "r2", "globex", 2_000),
        f.finished(5, "r1", "acme", 40),
        f.rejected(6, "r3", "initech", 700_000),
        f.stale_read(7),
        f.finished(8, "r2", "globex", 10),
    ]


def test_batch_is_stored_and_readable(collector: Collector) -> None:
    r = post(collector, workload())
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 8, "duplicates": 0, "gaps": []}
    with collector.client(collector.admin) as c:
        reqs = c.get("/v1/requests").json()["items"]
        by_id = {x["request_id"]: x for x in reqs}
        assert set(by_id) == {"r1", "r2", "r3"}
        assert by_id["r1"]["prompt_tokens"] == 900_000
        assert by_id["r1"]["completion_tokens"] == 40
        assert by_id["r1"]["status"] == "completed"
        assert by_id["r1"]["data_categories"] == ["source_code"]
        assert by_id["r3"]["status"] == "rejected"
        assert by_id["r3"]["reject_reason"] == "pool_exhausted"
        assert by_id["r3"]["limit_tokens"] == 681_280
        deps = c.get("/v1/deployments").json()
        assert [d["deployment_id"] for d in deps] == ["glm-prod"]
        cfg = deps[0]["config"][0]
        assert cfg["advertised_context"] == 1_048_576
        assert cfg["pool_capacity_tokens"] == 681_280
        pe = c.get("/v1/page-events").json()["items"]
        assert pe[0]["kind"] == "page.stale_read"
        assert pe[0]["tenant"] == "globex" and pe[0]["other_tenant"] == "acme"
        assert pe[0]["cross_tenant"] is True
        assert pe[0]["detail"]["page_ids"] == [3, 4, 5]


def test_retried_batch_stores_nothing_twice(collector: Collector) -> None:
    batch = workload()
    assert post(collector, batch).json()["accepted"] == 8
    before = all_counts(collector)
    again = post(collector, batch)
    assert again.status_code == 200
    assert again.json() == {"accepted": 0, "duplicates": 8, "gaps": []}
    assert all_counts(collector) == before
    # an overlapping batch stores only its new events
    r = post(collector, [*batch[5:], f.pool(9), f.pool(10)])
    assert r.json() == {"accepted": 2, "duplicates": 3, "gaps": []}
    assert count(collector, m.PoolSample) == 3


def test_request_events_merge_across_batches_in_any_order(collector: Collector) -> None:
    post(collector, [f.finished(5, "r9", "acme", 33, probe="decode")])
    post(collector, [f.admitted(1, "r9", "acme", 4242, probe="prefill")])
    with collector.client(collector.admin) as c:
        (row,) = c.get("/v1/requests").json()["items"]
    assert (row["prompt_tokens"], row["completion_tokens"], row["status"]) == (
        4242,
        33,
        "completed",
    )
    assert row["model_id"] == "glm-5.3"
    assert row["first_ts"] < row["last_ts"]


def test_the_limit_a_finished_request_was_held_to_is_stored(collector: Collector) -> None:
    """A gateway's request.finished carries the safe context it guarded the prompt with;
    the request row keeps it, as it keeps a rejection's."""
    post(collector, [f.finished(1, "r-guarded", "acme", 8, limit_tokens=2048, prompt_tokens=16)])
    with collector.client(collector.admin) as c:
        (row,) = c.get("/v1/requests").json()["items"]
    assert (row["limit_tokens"], row["prompt_tokens"]) == (2048, 16)


def test_shared_prompts_are_stored_and_never_cleared(collector: Collector) -> None:
    """vLLM's n=3 fan-out: children 1 and 2 name child 0. The admission sets the column;
    finishes, which never carry it, leave it alone whichever batch lands first, in one batch
    (the fold) or across batches (the upsert)."""
    c0, c1, c2 = f.parallel_sampling(1, "cmpl-7", 3, "acme", 3_000)
    batches = [
        [c0, c1, f.finished(4, "1_cmpl-7", "acme"), f.admitted(5, "solo", "globex", 500)],
        [f.finished(1, "2_cmpl-7", "acme", probe="decode")],  # before its admission
        [msgspec.structs.replace(c2, seq=6), f.finished(7, "0_cmpl-7", "acme")],
        [f.finished(2, "1_cmpl-7", "acme", 51, probe="decode")],  # after it was stored
    ]
    for batch in batches:
        r = post(collector, batch)
        assert r.status_code == 200, r.text
    with collector.client(collector.admin) as c:
        rows = {x["request_id"]: x for x in c.get("/v1/requests").json()["items"]}
    assert {k: v["prompt_shared_with"] for k, v in rows.items()} == {
        "0_cmpl-7": None,
        "1_cmpl-7": "0_cmpl-7",
        "2_cmpl-7": "0_cmpl-7",
        "solo": None,
    }
    assert {v["prompt_tokens"] for k, v in rows.items() if k != "solo"} == {3_000}
    assert rows["1_cmpl-7"]["completion_tokens"] == 51
    assert rows["2_cmpl-7"]["status"] == "completed"


def test_a_request_sharing_its_own_prompt_is_refused(collector: Collector) -> None:
    good = f.as_json(f.admitted(1, "r1"))
    bad = f.as_json(f.admitted(2, "r2")) | {"prompt_shared_with": "r2"}
    for body, ctype in (
        (json.dumps([good, bad], default=str).encode(), "application/json"),
        (
            b"\n".join(json.dumps(e, default=str).encode() for e in (good, bad)),
            "application/x-ndjson",
        ),
    ):
        r = post(collector, body, headers={"Content-Type": ctype})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_input"
        assert [(d["index"], d["field"]) for d in err["details"]] == [(1, "prompt_shared_with")]
        assert "prompt_shared_with" in err["message"] and "itself" in err["message"]
    assert all(v == 0 for v in all_counts(collector).values())


def test_seq_gaps_are_recorded_and_filled(collector: Collector) -> None:
    r = post(collector, [f.pool(1), f.pool(2), f.pool(6), f.pool(9)])
    assert r.json()["gaps"] == [[3, 5], [7, 8]]
    with collector.client(collector.admin) as c:
        (p,) = c.get("/v1/probes").json()
        assert p["missing"] == 5 and p["gaps"] == [[3, 5], [7, 8]]
        # a late event fills part of a gap; a resend of a stored one is a duplicate
        r = post(collector, [f.pool(4), f.pool(6)])
        assert r.json() == {"accepted": 1, "duplicates": 1, "gaps": []}
        (p,) = c.get("/v1/probes").json()
        assert p["gaps"] == [[3, 3], [5, 5], [7, 8]]
        metrics = c.get("/metrics").text
    assert 'kvwatch_probe_missing_events{deployment="glm-prod",probe="probe-a"} 4.0' in metrics


def test_ndjson_batches(collector: Collector) -> None:
    body = b"\n".join(ev.encode_event(e) for e in workload()[:3]) + b"\n"
    r = post(collector, body, headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 3


def _bad_batch() -> bytes:
    good = [f.as_json(e) for e in workload()]
    good[1]["prompt_tokens"] = "lots"  # wrong type
    del good[3]["tenant"]  # missing field
    good[4]["kind"] = "request.teleported"  # unknown kind
    good[6]["page_ids"] = [-1]  # out of range
    return json.dumps(good, default=str).encode()


def test_bad_events_are_named_and_nothing_is_stored(collector: Collector) -> None:
    r = post(collector, _bad_batch())
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_input"
    where = {(d["index"], d["field"]) for d in err["details"]}
    assert where == {(1, "prompt_tokens"), (3, "tenant"), (4, "kind"), (6, "page_ids[0]")}
    assert "event 1" in err["message"] and "prompt_tokens" in err["message"]
    assert all(v == 0 for v in all_counts(collector).values())


def test_text_fields_are_refused(collector: Collector) -> None:
    e = f.as_json(f.admitted(1, "r1"))
    e["prompt"] = "my secret source code"
    r = post(collector, json.dumps([e], default=str).encode())
    assert r.status_code == 422
    assert r.json()["error"]["details"][0]["field"] == "prompt"
    assert count(collector, m.Request) == 0


def test_semantic_checks(collector: Collector) -> None:
    from datetime import UTC, datetime, timedelta

    future = datetime.now(UTC) + timedelta(days=2)
    r = post(collector, [f.pool(1), f.pool(2, probe="other"), f.pool(3, ts=future)])
    assert r.status_code == 422
    assert {(d["index"], d["field"]) for d in r.json()["error"]["details"]} == {
        (1, "probe_id"),
        (2, "ts"),
    }
    r = post(collector, b"[]")
    assert r.status_code == 422 and "no events" in r.json()["error"]["message"]
    bad = f.as_json(f.pool(1, used=10, cap=20)) | {"used_tokens": 30}
    r = post(collector, json.dumps([bad], default=str).encode())
    assert r.status_code == 422
    assert r.json()["error"]["details"][0]["field"] == "used_tokens"
    assert post(collector, b"[{").status_code == 422
    assert post(collector, b'{"not": "a list"}').status_code == 422
    r = post(collector, b"[]", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert all(v == 0 for v in all_counts(collector).values())


def test_oversize_batches_get_413(collector: Collector) -> None:
    too_many = [f.pool(i) for i in range(1, 1002)]  # the fixture's limit is 1000 events
    r = post(collector, too_many)
    assert r.status_code == 413
    assert r.json()["error"]["details"] == {"limit_events": 1000}
    huge = b"[" + b" " * (1024 * 1024) + b"]"  # 1 MiB limit in the fixture
    r = post(collector, huge)
    assert r.status_code == 413
    # a chunked body without Content-Length is measured as it streams
    r = post(collector, iter([b"[", b" " * (1024 * 1024), b"]"]))  # type: ignore[arg-type]
    assert r.status_code == 413
    assert count(collector, m.PoolSample) == 0


def test_tokens(collector: Collector) -> None:
    batch = [f.pool(1)]
    assert post(collector, batch, token="").status_code == 401
    assert post(collector, batch, token="kvw_ingest_forged").status_code == 401
    r = post(collector, batch, headers={"Authorization": "Basic abc"})
    assert r.status_code == 401
    assert post(collector, batch, token=collector.admin).status_code == 403
    read = collector.token("read")
    assert post(collector, batch, token=read).status_code == 403
    assert count(collector, m.PoolSample) == 0
    # a probe's seq space belongs to the first token that wrote it
    assert post(collector, batch).status_code == 200
    other = collector.token("ingest")
    r = post(collector, [f.pool(2)], token=other)
    assert r.status_code == 403 and r.json()["error"]["details"] == {"field": "probe_id"}
    # a deployment-scoped ingest token writes only its deployment
    scoped = collector.token("ingest", deployment_id="llama-dev")
    r = post(collector, [f.pool(1, probe="p2", dep="glm-prod")], token=scoped)
    assert r.status_code == 403
    assert (
        post(collector, [f.pool(1, probe="p2", dep="llama-dev")], token=scoped).status_code == 200
    )
    # reads
    with collector.client(None) as c:
        r = c.get("/v1/requests")
        assert r.status_code == 401 and "items" not in r.text
    with collector.client(collector.ingest) as c:
        assert c.get("/v1/requests").status_code == 403
        assert c.get("/v1/deployments").status_code == 403


def test_tenant_scoped_read_tokens(collector: Collector) -> None:
    post(collector, workload())
    acme = collector.token("read", tenant="acme")
    with collector.client(acme) as c:
        items = c.get("/v1/requests").json()["items"]
        assert {x["tenant"] for x in items} == {"acme"}
        r = c.get("/v1/requests", params={"tenant": "globex"})
        assert r.status_code == 403 and "items" not in r.json()
        assert c.get("/v1/requests", params={"tenant": "acme"}).status_code == 200
        # page events: acme sees the stale read that exposed its pages, but not who read them
        (seen,) = c.get("/v1/page-events").json()["items"]
        assert seen["other_tenant"] == "acme" and seen["cross_tenant"] is True
        assert seen["tenant"] is None and seen["request_id"] is None
        assert c.get("/v1/probes").status_code == 403
    initech = collector.token("read", tenant="initech")
    with collector.client(initech) as c:
        assert [x["request_id"] for x in c.get("/v1/requests").json()["items"]] == ["r3"]
        assert c.get("/v1/page-events").json()["items"] == []


def test_request_filters_and_pages(collector: Collector) -> None:
    events = []
    for i in range(25):
        seq = i + 1
        events.append(
            f.admitted(
                seq,
                f"q{i:02d}",
                "acme" if i % 2 else "globex",
                1000 * i,
                model_id="glm-5.3" if i < 20 else "llama-3",
            )
        )
    post(collector, events)
    with collector.client(collector.admin) as c:
        seen: list[str] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 7}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/v1/requests", params=params).json()
            seen += [x["request_id"] for x in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert seen == [f"q{i:02d}" for i in reversed(range(25))]
        q = c.get("/v1/requests", params={"min_prompt_tokens": 20_000}).json()["items"]
        assert {x["request_id"] for x in q} == {f"q{i}" for i in range(20, 25)}
        q = c.get("/v1/requests", params={"model_id": "llama-3", "tenant": "acme"}).json()
        assert {x["request_id"] for x in q["items"]} == {"q21", "q23"}
        since = (f.T0.replace(second=10)).isoformat()
        q = c.get("/v1/requests", params={"since": since, "limit": 100}).json()["items"]
        assert len(q) == 16  # seq 10..25
        assert c.get("/v1/requests", params={"cursor": "garbage!"}).status_code == 400
        r = c.get("/v1/requests", params={"limit": 0})
        assert r.status_code == 422 and r.json()["error"]["details"][0]["field"] == "limit"
        assert c.get("/v1/requests", params={"since": "yesterday"}).status_code == 422


def test_pool_samples_are_downsampled(collector: Collector) -> None:
    from datetime import timedelta

    events = [f.pool(i, used=i * 10, ts=f.T0 + timedelta(seconds=i)) for i in range(1, 1001)]
    post(collector, events)
    with collector.client(collector.admin) as c:
        r = c.get(
            "/v1/pool-samples",
            params={
                "since": f.T0.isoformat(),
                "until": (f.T0 + timedelta(seconds=1000)).isoformat(),
                "max_points": 10,
            },
        ).json()
    assert r["bucket_seconds"] == 100
    items = r["items"]
    assert len(items) == 10
    assert sum(b["samples"] for b in items) == 999  # ts = T0+1000s lies at `until`, excluded
    assert items[-1]["used_max"] == 9990  # a spike survives downsampling
    assert items[0]["used_avg"] == sum(range(10, 1000, 10)) / 99


def test_metrics(collector: Collector) -> None:
    post(collector, workload())
    post(collector, workload())
    post(collector, _bad_batch())
    with collector.client(None) as c:
        text = c.get("/metrics").text
    assert 'kvwatch_ingest_events_total{result="accepted"} 8.0' in text
    assert 'kvwatch_ingest_events_total{result="duplicate"} 8.0' in text
    assert 'kvwatch_ingest_rejected_batches_total{reason="invalid_input"} 1.0' in text
    assert "kvwatch_ingest_batch_seconds_count 2.0" in text
    assert 'kvwatch_deployment_advertised_context_tokens{deployment="glm-prod"' in text
    used = 'kvwatch_deployment_pool_used_tokens{deployment="glm-prod",node="node-0",role="both"}'
    assert f"{used} 600000.0" in text


def test_health_and_openapi(collector: Collector) -> None:
    with collector.client(None) as c:
        assert c.get("/healthz").json()["status"] == "ok"
        assert c.get("/readyz").json()["status"] == "ok"
        doc = c.get("/openapi.json").json()
        assert c.get("/nope").json()["error"]["code"] == "not_found"
    for path in ("/v1/events", "/v1/requests", "/v1/deployments", "/v1/pool-samples"):
        assert path in doc["paths"]
    assert "PageStaleRead" in doc["components"]["schemas"]


def test_database_outage_is_503_never_500(tmp_path: Any) -> None:
    """With the database unreachable, producers get a retryable 503 and readiness fails."""
    import httpx

    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import free_port, serve_in_thread

    dead_pg = f"postgresql://postgres@127.0.0.1:{free_port()}/gone"
    app = create_app(Settings(database_url=dead_pg, auto_migrate=False))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post(
            "/v1/events",
            content=ev.encode_batch([f.pool(1)]),
            headers={"Authorization": "Bearer kvw_ingest_x"},
        )
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "unavailable"
        r = c.get("/v1/requests", headers={"Authorization": "Bearer kvw_read_x"})
        assert r.status_code == 503
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_request_rows_do_not_depend_on_arrival_order(collector: Collector) -> None:
    """The prefill node's rejection and the decode node's completion of the placeholder merge
    to the same row whichever batch lands first (the incident's two views of one request)."""
    import itertools
    import random

    def views(dep: str, rid: str) -> list[ev.Event]:
        return [
            f.admitted(1, rid, "acme", 700_000, dep=dep, probe=f"{dep}-gw",
                       route="/v1/chat/completions", data_categories=["pii"]),
            f.rejected(1, rid, "acme", 700_000, dep=dep, probe=f"{dep}-prefill"),
            f.finished(1, rid, "acme", 37, dep=dep, probe=f"{dep}-decode", prompt_tokens=1,
                       model_id="glm-5.3"),
        ]  # fmt: skip

    rnd = random.Random(7)
    orders = list(itertools.permutations(range(3)))
    rnd.shuffle(orders)
    for n, order in enumerate(orders):
        # each permutation gets its own deployment (and probes), so rows stay independent
        batch = views(f"dep{n}", "r1")
        for i in order:
            assert post(collector, [batch[i]]).status_code == 200
    with collector.client(collector.admin) as c:
        rows = c.get("/v1/requests", params={"limit": 100}).json()["items"]
    assert len(rows) == len(orders)
    # each deployment its own probes: the admitting probe, less its deployment's name
    shapes = {
        json.dumps(
            r | {"deployment_id": None, "probe_id": r["probe_id"].removeprefix(r["deployment_id"])},
            sort_keys=True,
        )
        for r in rows
    }
    assert len(shapes) == 1, shapes
    row = rows[0]
    assert row["prompt_tokens"] == 700_000  # not the placeholder's 1
    assert row["status"] == "completed" and row["reject_reason"] == "pool_exhausted"
    assert row["completion_tokens"] == 37 and row["route"] == "/v1/chat/completions"
    assert row["data_categories"] == ["pii"]


def test_a_requests_events_in_one_batch_merge_as_across_batches(collector: Collector) -> None:
    """The database merges one batch's rows of a request (SQLite's upsert row by row,
    PostgreSQL's grouping first) by the same rules as rows from different batches: every
    order of the views inside one batch gives the row the views give one batch each."""
    import itertools

    t0 = f.T0

    def views(dep: str, probe: str, seqs: tuple[int, ...]) -> list[ev.Event]:
        s = iter(seqs)
        return [
            f.admitted(next(s), "r1", "acme", 700_000, dep=dep, probe=probe, ts=t0,
                       route="/v1/chat/completions", data_categories=["pii", "health"],
                       max_tokens=512),
            f.rejected(next(s), "r1", "acme", 700_000, dep=dep, probe=probe,
                       ts=t0 + timedelta(seconds=1)),
            f.finished(next(s), "r1", "acme", 37, dep=dep, probe=probe, prompt_tokens=1,
                       model_id="glm-5.3", ts=t0 + timedelta(seconds=9), cached_tokens=1),
        ]  # fmt: skip

    # the reference: each view its own batch
    for e in views("apart", "apart-p", (1, 2, 3)):
        assert post(collector, [e]).status_code == 200
    orders = list(itertools.permutations(range(3)))
    for n, order in enumerate(orders):
        # seqs follow the order in the batch; each order its own deployment and probe
        seqs = tuple(1 + order.index(i) for i in range(3))
        batch = sorted(views(f"dep{n}", f"p{n}", seqs), key=lambda e: e.seq)
        assert post(collector, batch).status_code == 200
    with collector.client(collector.admin) as c:
        rows = c.get("/v1/requests", params={"limit": 100}).json()["items"]
    assert len(rows) == 1 + len(orders)
    # (each deployment its own probe)
    shapes = {
        json.dumps(r | {"deployment_id": None, "probe_id": None}, sort_keys=True) for r in rows
    }
    assert len(shapes) == 1, shapes
    row = rows[0]
    assert row["prompt_tokens"] == 700_000 and row["completion_tokens"] == 37
    assert row["status"] == "completed" and row["reject_reason"] == "pool_exhausted"
    assert row["max_tokens"] == 512 and row["cached_tokens"] == 1
    assert row["data_categories"] == ["health", "pii"]


def test_bad_input_never_gets_a_500(collector: Collector) -> None:
    nul = f.as_json(f.admitted(1, "r1")) | {"model_id": "glm\u0000"}
    r = post(collector, json.dumps([nul], default=str).encode())
    assert r.status_code == 422
    assert r.json()["error"]["details"][0]["field"] == "model_id"
    r = post(collector, b"[" * 50_000 + b"]" * 50_000)
    assert r.status_code == 422
    old = f.as_json(f.pool(1)) | {"ts": "1999-12-31T23:59:59Z"}
    r = post(collector, json.dumps([old]).encode())
    assert r.status_code == 422 and r.json()["error"]["details"][0]["field"] == "ts"
    with collector.client(collector.admin) as c:
        import base64

        huge = base64.urlsafe_b64encode(f"{2**64}:1".encode()).decode()
        assert c.get("/v1/requests", params={"cursor": huge}).status_code == 400
        assert c.get("/v1/requests", params={"min_prompt_tokens": 10**20}).status_code == 422
        r = c.get("/v1/pool-samples", params={"until": "0001-01-01T00:10:00Z"})
        assert r.status_code == 422 and "outside the range kvwatch accepts" in r.text
        for param in ("tenant", "deployment_id", "model_id", "route"):
            r = c.get("/v1/requests", params={param: "a\x00b"})
            assert r.status_code == 400, param
        assert c.get("/v1/deployments/a%00b/config-history").status_code == 400
    assert all(v == 0 for v in all_counts(collector).values())


def test_current_config_is_the_newest_event_not_the_last_arrival(collector: Collector) -> None:
    from datetime import timedelta

    post(collector, [f.config(5, pool_tokens=2_097_152, ts=f.T0 + timedelta(hours=1))])
    post(collector, [f.config(2, pool_tokens=681_280, ts=f.T0)])  # an old config, late
    with collector.client(collector.admin) as c:
        (dep,) = c.get("/v1/deployments").json()
        history = c.get("/v1/deployments/glm-prod/config-history").json()
        metrics = c.get("/metrics").text
    assert dep["config"][0]["pool_capacity_tokens"] == 2_097_152
    assert [h["pool_capacity_tokens"] for h in history] == [681_280, 2_097_152]
    assert 'kvwatch_deployment_pool_capacity_tokens{deployment="glm-prod"' in metrics
    assert "2.097152e+06" in metrics


def test_concurrent_probes_sharing_requests_neither_deadlock_nor_double(
    collector: Collector,
) -> None:
    """A prefill and a decode probe report the same requests at once, in opposite orders."""
    from concurrent.futures import ThreadPoolExecutor

    rids = [f"r{i:03d}" for i in range(200)]

    def send(probe: str, kind: str) -> list[int]:
        statuses = []
        order = rids if kind == "admitted" else list(reversed(rids))
        for b in range(0, len(order), 20):
            chunk = order[b : b + 20]
            if kind == "admitted":
                batch = [f.admitted(b + i + 1, r, probe=probe) for i, r in enumerate(chunk)]
            else:
                batch = [f.finished(b + i + 1, r, probe=probe) for i, r in enumerate(chunk)]
            statuses.append(post(collector, batch).status_code)
        return statuses

    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda a: send(*a),
                [("pre-a", "admitted"), ("dec-a", "finished"), ("pre-b", "admitted"),
                 ("dec-b", "finished")],
            )
        )  # fmt: skip
    assert all(s == 200 for r in results for s in r), results
    assert count(collector, m.Request) == 200
    with collector.client(collector.admin) as c:
        rows = c.get("/v1/requests", params={"limit": 1000}).json()["items"]
    assert {r["status"] for r in rows} == {"completed"}
    assert {r["prompt_tokens"] for r in rows} == {1000}
