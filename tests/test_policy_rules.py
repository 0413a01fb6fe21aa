"""Every rule kind of the default pack, firing and not firing, on events sent through the real
ingest path (HTTP, collector, database), and the timer's pass through the service."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from collector.alerting.service import AlertingService
from collector.db import Database
from collector.lost import LostRequests
from engine_probe import events as ev
from policies import TimerFacts, load_ruleset
from policies.facts import ProbeFact, clock_period, superseded
from policies.kinds import KINDS
from tests import factories as f
from tests.conftest import Collector


class Env:
    def __init__(self, c: Collector):
        self.c = c
        self.admin = c.client(c.admin)
        self.ingest = c.client(c.ingest)
        self.db = Database(c.db_url)
        self.service = AlertingService(self.db, load_ruleset())
        self.seq = 0
        self.probe = "probe-rules"

    def send(self, *events: ev.Event) -> None:
        body = [f.as_json(e) for e in events]
        r = self.ingest.post("/v1/events", json=body)
        assert r.status_code == 200, r.text

    def next(self, n: int = 1) -> int:
        self.seq += n
        return self.seq

    def alerts(self, rule: str, state: str | None = None) -> list[dict[str, Any]]:
        params = {"rule": rule, **({"state": state} if state else {})}
        r = self.admin.get("/v1/alerts", params=params)
        assert r.status_code == 200, r.text
        return list(r.json())

    def verification(self, passed: bool, safe: int | None) -> None:
        """A verification of glm-5.3 on glm-prod, measured under the factories' config."""
        r = self.ingest.post(
            "/v1/verifications",
            json={
                "deployment_id": "glm-prod",
                "model_id": "glm-5.3",
                "passed": passed,
                "verified_safe_context": safe,
                "engine_version": "0.5.21",
                "pool_capacity_tokens": 681_280,
            },
        )
        assert r.status_code == 201, r.text

    def prefix_verdict(self, doc: dict[str, Any]) -> None:
        """A passing verification of glm-5.3 whose evidence carries ``doc`` as its
        prefix-cache section, as kvwatch verify uploads it."""
        r = self.ingest.post(
            "/v1/verifications",
            json={"deployment_id": "glm-prod", "model_id": "glm-5.3", "passed": True,
                  "verified_safe_context": 500_000, "evidence": {"prefix_cache": doc}},
        )  # fmt: skip
        assert r.status_code == 201, r.text

    def tick(self, after: timedelta = timedelta(0)) -> None:
        self.service.tick(datetime.now(UTC) + after)


@pytest.fixture
def env(collector: Collector) -> Iterator[Env]:
    e = Env(collector)
    yield e
    e.admin.close()
    e.ingest.close()
    e.db.dispose()


def cfg(env: Env, **kw: Any) -> ev.Event:
    return f.config(env.next(), probe=env.probe, **kw)


def test_context_pressure_against_the_unverified_bound_then_the_verified_one(env: Env) -> None:
    env.send(cfg(env))  # pool 681,280 under an advertised 1,048,576: the bound is the pool
    env.send(f.admitted(env.next(), "r-small", prompt=100_000, probe=env.probe))
    assert env.alerts("context_pressure") == []
    env.send(f.admitted(env.next(), "r-near", prompt=600_000, probe=env.probe))  # 88%
    env.send(f.rejected(env.next(), "r-over", prompt=700_000, probe=env.probe))  # 103%
    got = {(a["severity"], a["labels"]["verified"]): a for a in env.alerts("context_pressure")}
    assert set(got) == {("warning", "false"), ("critical", "false")}
    warn = got[("warning", "false")]
    assert warn["state"] == "firing"
    assert warn["labels"]["model_id"] == "glm-5.3"
    assert warn["labels"]["route"] == "/v1/chat/completions"
    assert warn["value"] == pytest.approx(600_000 / 681_280, abs=1e-4)
    assert "681,280 tokens" in warn["annotations"]["summary"]

    # A verification measured under these settings sets the bound instead.
    env.verification(True, 500_000)
    env.send(f.admitted(env.next(), "r-verified", prompt=450_000, probe=env.probe))  # 90%
    verified = [a for a in env.alerts("context_pressure") if a["labels"]["verified"] == "true"]
    assert [a["severity"] for a in verified] == ["warning"]
    assert verified[0]["value"] == pytest.approx(0.9)
    # over the verified limit and refused: the verified refusal did its work, a warning
    route = {"route": "/v1/chat/completions", "probe": env.probe}
    env.send(f.rejected(env.next(), "r-refused", prompt=520_000, **route))  # 104%
    verified = [a for a in env.alerts("context_pressure") if a["labels"]["verified"] == "true"]
    assert [a["severity"] for a in verified] == ["warning"], verified
    # refused, then answered all the same (the incident's path): critical, verified or not
    env.send(
        f.rejected(env.next(), "r-leaked", prompt=520_000, **route),
        f.finished(env.next(), "r-leaked", prompt_tokens=520_000, model_id="glm-5.3", **route),
    )
    verified = [a for a in env.alerts("context_pressure") if a["labels"]["verified"] == "true"]
    assert sorted(a["severity"] for a in verified) == ["critical", "warning"], verified


def test_pool_rules_fire_and_resolve_with_the_config(env: Env) -> None:
    env.send(cfg(env))  # the incident's pool: 681,280 < 1,048,576
    (below,) = env.alerts("pool_below_advertised")
    assert below["state"] == "firing" and below["severity"] == "critical"
    assert below["labels"]["node"] == "prefill-0"
    assert env.alerts("pool_headroom", "firing") == []  # below is the critical rule's

    env.send(cfg(env, pool_tokens=1_500_000))  # fits once, not twice
    assert env.alerts("pool_below_advertised")[0]["state"] == "resolved"
    (head,) = env.alerts("pool_headroom")
    assert head["state"] == "firing" and head["severity"] == "warning"

    env.send(cfg(env, pool_tokens=2_200_000))
    assert env.alerts("pool_headroom")[0]["state"] == "resolved"
    history = env.admin.get(f"/v1/alerts/{head['id']}").json()["history"]
    assert [h["to"] for h in history] == ["firing", "resolved"]


