"""kvwatch's plugin in a live disaggregated SGLang deployment, the incident's topology.

One pair per module (``tests/engine_servers.py``): SGLang 0.5.23 prefill and decode servers
on the CPU, each with ``KVWATCH_SGLANG_PROBE=1``, KV moving between them over Mooncake's TCP
transport, and SGLang's router in front; clients talk to the router only. The sizing is the
incident's, scaled down: the prefill pool (1,024 tokens) is smaller than the advertised
context (2,048), the decode pool holds 2,048. What the collector then holds is checked
against SGLang's own figures: one request row per request although two servers each saw half
of it, a transfer per request, pool samples per node, no false stale read on decode (whose
probe checks which announced pages a transfer really overwrote), and a prompt over the
prefill pool refused with no transfer at all.

The incident itself: neither SGLang release tried here transfers a rejected request's KV on
this CPU path. 0.5.21 retires a request rejected at intake before any transfer is set up
(``PrefillBootstrapQueue.add`` → ``is_unadmitted_reject``); 0.5.20 still bootstraps and
prefills the one-token placeholder, but its prefill result path releases the aborted
request without sending, and decode gives up after its waiting timeout (both tried live on
this machine). So the incident's defect, prefill telling decode a transfer is done after
sending one page of many, is injected into this pair's prefill server for one tenant
(``engines/sglang/site/sitecustomize.py``, test only), and everything after it is SGLang's
and kvwatch's own: a real Mooncake transfer of that one page, decode decoding over the
rest, the decode probe's arrival check, the collector's stale read, alert and incident.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.engine_servers import (
    FAULT_GUARD,
    FAULT_TENANT,
    PD_DECODE_POOL_TOKENS,
    PD_PREFILL_POOL_TOKENS,
    SERVER_TEST_TIMEOUT,
    SglangPair,
    sglang_pair_fixture,
    wait_for,
)
from tests.engine_servers import collector_get as get

pytestmark = [pytest.mark.slow, SERVER_TEST_TIMEOUT]

A, B = "pd-tenant-a", "pd-tenant-b"
#: the incident's two tenants: VICTIM's KV fills decode's pool; READER's prefill sends one
#: page (the injected SGLang defect) and decode reads the rest
VICTIM, READER = "hooli", "massive-dynamic"

sglang_pd = sglang_pair_fixture(
    ".venv-sglang",
    "sglang-pd",
    # by default decode backs retracted requests' KV up into a host pool it registers with
    # CUDA: on the CPU, no backup
    decode_args=("--disaggregation-decode-retraction-backup", "none"),
    env={
        # TEST ONLY: SGLang's prefill sends READER's requests one page of KV and reports the
        # transfer done (engines/sglang/site/sitecustomize.py)
        "prefill": {
            "KVWATCH_TEST_FAULT_INJECTION": FAULT_GUARD,
            "KVWATCH_TEST_SGLANG_SEND_ONE_PAGE_OF_TENANT": READER,
        },
        # TEST ONLY: the decode probe leaves FAULT_TENANT's first arrivals out of its ledger
        "decode": {
            "KVWATCH_TEST_FAULT_INJECTION": FAULT_GUARD,
            "KVWATCH_TEST_LOSE_KV_WRITE_OF_TENANT": FAULT_TENANT,
        },
    },
)


def text(seed: int, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens for the tiny model's tokenizer (three per
    two-digit number and its space); SGLang's ``usage`` gives the exact count."""
    rng = random.Random(seed)
    return " ".join(str(rng.randrange(10, 99)) for _ in range(max(1, tokens // 3)))


def requests_of(pair: SglangPair, tenant: str) -> list[dict[str, Any]]:
    return list(get(pair, "/v1/requests", tenant=tenant, limit=100)["items"])


def events(pair: SglangPair, kind: str) -> list[dict[str, Any]]:
    return list(get(pair, "/v1/page-events", kind=kind, limit=500)["items"])


def test_each_node_reports_its_own_pool_and_role(sglang_pd: SglangPair) -> None:
    info = {role: sglang_pd.server_info(role) for role in ("prefill", "decode")}

    def configs() -> dict[str, dict[str, Any]]:
        deps = get(sglang_pd, "/v1/deployments")
        return {cfg["node"]: cfg for d in deps for cfg in d["config"]
                if d["deployment_id"] == sglang_pd.deployment_id}  # fmt: skip

    cfgs = wait_for(configs, lambda c: len(c) == 2)
    assert set(cfgs) == {sglang_pd.nodes["prefill"], sglang_pd.nodes["decode"]}
    for role, pool in (("prefill", PD_PREFILL_POOL_TOKENS), ("decode", PD_DECODE_POOL_TOKENS)):
        cfg = cfgs[sglang_pd.nodes[role]]
        assert cfg["role"] == role
        assert cfg["disaggregated"] is True
        assert cfg["engine_version"] == info[role]["version"] == "0.5.23"
        assert cfg["pool_capacity_tokens"] == info[role]["max_total_num_tokens"] == pool
        assert cfg["advertised_context"] == info[role]["context_length"]
    # the incident's sizing, as the probe reports it: prefill's pool below the context
    assert (
        cfgs[sglang_pd.nodes["prefill"]]["pool_capacity_tokens"]
        < cfgs[sglang_pd.nodes["prefill"]]["advertised_context"]
    )

    samples = wait_for(
        lambda: get(sglang_pd, "/v1/pool-samples")["items"],
        lambda items: (
            {(s["node"], s["role"]) for s in items}
            >= {(sglang_pd.nodes["prefill"], "prefill"), (sglang_pd.nodes["decode"], "decode")}
        ),
    )
    for s in samples:
        expected = PD_PREFILL_POOL_TOKENS if s["role"] == "prefill" else PD_DECODE_POOL_TOKENS
        assert s["capacity"] == expected


def test_a_request_is_one_row_although_two_servers_each_saw_half(
    sglang_pd: SglangPair,
) -> None:
    sent = {
        "a1": sglang_pd.complete(text(1, 300), tenant=A, max_tokens=5),
        "a2": sglang_pd.complete(text(2, 600), tenant=A, max_tokens=3),
        "b1": sglang_pd.complete(text(3, 450), tenant=B, max_tokens=4),
    }
    for name, r in sent.items():
        assert r.status_code == 200, (name, r.text)
    usage = {name: r.json()["usage"] for name, r in sent.items()}
    rows = {
        tenant: wait_for(
            lambda t=tenant: requests_of(sglang_pd, t),
            lambda rs, n=n: len(rs) == n and all(r["status"] == "length" for r in rs),
        )
        for tenant, n in ((A, 2), (B, 1))
    }
    by_prompt = {r["prompt_tokens"]: r for rs in rows.values() for r in rs}
    assert sorted(by_prompt) == sorted(u["prompt_tokens"] for u in usage.values())
    for name, u in usage.items():
        row = by_prompt[u["prompt_tokens"]]
        # admitted on prefill, finished on decode: one row, named by the bootstrap room
        assert row["request_id"].startswith("pd-"), row
        assert row["completion_tokens"] == u["completion_tokens"], (name, row)
        assert row["tenant"] == (B if name.startswith("b") else A)

    # prefill sent each request's KV to decode: one transfer of the whole prompt each
    transfers = wait_for(
        lambda: [e for e in events(sglang_pd, "kv.transfer") if e["tenant"] in (A, B)],
        lambda es: len(es) == 3,
    )
    for e in transfers:
        row = next(r for r in by_prompt.values() if r["request_id"] == e["request_id"])
        assert e["node"] == sglang_pd.nodes["prefill"]
        assert e["detail"]["tokens"] == row["prompt_tokens"]
        assert e["detail"]["prefill_rejected"] is False

    # both pools' occupancy followed the traffic (not only the empty pool at start)
    wait_for(
        lambda: get(sglang_pd, "/v1/pool-samples")["items"],
        lambda items: (
            {s["node"] for s in items if s["used_max"] > 0}
            == {sglang_pd.nodes["prefill"], sglang_pd.nodes["decode"]}
        ),
    )
    # decode read every page it received, and its probe found each overwritten by the
    # transfer: no stale read (the positive control below shows the check is live)
    # nor any other: SGLang's start-up warm-up on decode, a fake transfer that writes
    # nothing, is neither a finding nor a request
    assert events(sglang_pd, "page.stale_read") == []
    # SGLang's own /health generations are not requests of anybody's
    assert {r["tenant"] for r in get(sglang_pd, "/v1/requests", limit=500)["items"]} == {A, B}
    probes = [p for p in get(sglang_pd, "/v1/probes")
              if p["deployment_id"] == sglang_pd.deployment_id]  # fmt: skip
    assert len(probes) >= 2
    assert all(p["missing"] == 0 and p["reported_drops"] == {} for p in probes)
    for role in ("prefill", "decode"):
        log = sglang_pd.log_tail(role, 10**7)
        for failure in ("kvwatch SGLang hook", "kvwatch could not watch", "failed to register"):
            assert failure not in log, (role, failure)


def test_a_prompt_over_the_prefill_pool_is_refused_and_nothing_is_transferred(
    sglang_pd: SglangPair,
) -> None:
    """SGLang 0.5.23 rejects the over-pool prompt at prefill's intake and sends no KV: the
    decode half of the request gets nothing and gives up (after SGLang's waiting timeout,
    15 s here): the client gets an error, not text."""
    r = sglang_pd.complete(text(4, 1200), tenant=B, max_tokens=8)
    assert r.status_code >= 400, r.text
    assert "choices" not in r.text
    (row,) = wait_for(
        lambda: [x for x in requests_of(sglang_pd, B) if x["prompt_tokens"] > 1024],
        lambda rs: len(rs) == 1 and rs[0]["status"] not in ("admitted",),
    )
    assert row["request_id"].startswith("pd-")
    assert row["reject_reason"] == "pool_exhausted", row
    assert row["limit_tokens"] is not None and row["limit_tokens"] < PD_PREFILL_POOL_TOKENS
    assert row["prompt_tokens"] > row["limit_tokens"]
    assert not [e for e in events(sglang_pd, "kv.transfer") if e["request_id"] == row["request_id"]]
    assert not [e for e in events(sglang_pd, "page.stale_read") if e["tenant"] in (A, B)]


def test_positive_control_decode_reads_of_pages_it_never_saw_arrive_are_caught(
    sglang_pd: SglangPair,
) -> None:
    """The decode server's probe is told (test-only fault injection) to leave the pages that
    FAULT_TENANT's first transfer delivered out of its ledger: decode's own reads of them
    must then be reported as stale reads, through the real collector. So "no stale read"
    above comes from read checks that run on the live decode server."""
    r = sglang_pd.complete(text(5, 200), tenant=FAULT_TENANT, max_tokens=2)
    assert r.status_code == 200, r.text
    found = wait_for(
        lambda: [e for e in events(sglang_pd, "page.stale_read") if e["tenant"] == FAULT_TENANT],
        bool,
    )
    (row,) = wait_for(lambda: requests_of(sglang_pd, FAULT_TENANT), bool)
    assert {e["request_id"] for e in found} == {row["request_id"]}
    assert {e["node"] for e in found} == {sglang_pd.nodes["decode"]}
    assert sum(e["page_count"] for e in found) >= row["prompt_tokens"] - 1


def test_the_incident_live_a_partial_transfer_reads_another_tenants_kv(
    sglang_pd: SglangPair,
) -> None:
    """The incident's last links on the live pair: decode is told a transfer is done when
    prefill sent one page of many (SGLang's pre-fix rejection path, injected into the
    prefill server for READER's requests), and decodes over pages that still hold VICTIM's
    KV. kvwatch's decode probe sees which pages never arrived; the collector gets a
    cross-tenant stale read naming both tenants, a critical alert and an incident."""
    for seed in range(3):  # VICTIM's KV walks through decode's whole pool
        r = sglang_pd.complete(text(100 + seed, 900), tenant=VICTIM, max_tokens=4)
        assert r.status_code == 200, r.text
    victim_rows = wait_for(
        lambda: requests_of(sglang_pd, VICTIM),
        lambda rows: len(rows) == 3 and all(x["status"] == "length" for x in rows),
    )

    r = sglang_pd.complete(text(200, 600), tenant=READER, max_tokens=6)
    assert r.status_code == 200, r.text  # decode answered: over KV it never received
    (row,) = wait_for(
        lambda: requests_of(sglang_pd, READER),
        lambda rows: len(rows) == 1 and rows[0]["status"] == "length",
    )
    (transfer,) = [
        e for e in events(sglang_pd, "kv.transfer") if e["request_id"] == row["request_id"]
    ]
    assert transfer["page_count"] == 1  # what prefill really sent
    stale = wait_for(
        lambda: [e for e in events(sglang_pd, "page.stale_read") if e["tenant"] == READER],
        bool,
    )
    assert {(e["node"], e["request_id"]) for e in stale} == {
        (sglang_pd.nodes["decode"], row["request_id"])
    }
    assert all(e["cross_tenant"] for e in stale), stale
    exposed = [e for e in stale if e["other_tenant"] == VICTIM]
    assert {e["other_request_id"] for e in exposed} <= {x["request_id"] for x in victim_rows}
    # every prompt page but the one sent (decode's own generated tokens are its own); a
    # page or two may have been SGLang's own /health generation's last
    assert sum(e["page_count"] for e in stale) == row["prompt_tokens"] - 1
    assert sum(e["page_count"] for e in exposed) >= row["prompt_tokens"] - 3

    with sglang_pd.collector.client() as c:
        alerts = wait_for(
            lambda: [
                a
                for a in c.get("/v1/alerts", params={"rule": "stale_page_read"}).json()
                if a["labels"].get("reader_tenant") == READER
            ],
            bool,
        )
        (alert,) = alerts
        assert alert["severity"] == "critical" and alert["state"] == "firing"
        assert alert["deployment_id"] == sglang_pd.deployment_id
        assert (alert["labels"]["previous_tenant"], alert["labels"]["cross_tenant"]) == (
            VICTIM,
            "true",
        )
        assert alert["incident_id"] is not None
        incident = c.get(f"/v1/incidents/{alert['incident_id']}").json()
        assert incident["deployment_id"] == sglang_pd.deployment_id
        assert incident["state"] == "open"
