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