def test_a_small_pool_whose_refusals_are_verified_is_a_warning_until_that_stops_holding(
    env: Env,
) -> None:
    """The small pool is the incident's first link (critical); a passing verification whose
    safe context fits the pool shows prompts past it are refused cleanly, so the advertised
    context is overstated, not unsafe (a warning); once a verification fails, critical again.
    One alert fires at a time: severity is a label, the other one resolves."""

    def firing() -> list[str]:
        return [a["severity"] for a in env.alerts("pool_below_advertised", "firing")]

    env.send(cfg(env))  # 681,280 < 1,048,576
    assert firing() == ["critical"]
    env.verification(True, 600_000)
    env.tick()
    assert firing() == ["warning"], env.alerts("pool_below_advertised")
    (warn,) = env.alerts("pool_below_advertised", "firing")
    assert "overstated, not unsafe" in warn["annotations"]["summary"], warn
    fleet = env.admin.get("/v1/fleet").json()["deployments"]
    (dep,) = [d for d in fleet if d["deployment_id"] == "glm-prod"]
    # the fleet says the same (its status stays red here for the engine's advisory)
    assert any(r.endswith("refused past it (verified)") for r in dep["reasons"]), dep
    # a leak seen since: an open incident says otherwise, whatever the verification said
    env.send(f.stale_read(env.next(), probe=env.probe, ts=datetime.now(UTC)))
    env.tick()
    assert firing() == ["critical"], env.alerts("pool_below_advertised")
    (incident,) = env.admin.get("/v1/incidents").json()
    r = env.admin.post(f"/v1/incidents/{incident['id']}/close", json={"reason": "contained"})
    assert r.status_code == 200, r.text
    env.tick()
    assert firing() == ["warning"]
    env.verification(False, None)  # a leak found: the rejection path is not what it was
    env.tick()
    assert firing() == ["critical"], env.alerts("pool_below_advertised")


def test_verification_missing_pends_fires_and_resolves_and_drift_makes_it_stale(env: Env) -> None:
    env.send(cfg(env, pool_tokens=2_200_000))
    (a,) = env.alerts("verification_missing_or_stale")
    assert a["state"] == "pending"  # the default pack waits 10 minutes
    env.tick(timedelta(minutes=11))
    assert env.alerts("verification_missing_or_stale")[0]["state"] == "firing"

    r = env.admin.post(
        "/v1/verifications",
        json={
            "deployment_id": "glm-prod",
            "model_id": "glm-5.3",
            "passed": True,
            "verified_safe_context": 900_000,
            "engine_version": "0.5.21",
            "pool_capacity_tokens": 2_200_000,
            "quantization": None,
        },
    )
    assert r.status_code == 201, r.text
    env.tick()
    assert env.alerts("verification_missing_or_stale")[0]["state"] == "resolved"

    # the engine is upgraded: the verification no longer holds, and that is drift too
    env.send(cfg(env, pool_tokens=2_200_000, engine_version="0.5.22"))
    (again,) = env.alerts("verification_missing_or_stale")
    assert again["state"] == "pending"
    assert "engine_version: 0.5.21 -> 0.5.22" in again["annotations"]["summary"]
    (drift,) = env.alerts("config_drift")
    assert drift["state"] == "firing"
    assert drift["annotations"]["changed"] == "engine_version"


def test_config_drift_not_on_an_unchanged_config(env: Env) -> None:
    env.send(cfg(env), cfg(env))
    env.send(cfg(env, dtype="fp8"))
    assert env.alerts("config_drift") == []
    env.send(cfg(env, quantization="awq", tp_size=8))
    (drift,) = env.alerts("config_drift")
    assert drift["annotations"]["changed"] == "quantization,tp_size"


def test_cross_tenant_stale_read_fires_critical_and_opens_one_incident(env: Env) -> None:
    env.send(f.stale_read(env.next(), probe=env.probe))
    env.send(f.stale_read(env.next(), probe=env.probe, page_ids=[9]))  # same pair: same alert
    (a,) = env.alerts("stale_page_read")
    assert a["state"] == "firing" and a["severity"] == "critical"
    assert a["labels"]["cross_tenant"] == "true"
    assert (a["labels"]["reader_tenant"], a["labels"]["previous_tenant"]) == ("globex", "acme")
    assert a["occurrences"] == 2
    (inc,) = env.admin.get("/v1/incidents").json()
    assert inc["state"] == "open"
    aware = datetime.fromisoformat(inc["awareness_at"])
    assert datetime.fromisoformat(inc["deadline_at"]) - aware == timedelta(hours=72)
    detail = env.admin.get(f"/v1/incidents/{inc['id']}").json()
    assert [x["id"] for x in detail["alerts"]] == [a["id"]]

    # another tenant pair on the same deployment joins the open incident
    env.send(f.stale_read(env.next(), probe=env.probe, reader_tenant="initech"))
    assert len(env.admin.get("/v1/incidents").json()) == 1
    assert len(env.alerts("stale_page_read")) == 2


