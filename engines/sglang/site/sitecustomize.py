"""Imported by every Python process of a test's SGLang server (``PYTHONPATH`` points here).

SGLang starts its scheduler and detokenizer as fresh processes, so a pytest conftest cannot
reach them; ``sitecustomize`` is what each new interpreter imports first. It installs two
test-only stubs, for imports on SGLang's CPU path that nothing there calls:

* ``torchvision``: PyPI's build does not import beside the CPU torch, and SGLang's model
  configs import it; the same stub as the in-process tests (``tests/engines/sglang/tvstub``);
* ``vllm._custom_ops``: SGLang's rotary embedding imports ``rotary_embedding`` from it at
  construction and calls it only for CUDA (the CPU path is plain PyTorch); vLLM is not in
  SGLang's venv.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "engines" / "sglang"))
import tvstub  # noqa: F401  (installs the torchvision stub on import)

sys.path.pop(0)


def _not_here(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("vllm._custom_ops stub: a CUDA kernel, never called on the CPU path")


if "vllm" not in sys.modules:
    _ops = types.ModuleType("vllm._custom_ops")
    _ops.rotary_embedding = _not_here
    _vllm = types.ModuleType("vllm")
    _vllm.__path__ = []  # a package, so that `vllm._custom_ops` resolves
    _vllm._custom_ops = _ops
    sys.modules["vllm"] = _vllm
    sys.modules["vllm._custom_ops"] = _ops


# Patches applied to SGLang modules right after they are first imported (a meta path finder
# lets the real finders load the module, then calls the patch; once per module).
_ON_IMPORT: dict[str, Any] = {}


class _PatchOnImport:
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = _ON_IMPORT.pop(name, None)
        if patch is None:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # the real finders, not this one, find the module
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if _ON_IMPORT:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _cpu_mooncake_sender(module: types.ModuleType) -> None:
    """SGLang 0.5.23's prefill (``disaggregation/prefill.py``) stages a Mooncake sender's
    page indices in pinned host memory (``torch.empty(..., pin_memory=True)`` and a CUDA
    event) whenever the sender says ``supports_host_tensor_indices``; both need CUDA. On a
    CPU build the sender is told it does not, so SGLang takes its own plain path
    (``kv_to_page_indices``). A test-only runtime fix of an upstream CPU bug."""
    import torch

    if not torch.cuda.is_available():
        module.MooncakeKVSender.supports_host_tensor_indices = False


_ON_IMPORT["sglang.srt.disaggregation.mooncake.conn"] = _cpu_mooncake_sender

#: TEST ONLY, with the probe's fault-injection guard set: SGLang's prefill of this tenant's
#: requests sends decode one page of KV and reports the transfer done, the defect of SGLang
#: before its rejection-path fixes (the incident: "marks it rejected, substitutes a one-token
#: placeholder, and still transfers partial KV state to decode"), injected because neither
#: 0.5.20 nor 0.5.21 reaches it on this CPU path (see tests/test_sglang_pd.py)
_PARTIAL_TENANT = os.environ.get("KVWATCH_TEST_SGLANG_SEND_ONE_PAGE_OF_TENANT")
_GUARD = "i-know-this-probe-will-report-false-stale-reads"


def _partial_transfer(module: types.ModuleType) -> None:
    import threading

    rooms: set[int] = set()
    sending = threading.local()
    queue = module.PrefillBootstrapQueue
    mixin = module.SchedulerDisaggregationPrefillMixin
    pages_to_send, send_kv_chunk = queue._num_pages_to_send, mixin.send_kv_chunk
    to_page_indices = module.kv_to_page_indices

    def num_pages_to_send(self: Any, req: Any, decode_prefix_len: int) -> int:
        n = int(pages_to_send(self, req, decode_prefix_len))
        if getattr(req, "routing_key", None) == _PARTIAL_TENANT:
            rooms.add(req.bootstrap_room)
            return min(n, 1)
        return n

    def send_chunk(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        sending.partial = req.bootstrap_room in rooms
        try:
            return send_kv_chunk(self, req, *args, **kwargs)
        finally:
            sending.partial = False

    def kv_to_page_indices(*args: Any, **kwargs: Any) -> Any:
        pages = to_page_indices(*args, **kwargs)
        return pages[:1] if getattr(sending, "partial", False) else pages

    queue._num_pages_to_send = num_pages_to_send
    mixin.send_kv_chunk = send_chunk
    module.kv_to_page_indices = kv_to_page_indices


if _PARTIAL_TENANT and os.environ.get("KVWATCH_TEST_FAULT_INJECTION") == _GUARD:
    _ON_IMPORT["sglang.srt.disaggregation.prefill"] = _partial_transfer

sys.meta_path.insert(0, _PatchOnImport())
