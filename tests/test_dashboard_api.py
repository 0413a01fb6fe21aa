"""The collector's dashboard endpoints (fleet, prompt-token statistics from rollups, top
prompts, page-event statistics, pool samples from rollups), against a real collector on
SQLite and PostgreSQL: every figure checked against what was ingested, tenant scoping, bad
input, and the rollups kept exact when a request's earliest event arrives late."""

from __future__ import annotations

import math
import random
from datetime import timedelta
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa

from collector import migrate
from collector import models as m
from collector.db import Database
from collector.rollups.buckets import (
    ALL_TENANTS,
    BINS_PER_OCTAVE,
    HOUR_US,
    bin_high,
    bin_low,
    bin_of,
)
from collector.rollups.refresh import RollupRefresher
from collector.rollups.stats import _Dist
from collector.timefmt import iso
from engine_probe import events as ev
from tests import factories as f
from tests.conftest import Collector, wait_rollups

MODEL = "glm-5.3"
CHAT, EMB = "/v1/chat/completions", "/v1/embeddings"
WINDOW = {"since": f.T0.isoformat(), "until": (f.T0 + timedelta(hours=2)).isoformat()}
SAFE = 600_000


def send(c: Collector, *events: Any) -> None:
    with c.client(c.ingest) as h:
        r = h.post("/v1/events", json=[f.as_json(e) for e in events])
    assert r.status_code == 200, r.text


def get(c: Collector, path: str, token: str | None = None, **params: Any) -> Any:
    with c.client(token or c.admin) as h:
        r = h.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


_SEEDED = [
    ("acme", CHAT, 1_000, 10),
    ("acme", CHAT, 470_000, 20),  # 78%: below the warn line
    ("acme", CHAT, 500_000, 30),  # 83%
    ("acme", EMB, 300, 40),
    ("globex", CHAT, 610_000, 50),  # over the safe context
    ("globex", CHAT, 90_000, 400),  # second bucket
    ("globex", CHAT, 120_000, 410),
]
T0_US = int(f.T0.timestamp() * 10**6)


def _seed(c: Collector) -> list[tuple[str, str, int, int]]:
    """Requests over two 5-minute buckets, two routes and two tenants; returns
    (tenant, route, prompt, seconds after T0) per request."""
    send(
        c,
        f.config(1, pool_tokens=681_280),
        f.config(2, pool_tokens=681_280, node="decode-0", role="decode"),
    )
    with c.client(c.admin) as h:
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": MODEL,
                "passed": True,
                "verified_safe_context": SAFE,
            },
        )
        assert r.status_code == 201, r.text
    reqs = _SEEDED
    events = [
        f.admitted(100 + i, f"r{i}", tenant, prompt, route=route, ts=f.T0 + timedelta(seconds=s))
        for i, (tenant, route, prompt, s) in enumerate(reqs)
    ]
    send(c, *events)
    wait_rollups(c.db_url)
    return reqs


def _exact_at_or_above(prompts: list[int], line: float) -> int:
    return sum(p >= line for p in prompts)