def test_a_stale_reads_previous_tenant_is_the_ledgers_record_and_says_so(env: Env) -> None:
    """The alert names the tenant whose write the probe's page ledger last recorded, says it
    is the ledger's record, and says when the ledger recorded none (or cannot name it)."""
    env.send(f.stale_read(env.next(), probe=env.probe))
    env.send(
        f.stale_read(env.next(), probe=env.probe, reader_tenant="initech",
                     previous_request_id=None, previous_tenant=None),
    )  # fmt: skip
    env.send(f.stale_read(env.next(), probe=env.probe, reader_tenant="umbrella",
                          previous_tenant="unknown"))  # fmt: skip
    env.send(
        ev.CanaryHit(**f.base(env.next(), probe=env.probe), detector="paint",
                     reader_request_id="r-c", reader_tenant="hooli", canary_tenant="acme",
                     page_ids=[4], node="decode-0"),
    )  # fmt: skip
    said = {a["labels"]["reader_tenant"]: a for a in env.alerts("stale_page_read")}
    acme = said["globex"]["annotations"]["summary"]
    assert (
        "read 3 page(s) last written, as the probe's page ledger recorded, by tenant acme" in acme
    )
    assert "the ledger's last recorded writer" in acme and acme.endswith("(cross-tenant exposure)")
    none = said["initech"]
    assert none["labels"]["previous_tenant"] == "none"
    assert (
        "page ledger holds no write of since the pool was created" in none["annotations"]["summary"]
    )
    assert "a tenant the ledger cannot name" in said["umbrella"]["annotations"]["summary"]
    assert "holding tenant acme's canary" in said["hooli"]["annotations"]["summary"]


def test_same_tenant_or_zeroized_stale_reads_open_no_incident(env: Env) -> None:
    env.send(f.stale_read(env.next(), probe=env.probe, previous_tenant="globex"))
    env.send(f.stale_read(env.next(), probe=env.probe, reader_tenant="initech", zeroized=True))
    alerts = env.alerts("stale_page_read")
    assert sorted(a["labels"]["cross_tenant"] for a in alerts) == ["false", "false"]
    assert all(a["state"] == "firing" for a in alerts)  # still a defect worth paging on
    assert env.admin.get("/v1/incidents").json() == []


def test_rejected_prefill_transfer(env: Env) -> None:
    def transfer(rejected: bool, rid: str) -> ev.Event:
        return ev.KvTransfer(
            **f.base(env.next(), probe=env.probe),
            request_id=rid,
            tenant="acme",
            from_node="prefill-0",
            to_node="decode-0",
            pages=4,
            prefill_rejected=rejected,
        )

    env.send(transfer(False, "r-ok"))
    assert env.alerts("rejected_prefill_kv_transfer") == []
    env.send(transfer(True, "r-bad"))
    (a,) = env.alerts("rejected_prefill_kv_transfer")
    assert a["severity"] == "critical" and a["labels"]["from_node"] == "prefill-0"


def test_engine_version_advisory_needs_the_version_and_the_condition(env: Env) -> None:
    env.send(cfg(env, pool_tokens=2_200_000, disaggregated=False))  # 0.5.21, monolithic
    assert env.alerts("engine_version_advisory", "firing") == []
    env.send(cfg(env, pool_tokens=2_200_000))  # 0.5.21, disaggregated: affected
    (a,) = env.alerts("engine_version_advisory")
    assert a["state"] == "firing" and a["severity"] == "critical"
    assert a["labels"]["advisory"] == "sglang-disagg-rejected-prefill-transfer"
    assert "sglang/pull/34208" in a["annotations"]["references"]
    env.send(cfg(env, pool_tokens=2_200_000, engine_version="0.5.22"))
    assert env.alerts("engine_version_advisory")[0]["state"] == "resolved"


def test_a_verification_that_found_prefixes_shared_fires_prefix_cache_unsalted(env: Env) -> None:
    """The same exposure proven from outside: kvwatch verify's prefix-cache verdict, in the
    evidence it uploads, fires the rule at once (node ``endpoint``), and the next verdict of
    the same model resolves it."""

    def verify(verdict: str, pairs: list[dict[str, Any]]) -> None:
        env.prefix_verdict({"verdict": verdict, "method": "cached_tokens", "shared_pairs": pairs})

    verify("inconclusive", [])
    assert env.alerts("prefix_cache_unsalted") == []
    verify("shared_across_tenants", [{"owner": "acme", "reader": "globex", "salted": False}])
    (a,) = env.alerts("prefix_cache_unsalted")
    assert a["state"] == "firing"
    assert (a["labels"]["node"], a["labels"]["model_id"]) == ("endpoint", "glm-5.3")
    assert "acme to globex" in a["annotations"]["summary"]
    # the context verdict is untouched: the verification passed, its safe context holds
    assert env.alerts("verification_failed") == []
    verify("isolated", [])
    (a,) = env.alerts("prefix_cache_unsalted")
    assert a["state"] == "resolved"


def test_a_verification_whose_eviction_round_shared_says_the_tier(env: Env) -> None:
    pair = {"owner": "acme", "reader": "globex", "salted": True}
    shared = "shared_across_tenants"
    env.prefix_verdict({"verdict": shared, "method": "cached_tokens", "tier_verdict": shared,
                        "shared_pairs": [pair]})  # fmt: skip
    (a,) = env.alerts("prefix_cache_unsalted")
    assert (
        "(acme to globex, after it left the pool: from an offload tier, each with its own "
        "cache_salt: the salt did not isolate;"
    ) in a["annotations"]["summary"]
    # salts sent and defeated: critical, where an unsalted share is the rule's warning
    assert a["severity"] == "critical"


def test_prefix_cache_unsalted_once_two_tenants_share_it(env: Env) -> None:
    env.send(cfg(env, prefix_caching=True))
    env.send(f.admitted(env.next(), "r-1", tenant="acme", prompt=10, probe=env.probe))
    env.tick()
    assert env.alerts("prefix_cache_unsalted", "firing") == []  # one tenant: nothing shared
    env.send(f.admitted(env.next(), "r-2", tenant="globex", prompt=10, probe=env.probe))
    env.tick()
    (a,) = env.alerts("prefix_cache_unsalted")
    assert a["state"] == "firing" and a["value"] == 2
    env.send(cfg(env, prefix_caching=True, prefix_cache_salting=True))
    assert env.alerts("prefix_cache_unsalted")[0]["state"] == "resolved"


