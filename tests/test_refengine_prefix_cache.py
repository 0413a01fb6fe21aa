"""refengine's prefix cache, through the engine's public interface, its HTTP server and the
probe: who shares cached pages with whom in each mode, what a hit saves, LRU eviction under
pressure that never evicts a page in use nor returns wrong KV (the lab model decodes what
the KV holds, so a wrong page comes out as wrong text), and the page ledger seeing granted
pages as legitimate reads while still catching stale ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import torch

from engine_probe import events as ev
from engine_probe.adapters.refengine import RefengineAdapter, attach
from engine_probe.recording import RecordingProbe
from kvwatch.embedded import serve_in_thread
from refengine import EOS, Engine, EngineConfig, Request
from refengine.prefix_cache import PrefixCache
from refengine.server import create_app
from tests.metrics_text import samples
from tests.test_refengine import Recorder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PS = 16
SYSTEM = ("You are a careful assistant. Answer briefly and cite the memo. " * 3)[:128]
assert len(SYSTEM) == 8 * PS


def most(prompt: str) -> int:
    """Tokens a full hit grants: the prompt's full pages, less the last token's page."""
    return (len(prompt.encode()) - 1) // PS * PS


def make(prefix_cache: str = "shared", **kw: Any) -> Engine:
    base: dict[str, Any] = {
        "advertised_context": 1024,
        "pool_tokens": 1024,
        "page_size": PS,
        "prefix_cache": prefix_cache,
    }
    return Engine(EngineConfig(**(base | kw)))


def run(eng: Engine, prompt: str, tenant: str, max_tokens: int = 400, **kw: Any) -> Request:
    """Submit and step to the end, checking the engine's invariants after every step."""
    req = eng.submit(prompt, tenant, max_tokens, **kw)
    while not req.finished:
        eng.step()
        eng.check_invariants()
    return req


def reads_back(req: Request, prompt: str) -> bool:
    """The lab model decodes the KV it reads: its own prompt (as much as its budget lets it
    generate), then EOS."""
    data, out = prompt.encode(), req.output_tokens
    n = min(len(out), len(data))
    return bytes(out[:n]) == data[:n] and out[n:] in ([], [EOS])


# -- the engine ----------------------------------------------------------------------------


def test_a_repeated_prompt_hits_and_prefill_computes_only_the_rest() -> None:
    eng = make()
    rec = Recorder()
    eng.add_observer(rec)
    prompt = SYSTEM + "Question one?"  # 141 tokens: 8 full pages
    first = run(eng, prompt, "acme")
    assert first.cached_tokens == 0 and reads_back(first, prompt)
    cache = eng.prefix_cache
    assert cache is not None and cache.cached_pages == 8 and cache.idle_pages == 8

    second = eng.submit(prompt, "acme", 400)
    step = eng.step()
    assert second.cached_tokens == 8 * PS
    assert step.prefill_tokens == len(prompt) - 8 * PS  # the granted prefix is not computed
    hit = rec.kinds("hit")[-1]
    assert hit[3] == second.request_id and hit[4] == [first.handle] * 8
    writes = [e for e in rec.kinds("write") if e[3] == second.request_id]
    assert len(writes) == 1 and not set(writes[0][2]) & set(hit[2])  # only fresh pages written
    eng.run_until_idle()
    eng.check_invariants()
    assert reads_back(second, prompt) and second.completion().cached_tokens == 128
    assert rec.stale == []

    # A prompt exactly on a page boundary still computes its last page (the first token's
    # query needs its last token), as vLLM does.
    whole = SYSTEM  # 128 tokens, 8 full pages
    third = run(eng, whole, "acme")
    assert third.cached_tokens == 7 * PS and reads_back(third, whole)


def test_a_page_matches_only_with_its_whole_prefix() -> None:
    eng = make()
    run(eng, SYSTEM + "tail", "acme")
    # Same second half, different first page: nothing matches, though pages 2.. are equal.
    other = "X" + SYSTEM[1:] + "tail"
    assert run(eng, other, "acme").cached_tokens == 0
    # Same first 3 pages then different: exactly 3 pages hit.
    fork = SYSTEM[: 3 * PS] + "Y" * 80
    assert run(eng, fork, "acme").cached_tokens == 3 * PS


