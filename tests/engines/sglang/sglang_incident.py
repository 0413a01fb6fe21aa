"""The incident, and a clean run, on real SGLang 0.5.23 classes on CPU: the scenario the
tests in this folder drive, also runnable as a script (``python sglang_incident.py incident|
clean``) with the process's probe configured from the ``KVWATCH_*`` environment, which is
how the main suite sends its events to a real collector.

Two nodes in one process, as in disaggregated serving: a prefill node and a decode node,
each a real ``MHATokenToKVPool`` + ``PagedTokenToKVPoolAllocator`` + ``ReqToTokenPool`` and a
real ``TorchNativeAttnBackend`` (the attention that writes and gathers the KV). The code here
plays SGLang's scheduler: it makes the calls the scheduler makes, in the incident's order,
including the pre-0.5.22 behaviour of still transferring an aborted request's KV (SGLang
0.5.23 itself no longer does). Requests are real ``Req`` objects; the over-length check is
SGLang's own ``validate_input_length`` and ``set_finish_with_abort``; transfers go through
the fake disaggregation backend's real ``FakeKVSender``/``FakeKVReceiver``.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import numpy as np
import torch
import tvstub  # noqa: F401  (before SGLang is imported)
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver, FakeKVSender
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN, Req
from sglang.srt.managers.utils import validate_input_length
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams

PAGE = 4
HEADS, DIM, LAYERS = 2, 8, 2
CONTEXT = 64
PREFILL_TOKENS = 32  # 8 pages
DECODE_TOKENS = 40  # 10 pages
# SGLang's own limit (tp_worker): min(context_len - 1, kv_capacity - 1) - 5
MAX_INPUT = min(CONTEXT - 1, PREFILL_TOKENS - 1) - 5


@dataclass
class Node:
    kv: MHATokenToKVPool
    alloc: PagedTokenToKVPoolAllocator
    r2t: ReqToTokenPool
    backend: TorchNativeAttnBackend


def make_node(tokens: int) -> Node:
    kv = MHATokenToKVPool(
        size=tokens,
        page_size=PAGE,
        dtype=torch.float32,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = PagedTokenToKVPoolAllocator(tokens, PAGE, torch.float32, "cpu", kv, need_sort=False)
    r2t = ReqToTokenPool(size=4, max_context_len=CONTEXT, device="cpu", enable_memory_saver=False)
    # TorchNativeAttnBackend reads these three attributes of its ModelRunner, nothing else
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=kv)
    return Node(kv, alloc, r2t, TorchNativeAttnBackend(runner))


LAYER_OBJS = [
    RadixAttention(num_heads=HEADS, head_dim=DIM, scaling=1.0, num_kv_heads=HEADS, layer_id=i)
    for i in range(LAYERS)
]


def new_req(rid: str, tenant: str, prompt: int, room: int) -> Req:
    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=list(range(1, prompt + 1)),
        sampling_params=SamplingParams(max_new_tokens=16),
        bootstrap_room=room,
        routing_key=tenant,
    )


def run_layers(node: Node, batch: ForwardBatch, n: int) -> None:
    for layer in LAYER_OBJS:
        q = torch.randn(n, HEADS * DIM)
        node.backend.forward(
            q, torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM), layer, batch
        )


def prefill(node: Node, req: Req) -> tuple[int, list[int]]:
    """SGLang's prefill of ``req``'s (current) prompt: a row, page-aligned slots, the row's
    table written, one extend forward. Returns (row, the pages it wrote)."""
    n = len(req.origin_input_ids)
    (row,) = node.r2t.alloc([req])
    slots = node.alloc.alloc(math.ceil(n / PAGE) * PAGE)[:n]
    node.r2t.write((row, slice(0, n)), slots.to(torch.int32))
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.zeros(n, dtype=torch.long),
        req_pool_indices=torch.tensor([row]),
        seq_lens=torch.tensor([n]),
        out_cache_loc=slots,
        seq_lens_sum=n,
        extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=torch.tensor([n]),
    )
    run_layers(node, batch, n)
    return row, sorted({int(s) // PAGE for s in slots})


def prealloc(node: Node, req: Req, prompt: int) -> tuple[int, list[int]]:
    """The decode node's preallocation for a ``prompt``-token request (what it tells
    prefill to fill)."""
    (row,) = node.r2t.alloc([req])
    slots = node.alloc.alloc(math.ceil(prompt / PAGE) * PAGE)[:prompt]
    node.r2t.write((row, slice(0, prompt)), slots.to(torch.int32))
    pages: list[int] = []
    for s in slots.tolist():
        if s // PAGE not in pages:
            pages.append(s // PAGE)
    return row, pages


def decode_step(node: Node, row: int, seq_len: int) -> None:
    """One decode step: a slot for token ``seq_len`` (a new page when the last is full),
    written into the row, one decode forward (write, then the gather of ``seq_len + 1``)."""
    last = int(node.r2t.req_to_token[row, seq_len - 1])
    slot = last + 1 if seq_len % PAGE else int(node.alloc.alloc(PAGE)[0])
    node.r2t.write((row, seq_len), torch.tensor(slot, dtype=torch.int32))
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        input_ids=torch.zeros(1, dtype=torch.long),
        req_pool_indices=torch.tensor([row]),
        seq_lens=torch.tensor([seq_len + 1]),
        out_cache_loc=torch.tensor([slot]),
        seq_lens_sum=seq_len + 1,
    )
    run_layers(node, batch, 1)


def finish(node: Node, req: Req, row: int, length: int) -> None:
    """The request's row and KV given back, as SGLang does once it is finished (its
    ``finished_reason`` set: a row given back without one is a retraction)."""
    if req.finished_reason is None:
        req.finished_reason = req.to_finish or FINISH_MATCHED_TOKEN(matched=0)  # an EOS
    node.alloc.free(node.r2t.req_to_token[row, :length].long())
    node.r2t.free(req)


def transfer(
    p: Node, d: Node, p_req: Req, d_req: Req, p_pages: list[int], send_pages: int
) -> tuple[int, int]:
    """Prefill → decode over the fake backend: decode announces its pages, prefill sends
    the first ``send_pages`` of its own. Returns (decode row, decode prompt length)."""
    room = d_req.bootstrap_room
    prompt = len(d_req.origin_input_ids)
    receiver = FakeKVReceiver(None, "fake-bootstrap:8998", room)
    receiver.init(prefill_dp_rank=0)
    d_row, d_pages = prealloc(d, d_req, prompt)
    receiver.send_metadata(kv_indices=d_pages, aux_index=0)
    sender = FakeKVSender(None, "fake-bootstrap:8998", room)
    sender.init(num_kv_indices=len(p_pages), aux_index=0)
    sender.send(np.array(p_pages[:send_pages], dtype=np.int32))
    assert sender.poll() == KVPoll.Success
    assert receiver.poll() == KVPoll.Success
    return d_row, prompt


def serve_tenant_a(p: Node, d: Node) -> None:
    """Tenant A: a 24-token prompt, prefilled, fully transferred, decoded until its KV fills
    every decode page, finished (pages freed, not zeroed)."""
    a_p, a_d = new_req("a-1", "tenant-a", 24, room=1), new_req("a-1", "tenant-a", 24, room=1)
    assert validate_input_length(a_p, MAX_INPUT, allow_auto_truncate=False) is None
    p_row, p_pages = prefill(p, a_p)
    d_row, n = transfer(p, d, a_p, a_d, p_pages, send_pages=len(p_pages))
    finish(p, a_p, p_row, n)
    for pos in range(n, DECODE_TOKENS):
        decode_step(d, d_row, pos)
    finish(d, a_d, d_row, DECODE_TOKENS)


def serve_tenant_b(p: Node, d: Node, prompt: int) -> None:
    """Tenant B through SGLang's intake: over ``MAX_INPUT`` it is aborted with SGLang's
    one-token placeholder, and (the legacy path) still prefilled and transferred: one page
    sent of the ten decode expects. Decode then runs one step over the whole prompt."""
    b_p, b_d = new_req("b-1", "tenant-b", prompt, room=2), new_req("b-1", "tenant-b", prompt, 2)
    error = validate_input_length(b_p, MAX_INPUT, allow_auto_truncate=False)
    if error is not None:
        b_p.set_finish_with_abort(error)
    p_row, p_pages = prefill(p, b_p)
    d_row, n = transfer(p, d, b_p, b_d, p_pages, send_pages=len(p_pages))
    finish(p, b_p, p_row, len(b_p.origin_input_ids))
    decode_step(d, d_row, n)


def main(argv: list[str]) -> int:
    """Runs each named scenario (``incident``, ``clean``) on fresh nodes, each through its
    own adapter on the environment's probe, its events under deployment
    ``{KVWATCH_DEPLOYMENT_ID}-{scenario}``; flushes the probe and prints the counters."""
    from sglang.srt.runtime_context import get_parallel

    from engine_probe.adapters.sglang import attach
    from engine_probe.probe import configure_probe, shutdown_probe
    from engine_probe.settings import ProbeSettings

    scenarios = argv or ["incident"]
    if not set(scenarios) <= {"incident", "clean"}:
        print("usage: sglang_incident.py incident|clean ...", file=sys.stderr)
        return 2
    settings = ProbeSettings()
    probe = configure_probe(settings)
    for scenario in scenarios:
        p, d = make_node(PREFILL_TOKENS), make_node(DECODE_TOKENS)
        adapter = attach(
            req_to_token_pool=p.r2t,
            allocator=p.alloc,
            role="prefill",
            node="p0",
            probe=probe,
            deployment_id=f"{settings.deployment_id}-{scenario}",
        )
        adapter.watch(req_to_token_pool=d.r2t, allocator=d.alloc, role="decode", node="d0")
        with get_parallel().override(tp_rank=0):
            serve_tenant_a(p, d)
            serve_tenant_b(p, d, prompt=39 if scenario == "incident" else 20)
        adapter.detach()
        print(scenario, adapter.counters)
    delivered = probe.force_flush(30.0)
    shutdown_probe(10.0)
    return 0 if delivered else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
