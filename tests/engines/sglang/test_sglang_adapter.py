"""The kvwatch SGLang adapter on real SGLang 0.5.23 classes, on CPU, through the scenario
in ``sglang_incident.py`` (see there): the incident's sequence, a clean one, hardening."""

from __future__ import annotations

import math
from typing import Any

import pytest
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang_incident import (
    CONTEXT,
    DECODE_TOKENS,
    MAX_INPUT,
    PAGE,
    PREFILL_TOKENS,
    Node,
    make_node,
    serve_tenant_a,
    serve_tenant_b,
)

from engine_probe.adapters.sglang import SGLangAdapter, attach
from engine_probe.events import (
    EngineConfig,
    KvTransfer,
    PageStaleRead,
    RequestAdmitted,
    RequestFinished,
    RequestRejected,
)


@pytest.fixture
def cluster(probe: Any) -> tuple[SGLangAdapter, Node, Node]:
    p, d = make_node(PREFILL_TOKENS), make_node(DECODE_TOKENS)
    adapter = attach(
        req_to_token_pool=p.r2t, allocator=p.alloc, role="prefill", node="p0", probe=probe
    )
    adapter.watch(req_to_token_pool=d.r2t, allocator=d.alloc, role="decode", node="d0")
    yield adapter, p, d
    adapter.detach()


def test_incident_sequence_reports_one_stale_read_naming_both_tenants(
    cluster: Any, probe: Any, tp_rank0: None
) -> None:
    adapter, p, d = cluster
    serve_tenant_a(p, d)
    assert probe.of(PageStaleRead) == []  # tenant A read only what it wrote

    serve_tenant_b(p, d, prompt=39)

    rejected = probe.of(RequestRejected)
    assert [(r.request_id, r.tenant, r.prompt_tokens, r.limit_tokens) for r in rejected] == [
        ("b-1", "tenant-b", 39, MAX_INPUT)
    ]
    b_transfer = [t for t in probe.of(KvTransfer) if t.request_id == "b-1"]
    assert [(t.pages, t.prefill_rejected, t.from_node, t.to_node) for t in b_transfer] == [
        (1, True, "p0", "d0")
    ]
    stale = probe.of(PageStaleRead)
    assert stale, "decode read pages nobody transferred"
    assert {(s.reader_request_id, s.reader_tenant, s.node) for s in stale} == {
        ("b-1", "tenant-b", "d0")
    }
    exposing = [s for s in stale if s.previous_tenant is not None]
    assert len(exposing) == 1
    (leak,) = exposing
    assert (leak.previous_request_id, leak.previous_tenant) == ("a-1", "tenant-a")
    assert leak.zeroized is False and leak.cross_tenant
    # every decode page B read: nine it never received (A's decode KV), and the one page
    # that was sent, whose slots past B's one placeholder token are what the prefill page
    # held before (transfers move whole pages): A's prefill KV
    assert sorted(leak.page_ids) == sorted(b_decode_pages(adapter))
    assert len(leak.page_ids) == math.ceil(39 / PAGE)


def b_decode_pages(adapter: SGLangAdapter) -> list[int]:
    """The decode pages the ledger says request b-1 owns."""
    ledger = adapter.ledgers["d0"]
    owners = ledger.owner_of(list(range(ledger.num_pages)))
    handle = adapter._handles["b-1"]
    return [i for i, o in enumerate(owners.tolist()) if o == handle]


def test_clean_sequence_has_no_finding(cluster: Any, probe: Any, tp_rank0: None) -> None:
    _, p, d = cluster
    serve_tenant_a(p, d)
    serve_tenant_b(p, d, prompt=20)  # under the limit: a full prefill and a full transfer

    assert probe.of(RequestRejected) == []
    assert probe.of(PageStaleRead) == []
    assert [(t.pages, t.prefill_rejected) for t in probe.of(KvTransfer)] == [
        (6, False),
        (5, False),
    ]
    assert [r.request_id for r in probe.of(RequestAdmitted)] == ["a-1", "b-1"]
    # b-1 is still decoding
    assert [(f.request_id, f.node, f.status) for f in probe.of(RequestFinished)] == [
        ("a-1", "d0", "completed")
    ]


def test_zeroize_on_free_marks_the_exposure_zeroized(probe: Any, tp_rank0: None) -> None:
    p, d = make_node(PREFILL_TOKENS), make_node(DECODE_TOKENS)
    adapter = attach(
        req_to_token_pool=p.r2t,
        allocator=p.alloc,
        role="prefill",
        node="p0",
        probe=probe,
        zeroize_on_free=True,
    )
    adapter.watch(req_to_token_pool=d.r2t, allocator=d.alloc, role="decode", node="d0")
    try:
        serve_tenant_a(p, d)
        assert float(d.kv.k_buffer[0][PAGE:].abs().sum()) == 0.0  # A's KV is gone
        serve_tenant_b(p, d, prompt=39)
    finally:
        adapter.detach()
    stale = probe.of(PageStaleRead)
    assert stale and all(s.reader_tenant == "tenant-b" for s in stale)
    named_a = [s for s in stale if s.previous_tenant == "tenant-a"]
    assert len(named_a) == 1 and named_a[0].zeroized


def test_engine_config_and_detach(probe: Any) -> None:
    p = make_node(PREFILL_TOKENS)
    original = type(p.r2t).write
    adapter = attach(req_to_token_pool=p.r2t, allocator=p.alloc, role="both", probe=probe)
    (config,) = probe.of(EngineConfig)
    assert (config.engine, config.engine_version, config.page_size) == ("sglang", "0.5.23", PAGE)
    assert config.pool_capacity_tokens == PREFILL_TOKENS and config.advertised_context == CONTEXT
    adapter.detach()
    assert "write" not in vars(p.r2t) and type(p.r2t).write is original
    assert not getattr(TorchNativeAttnBackend.forward, "__kvwatch_wrapped__", False)


def test_plugin_entry_point_is_what_sglang_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own plugin loader finds kvwatch's entry point; it does nothing unless
    KVWATCH_SGLANG_PROBE is set, and then hooks the ModelRunner's pool allocation."""
    from importlib.metadata import entry_points

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    from engine_probe.adapters.sglang import plugin

    names = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert names.get("kvwatch") == "engine_probe.adapters.sglang.plugin:register"
    loaded = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    register = loaded["kvwatch"][0]
    original = ModelRunner.alloc_memory_pool
    monkeypatch.delenv("KVWATCH_SGLANG_PROBE", raising=False)
    register()
    assert ModelRunner.alloc_memory_pool is original and plugin.current_adapter() is None
    monkeypatch.setenv("KVWATCH_SGLANG_PROBE", "1")
    monkeypatch.delenv("KVWATCH_COLLECTOR_URL", raising=False)
    try:
        register()
        assert getattr(ModelRunner.alloc_memory_pool, "__kvwatch_wrapped__", False)
        assert isinstance(plugin.current_adapter(), SGLangAdapter)
    finally:
        ModelRunner.alloc_memory_pool = original  # type: ignore[method-assign]
        plugin._state.clear()