def test_off_never_hits() -> None:
    eng = make("off")
    for _ in range(3):
        assert run(eng, SYSTEM + "again", "acme").cached_tokens == 0
    assert eng.prefix_cache is None and eng.prefill_pool.used_pages == 0


@pytest.mark.parametrize(
    ("mode", "salts", "shared"),
    [
        # shared (vLLM's keys): the same salt shares, different ones do not, and no salt is
        # the same (empty) salt: tenants whose clients do not salt share everything
        ("shared", (None, None), True),
        ("shared", ("same", "same"), True),
        ("shared", ("a", "b"), False),
        # salted (by tenant, on the server): never across tenants, whatever the salts
        ("salted", (None, None), False),
        ("salted", ("same", "same"), False),
    ],
)
def test_who_shares_cached_pages(
    mode: str, salts: tuple[str | None, str | None], shared: bool
) -> None:
    eng = make(mode)
    prompt = SYSTEM + "What is the merger code?"
    a = run(eng, prompt, "acme", cache_salt=salts[0])
    b = run(eng, prompt, "globex", cache_salt=salts[1])
    assert b.cached_tokens == (most(prompt) if shared else 0)
    assert reads_back(a, prompt) and reads_back(b, prompt)
    # The same tenant with the same salt always hits its own pages.
    again = run(eng, prompt, "acme", cache_salt=salts[0])
    assert again.cached_tokens == most(prompt)


def test_configuration_rules() -> None:
    with pytest.raises(ValueError, match="monolithic"):
        EngineConfig(prefix_cache="shared", topology="disaggregated")
    with pytest.raises(ValueError, match="prefix_cache must be"):
        EngineConfig(prefix_cache="on")  # type: ignore[arg-type]
    eng = make("salted")
    info = eng.info()
    assert info["prefix_cache"] is True and info["prefix_cache_mode"] == "salted"
    assert info["prefix_cache_salting"] is True
    assert make("shared").info()["prefix_cache_salting"] is False  # isolation left to clients
    assert make("off").info()["prefix_cache"] is False
    with pytest.raises(ValueError, match="cache_salt"):
        eng.submit("hi", "acme", cache_salt="")


def test_lru_eviction_under_pressure_never_evicts_a_page_in_use() -> None:
    """A 24-page pool: a long request holds granted pages while a stream of other prompts
    fills and evicts the cache around it; it still reads back its own prompt, as does every
    other request, and the engine's invariants hold after every step."""
    eng = make(pool_tokens=24 * PS, advertised_context=24 * PS)
    rec = Recorder()
    eng.add_observer(rec)
    cache = eng.prefix_cache
    assert cache is not None
    warm = run(eng, SYSTEM + "warm", "acme", max_tokens=1)
    assert warm.completion_tokens == 1 and cache.cached_pages == 8
    # Holds the 8 cached pages (granted) and 3 of its own for 100 decode steps.
    long = eng.submit(SYSTEM + "hold", "acme", 100)
    others: list[tuple[Request, str]] = []
    for i in range(12):
        eng.step()
        eng.check_invariants()
        prompt = f"{i:02d}" + chr(65 + i) * 60  # 62 tokens, 3 full pages, distinct per i
        others.append((eng.submit(prompt, "globex", 40), prompt))
        held = set(long.cached_pages)
        assert held and not held & set(cache.idle)  # in use: never idle, never evictable
    eng.run_until_idle()
    eng.check_invariants()
    assert cache.evictions > 0  # the pool was too small to keep everything
    assert long.cached_tokens == 8 * PS and reads_back(long, SYSTEM + "hold")
    for req, prompt in others:
        assert req.status == "finished"
        assert bytes(req.output_tokens) == prompt.encode()[: req.completion_tokens]
    assert rec.stale == []
    # What was evicted is gone from the cache: a prompt seen early misses now.
    assert run(eng, "00" + "A" * 60, "globex").cached_tokens == 0


