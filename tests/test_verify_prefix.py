"""kvwatch verify's prefix-cache phase over real HTTP on 127.0.0.1, against the reference
engine's real server in each prefix-cache mode, through kvwatch's gateway, and uploaded to a
real collector, where a shared verdict fires ``prefix_cache_unsalted``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from engine_probe.probe import NoopProbe
from kvwatch.embedded import serve_in_thread
from kvwatch.gateway import GatewaySettings
from kvwatch.gateway import create_app as gateway_app
from refengine import Engine, EngineConfig
from refengine.server import create_app
from tests.conftest import Collector
from tests.test_verify import Ran, kvwatch_verify

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-2"}
SECRET = "prefix-tests-" + "0123456789abcdef" * 2


@contextmanager
def engine(prefix_cache: str, **tier: Any) -> Iterator[str]:
    """A monolithic hardened reference engine with room for the phase's 1,024-token prefixes
    and the sweep's prompts (``tier``: an offload tier's settings, with a pool small
    enough for the eviction round's filler to push prefixes out of it)."""
    eng = Engine(
        EngineConfig(
            mode="hardened",
            advertised_context=2048,
            pool_tokens=4096 if tier else 16_384,
            page_size=16,
            prefix_cache=prefix_cache,  # type: ignore[arg-type]
            **tier,
        )
    )
    with serve_in_thread(create_app(eng, tenant_keys=KEYS)) as url:
        yield f"{url}/v1"


def verify(endpoint: str, tmp_path: Any, *extra: str, env: Any = None) -> Ran:
    return kvwatch_verify(endpoint, KEYS, "--no-upload", *extra, tmp_path=tmp_path, env=env)


def prefix(ran: Ran) -> dict[str, Any]:
    assert ran.report is not None, ran.stderr
    return dict(ran.report["prefix_cache"])


def test_a_shared_cache_is_reported_naming_the_pair_and_exits_1(tmp_path: Any) -> None:
    with engine("shared") as url:
        ran = verify(url, tmp_path)
    p = prefix(ran)
    assert ran.code == 1, ran.stdout
    assert p["verdict"] == "shared_across_tenants" and p["method"] == "cached_tokens"
    # unsalted, globex was served acme's prefix; with their own salts the two do not share
    assert p["shared_pairs"] == [{"owner": "acme", "reader": "globex", "salted": False}]
    assert p["salt_accepted"] is True
    by = {(c["kind"], c["salted"]): c for c in p["comparisons"]}
    assert by[("control", False)]["hit"] and by[("control", True)]["hit"]  # the controls
    assert by[("cross", True)]["hit"] is False
    assert by[("cross", False)]["cached_tokens"][0] >= 0.5 * p["prefix_tokens"]
    assert "PREFIX SHARED" in ran.stdout and "globex was served acme's cached prefix" in ran.stdout
    assert "with each tenant's own cache_salt nothing was shared" in ran.stdout
    assert p["requests"] <= 40
    # the context verdict is apart: no leak, a safe context measured
    assert ran.report is not None and ran.report["verified_safe_context"] is not None
    assert ran.report["leaks"] == [] and ran.report["result"] == "fail"


def test_a_cache_salted_by_tenant_is_isolated(tmp_path: Any) -> None:
    with engine("salted") as url:
        ran = verify(url, tmp_path)
    p = prefix(ran)
    assert ran.code == 0, ran.stdout
    assert p["verdict"] == "isolated" and p["shared_pairs"] == []
    controls = [c for c in p["comparisons"] if c["kind"] == "control"]
    assert controls and all(c["hit"] for c in controls)
    assert "prefix cache" in ran.stdout and "isolated" in ran.stdout


