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


# SGLang 0.5.23's prefill (``disaggregation/prefill.py``) stages a Mooncake sender's page
# indices in pinned host memory (``torch.empty(..., pin_memory=True)`` and a CUDA event)
# whenever the sender says ``supports_host_tensor_indices``; both need CUDA. On a CPU build
# the sender is told it does not, so SGLang takes its own plain path (``kv_to_page_indices``).
# A test-only runtime fix of an upstream CPU bug, applied when the module is first imported.
_MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"


class _PatchMooncakeOnImport:
    """A meta path finder that lets the real finders load ``_MOONCAKE_CONN``, then patches
    the loaded module (once; it removes itself)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MOONCAKE_CONN:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            import torch

            if not torch.cuda.is_available():
                module.MooncakeKVSender.supports_host_tensor_indices = False

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchMooncakeOnImport())