def test_replicas_each_keep_their_own_prefix_cache_alert_and_disagreeing_is_drift(
    env: Env,
) -> None:
    """Two replicas of one deployment (same model, same role), each its own node and probe:
    the one that stops caching neither replaces the other's config nor resolves its
    prefix_cache_unsalted; their disagreement is config_drift between them, a state that
    resolves when they agree again, and when one goes away (its probe stopped)."""
    a = {"node": "gpu-a:8000", "role": "both", "disaggregated": False, "dtype": "bfloat16"}
    b = {**a, "node": "gpu-b:8000"}
    env.send(cfg(env, prefix_caching=True, **a))
    for i, tenant in enumerate(("acme", "globex")):
        env.send(f.admitted(env.next(), f"r-{i}", tenant=tenant, prompt=10, probe=env.probe))
    env.tick()
    (unsalted,) = env.alerts("prefix_cache_unsalted", "firing")
    assert unsalted["labels"]["node"] == "gpu-a:8000"
    assert env.alerts("config_drift") == []  # one node: nothing to disagree with

    other = "probe-replica-b-1-abcdef"  # another engine process: its own probe
    env.send(f.config(env.next(), probe=other, prefix_caching=False, **b))
    env.tick()
    firing = env.alerts("prefix_cache_unsalted", "firing")
    assert [x["labels"]["node"] for x in firing] == ["gpu-a:8000"]  # still served shared
    (drift,) = env.alerts("config_drift")
    assert drift["state"] == "firing"
    assert drift["labels"]["deployment_id"] == "glm-prod"
    assert (drift["labels"]["model_id"], drift["labels"]["role"]) == ("glm-5.3", "both")
    assert "node" not in drift["labels"]  # one alert per group, whichever nodes disagree
    assert drift["annotations"]["nodes"] == "gpu-a:8000,gpu-b:8000"
    assert drift["annotations"]["changed"] == "prefix_caching"
    assert "prefix_caching: gpu-a:8000=True, gpu-b:8000=False" in drift["annotations"]["summary"]

    # B's KV dtype differs too, then only "auto" (not resolved: agrees with anything)
    env.send(f.config(env.next(), probe=other, prefix_caching=False, **{**b, "dtype": "fp8"}))
    (drift,) = env.alerts("config_drift")
    assert drift["annotations"]["changed"] == "dtype,prefix_caching"
    env.send(f.config(env.next(), probe=other, prefix_caching=True, **{**b, "dtype": "auto"}))
    (drift,) = env.alerts("config_drift")
    assert drift["state"] == "resolved"
    env.tick()
    assert {x["labels"]["node"] for x in env.alerts("prefix_cache_unsalted", "firing")} == {
        "gpu-a:8000",
        "gpu-b:8000",
    }

    # a pool of another size: drift again (and B's own change over time, an event of its
    # node); then B's engine stops (its probe says so): gone
    env.send(f.config(env.next(), probe=other, pool_tokens=1_000_000, prefix_caching=True, **b))
    between = [x for x in env.alerts("config_drift") if "node" not in x["labels"]]
    (own,) = [x for x in env.alerts("config_drift") if "node" in x["labels"]]
    assert own["labels"]["node"] == "gpu-b:8000"
    (drift,) = between
    assert drift["state"] == "firing"
    assert drift["annotations"]["changed"] == "pool_capacity_tokens"
    env.send(ev.ProbeStopped(**f.base(env.next(), probe=other)))
    env.tick()
    (drift,) = [x for x in env.alerts("config_drift") if "node" not in x["labels"]]
    assert drift["state"] == "resolved"
    assert drift["annotations"]["nodes"] == "gpu-a:8000"


def test_config_drift_between_nodes_leaves_other_roles_and_models_alone(env: Env) -> None:
    """A disaggregated pair's prefill and decode pools differ by design, as do two models'."""
    env.send(cfg(env, node="p-0", role="prefill", pool_tokens=700_000))
    env.send(cfg(env, node="d-0", role="decode", pool_tokens=2_000_000))
    env.send(cfg(env, node="m2-0", role="prefill", model_id="other", pool_tokens=50_000))
    env.tick()
    assert env.alerts("config_drift", "firing") == []