def test_a_prompt_that_prefill_does_not_write_whole_stays_out_of_the_cache() -> None:
    """Legacy monolithic truncation is unchanged: the cut prompt neither hits nor is
    cached."""
    eng = make(mode="legacy", pool_tokens=8 * PS, advertised_context=1024)
    long = SYSTEM + "z" * 100  # 228 tokens > a 128-token pool
    r1 = run(eng, long, "acme")
    r2 = run(eng, long, "acme")
    assert r1.truncated and r2.truncated and r2.cached_tokens == 0
    assert eng.prefix_cache is not None and eng.prefix_cache.cached_pages == 0


# -- the probe -------------------------------------------------------------------------------


def test_the_probe_reports_every_hit_with_owner_and_reader_and_no_stale_read() -> None:
    eng = make("shared")
    probe = RecordingProbe()
    adapter = attach(eng, probe)
    prompt = SYSTEM + "status?"
    a = run(eng, prompt, "acme")
    b = run(eng, prompt, "acme")  # same tenant
    c = run(eng, prompt, "globex")  # across tenants: no salt, like acme's
    hits = probe.of(ev.PrefixCacheHit)
    assert [(h.reader_request_id, h.owner_request_id) for h in hits] == [
        (b.request_id, a.request_id),
        # c's pages: page 0..7 were a's (b hit them, cached nothing new)
        (c.request_id, a.request_id),
    ]
    assert [(h.reader_tenant, h.owner_tenant, h.pages, h.tokens) for h in hits] == [
        ("acme", "acme", 8, 128),
        ("globex", "acme", 8, 128),
    ]
    assert all(h.salted is False for h in hits)
    assert [h.cross_tenant for h in hits] == [False, True]
    assert adapter.counters["prefix_hits_same_tenant"] == 1
    assert adapter.counters["prefix_hits_cross_tenant"] == 1
    assert probe.of(ev.PageStaleRead) == [] and adapter.counters["stale_reads"] == 0
    finished = {f.request_id: f.cached_tokens for f in probe.of(ev.RequestFinished)}
    assert finished == {a.request_id: 0, b.request_id: 128, c.request_id: 128}
    (config,) = probe.of(ev.EngineConfig)
    assert config.prefix_caching is True and config.prefix_cache_salting is False
    # Idle cached pages are evictable: a pool sample counts them free, as vLLM does.
    assert eng.prefill_pool.used_pages == 8 and eng.prefill_pool.cached_idle_pages == 8
    adapter.sample_pools()
    sample = probe.of(ev.PoolSample)[-1]
    assert sample.used_tokens == 0 and sample.free_tokens == sample.capacity_tokens
    for ledger in adapter.ledgers.values():
        assert ledger.check_invariants() == []
        assert ledger.granted(b.handle) == 0  # revoked when the reader finished
    assert probe.decoded()  # the collector would take every event


def test_the_probe_says_salting_by_tenant_and_marks_salted_hits() -> None:
    eng = make("salted")
    probe = RecordingProbe()
    attach(eng, probe)
    run(eng, SYSTEM, "acme")
    run(eng, SYSTEM, "globex")  # misses: another tenant
    run(eng, SYSTEM, "acme")
    (config,) = probe.of(ev.EngineConfig)
    assert config.prefix_caching is True and config.prefix_cache_salting is True
    (hit,) = probe.of(ev.PrefixCacheHit)
    assert hit.salted is True and hit.reader_tenant == hit.owner_tenant == "acme"
    off = make("off")
    probe_off = RecordingProbe()
    attach(off, probe_off)
    run(off, SYSTEM, "acme")
    (config,) = probe_off.of(ev.EngineConfig)
    assert config.prefix_caching is False
    assert [f.cached_tokens for f in probe_off.of(ev.RequestFinished)] == [None]