def test_prompt_token_stats_match_the_ingested_requests(collector: Collector) -> None:
    reqs = _seed(collector)
    doc = get(collector, "/v1/stats/prompt-tokens", **WINDOW, max_points=24)
    (line,) = doc["thresholds"]
    limit = line.pop("limit")
    assert line == {
        "model_id": MODEL,
        "safe_context": SAFE,
        "verified": True,
        "source": "verified",
        "stale": False,
        "deployment_id": "glm-prod",
        "deployments": ["glm-prod"],  # every deployment serving it (the charts' markers)
        "warn_line": 480_000,
        "critical_line": SAFE,
    }
    # the limit in force in the collector's words, as the card and the alerts say it
    card = get(collector, "/v1/deployments/glm-prod/limits-card")
    assert limit == card["models"][0]["limit_in_force"]["text"]
    assert limit.startswith(f"{SAFE:,} tokens (verified safe context on ")
    assert doc["bucket_seconds"] == 300
    # times are ISO text like every other answer; fields named *_us stay microseconds
    assert (doc["since"], doc["until"]) == (iso(f.T0), iso(f.T0 + timedelta(hours=2)))
    routes = {x["route"]: x for x in doc["routes"]}
    chat = [p for _, route, p, _ in reqs if route == CHAT]
    c = routes[CHAT]
    assert c["requests"] == len(chat) and c["rejected"] == 0
    assert c["max"] == max(chat)
    assert c["mean"] == pytest.approx(sum(chat) / len(chat), abs=0.1)
    # Bins are 9% wide: a quantile is an upper bound within one bin of the exact one.
    exact_p50 = sorted(chat)[math.ceil(0.5 * len(chat)) - 1]
    assert exact_p50 <= c["p50"] <= exact_p50 * 2 ** (1 / BINS_PER_OCTAVE)
    assert c["p99"] == max(chat)  # the top bin is clipped to the exact max
    assert c["at_or_above_warn"] == _exact_at_or_above(chat, 480_000) == 2
    assert c["at_or_above_critical"] == _exact_at_or_above(chat, SAFE) == 1
    assert routes[EMB]["requests"] == 1 and routes[EMB]["max"] == 300
    # Over time: chat's first bucket holds five requests (one is the embedding), the second two.
    series = [x for x in doc["series"] if x["route"] == CHAT]
    assert [x["requests"] for x in series] == [4, 2]
    t0_us = int(f.T0.timestamp() * 10**6)
    assert [x["bucket_start_us"] for x in series] == [t0_us, t0_us + 300 * 10**6]
    assert series[1]["max"] == 120_000
    hist = {(h["bin_low"], h["bin_high"]): h["requests"] for h in doc["histogram"]}
    assert sum(hist.values()) == len(reqs)
    b = bin_of(610_000)
    assert hist[(int(bin_low(b)), int(bin_high(b)))] >= 1