def _probe_campaign(
    env: Env,
    reader: str,
    owner: str,
    lengths: list[int],
    suffix: int,
    *,
    batch: int = 7,
    start: datetime | None = None,
) -> None:
    """``reader``'s requests, each hitting ``owner``'s cached blocks for ``lengths[i]`` tokens
    with a prompt ``suffix`` tokens longer, sent in batches as a probe flushes them."""
    t = start or datetime.now(UTC) - timedelta(minutes=5)
    events: list[ev.Event] = []
    for i, tokens in enumerate(lengths):
        at = t + timedelta(seconds=2 * i)
        rid = f"{reader}-{env.seq + 1}"
        events.append(
            f.admitted(
                env.next(), rid, tenant=reader, prompt=tokens + suffix, probe=env.probe, ts=at
            )
        )
        events.append(
            f.prefix_hit(
                env.next(),
                probe=env.probe,
                ts=at,
                reader_request_id=rid,
                reader_tenant=reader,
                owner_tenant=owner,
                owner_request_id="r-sys",
                tokens=tokens,
                pages=max(1, tokens // 16),
            )
        )
        if len(events) >= 2 * batch:
            env.send(*events)
            events = []
    if events:
        env.send(*events)


def test_prefix_probe_suspected_fires_for_a_prober_not_for_tenants_sharing_a_template(
    env: Env,
) -> None:
    # A public system prompt two tenants both use: the same 512-token hit every time, each
    # request going on with a long prompt of its own.
    _probe_campaign(env, "initech", "acme", [512] * 40, suffix=2_000)
    # Short requests, matched prefixes growing page by page: the PromptPeek pattern, but
    # fewer hits than min_hits (20) so far.
    probing = [16 * (1 + i // 3) for i in range(30)]  # 16, 16, 16, 32, ... 160
    t = datetime.now(UTC) - timedelta(minutes=5)
    _probe_campaign(env, "globex", "acme", probing[:19], suffix=1, start=t)
    assert env.alerts("prefix_probe_suspected") == []
    _probe_campaign(env, "globex", "acme", probing[19:], suffix=1, start=t + timedelta(seconds=38))
    (a,) = env.alerts("prefix_probe_suspected")
    assert a["state"] == "firing" and a["severity"] == "critical"
    assert a["labels"] == {
        "alertname": "prefix_probe_suspected",
        "deployment_id": "glm-prod",
        "reader_tenant": "globex",
        "owner_tenant": "acme",
        "severity": "critical",
    }
    assert a["value"] == 30  # the hits weighed (in the window ending at the latest)
    assert a["occurrences"] == 11  # the hits of the batches that met the thresholds
    assert "at 10 different lengths (16 to 160 tokens)" in a["annotations"]["summary"]
    # another reader probing the same owner, but with long prompts after each hit: not short
    _probe_campaign(env, "hooli", "acme", probing, suffix=400)
    assert [x["labels"]["reader_tenant"] for x in env.alerts("prefix_probe_suspected")] == [
        "globex"
    ]


def test_prefix_probe_suspected_weighs_its_window_only(env: Env) -> None:
    probing = [16 * (1 + i // 2) for i in range(24)]
    # 12 probes an hour ago, 12 now: never 20 within the 10-minute window
    _probe_campaign(env, "globex", "acme", probing[:12], suffix=0,
                    start=datetime.now(UTC) - timedelta(minutes=58))  # fmt: skip
    _probe_campaign(env, "globex", "acme", probing[12:], suffix=0)
    assert env.alerts("prefix_probe_suspected") == []


def test_prefix_cache_cross_tenant_on_hits_across_tenants_only(env: Env) -> None:
    same = f.prefix_hit(env.next(), probe=env.probe, reader_tenant="acme")
    env.send(same, f.prefix_hit(env.next(), probe=env.probe, owner_tenant=None))
    assert env.alerts("prefix_cache_cross_tenant") == []  # own tenant, or owner unknown
    env.send(f.prefix_hit(env.next(), probe=env.probe, pages=4))
    (a,) = env.alerts("prefix_cache_cross_tenant")
    assert a["state"] == "firing" and a["value"] == 4
    assert a["labels"]["reader_tenant"] == "globex" and a["labels"]["owner_tenant"] == "acme"
    assert a["labels"]["salted"] == "false"
    env.send(f.prefix_hit(env.next(), probe=env.probe, salted=True))
    salted = [x for x in env.alerts("prefix_cache_cross_tenant") if x["labels"]["salted"] == "true"]
    assert len(salted) == 1 and "share a salt" in salted[0]["annotations"]["summary"]
    r = env.admin.get("/v1/page-events", params={"kind": "prefix_cache.hit"})
    items = r.json()["items"]
    assert len(items) == 4 and sum(i["cross_tenant"] for i in items) == 2
    hit = next(i for i in items if i["page_count"] == 4)
    assert hit["tenant"] == "globex" and hit["other_tenant"] == "acme"
    assert hit["detail"] == {"role": "both", "tokens": 96, "salted": False}


def test_telemetry_gaps_missing_fields_and_silent_probes(env: Env) -> None:
    # stamped now, as a producer stamps them: three requests admitted and never finished, so
    # the probe that goes quiet afterwards is silent (not idle)
    now = datetime.now(UTC)
    env.send(f.admitted(env.next(), "r-1", probe=env.probe, ts=now))
    assert env.alerts("telemetry_gap") == []
    env.seq += 3  # three events lost
    env.send(
        f.admitted(env.next(), "r-2", probe=env.probe, prompt=None, ts=now),  # type: ignore[arg-type]
        f.admitted(env.next(), "r-3", probe=env.probe, model_id=None, ts=now),
    )
    problems = {a["labels"]["problem"]: a for a in env.alerts("telemetry_gap")}
    assert set(problems) == {"seq_gap", "missing_token_counts", "missing_model_id"}
    assert problems["seq_gap"]["value"] == 3
    env.tick(timedelta(minutes=10))
    silent = [a for a in env.alerts("telemetry_gap") if a["labels"]["problem"] == "silent"]
    assert [a["state"] for a in silent] == ["firing"]
    assert silent[0]["labels"]["probe_id"] == env.probe
    summary = silent[0]["annotations"]["summary"]
    assert "silent for 10m" in summary and "(limit 5m)" in summary, summary
    assert "3 request(s) admitted before it went quiet never finished" in summary
    # event alerts resolve after an hour without an occurrence
    env.tick(timedelta(hours=2))
    assert env.alerts("telemetry_gap", "firing")[0]["labels"]["problem"] == "silent"
    assert problems["seq_gap"]["id"] in [a["id"] for a in env.alerts("telemetry_gap", "resolved")]


def test_a_probe_that_stopped_or_restarted_is_not_silent(env: Env) -> None:
    """A probe that said probe.stopped is not silent; nor one whose engine came back on the
    same host under a new probe (same id root, first heard from after the old went quiet),
    and the alert the old one raised resolves when the new one arrives. A probe that went
    quiet while a sibling of its root kept running is still silent. (Each had a request in
    flight: without one, or other evidence, a quiet probe is idle, not silent.)"""
    stopped, crashed, sibling = "h1-101-aaaaaa", "h1-102-bbbbbb", "h2-201-cccccc"
    now = datetime.now(UTC)
    for probe in (stopped, crashed, sibling):
        env.send(f.pool(1, probe=probe), f.admitted(2, f"r-{probe}", probe=probe, ts=now))
    env.send(ev.ProbeStopped(**f.base(3, probe=stopped)))
    env.tick(timedelta(minutes=10))
    silent = {
        a["labels"]["probe_id"]: a["state"]
        for a in env.alerts("telemetry_gap")
        if a["labels"]["problem"] == "silent"
    }
    assert silent == {crashed: "firing", sibling: "firing"}
    # the crashed engine restarts on h1 under a new probe; nothing comes back on h2
    env.send(f.pool(1, probe="h1-103-dddddd"))
    env.tick(timedelta(minutes=10))
    state = {
        a["labels"]["probe_id"]: a["state"]
        for a in env.alerts("telemetry_gap")
        if a["labels"]["problem"] == "silent"
    }
    assert state[crashed] == "resolved" and state[sibling] == "firing"
    (old,) = [a for a in env.alerts("telemetry_gap") if a["labels"]["probe_id"] == crashed]
    assert "replaced by probe h1-103-dddddd" in old["annotations"]["summary"]
    with env.c.client(env.c.admin) as h:
        probes = {p["probe_id"]: p for p in h.get("/v1/probes").json()}
    assert probes[stopped]["stopped_at"] is not None
    assert probes[crashed]["superseded_by"] == "h1-103-dddddd"
    assert probes[sibling]["superseded_by"] is None and probes[sibling]["stopped_at"] is None


def test_a_probe_gone_with_requests_open_fires_lost_requests(env: Env) -> None:
    """telemetry_gap says when a probe went away with requests open (closed as lost): a stop
    mid-request fires lost_requests, a stop between requests does not, and a silent probe's
    own alert already says so (no second one)."""
    mid, between, silent = "h5-501-aaaaaa", "h5-502-bbbbbb", "h6-601-cccccc"
    now = datetime.now(UTC)
    for probe in (mid, between, silent):
        env.send(f.pool(1, probe=probe), f.admitted(2, f"r-{probe}", probe=probe, ts=now))
    env.send(ev.ProbeStopped(**f.base(3, probe=mid, ts=now)))
    env.send(
        f.finished(3, f"r-{between}", probe=between, ts=now),
        ev.ProbeStopped(**f.base(4, probe=between, ts=now)),
    )
    assert LostRequests(env.db, 300).close_silent(now + timedelta(minutes=10)).lost == 1
    env.tick(timedelta(minutes=10))
    by_probe = {
        (a["labels"]["probe_id"], a["labels"]["problem"]): a
        for a in env.alerts("telemetry_gap", "firing")
    }
    assert set(by_probe) == {(mid, "lost_requests"), (silent, "silent")}
    lost = by_probe[(mid, "lost_requests")]
    assert lost["value"] == 1
    assert "probe_stopped" in lost["annotations"]["summary"]
    assert "1 request(s) it admitted still open" in lost["annotations"]["summary"]
    summary = by_probe[(silent, "silent")]["annotations"]["summary"]
    # (the deployment's: its lost rows count as in flight, mid's among them)
    assert "2 request(s) admitted before it went quiet never finished" in summary


def test_probes_running_side_by_side_never_supersede_each_other() -> None:
    """Two replicas on one host overlap in time: neither replaces the other (pure)."""
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    a = ProbeFact("host-1-aaaaaa", "d", last_seen=t0 + timedelta(hours=1), first_seen=t0)
    b = ProbeFact(
        "host-2-bbbbbb",
        "d",
        last_seen=t0 + timedelta(hours=1),
        first_seen=t0 + timedelta(minutes=5),
    )
    later = ProbeFact(
        "host-3-cccccc", "d", last_seen=t0 + timedelta(hours=3), first_seen=t0 + timedelta(hours=2)
    )
    other_dep = ProbeFact(
        "host-4-dddddd", "e", last_seen=t0 + timedelta(hours=3), first_seen=t0 + timedelta(hours=2)
    )
    not_derived = ProbeFact("scrape-target", "d", last_seen=t0, first_seen=t0)
    assert superseded([a, b]) == {}
    assert superseded([a, b, later, other_dep, not_derived]) == {
        "host-1-aaaaaa": "host-3-cccccc",
        "host-2-bbbbbb": "host-3-cccccc",
    }


T = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def silence(*probes: ProbeFact, now: datetime) -> dict[str, tuple[bool, str, str]]:
    """telemetry_gap's timer pass (the default pack's: silent after 5m) over these probes,
    pure: probe id -> (firing, state, summary)."""
    rule = load_ruleset().rule("telemetry_gap")
    assert rule is not None
    signals = KINDS["telemetry_gap"].on_timer(rule, TimerFacts(probes=probes), now)
    return {
        s.labels["probe_id"]: (s.firing, s.annotations["state"], s.annotations["summary"])
        for s in signals
        if s.labels["problem"] == "silent"
    }


def quiet_probe(probe_id: str, quiet: timedelta, **kw: Any) -> ProbeFact:
    return ProbeFact(probe_id, "gw", last_seen=T - quiet, first_seen=T - timedelta(days=1), **kw)


def test_an_idle_probe_is_not_silent() -> None:
    """A gateway nobody calls sends nothing: quiet for long, with nothing saying it should be
    sending (no sibling heard from since, no request in flight, no clock), it is idle."""
    got = silence(quiet_probe("gw-1", timedelta(minutes=6, seconds=49)), now=T)
    firing, state, summary = got["gw-1"]
    assert not firing and state == "idle"
    assert summary.startswith("probe gw-1 of gw idle for 6m 49s: nothing says"), summary


def test_a_probe_quiet_while_a_sibling_sends_is_silent() -> None:
    """Another probe of the deployment was heard from after this one had been quiet for
    silent_after: the deployment is alive, this probe is not."""
    got = silence(
        quiet_probe("gw-1", timedelta(hours=1, minutes=9, seconds=30)),
        quiet_probe("gw-2", timedelta(seconds=20)),
        now=T,
    )
    firing, state, summary = got["gw-1"]
    assert firing and state == "silent"
    assert summary == (
        "probe gw-1 of gw silent for 1h 9m (limit 5m): probe gw-2 of the same deployment was "
        "heard from 20s ago"
    )
    assert got["gw-2"][:2] == (False, "sending")
    # a sibling heard from only shortly after this one went quiet proves nothing (two idle
    # gateways behind one balancer, the last request went to the other one)
    got = silence(
        quiet_probe("gw-1", timedelta(minutes=30)),
        quiet_probe("gw-2", timedelta(minutes=28)),
        now=T,
    )
    assert got["gw-1"][:2] == (False, "idle") and got["gw-2"][:2] == (False, "idle")
    # nor does a sibling that samples on a clock (the collector's scraper of an idle engine)
    got = silence(
        quiet_probe("gw-1", timedelta(minutes=30)),
        quiet_probe("scrape-gw", timedelta(seconds=5), sample_period_s=15.0),
        now=T,
    )
    assert got["gw-1"][:2] == (False, "idle")


def test_a_probe_with_requests_in_flight_that_goes_quiet_is_silent() -> None:
    got = silence(quiet_probe("eng-1", timedelta(minutes=7), in_flight=2), now=T)
    firing, state, summary = got["eng-1"]
    assert firing and state == "silent"
    assert summary.endswith(
        "silent for 7m (limit 5m): 2 request(s) admitted before it went quiet never finished"
    ), summary


def test_a_probe_sampling_on_a_clock_that_stops_is_silent() -> None:
    got = silence(
        quiet_probe("scrape-a", timedelta(minutes=6), sample_period_s=15.0),
        quiet_probe("scrape-b", timedelta(minutes=6), scrape_error="connection refused"),
        now=T,
    )
    assert got["scrape-a"][0] and "it sampled its pool every 15s and stopped" in got["scrape-a"][2]
    assert got["scrape-b"][0] and got["scrape-b"][2].endswith(
        "the collector's scrape of its engine fails: connection refused"
    )
    # a beat longer than silent_after: not silent before two beats are missed
    slow = silence(quiet_probe("slow", timedelta(minutes=6), sample_period_s=600.0), now=T)
    assert slow["slow"][:2] == (False, "idle")


def test_a_stopped_or_forgotten_probe_is_never_silent() -> None:
    got = silence(
        quiet_probe("stopped", timedelta(minutes=10), in_flight=1, stopped_at=T),
        quiet_probe("forgotten", timedelta(hours=25), in_flight=1),
        quiet_probe("sibling", timedelta(seconds=1)),
        now=T,
    )
    assert got["stopped"][:2] == (False, "stopped")
    assert got["stopped"][2] == "probe stopped of gw quiet for 10m; stopped cleanly"
    assert got["forgotten"][:2] == (False, "silent")  # past forget_after: no longer alerted


@pytest.mark.parametrize(
    ("samples", "period"),
    [
        ([(60.0, 0), (45.0, 0), (30.0, 0), (15.0, 0)], 15.0),
        ([(60.0, 0), (44.0, 0), (30.0, 0), (16.0, 0)], 16.0),
        ([(60.0, 0), (45.0, 0), (30.0, 0)], None),  # too few to call it a clock
        ([(60.0, 5), (45.0, 9), (30.0, 5), (15.0, 5)], None),  # the pool changed: traffic
        ([(60.0, 0), (59.0, 0), (30.0, 0), (15.0, 0)], None),  # irregular
        ([(60.0, 0), (60.0, 0), (30.0, 0), (15.0, 0)], None),
    ],
)
def test_a_clock_is_regular_samples_of_an_unchanging_pool(
    samples: list[tuple[float, int]], period: float | None
) -> None:
    assert clock_period(samples) == period


def test_the_timer_loads_the_evidence_of_quiet_probes(env: Env) -> None:
    """Through the database: a probe that sampled every 15 s over an unchanged pool and
    stopped is silent; an engine probe that only said hello is idle."""
    now = datetime.now(UTC)
    clock, hello = "scrape-glm", "engine-glm"
    env.send(
        *(f.pool(i + 1, probe=clock, ts=now - timedelta(seconds=15 * (3 - i))) for i in range(4))
    )
    env.send(f.config(1, probe=hello, ts=now), f.pool(2, probe=hello, ts=now))
    env.tick(timedelta(minutes=6))
    got = {
        a["labels"]["probe_id"]: a
        for a in env.alerts("telemetry_gap")
        if a["labels"]["problem"] == "silent"
    }
    assert set(got) == {clock}, got
    assert got[clock]["state"] == "firing"
    assert "it sampled its pool every 15s and stopped" in got[clock]["annotations"]["summary"]
    assert got[clock]["annotations"]["state"] == "silent"


def test_a_resent_batch_raises_nothing_twice(env: Env) -> None:
    batch = [f.stale_read(env.next(), probe=env.probe)]
    env.send(*batch)
    env.send(*batch)  # the probe retried: duplicates are not evaluated again
    (a,) = env.alerts("stale_page_read")
    assert a["occurrences"] == 1
    assert len(env.admin.get("/v1/incidents").json()) == 1


def test_a_verification_is_tied_to_the_current_config_and_clamped_to_the_pool(env: Env) -> None:
    env.send(cfg(env, quantization="fp8", tp_size=4))  # pool 681,280
    r = env.ingest.post(
        "/v1/verifications",
        json={"deployment_id": "glm-prod", "model_id": "glm-5.3", "passed": True,
              "verified_safe_context": 900_000, "evidence": {"tool": "test"}},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    v = r.json()
    assert (v["engine_version"], v["pool_capacity_tokens"], v["quantization"], v["tp_size"]) == (
        "0.5.21", 681_280, "fp8", 4,
    )  # fmt: skip
    assert v["verified_safe_context"] == 681_280
    assert v["evidence"]["clamped_to_pool"] == {
        "measured": 900_000,
        "pool_capacity_tokens": 681_280,
    }
    assert v["evidence"]["tool"] == "test"
    # an ingest token bound to another deployment may not record one here
    other = env.c.client(env.c.token("ingest", deployment_id="elsewhere"))
    try:
        body = {"deployment_id": "glm-prod", "model_id": "m", "passed": False}
        assert other.post("/v1/verifications", json=body).status_code == 403
    finally:
        other.close()


def test_a_verification_is_not_stale_against_a_differently_sized_decode_pool(env: Env) -> None:
    """Disaggregated: the verification measured the prefill pool; the decode pool is sized
    separately and must not make it stale."""
    env.send(cfg(env, pool_tokens=2_200_000))  # prefill-0
    env.send(cfg(env, pool_tokens=4_400_000, role="decode", node="decode-0"))
    r = env.admin.post(
        "/v1/verifications",
        json={"deployment_id": "glm-prod", "model_id": "glm-5.3", "passed": True,
              "verified_safe_context": 900_000},
    )  # fmt: skip
    assert r.status_code == 201 and r.json()["pool_capacity_tokens"] == 2_200_000
    env.tick()
    states = {a["state"] for a in env.alerts("verification_missing_or_stale")}
    assert states <= {"resolved", "pending"} and "firing" not in states
    env.send(f.admitted(env.next(), "r-v", prompt=800_000, probe=env.probe))  # 89% of 900k
    (a,) = env.alerts("context_pressure")
    assert a["labels"]["verified"] == "true"


def test_a_silent_source_fires_until_its_producer_has_figures_again(env: Env) -> None:
    """kvwatch kv-events' source.gap: stored as the gap it is (never as a kv.turnover of
    zeros), a telemetry_gap state naming the producer's reason, on the fleet line of its
    deployment; the producer's next kv.turnover resolves it, and so does a clean stop."""
    now = datetime.now(UTC)
    probe = "kv-events-glm-prod-1-abcdef"

    def gap(seq: int, cause: str = "not_connected") -> ev.Event:
        return ev.SourceGap(
            **f.base(seq, probe=probe, ts=now),
            node="vllm-0:8000",
            source="kv_events",
            interval_s=10.0,
            silent_s=70.0,
            cause=cause,  # type: ignore[arg-type]
            reason="no KV event for 70 s: nothing accepts connections at tcp://vllm-0:5557",
        )

    def turnover(seq: int) -> ev.Event:
        return ev.KvTurnover(
            **f.base(seq, probe=probe, ts=now), node="vllm-0:8000", interval_s=10.0,
            stored_blocks=2, removed_blocks=0,
        )  # fmt: skip

    def source_alerts() -> list[dict[str, Any]]:
        return [a for a in env.alerts("telemetry_gap") if a["labels"]["problem"] == "source_silent"]

    env.send(turnover(1))
    assert source_alerts() == []  # figures, no gap: nothing to resolve, nothing stored
    env.send(gap(2), gap(3))
    (alert,) = source_alerts()
    assert alert["state"] == "firing" and alert["labels"]["probe_id"] == probe
    assert alert["annotations"]["cause"] == "not_connected"
    assert "nothing accepts connections at tcp://vllm-0:5557" in alert["annotations"]["summary"]
    rows = env.admin.get("/v1/page-events", params={"deployment_id": "glm-prod"}).json()["items"]
    gaps = [r for r in rows if r["kind"] == "source.gap"]
    assert len(gaps) == 2 and all(r["page_count"] == 0 for r in gaps)
    assert gaps[0]["detail"]["cause"] == "not_connected" and gaps[0]["detail"]["silent_s"] == 70
    assert [r["kind"] for r in rows].count("kv.turnover") == 1  # no zeros stored for the gap
    (dep,) = [d for d in env.admin.get("/v1/fleet").json()["deployments"]
              if d["deployment_id"] == "glm-prod"]  # fmt: skip
    assert dep["status"] != "green"
    (src,) = dep["silent_sources"]
    assert (
        src["probe_id"] == probe
        and src["node"] == "vllm-0:8000"
        and src["cause"] == "not_connected"
    )
    assert any(r.startswith("source silent: KV events of node vllm-0:8000") for r in dep["reasons"])
    # a gap then figures in one batch: the later word (the figures) holds
    env.send(gap(4), turnover(5))
    assert [a["state"] for a in source_alerts()] == ["resolved"]
    assert env.admin.get("/v1/fleet").json()["deployments"][0]["silent_sources"] == []
    env.send(gap(6, "engine_down"))
    assert [a["state"] for a in source_alerts()] == ["firing"]
    env.send(ev.ProbeStopped(**f.base(7, probe=probe, ts=now)))
    assert [a["state"] for a in source_alerts()] == ["resolved"]


def test_a_replica_killed_without_a_word_leaves_the_drift_once_the_collector_knows_it_gone(
    env: Env,
) -> None:
    """vLLM's engine core never sends probe.stopped: a replica that disagreed and was then
    killed keeps the drift firing only until the collector knows its probe gone (silent
    past KVWATCH_PROBE_LOST_AFTER_S: the one decision of collector.lost), never forever."""
    a = {"node": "gpu-a:8000", "role": "both", "disaggregated": False, "dtype": "bfloat16"}
    b = {**a, "node": "gpu-b:8000"}
    other = "probe-replica-b-1-abcdef"
    env.send(cfg(env, prefix_caching=True, **a))
    env.send(f.config(env.next(), probe=other, prefix_caching=False, **b))
    env.tick()
    (drift,) = [x for x in env.alerts("config_drift") if "node" not in x["labels"]]
    assert drift["state"] == "firing"

    sweep = LostRequests(env.db, lost_after_s=300)
    assert sweep.close_silent(datetime.now(UTC) + timedelta(seconds=200)).probes == 0
    env.tick()
    (drift,) = [x for x in env.alerts("config_drift") if "node" not in x["labels"]]
    assert drift["state"] == "firing"  # quiet, not yet known gone
    # past the bound both are quiet; node A's engine is heard from again, B's never
    assert sweep.close_silent(datetime.now(UTC) + timedelta(seconds=301)).probes == 2
    env.send(f.admitted(env.next(), "r-a", tenant="acme", prompt=10, probe=env.probe))
    env.tick()
    (drift,) = [x for x in env.alerts("config_drift") if "node" not in x["labels"]]
    assert drift["state"] == "resolved"
    assert drift["annotations"]["nodes"] == "gpu-a:8000"
