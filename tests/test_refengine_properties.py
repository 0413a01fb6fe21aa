"""refengine under random workloads: whatever the sizes, topology and arrival times, every
request that prefill really wrote reads back exactly its own prompt, pages are never lost,
nothing deadlocks, and stale reads happen only on the legacy placeholder path."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from refengine import EOS, ContextLengthExceeded, Engine, EngineConfig, Request
from tests.test_refengine import Recorder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADVERTISED = 300
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def prompt_of(tenant: int, i: int, length: int) -> str:
    """ASCII (one token per character), distinct per request."""
    head = f"T{tenant}R{i}:"
    body = "".join(ALPHABET[(i * 7 + j) % len(ALPHABET)] for j in range(length))
    return (head + body)[:length]


workloads = st.lists(
    st.tuples(
        st.integers(0, 3),  # tenant
        st.integers(1, 60) | st.integers(1, 330),  # prompt tokens (some over the context)
        st.integers(1, 400),  # max_tokens
        st.integers(0, 10),  # step at which it arrives
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    topology=st.sampled_from(["monolithic", "disaggregated"]),
    mode=st.sampled_from(["legacy", "hardened"]),
    zeroize=st.booleans(),
    page_size=st.sampled_from([4, 8, 16]),
    pool_pages=st.integers(2, 40),
    decode_pages=st.integers(2, 80),
    max_batch=st.integers(1, 5),
    work=workloads,
)
def test_random_workloads(
    topology: Any,
    mode: Any,
    zeroize: bool,
    page_size: int,
    pool_pages: int,
    decode_pages: int,
    max_batch: int,
    work: list[tuple[int, int, int, int]],
) -> None:
    disagg = topology == "disaggregated"
    eng = Engine(
        EngineConfig(
            mode=mode,
            topology=topology,
            advertised_context=ADVERTISED,
            pool_tokens=pool_pages * page_size,
            decode_pool_tokens=decode_pages * page_size if disagg else None,
            page_size=page_size,
            max_batch=max_batch,
            zeroize_on_free=zeroize,
        )
    )
    rec = Recorder()
    eng.add_observer(rec)
    pcap = eng.prefill_pool.capacity_tokens
    dcap = eng.decode_pool.capacity_tokens
    accepted: list[Request] = []
    arrivals = sorted(enumerate(work), key=lambda x: x[1][3])
    step = 0
    while arrivals or eng.has_work:
        while arrivals and arrivals[0][1][3] <= step:
            i, (tenant, length, max_tokens, _) = arrivals.pop(0)
            text = prompt_of(tenant, i, length)
            over_pool = length > min(pcap, dcap)
            try:
                accepted.append(eng.submit(text, f"tenant-{tenant}", max_tokens))
            except ContextLengthExceeded as e:
                event(f"clean rejection: {e.reason}")
                assert length > ADVERTISED or (mode == "hardened" and over_pool)
                assert e.limit_tokens == (ADVERTISED if length > ADVERTISED else min(pcap, dcap))
            else:
                assert length <= ADVERTISED and (mode == "legacy" or not over_pool)
        eng.step()
        eng.check_invariants()
        step += 1
        assert step < 3000, "the engine stopped making progress"

    assert all(p.used_pages == 0 for p in eng.pools.values())
    placeholder_readers = set()
    for r in accepted:
        assert r.status == "finished" and 1 <= r.completion_tokens <= r.max_tokens
        if r.prefill_rejected:
            assert disagg and mode == "legacy" and r.prompt_tokens > pcap
            placeholder_readers.add(r.handle)
            event("legacy placeholder path" + (" (zeroized)" if zeroize else ""))
            if zeroize:  # nothing stale left to read: no byte of anyone's text comes out
                assert all(t >= 256 for t in r.output_tokens)
            continue
        # Everything prefill wrote is read back exactly, then EOS.
        out = r.output_tokens
        n = min(len(out), r.prompt_tokens)
        assert bytes(out[:n]) == r.prompt[:n]
        if len(out) > r.prompt_tokens:
            assert out[r.prompt_tokens :] == [EOS]
    readers = {reader for reader, _, _ in rec.stale}
    if readers:
        event("stale reads seen")
    if any(len(set(e[3])) > 1 for e in rec.kinds("read")):
        event("batched decode")
    assert readers <= placeholder_readers


# -- with the prefix cache on --------------------------------------------------------------

PREFIXES = ("You are helpful; answer in one line. ", "Summarise the memo below for legal. ")


def shared_prompt_of(topic: int, tenant: int, i: int, length: int) -> str:
    """A common system prefix per topic (what a prefix cache shares), then a distinct tail;
    ASCII, one token per character."""
    return (PREFIXES[topic] * 4 + prompt_of(tenant, i, length))[: 40 + length]


cached_workloads = st.lists(
    st.tuples(
        st.integers(0, 2),  # tenant
        st.integers(0, 1),  # topic: which shared prefix
        st.integers(1, 80) | st.integers(1, 300),  # tail tokens (some over a small pool)
        st.integers(1, 120),  # max_tokens
        st.integers(0, 10),  # step at which it arrives
        st.sampled_from([None, "s1", "s2"]),  # cache_salt
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["legacy", "hardened"]),
    cache=st.sampled_from(["shared", "salted"]),
    zeroize=st.booleans(),
    page_size=st.sampled_from([4, 8, 16]),
    pool_pages=st.integers(4, 60),
    max_batch=st.integers(1, 5),
    work=cached_workloads,
)
def test_random_workloads_with_the_prefix_cache(
    mode: Any,
    cache: Any,
    zeroize: bool,
    page_size: int,
    pool_pages: int,
    max_batch: int,
    work: list[tuple[int, int, int, int, int, str | None]],
) -> None:
    """Whatever shares what and whatever the pool evicts: every request reads back exactly
    the prompt prefill wrote (a wrong granted or evicted page would come out as wrong
    text), every page is free, cached or held as the invariants say after every step, hits
    never cross what the keys separate, and neither the oracle nor the page ledger sees a
    stale read."""
    from engine_probe import events as ev
    from engine_probe.adapters.refengine import attach
    from engine_probe.recording import RecordingProbe

    prefix_cache = cache
    eng = Engine(
        EngineConfig(
            mode=mode,
            advertised_context=ADVERTISED + 40,
            pool_tokens=pool_pages * page_size,
            page_size=page_size,
            max_batch=max_batch,
            zeroize_on_free=zeroize,
            prefix_cache=prefix_cache,
        )
    )
    rec = Recorder()
    eng.add_observer(rec)
    probe = RecordingProbe()
    adapter = attach(eng, probe)
    accepted: list[tuple[Request, str | None]] = []
    arrivals = sorted(enumerate(work), key=lambda x: x[1][4])
    step = 0
    while arrivals or eng.has_work:
        while arrivals and arrivals[0][1][4] <= step:
            i, (tenant, topic, length, max_tokens, _, salt) = arrivals.pop(0)
            text = shared_prompt_of(topic, tenant, i, length)
            try:
                req = eng.submit(text, f"tenant-{tenant}", max_tokens, cache_salt=salt)
            except ContextLengthExceeded:
                continue
            accepted.append((req, salt))
        eng.step()
        eng.check_invariants()
        step += 1
        assert step < 5000, "the engine stopped making progress"

    assert eng.prefix_cache is not None
    assert eng.prefill_pool.used_pages == eng.prefix_cache.cached_pages  # all idle now
    assert eng.prefix_cache.idle_pages == eng.prefix_cache.cached_pages
    by_id = {r.request_id: (r, salt) for r, salt in accepted}
    for r, _ in accepted:
        assert r.status == "finished" and 1 <= r.completion_tokens <= r.max_tokens
        out = r.output_tokens
        wrote = r.cached_prompt_tokens
        n = min(len(out), wrote)
        assert bytes(out[:n]) == r.prompt[:n]
        if len(out) > wrote:
            assert out[wrote:] == [EOS]
        assert r.cached_tokens % page_size == 0 and r.cached_tokens < max(wrote, 1)
        if r.cached_tokens:
            event("prefix-cache hit")
            assert not r.truncated
    for hit in probe.of(ev.PrefixCacheHit):
        reader, reader_salt = by_id[hit.reader_request_id]
        owner, owner_salt = by_id[hit.owner_request_id]
        assert reader.prompt[: hit.tokens] == owner.prompt[: hit.tokens]
        assert reader_salt == owner_salt  # both modes key by the request's salt
        if prefix_cache == "salted":
            assert reader.tenant == owner.tenant
        if reader.tenant != owner.tenant:
            event("cross-tenant hit")
    if eng.prefix_cache.evictions:
        event("evictions")
    assert rec.stale == []
    assert probe.of(ev.PageStaleRead) == [] and adapter.counters["stale_reads"] == 0
    for ledger in adapter.ledgers.values():
        assert ledger.check_invariants() == []