def test_every_series_figure_equals_the_reference_fold(collector: Collector) -> None:
    """The series' quantiles and line counts come from SQL window functions; the route
    totals from a fold in Python. Both must agree with the reference fold over exact bins."""
    _seed(collector)  # the verified safe context: lines at 480,000 and 600,000
    rng = random.Random(7)
    reqs = [
        (rng.choice((CHAT, EMB)), int(rng.lognormvariate(11, 1.5)) + 1, rng.randrange(0, 900))
        for _ in range(400)
    ]
    reqs += [(CHAT, None, 30), (EMB, None, 700)]  # unknown prompt sizes
    events = [
        f.admitted(1000 + i, f"x{i}", "acme", p, route=route, ts=f.T0 + timedelta(seconds=sec))
        for i, (route, p, sec) in enumerate(reqs)
    ]
    send(collector, *events)
    wait_rollups(collector.db_url)
    doc = get(collector, "/v1/stats/prompt-tokens", **WINDOW, max_points=24)
    line = {"warn_line": 480_000, "critical_line": SAFE}
    seeded = [(route, p, sec) for _, route, p, sec in _SEEDED]
    want: dict[tuple[str, int], _Dist] = {}
    for route, p, sec in seeded + reqs:
        d = want.setdefault((route, sec // 300), _Dist())
        d.add(-1 if p is None else bin_of(p), 1, 0, p, p or 0)
    got = {(x["route"], (x["bucket_start_us"] - T0_US) // 300_000_000): x for x in doc["series"]}
    assert set(got) == set(want)
    for key, d in want.items():
        exp = d.summary(line)
        assert {k: got[key][k] for k in exp} == exp, key


def test_a_long_window_reads_the_hourly_tier_with_the_same_figures(collector: Collector) -> None:
    reqs = _seed(collector)
    acme = collector.token("read", tenant="acme")
    week = {"since": (f.T0 - timedelta(days=7)).isoformat(), "until": WINDOW["until"]}
    for token, mine in ((None, reqs), (acme, [r for r in reqs if r[0] == "acme"])):
        short = get(collector, "/v1/stats/prompt-tokens", token, **WINDOW)
        long = get(collector, "/v1/stats/prompt-tokens", token, **week)
        assert short["bucket_seconds"] == 300 and long["bucket_seconds"] % 3600 == 0
        assert long["routes"] == short["routes"] and long["histogram"] == short["histogram"]
        assert sum(x["requests"] for x in long["routes"]) == len(mine)
        (hour,) = {x["bucket_start_us"] for x in long["series"]}  # all in T0's hour
        assert hour == int(f.T0.timestamp() * 10**6) // 3_600_000_000 * 3_600_000_000


def test_a_tenant_token_sees_only_its_tenant(collector: Collector) -> None:
    reqs = _seed(collector)
    acme = collector.token("read", tenant="acme")
    doc = get(collector, "/v1/stats/prompt-tokens", acme, **WINDOW)
    mine = [p for t, _, p, _ in reqs if t == "acme"]
    assert sum(x["requests"] for x in doc["routes"]) == len(mine)
    assert max(x["max"] for x in doc["routes"]) == max(mine)
    top = get(collector, "/v1/stats/top-prompts", acme, **WINDOW)["items"]
    assert {x["tenant"] for x in top} == {"acme"}
    # Asking for another tenant's route filter cannot widen the scope.
    none = get(collector, "/v1/stats/top-prompts", acme, **WINDOW, route=CHAT, model_id=MODEL)
    assert all(x["tenant"] == "acme" for x in none["items"])


def test_top_prompts_are_the_largest_with_their_ratio(collector: Collector) -> None:
    reqs = _seed(collector)
    items = get(collector, "/v1/stats/top-prompts", **WINDOW, limit=3)["items"]
    want = sorted((p for *_, p, _ in reqs), reverse=True)[:3]
    assert [x["prompt_tokens"] for x in items] == want
    assert items[0]["safe_context"] == SAFE
    assert items[0]["ratio"] == pytest.approx(610_000 / SAFE, abs=1e-4)
    assert items[0]["tenant"] == "globex" and items[0]["request_id"] == "r4"


def test_a_late_earlier_event_moves_a_request_without_counting_it_twice(
    collector: Collector,
) -> None:
    # The decode node reports first (bucket 2); the prefill node's admission, four minutes
    # earlier and in the bucket before, arrives later: the request moves buckets.
    late = f.T0 + timedelta(seconds=590)
    early = f.T0 + timedelta(seconds=290)
    send(collector, f.finished(1, "x", "acme", ts=late, model_id=MODEL, route=CHAT))
    wait_rollups(collector.db_url)
    send(collector, f.admitted(2, "x", "acme", 5_000, probe="probe-b", ts=early, route=CHAT))
    wait_rollups(collector.db_url)
    doc = get(collector, "/v1/stats/prompt-tokens", **WINDOW)
    assert sum(x["requests"] for x in doc["series"]) == 1
    (only,) = doc["series"]
    assert only["bucket_start_us"] == int((f.T0.timestamp()) * 10**6)
    assert only["max"] == 5_000


def test_a_shared_prompt_counts_once_in_usage_and_per_request_elsewhere(
    collector: Collector,
) -> None:
    """vLLM's n=3 fan-out (children 1 and 2 name child 0's prompt) plus a plain request, in
    one deployment; the same four requests without the field in another. Usage (``prompts``,
    ``prompt_tokens``) counts the shared prompt once; everything else stays per request."""
    at = f.T0 + timedelta(seconds=30)
    for dep, share in (("dep-shared", True), ("dep-plain", False)):
        where = {"probe": dep, "dep": dep, "ts": at, "route": CHAT}
        group = f.parallel_sampling(1, "cmpl-1", 3, "acme", 3_000, **where)
        if not share:
            group = [msgspec.structs.replace(e, prompt_shared_with=None) for e in group]
        send(collector, *group, f.admitted(4, "solo", "globex", 500, **where))
    wait_rollups(collector.db_url)

    def stats(dep: str, token: str | None = None, **window: Any) -> Any:
        return get(collector, "/v1/stats/prompt-tokens", token, deployment_id=dep, **window)

    def per_request(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in ("prompts", "prompt_tokens")}

    week = {"since": (f.T0 - timedelta(days=7)).isoformat(), "until": WINDOW["until"]}
    shared, plain = stats("dep-shared", **WINDOW), stats("dep-plain", **WINDOW)
    ((route,), (series,)) = shared["routes"], shared["series"]
    for x in (route, series):
        assert (x["requests"], x["prompts"], x["prompt_tokens"]) == (4, 2, 3_500)
    assert (route["max"], route["p99"], route["mean"]) == (3_000, 3_000, 9_500 / 4)
    assert per_request(route) == per_request(plain["routes"][0])
    assert per_request(series) == per_request(plain["series"][0])
    assert shared["histogram"] == plain["histogram"]
    assert sum(h["requests"] for h in shared["histogram"]) == 4
    assert (plain["routes"][0]["prompts"], plain["routes"][0]["prompt_tokens"]) == (4, 9_500)
    # the hourly tier (a week's window) and each tenant's own rows say the same
    assert stats("dep-shared", **week)["routes"] == shared["routes"]
    for tenant, want in (("acme", (3, 1, 3_000)), ("globex", (1, 1, 500))):
        token = collector.token("read", tenant=tenant)
        for window in (WINDOW, week):
            (mine,) = stats("dep-shared", token, **window)["routes"]
            assert (mine["requests"], mine["prompts"], mine["prompt_tokens"]) == want


def test_shared_prompts_sum_over_tenants_and_into_the_hour(collector: Collector) -> None:
    """The rollup rows: shared prompts per tenant, summed over tenants (``'*'``) in each
    5-minute bucket, and per tenant and over tenants in the hourly tier. All prompts fall in
    one size bin, so each sum really adds rows (of two tenants, of two buckets)."""
    first, second = f.T0 + timedelta(seconds=30), f.T0 + timedelta(seconds=330)
    assert bin_of(2_900) == bin_of(3_000) == bin_of(3_100)
    send(
        collector,
        *f.parallel_sampling(1, "cmpl-1", 3, "acme", 3_000, ts=first),
        *f.parallel_sampling(4, "cmpl-2", 2, "globex", 3_100, ts=first),
        *f.parallel_sampling(6, "cmpl-3", 2, "acme", 2_900, ts=second),
    )
    wait_rollups(collector.db_url)
    db = Database(collector.db_url)
    try:
        got = {}
        with db.read() as conn:
            for t in (m.RequestRollup, m.RequestRollupHourly):
                figures = (
                    sa.func.sum(t.requests),
                    sa.func.sum(t.shared_prompts),
                    sa.func.sum(t.shared_prompt_tokens),
                )
                q = sa.select(t.bucket_start, t.tenant, *figures).group_by(t.bucket_start, t.tenant)
                got[t.__tablename__] = {
                    ((int(r[0]) - T0_US) // 10**6, r[1]): tuple(int(v) for v in r[2:])
                    for r in conn.execute(q)
                }
    finally:
        db.dispose()
    assert got["request_rollups"] == {
        (0, "acme"): (3, 2, 6_000),
        (0, "globex"): (2, 1, 3_100),
        (0, ALL_TENANTS): (5, 3, 9_100),
        (300, "acme"): (2, 1, 2_900),
        (300, ALL_TENANTS): (2, 1, 2_900),
    }
    hour = (T0_US // HOUR_US * HOUR_US - T0_US) // 10**6
    assert got["request_rollups_hourly"] == {
        (hour, "acme"): (5, 3, 8_900),
        (hour, "globex"): (2, 1, 3_100),
        (hour, ALL_TENANTS): (7, 4, 12_000),
    }
    (route,) = get(collector, "/v1/stats/prompt-tokens", **WINDOW)["routes"]
    assert (route["requests"], route["prompts"], route["prompt_tokens"]) == (7, 3, 9_000)


def test_pool_samples_over_a_long_window_come_from_rollups(collector: Collector) -> None:
    used = [100, 5_000, 640_000, 20, 30_000, 7]
    send(
        collector,
        *(f.pool(10 + i, used=u, ts=f.T0 + timedelta(seconds=45 * i)) for i, u in enumerate(used)),
    )
    wait_rollups(collector.db_url)
    day = {"since": f.T0.isoformat(), "until": (f.T0 + timedelta(days=1)).isoformat()}
    doc = get(collector, "/v1/pool-samples", **day, max_points=48)
    assert doc["bucket_seconds"] == 1800
    (bucket,) = doc["items"]
    assert bucket["samples"] == len(used)
    assert bucket["used_max"] == max(used)
    assert bucket["used_avg"] == pytest.approx(sum(used) / len(used))
    assert bucket["free_min"] == 681_280 - max(used)
    # A short window still reads raw samples, at their own resolution.
    short = get(
        collector,
        "/v1/pool-samples",
        since=f.T0.isoformat(),
        until=(f.T0 + timedelta(minutes=5)).isoformat(),
        max_points=10,
    )
    assert sum(x["samples"] for x in short["items"]) == len(used)
    assert len(short["items"]) == len(used)


def test_page_event_stats_count_stale_reads_per_bucket(collector: Collector) -> None:
    send(
        collector,
        f.stale_read(1, ts=f.T0 + timedelta(seconds=5)),
        f.stale_read(2, ts=f.T0 + timedelta(seconds=6), page_ids=[9]),
        f.stale_read(
            3, ts=f.T0 + timedelta(minutes=50), reader_tenant="acme", previous_tenant="acme"
        ),
    )
    doc = get(collector, "/v1/stats/page-events", **WINDOW, max_points=4)
    assert doc["bucket_seconds"] == 1800
    assert (doc["since"], doc["until"]) == (iso(f.T0), iso(f.T0 + timedelta(hours=2)))
    rows = [(x["kind"], x["events"], x["pages"], x["cross_tenant"]) for x in doc["items"]]
    assert rows == [("page.stale_read", 2, 4, 2), ("page.stale_read", 1, 3, 0)]
    # initech is party to none of them.
    initech = collector.token("read", tenant="initech")
    assert get(collector, "/v1/stats/page-events", initech, **WINDOW)["items"] == []


def test_fleet_is_red_with_its_reasons_and_counts(collector: Collector) -> None:
    send(collector, f.config(1, pool_tokens=681_280), f.stale_read(2))
    doc = get(collector, "/v1/fleet")
    (dep,) = doc["deployments"]
    assert dep["deployment_id"] == "glm-prod" and dep["status"] == "red"
    assert any("pool 681,280 tokens < advertised context 1,048,576" in r for r in dep["reasons"])
    assert any("not verified" in r for r in dep["reasons"])
    (mod,) = dep["models"]
    assert (mod["advertised_context"], mod["pool_capacity_tokens"]) == (1_048_576, 681_280)
    assert mod["verified_safe_context"] is None
    assert dep["critical_alerts"] >= 1 and dep["open_incidents"] == 1


def test_the_fleet_lists_each_replica_as_a_node_with_its_key_config(collector: Collector) -> None:
    """Replicas of one deployment are nodes of their own, each with its role and the config
    they must agree on; one that stopped is shown so (its probe said it stopped)."""
    a = {"node": "gpu-a:8000", "role": "both", "disaggregated": False, "dtype": "bfloat16"}
    tiers = (
        ev.KvTier(medium="cpu", backend="lmcache", capacity_bytes=64 << 30, salted=True),
        ev.KvTier(medium="disk", backend="lmcache", capacity_bytes=2 << 40, salted=False),
    )
    send(
        collector,
        f.config(1, prefix_caching=True, kv_connector="LMCacheConnectorV1",
                 kv_connector_version="0.5.2", kv_tiers=tiers, **a),
    )  # fmt: skip
    send(collector, f.config(1, probe="probe-b-1-abcdef", **{**a, "node": "gpu-b:8000"}))
    (dep,) = get(collector, "/v1/fleet")["deployments"]
    nodes = {n["node"]: n for n in dep["nodes"]}
    assert set(nodes) == {"gpu-a:8000", "gpu-b:8000"}
    assert {
        k: nodes["gpu-a:8000"][k]
        for k in (
            "role",
            "dtype",
            "prefix_caching",
            "prefix_cache_salting",
            "pool_capacity_tokens",
            "running",
        )
    } == {
        "role": "both",
        "dtype": "bfloat16",
        "prefix_caching": True,
        "prefix_cache_salting": False,
        "pool_capacity_tokens": 681_280,
        "running": True,
    }
    assert nodes["gpu-b:8000"]["prefix_caching"] is False
    # where KV goes past the pool: as sent, and said once for the card and the dashboard
    assert nodes["gpu-a:8000"]["kv_tiers"][1] == {
        "medium": "disk",
        "backend": "lmcache",
        "capacity_bytes": 2 << 40,
        "salted": False,
    }
    assert nodes["gpu-a:8000"]["kv_offload"] == (
        "LMCacheConnectorV1 0.5.2: cpu (lmcache) 64 GiB, salted; disk (lmcache) 2 TiB, salt dropped"
    )
    assert nodes["gpu-a:8000"]["prefix_cache"] == "on, shared unsalted"
    assert nodes["gpu-b:8000"]["kv_offload"] == "none reported"
    with collector.client(collector.admin) as h:
        md = h.get("/v1/deployments/glm-prod/limits-card", params={"format": "md"}).text
    assert "| on, shared unsalted | LMCacheConnectorV1 0.5.2: cpu (lmcache) 64 GiB" in md
    send(collector, ev.ProbeStopped(**f.base(2, probe="probe-b-1-abcdef")))
    (dep,) = get(collector, "/v1/fleet")["deployments"]
    assert {n["node"]: n["running"] for n in dep["nodes"]} == {
        "gpu-a:8000": True,
        "gpu-b:8000": False,
    }


def test_fleet_is_green_when_verified_and_the_pool_covers_the_context(
    collector: Collector,
) -> None:
    # (0.5.22: the release that fixed the rejection path, so no advisory fires)
    send(
        collector,
        f.config(1, pool_tokens=2_000_000, advertised_context=1_000_000, engine_version="0.5.22"),
    )
    with collector.client(collector.admin) as h:
        r = h.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": MODEL,
                "passed": True,
                "verified_safe_context": 1_000_000,
            },
        )
        assert r.status_code == 201, r.text
    (dep,) = get(collector, "/v1/fleet")["deployments"]
    assert dep["status"] == "green", dep["reasons"]
    (mod,) = dep["models"]
    assert mod["verified_safe_context"] == 1_000_000
    assert mod["verification_age_days"] == pytest.approx(0, abs=0.01)
    assert mod["engine_version"] == "0.5.22"


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/v1/stats/prompt-tokens", {"since": "2026-08-28", "until": "2026-08-27"}, "since"),
        ("/v1/stats/top-prompts", {"limit": 0}, "limit"),
        ("/v1/stats/page-events", {"max_points": 0}, "max_points"),
        ("/v1/stats/prompt-tokens", {"model": MODEL}, "model"),
        # its UTC instant is in year 0: refused, never a 500 when the window is written back
        ("/v1/stats/prompt-tokens", {"since": "0001-01-01T00:00:00+00:01"}, "since"),
        ("/v1/requests", {"until": "0001-01-01T00:00:00+00:01"}, "until"),
    ],
)
def test_bad_parameters_get_a_clear_422(
    collector: Collector, path: str, params: dict[str, Any], field: str
) -> None:
    with collector.client(collector.admin) as h:
        r = h.get(path, params=params)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert field in r.text and err["message"]


def test_stats_need_a_token(collector: Collector) -> None:
    for path in ("/v1/fleet", "/v1/stats/prompt-tokens", "/v1/stats/page-events"):
        with collector.client(None) as h:
            assert h.get(path).status_code == 401
        with collector.client(collector.ingest) as h:
            assert h.get(path).status_code == 403


def test_existing_data_is_backfilled_by_the_migration(sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url, "0004")
    db = Database(sqlite_url)
    try:
        with db.write() as conn:
            conn.exec_driver_sql(
                "INSERT INTO requests (deployment_id, request_id, tenant, route, model_id, "
                "prompt_tokens, status, first_ts, last_ts) VALUES "
                "('d', 'r1', 't', '/x', 'm', 1234, 'completed', 1000000, 1000000), "
                "('d', 'r2', 't', '/x', 'm', NULL, 'rejected', 2000000, 2000000)"
            )
        migrate.upgrade(sqlite_url)
        assert RollupRefresher(db).refresh().request_buckets == 1
        with db.read() as conn:
            rows = conn.exec_driver_sql(
                "SELECT tenant, prompt_bin, requests, rejected, prompt_tokens_max FROM "
                "request_rollups ORDER BY tenant DESC, prompt_bin"
            ).all()
            hourly = conn.exec_driver_sql(
                "SELECT tenant, bucket_start, prompt_bin, requests FROM request_rollups_hourly "
                "ORDER BY tenant DESC, prompt_bin"
            ).all()
        one = [(-1, 1, 1, None), (bin_of(1234), 1, 0, 1234)]
        assert [tuple(r) for r in rows] == [("t", *x) for x in one] + [("*", *x) for x in one]
        assert [tuple(r) for r in hourly] == [
            (t, 0, b, 1) for t in ("t", "*") for b in (-1, bin_of(1234))
        ]  # the hourly tier: the hour's sums, per tenant and over tenants
    finally:
        db.dispose()


def test_the_database_bins_prompts_as_python_does(db_url: str) -> None:
    prompts = [0, 1, 2, 3, 255, 256, 257, 1023, 1024, 1025, 700_000, 1_048_576, None]
    migrate.upgrade(db_url)
    db = Database(db_url)
    try:
        with db.write() as conn:
            for i, p in enumerate(prompts):
                conn.execute(
                    sa.insert(m.Request).values(
                        deployment_id="d", request_id=f"r{i}", tenant=f"t{i}", route="/x",
                        model_id="m", prompt_tokens=p, status="completed", first_ts=1_000_000,
                        last_ts=1_000_000, part_ts=1_000_000,
                    )
                )  # fmt: skip
            conn.execute(
                sa.insert(m.RollupDirty).values(
                    kind="requests", deployment_id="d", bucket_start=0, marked_at=0
                )
            )
        RollupRefresher(db).refresh()
        with db.read() as conn:
            rr = m.RequestRollup
            q = sa.select(rr.tenant, rr.prompt_bin).where(rr.tenant != ALL_TENANTS)
            got = {t: b for t, b in conn.execute(q)}
    finally:
        db.dispose()
    want = {f"t{i}": (-1 if p is None else bin_of(p)) for i, p in enumerate(prompts)}
    assert got == want
    bins = [bin_of(p) for p in prompts if p is not None]
    assert bins == sorted(bins) and bin_of(256) == 8 * BINS_PER_OCTAVE
    for b in range(1, 200):
        assert bin_high(b) / bin_low(b) == pytest.approx(2 ** (1 / BINS_PER_OCTAVE))


def test_the_open_request_bucket_is_rolled_up_at_most_once_a_minute(sqlite_url: str) -> None:
    from datetime import UTC, datetime

    migrate.upgrade(sqlite_url)
    db = Database(sqlite_url)
    bucket = datetime(2026, 8, 27, 12, 0, tzinfo=UTC)
    now = bucket + timedelta(minutes=2)  # two minutes into the 5-minute bucket

    def mark(at: datetime) -> None:
        with db.write() as conn:
            conn.exec_driver_sql(
                "INSERT INTO rollup_dirty (kind, deployment_id, bucket_start, marked_at) "
                f"VALUES ('requests', 'd', {int(bucket.timestamp()) * 10**6}, "
                f"{int(at.timestamp()) * 10**6}) ON CONFLICT DO NOTHING"
            )

    try:
        mark(now)
        refresher = RollupRefresher(db)
        assert refresher.pending(now) == 0 and refresher.refresh(now=now).buckets == 0
        assert refresher.pending(now + timedelta(seconds=59)) == 0
        a_minute_on = now + timedelta(seconds=61)
        assert refresher.refresh(now=a_minute_on).request_buckets == 1
        mark(a_minute_on)  # ingest goes on: marked again, not due for another minute
        assert refresher.pending(a_minute_on + timedelta(seconds=30)) == 0
        closed = bucket + timedelta(minutes=5, seconds=11)  # closed and settled: due at once
        assert refresher.pending(closed) == 1
        assert refresher.refresh(now=closed).request_buckets == 1
        assert refresher.pending(closed) == 0
        mark(now)  # a collector's first pass takes every mark, due or not
        assert refresher.refresh(now=now, everything=True).request_buckets == 1
        assert refresher.pending(closed) == 0
    finally:
        db.dispose()
