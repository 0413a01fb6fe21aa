"""Engine adapters: each turns one engine's objects and hooks into the probe's events.

``refengine`` (the reference engine, observer hooks), ``vllm`` (a ``vllm.general_plugins``
entry point) and ``sglang`` (an ``sglang.srt.plugins`` entry point) share ``common``: wire-safe
ids, page-id chunking and the stale-read emitter. The adapter modules import torch (the
ledger's tensors); the vLLM plugin package imports neither vLLM nor torch until it attaches.
Nothing here is imported by ``engine_probe``'s top level.
"""
