"""Engine adapters: each turns one engine's objects and hooks into the probe's events.

``refengine`` (the reference engine, observer hooks), ``vllm`` (a ``vllm.general_plugins``
entry point) and ``sglang`` (an ``sglang.srt.plugins`` entry point). The vLLM and SGLang
packages each split in ``hooks`` (what patches the engine and reads its objects),
``bookkeeping`` (requests, tenants, ledgers and events, from plain values) and ``adapter``
(the two joined: the class ``attach`` returns). What they do alike is shared: ``common``
(wire-safe ids, page-id chunking, the stale-read emitter), ``registry`` (bounded maps,
request and tenant handles and names), ``reporting`` (the probe, request events, page
reuse, prefix-hit counts), ``guard`` (a hook's exception counted and logged, never raised
into the engine) and ``ledger_ops`` (ledger operations gathered for a scheduler in Python).
The adapter modules import torch (the ledger's tensors); the vLLM plugin package imports
neither vLLM nor torch until it attaches. Nothing here is imported by ``engine_probe``'s
top level.
"""