class EvictsPagesInUse(PrefixCache):
    """A broken cache (the positive control): it evicts least recently *cached* pages,
    held or not, as an allocator that forgot the reference counts would."""

    def evict(self, n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for p in list(self.key_of)[:n]:
            del self.by_key[self.key_of.pop(p)]
            out.append((p, self.computed_by.pop(p)))
            del self.refs[p]
            self.idle.pop(p, None)
        return out

    def release(self, pages: Any) -> None:
        # (a page evicted from under its holder may be somebody else's cached page by now)
        super().release([p for p in pages if self.refs.get(p, 0) > 0])

    @property
    def idle_pages(self) -> int:
        return self.cached_pages  # held ones counted as evictable too


def test_stale_reads_are_still_caught_with_the_cache_on() -> None:
    """An engine that evicts a page a request was granted, and hands it to another tenant
    who overwrites it: the granted reader now reads that tenant's KV (its text comes out),
    and the ledger reports it as the reader's stale read, naming the new writer."""
    eng = make("shared", pool_tokens=12 * PS, advertised_context=12 * PS)
    eng.prefix_cache = EvictsPagesInUse(eng.prefill_pool.num_pages)
    probe = RecordingProbe()
    adapter = attach(eng, probe)
    shared = "S" * (4 * PS) + "owner"
    run(eng, shared, "acme", max_tokens=1)
    reader = eng.submit("S" * (4 * PS) + "reader", "acme", 60)
    eng.step()
    assert reader.cached_tokens == 4 * PS
    intruder = eng.submit("I" * (7 * PS), "globex", 1)  # needs pages: evicts held ones
    while not reader.finished:
        eng.step()
    assert intruder.status == "finished"
    stale = probe.of(ev.PageStaleRead)
    assert stale and adapter.counters["stale_reads"] >= 1
    assert {s.reader_request_id for s in stale} == {reader.request_id}
    assert {s.previous_request_id for s in stale} == {intruder.request_id}
    assert all(s.reader_tenant == "acme" and s.previous_tenant == "globex" for s in stale)
    assert b"I" in bytes(reader.output_tokens)  # the wrong KV really came out


def test_the_canary_never_paints_a_cached_page() -> None:
    """Cached pages are not freed when their request ends (only when evicted), so the
    canary detector never paints KV a later request is granted; evicted pages are painted
    and then overwritten before anyone reads them."""
    eng = make("shared", pool_tokens=20 * PS, advertised_context=300)
    probe = RecordingProbe()
    adapter = attach(eng, probe, canary=True)
    system = "Shared system prompt for everyone, please be nice. " * 2
    reqs = []
    for i in range(24):
        prompt = system + f"user {i} " + "x" * (i * 3)
        reqs.append((eng.submit(prompt, f"t{i % 3}", 30), prompt))
        eng.step()
        eng.check_invariants()
    eng.run_until_idle()
    eng.check_invariants()
    assert eng.prefix_cache is not None and eng.prefix_cache.evictions > 0
    assert sum(r.cached_tokens for r, _ in reqs) > 0
    assert all(reads_back(r, prompt) for r, prompt in reqs)
    assert probe.of(ev.CanaryHit) == [] and probe.of(ev.PageStaleRead) == []
    assert adapter.counters["prefix_hits_cross_tenant"] > 0


def test_stale_reads_of_the_incident_are_unchanged() -> None:
    """The cache is refused in the disaggregated topology, so the legacy incident is exactly
    what it was: its stale reads are still reported (see tests/test_adapter.py)."""
    eng = Engine(
        EngineConfig(
            mode="legacy",
            topology="disaggregated",
            advertised_context=4096,
            pool_tokens=256,
            decode_pool_tokens=2048,
            page_size=PS,
        )
    )
    probe = RecordingProbe()
    attach(eng, probe)
    eng.generate("secret of acme " * 10, "acme", 8)
    eng.generate("x" * 1000, "globex", 40)  # over the prefill pool: the placeholder path
    stale = probe.of(ev.PageStaleRead)
    assert stale and "acme" in {s.previous_tenant for s in stale}


def test_a_hit_on_pages_computed_before_the_attach_is_taken_on_trust() -> None:
    eng = make("shared")
    run(eng, SYSTEM + "one", "acme")
    probe = RecordingProbe()
    adapter = RefengineAdapter(probe)
    eng.add_observer(adapter)
    r = run(eng, SYSTEM + "two", "globex")
    assert r.cached_tokens == 128 and reads_back(r, SYSTEM + "two")
    (hit,) = probe.of(ev.PrefixCacheHit)
    assert hit.owner_request_id is None and hit.owner_tenant is None
    assert adapter.counters["prefix_hits_unknown_owner"] == 1
    assert probe.of(ev.PageStaleRead) == []


# -- the server ------------------------------------------------------------------------------

KEYS = {"acme": "sk-acme", "globex": "sk-globex"}


@contextmanager
def serve(**config: Any) -> Iterator[tuple[httpx.Client, Engine]]:
    engine = make(**config)
    app = create_app(engine, tenant_keys=KEYS)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, engine


def post(client: httpx.Client, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})


