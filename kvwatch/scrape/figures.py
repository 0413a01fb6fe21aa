"""What one scrape found, per node, shaped as the wire contract's events want it.

Invariants (checked at construction, so an event built from these never fails the
collector's validation): capacity = used + free; ids follow the wire contract's id rule;
the advertised context is positive.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import msgspec

from engine_probe.events import NAME_MAX, Role, is_valid_id
from engine_probe.node import node_id
from kvwatch.scrape.errors import BadTarget, MalformedMetrics
from kvwatch.scrape.exposition import Histogram

ENGINES: Final = ("vllm", "sglang")
ROLES: Final = ("prefill", "decode", "both")
UNKNOWN: Final = "unknown"
_BAD_ID_CHARS: Final = re.compile(r"[^A-Za-z0-9._:/@+=-]")


def id_from(raw: str, fallback: str) -> str:
    """Map a host name, model name or label value onto the id rule (``node`` ids)."""
    cleaned = _BAD_ID_CHARS.sub("-", raw).strip("-") or fallback
    if not cleaned[0].isalnum():
        cleaned = f"{fallback}-{cleaned}"
    return cleaned[:128]


def rank_node(prefix: str, rank: str) -> str:
    """The node id of data-parallel rank ``rank`` (a metrics label) of a server whose node
    id is ``prefix``, by the rule of ``engine_probe.node``: ``prefix`` for rank 0 (and no
    rank), ``prefix/dpN`` for rank N."""
    if not rank or rank.isdigit():
        return node_id(prefix, dp_rank=int(rank or 0))
    return f"{prefix}/dp{id_from(rank, 'x')}"


def short_name(raw: str | None) -> str:
    """A ``ShortName`` field (engine version, dtype): 1..64 printable characters."""
    text = (raw or "").strip()
    return text[:64] if text and text.isprintable() else UNKNOWN


@dataclass(frozen=True, slots=True)
class NodeFigures:
    """One engine node's configuration and pool occupancy at scrape time.

    ``used_tokens``: KV slots held by running requests; ``free_tokens``: slots nobody holds;
    slots holding evictable prefix-cache entries count as neither (SGLang reports them
    apart), so used + free may be below capacity but never above it.
    """

    node: str
    role: Role
    model_id: str
    engine: str
    engine_version: str
    advertised_context: int
    pool_capacity_tokens: int
    page_size: int
    dtype: str
    used_tokens: int
    free_tokens: int
    quantization: str | None = None
    tp_size: int = 1
    cuda_graphs: bool = False
    disaggregated: bool = False
    prefix_caching: bool = False
    #: where KV goes past the pool, where the metrics say (``engine.config``'s fields)
    kv_destinations: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_valid_id(self.node):
            raise BadTarget(f"node id {self.node!r} does not follow the id rule")
        if not 0 < len(self.model_id) <= NAME_MAX:
            raise MalformedMetrics(f"model name {self.model_id[:80]!r} is empty or too long")
        if self.advertised_context < 1:
            raise MalformedMetrics(
                f"node {self.node}: advertised context {self.advertised_context} is not positive"
            )
        if self.page_size < 1:
            raise MalformedMetrics(f"node {self.node}: page size {self.page_size} is not positive")
        if self.used_tokens + self.free_tokens > self.pool_capacity_tokens:
            raise MalformedMetrics(
                f"node {self.node}: used {self.used_tokens} + free {self.free_tokens} tokens "
                f"exceed the pool's {self.pool_capacity_tokens}"
            )

    def config_fields(self) -> dict[str, Any]:
        """Keyword arguments of ``events.EngineConfig`` (without the stamped fields)."""
        return {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "model_id": self.model_id,
            "node": self.node,
            "role": self.role,
            "advertised_context": self.advertised_context,
            "pool_capacity_tokens": self.pool_capacity_tokens,
            "page_size": self.page_size,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "tp_size": self.tp_size,
            "cuda_graphs": self.cuda_graphs,
            "disaggregated": self.disaggregated,
            "prefix_caching": self.prefix_caching,
            **self.kv_destinations,
        }

    def pool_fields(self) -> dict[str, Any]:
        """Keyword arguments of ``events.PoolSample`` (without the stamped fields)."""
        return {
            "node": self.node,
            "role": self.role,
            "capacity_tokens": self.pool_capacity_tokens,
            "used_tokens": self.used_tokens,
            "free_tokens": self.free_tokens,
        }


@dataclass(frozen=True, slots=True)
class PromptFigures:
    """A node's prompt-token counters and histogram, as the engine aggregates them.

    They carry no request ids, so they become no request events (inventing requests would
    corrupt every per-request report); they are reported in the scrape's summary.
    ``over_pool_at_least`` / ``_at_most``: how many requests had a prompt longer than the
    pool, as far as the histogram's buckets can tell (None without a histogram).
    """

    node: str
    model_id: str
    prompt_tokens_total: int | None
    requests: int | None
    largest_prompt_at_most: int | None
    over_pool_at_least: int | None
    over_pool_at_most: int | None


def prompt_figures(
    node: str, model: str, total: int | None, hist: Histogram | None, capacity: int
) -> PromptFigures:
    if hist is None:
        return PromptFigures(node, model, total, None, None, None, None)
    largest = hist.covering_bound()
    at_least, at_most = hist.above(capacity)
    return PromptFigures(
        node=node,
        model_id=model,
        prompt_tokens_total=total,
        requests=hist.count,
        largest_prompt_at_most=None if largest is None else int(largest),
        over_pool_at_least=at_least,
        over_pool_at_most=at_most,
    )


@dataclass(frozen=True, slots=True)
class Scrape:
    """Everything one scrape of one target found."""

    engine: str
    target: str
    nodes: tuple[NodeFigures, ...]
    prompts: tuple[PromptFigures, ...] = field(default=())

    def summary(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "target": self.target,
            # msgspec's to_builtins: the offload tiers are msgspec structs
            "nodes": [msgspec.to_builtins(asdict(n)) for n in self.nodes],
            "prompts": [asdict(p) for p in self.prompts],
        }
