"""Engine configuration: what the API promises and what the memory holds, set separately.

The incident came from exactly that split: an advertised context (what the API accepts)
larger than the KV pool that must hold a prompt. Nothing here checks one against the other,
on purpose; ``mode`` decides what happens when a prompt falls in the gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["legacy", "hardened"]
Topology = Literal["monolithic", "disaggregated"]
KVDtype = Literal["float32", "float16", "bfloat16"]
PrefixCacheMode = Literal["off", "shared", "salted"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class EngineConfig:
    """Immutable settings of one engine.

    Invariants (checked in ``__post_init__``, a violation raises ``ValueError``):
    all sizes are positive; every pool holds at least one page, i.e. ``pool_tokens`` and
    ``decode_pool_tokens`` are >= ``page_size``; ``head_dim`` >= 16 (the lab model's value
    code needs the room, see ``model.py``). Pools hold ``tokens // page_size`` whole pages, so
    a pool's capacity is ``pool_tokens`` rounded down to a multiple of ``page_size``.
    ``prefix_cache`` other than ``"off"`` needs the monolithic topology (a disaggregated
    engine refuses it: its prefill pages leave for the decode pool, so nothing would stay
    to be reused).

    Prefix caching (see :mod:`refengine.prefix_cache`): ``"off"`` caches nothing;
    ``"shared"`` is vLLM's behaviour: a prompt's full pages are keyed by their tokens and
    the request's ``cache_salt`` when it sends one, so tenants share every prefix unless
    their clients (or a gateway) salt it, and one tenant's hit tells it what another sent;
    ``"salted"`` salts by tenant on the server besides: the tenant is part of every key, so
    no two tenants ever share a cached page whatever salts they send.
    """

    mode: Mode = "hardened"
    topology: Topology = "monolithic"
    #: What the API accepts, in tokens (bytes for this byte-level model).
    advertised_context: int = 8192
    #: Tokens of the prefill pool (disaggregated) or of the only pool (monolithic).
    pool_tokens: int = 16384
    #: Tokens of the decode pool (disaggregated only); ``None`` means "same as pool_tokens".
    decode_pool_tokens: int | None = None
    page_size: int = 16
    #: Most requests decoded together in one step (and, disaggregated, most waiting for
    #: transfer).
    max_batch: int = 32
    #: Prefill token budget per step; the first prefill of a step always runs, so a prompt
    #: longer than the budget still makes progress.
    max_prefill_tokens: int = 16384
    #: Paint freed pages with zeros before they can be handed out again (the hardening
    #: option; legacy engines did not).
    zeroize_on_free: bool = False
    device: str = "cpu"
    kv_dtype: KVDtype = "float32"
    heads: int = 1
    head_dim: int = 64
    model_id: str = "refengine-lab"
    prefix_cache: PrefixCacheMode = "off"
    #: Tokens of the offload tier (host memory) that evicted prefix-cache pages go to and
    #: are loaded back from (vLLM's CPU offloading, LMCache's CPU tier); 0: none. Needs the
    #: prefix cache. See :mod:`refengine.offload`.
    offload_tier_tokens: int = 0
    #: Fault (tests, demos): the tier keys pages by their tokens alone, dropping the salt
    #: (and the tenant, salting by tenant), as LMCache's SGLang path did (LMCache #4825).
    offload_drops_salt: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("legacy", "hardened"):
            raise ValueError(f"mode must be 'legacy' or 'hardened', not {self.mode!r}")
        if self.topology not in ("monolithic", "disaggregated"):
            raise ValueError(
                f"topology must be 'monolithic' or 'disaggregated', not {self.topology!r}"
            )
        if self.kv_dtype not in _DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(_DTYPES)}, not {self.kv_dtype!r}")
        for name in (
            "advertised_context",
            "pool_tokens",
            "page_size",
            "max_batch",
            "max_prefill_tokens",
            "heads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.head_dim < 16:
            raise ValueError(f"head_dim must be >= 16, not {self.head_dim}")
        if self.pool_tokens < self.page_size:
            raise ValueError(
                f"pool_tokens ({self.pool_tokens}) must hold at least one page "
                f"of {self.page_size} tokens"
            )
        if self.decode_pool_tokens is not None:
            if self.topology != "disaggregated":
                raise ValueError("decode_pool_tokens only applies to the disaggregated topology")
            if self.decode_pool_tokens < self.page_size:
                raise ValueError(
                    f"decode_pool_tokens ({self.decode_pool_tokens}) must hold at least one "
                    f"page of {self.page_size} tokens"
                )
        if self.prefix_cache not in ("off", "shared", "salted"):
            raise ValueError(
                f"prefix_cache must be 'off', 'shared' or 'salted', not {self.prefix_cache!r}"
            )
        if self.prefix_cache != "off" and self.topology != "monolithic":
            raise ValueError(
                "the prefix cache needs the monolithic topology: a disaggregated engine's "
                "prefill pages leave for the decode pool, so nothing stays to be reused"
            )
        if not isinstance(self.offload_tier_tokens, int) or self.offload_tier_tokens < 0:
            raise ValueError(
                f"offload_tier_tokens must be an integer >= 0, not {self.offload_tier_tokens!r}"
            )
        if self.offload_tier_tokens and not self.prefix_caching:
            raise ValueError("the offload tier needs the prefix cache (prefix_cache on)")
        if 0 < self.offload_tier_tokens < self.page_size:
            raise ValueError(
                f"offload_tier_tokens ({self.offload_tier_tokens}) must hold at least one "
                f"page of {self.page_size} tokens"
            )
        if self.offload_drops_salt and not self.offload_tier_tokens:
            raise ValueError("offload_drops_salt needs an offload tier (offload_tier_tokens)")
        torch.device(self.device)  # fail here, not at the first allocation, on a typo

    @property
    def prefix_caching(self) -> bool:
        return self.prefix_cache != "off"

    @property
    def prefix_cache_isolates_tenants(self) -> bool:
        """Whether no two tenants can ever share a cached page (salted by tenant)."""
        return self.prefix_cache == "salted"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def prefill_pool_tokens(self) -> int:
        """Capacity of the pool prefill writes into (whole pages)."""
        return (self.pool_tokens // self.page_size) * self.page_size

    @property
    def decode_pool_capacity_tokens(self) -> int:
        """Capacity of the pool decode reads from (whole pages); monolithic: the only pool."""
        if self.topology == "monolithic":
            return self.prefill_pool_tokens
        tokens = self.pool_tokens if self.decode_pool_tokens is None else self.decode_pool_tokens
        return (tokens // self.page_size) * self.page_size