def test_server_reports_cached_tokens_in_usage_as_vllm_does() -> None:
    # shared keys by the request's cache_salt, as vLLM does: one salt, two tenants, one cache
    with serve(prefix_cache="shared") as (client, engine):
        body = {"prompt": SYSTEM + "Q?", "max_tokens": 4, "cache_salt": "team-1"}
        first = post(client, "/v1/completions", body, "sk-acme").json()
        second = post(client, "/v1/completions", body, "sk-globex").json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 128}
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        other = post(client, "/v1/completions", body | {"cache_salt": "team-2"}, "sk-globex")
        assert other.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

        chat = {"messages": [{"role": "system", "content": SYSTEM}], "max_tokens": 3}
        post(client, "/v1/chat/completions", chat, "sk-acme")
        again = post(client, "/v1/chat/completions", chat, "sk-acme").json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
        streamed = client.post(
            "/v1/chat/completions",
            json=chat | {"stream": True, "stream_options": {"include_usage": True}},
            headers={"Authorization": "Bearer sk-acme"},
        )
        chunks = [
            line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data")
        ]
        assert chunks[-1] == "[DONE]"
        usage = json.loads(chunks[-2])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 128}

        bad = post(client, "/v1/completions", body | {"cache_salt": ""}, "sk-acme")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        card = client.get("/v1/models", headers={"Authorization": "Bearer sk-acme"}).json()
        assert card["data"][0]["prefix_caching"] is True
        assert card["data"][0]["prefix_cache"] == "shared"

        metrics = samples(client.get("/metrics").text)
        labels = {"engine": "0", "model_name": "refengine-lab"}
        queries = metrics.get("vllm:prefix_cache_queries_total", labels)
        hits = metrics.get("vllm:prefix_cache_hits_total", labels)
        assert hits == 128 * 3 and queries is not None and queries >= hits
        assert engine.prefix_cache is not None and engine.prefix_cache.hits == hits
        assert engine.prefill_pool.cached_idle_pages > 0
        assert metrics.get("vllm:kv_cache_usage_perc", labels | {"node": "kv", "role": "both"}) == 0


def test_server_without_the_cache_says_no_token_was_cached() -> None:
    with serve(prefix_cache="off") as (client, _):
        body = {"prompt": SYSTEM, "max_tokens": 2, "cache_salt": "accepted-and-ignored"}
        for _ in range(2):  # the same prompt again: still nothing cached
            r = post(client, "/v1/completions", body, "sk-acme").json()
            assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert "vllm:prefix_cache_hits_total" not in client.get("/metrics").text


def test_the_lab_model_decodes_what_granted_pages_hold() -> None:
    """A direct check on the KV itself: the granted pages hold exactly the first request's
    K/V, which equals what prefill would have computed for the second prompt's prefix."""
    eng = make()
    run(eng, SYSTEM + "a", "acme", max_tokens=1)
    req = eng.submit(SYSTEM + "b", "acme", 1)
    eng.step()
    cache = eng.prefix_cache
    assert cache is not None and req.cached_tokens == 128
    pages = torch.tensor(cache.lookup(req.page_keys[:8]))
    k, _ = eng.model.kv(torch.tensor(list(SYSTEM.encode())), 0)
    assert torch.equal(eng.prefill_pool.k[pages].reshape(k.shape), k)