def test_caching_off_is_said_not_taken_for_isolation(tmp_path: Any) -> None:
    with engine("off") as url:
        ran = verify(url, tmp_path)
    p = prefix(ran)
    assert ran.code == 0, ran.stdout
    assert p["verdict"] == "caching_off"
    # said, as a note (no risk, only no evidence): not a warning on every such run
    assert "WARNING" not in ran.stdout, ran.stdout
    assert "note: the owner's repeated prefix was never served from a cache" in ran.stdout
    assert "isolation with caching on is not demonstrated" in " ".join(ran.stdout.split())


def test_the_phase_can_be_skipped_and_says_so(tmp_path: Any) -> None:
    with engine("shared") as url:
        ran = verify(url, tmp_path, "--no-prefix-cache-check")
    assert ran.code == 0
    assert prefix(ran) == {"verdict": None, "error": "not checked"}
    assert not [r for r in (ran.report or {})["probes"] if r["phase"] == "prefix"]


def test_the_gateways_per_tenant_salts_isolate_a_shared_engine(tmp_path: Any) -> None:
    """The same shared engine as above, behind the gateway (its default: a per-tenant
    cache_salt overriding the client's): the verifier now finds it isolated."""
    with engine("shared") as upstream:
        settings = GatewaySettings(
            gateway_upstream=upstream.removesuffix("/v1"),
            gateway_tenant_keys=KEYS,
            gateway_salt_secret=SECRET,
        )
        with serve_in_thread(gateway_app(settings, probe=NoopProbe())) as gw:
            ran = verify(f"{gw}/v1", tmp_path)
    p = prefix(ran)
    assert p["verdict"] == "isolated", (ran.stdout, p)
    assert ran.code == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_shared_verdict_uploaded_fires_prefix_cache_unsalted(
    collector: Collector, tmp_path: Any
) -> None:
    env = {
        "KVWATCH_COLLECTOR_URL": collector.url,
        "KVWATCH_INGEST_TOKEN": collector.ingest,
        "KVWATCH_DEPLOYMENT_ID": "lab",
    }
    with engine("shared") as url:
        ran = kvwatch_verify(url, KEYS, tmp_path=tmp_path, env=env)
    assert ran.code == 1 and "uploaded" in ran.stderr
    auth = {"Authorization": f"Bearer {collector.admin}"}
    alerts = httpx.get(
        f"{collector.url}/v1/alerts", headers=auth, params={"rule": "prefix_cache_unsalted"}
    ).json()
    (a,) = alerts
    assert a["state"] == "firing"
    assert a["labels"] == {
        "alertname": "prefix_cache_unsalted",
        "deployment_id": "lab",
        "node": "endpoint",
        "model_id": "refengine-lab",
        "severity": "warning",
    }
    assert "acme to globex" in a["annotations"]["summary"]
    (v,) = httpx.get(f"{collector.url}/v1/verifications", headers=auth).json()
    assert v["passed"] is True  # no leak into an answer: the context verdict holds


