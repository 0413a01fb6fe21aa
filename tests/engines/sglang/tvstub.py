"""A test-only import stub for ``torchvision``, installed on import (before SGLang is).

Importing ``sglang.srt.mem_cache.memory_pool`` pulls in SGLang's model configs, which import
``torchvision``; PyPI's torchvision does not import beside the CPU torch, and nothing on the
KV path uses it. So ``torchvision`` (and every ``torchvision.*``) is a stub package whose
attributes are placeholder classes that refuse to be called; transformers sees it as
torchvision 0.0.0. Never used outside tests/engines/sglang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Placeholder(type):
    """A torchvision name nobody on the KV path uses: any attribute is another
    placeholder; calling one fails loudly."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchvision stub: {cls.__name__} is not available in tests")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers parses it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionStub())
