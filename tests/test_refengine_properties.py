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