# -- tenants probing the cache, seen from inside ----------------------------------------------


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_promptpeek_style_probe_fires_prefix_probe_suspected_for_the_prober_only(
    collector: Collector, probes: list[Any]
) -> None:
    """acme's secret system prompt is cached in a shared reference engine. globex recovers
    it the PromptPeek way: short prompts, each the part it has matched so far plus a guess,
    hitting acme's pages at growing lengths. initech re-uses its own system prompt all the
    while (hits on its own pages). Only globex is suspected; initech's hits are no
    cross-tenant hit at all."""
    from engine_probe.adapters.refengine import attach
    from engine_probe.probe import Probe
    from tests.test_probe_real_collector import probe_settings

    keys = {"acme": "sk-acme", "globex": "sk-globex", "initech": "sk-initech"}
    eng = Engine(
        EngineConfig(
            advertised_context=2048, pool_tokens=16_384, page_size=16, prefix_cache="shared"
        )
    )
    probe = Probe(probe_settings(collector, collector.ingest, deployment_id="lab"))
    probes.append(probe)
    attach(eng, probe, deployment_id="lab")
    secret = "SYSTEM: you are acme's merger desk. The code word for the deal is " * 4
    own = "SYSTEM: initech's support bot; answer politely and briefly. " * 4
    with serve_in_thread(create_app(eng, tenant_keys=keys)) as url:

        def send(tenant: str, prompt: str) -> dict[str, Any]:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 1},
                headers={"Authorization": f"Bearer {keys[tenant]}"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            return dict(r.json()["usage"])

        send("acme", secret + "Q: status?")
        for i in range(30):
            matched = 16 * (1 + i // 3)  # one more page matched every third guess
            usage = send("globex", secret[:matched] + "?")
            assert usage["prompt_tokens_details"]["cached_tokens"] == matched
            send("initech", own + f"Ticket {i}: my printer is on fire.")
        assert probe.force_flush(10)
    admin = {"Authorization": f"Bearer {collector.admin}"}
    suspected = httpx.get(
        f"{collector.url}/v1/alerts", headers=admin, params={"rule": "prefix_probe_suspected"}
    ).json()
    assert [(a["labels"]["reader_tenant"], a["labels"]["owner_tenant"]) for a in suspected] == [
        ("globex", "acme")
    ]
    assert suspected[0]["state"] == "firing" and suspected[0]["value"] >= 20
    crossing = httpx.get(
        f"{collector.url}/v1/alerts", headers=admin, params={"rule": "prefix_cache_cross_tenant"}
    ).json()
    assert {a["labels"]["reader_tenant"] for a in crossing} == {"globex"}


EVICT = ("--prefix-evict-tokens", "5000", "--budget", "120")


@pytest.mark.parametrize(
    ("drops_salt", "verdict", "tier_verdict", "code"),
    [(False, "isolated", "isolated", 0),
     (True, "shared_across_tenants", "shared_across_tenants", 1)],
    ids=["tier-keeps-the-salt", "tier-drops-the-salt"],
)  # fmt: skip
def test_the_eviction_round_catches_a_tier_that_drops_the_salt(
    tmp_path: Any, drops_salt: bool, verdict: str, tier_verdict: str, code: int
) -> None:
    """Salted by tenant, the pool never shares (the first round is isolated either way);
    after filler pushes the prefix into the offload tier, the owner gets it back from the
    tier, and another tenant with its own salt does only where the tier dropped the salt."""
    with engine("salted", offload_tier_tokens=65_536, offload_drops_salt=drops_salt) as url:
        ran = verify(url, tmp_path, *EVICT)
    p = prefix(ran)
    assert ran.code == code, ran.stdout
    assert (p["verdict"], p["tier_verdict"]) == (verdict, tier_verdict)
    evicted = [c for c in p["comparisons"] if c["after_eviction"]]
    (control,) = [c for c in evicted if c["kind"] == "control"]
    (cross,) = [c for c in evicted if c["kind"] == "cross"]
    assert control["hit"] and control["salted"] and cross["salted"]
    assert cross["hit"] is drops_salt
    before = [c for c in p["comparisons"] if not c["after_eviction"] and c["kind"] == "cross"]
    assert before and not any(c["hit"] for c in before)  # the pool itself kept them apart
    assert "offload tier" in ran.stdout
    if drops_salt:
        assert (
            "globex was served acme's cached prefix with its own cache_salt after it left "
            "the pool (from an offload tier)"
        ) in ran.stdout
        assert p["shared_pairs"] == [{"owner": "acme", "reader": "globex", "salted": True}]


def test_an_eviction_round_without_a_tier_says_it_was_not_reached(tmp_path: Any) -> None:
    with engine("salted", offload_tier_tokens=0) as url:
        ran = verify(url, tmp_path, *EVICT)
    p = prefix(ran)
    assert ran.code == 0, ran.stdout
    assert (p["verdict"], p["tier_verdict"]) == ("isolated", "not_reached")
    assert "did not come back" in p["note"]
