"""kvwatch's probe inside SGLang: SGLang's allocators, KV pools, request table and
disaggregation transfers feed the page ledger (see :mod:`engine_probe.adapters.sglang.adapter`).

Two ways in: :func:`attach` (one call, in-process, given SGLang's objects), or the
environment (``KVWATCH_SGLANG_PROBE=1``), read by the SGLang general plugin
:func:`engine_probe.adapters.sglang.plugin.register` that SGLang loads in every scheduler process.
"""

from engine_probe.adapters.sglang.adapter import SGLangAdapter, attach, default_tenant_of
from engine_probe.adapters.sglang.errors import NotAttachableError, SGLangProbeError

__all__ = [
    "NotAttachableError",
    "SGLangAdapter",
    "SGLangProbeError",
    "attach",
    "default_tenant_of",
]
