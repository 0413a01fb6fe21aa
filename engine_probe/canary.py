"""Canary painting: a second stale-read detector that looks at KV contents, not bookkeeping.

When a page is freed (and the engine did not zeroize it), every K and V element of the page
is painted with :data:`SENTINEL`. A later read of a painted slot that attention actually used
means the reader attended to memory nobody wrote for it since it was freed: the same bug the
page ledger catches, seen from the data side, so it still works when an engine's write or
read hooks are incomplete or switched off.

:data:`SENTINEL` is -29568.0: exactly representable in float32, float16 and bfloat16 (so a
painted slot compares equal after the round trip through any KV dtype), finite (no NaN or
inf reaches attention), and a whole K row of one such constant is something no model writes.
It is negative, so for engines whose attention rewards large keys a painted slot scores low
rather than swallowing attention. A slot counts as painted when the first and last K element
and the first V element of its row all hold the sentinel: three compares per slot, not one per
element.

Painting changes what the engine reads (stale pages read back as the sentinel instead of the
previous owner's KV): it is a staging and debugging mode, and it needs an engine that lets an
observer write its pool (refengine allows it inside ``on_free``).

This module imports torch; ``engine_probe/__init__.py`` does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

__all__ = ["SENTINEL", "CanaryFinding", "PoolCanary"]

SENTINEL: Final = -29568.0
_NONE: Final = -1


@dataclass(frozen=True, slots=True)
class CanaryFinding:
    """Painted pages one reader attended to. ``canary_tenant`` is the tenant handle that owned
    the pages when they were freed and painted (-1 when unknown)."""

    reader: int
    canary_tenant: int
    page_ids: list[int]


class PoolCanary:
    """Paint state of one KV pool, as tensors on the pool's device: per page, the tenant
    owning it now (set on alloc) and the tenant that owned it when it was last painted."""

    def __init__(self, num_pages: int, device: torch.device | str, dtype: torch.dtype) -> None:
        if torch.tensor(SENTINEL, dtype=dtype).item() != SENTINEL:
            raise ValueError(f"the canary sentinel is not exact in {dtype}")
        dev = torch.device(device)
        self._owner_tenant = torch.full((num_pages,), _NONE, dtype=torch.long, device=dev)
        self._painted_by = torch.full((num_pages,), _NONE, dtype=torch.long, device=dev)
        self.device = self._owner_tenant.device

    def on_alloc(self, pages: Tensor, tenant: int) -> None:
        self._owner_tenant.index_fill_(0, pages, tenant)

    def paint(self, k: Tensor, v: Tensor, pages: Tensor) -> None:
        """Paint ``pages`` of the pool tensors ``k``/``v`` (``[pages, ...]``) in place."""
        k.index_fill_(0, pages, SENTINEL)
        v.index_fill_(0, pages, SENTINEL)
        self._painted_by.index_copy_(0, pages, self._owner_tenant.index_select(0, pages))
        self._owner_tenant.index_fill_(0, pages, _NONE)

    def on_transfer(self, src: PoolCanary, src_pages: Tensor, dst_pages: Tensor) -> None:
        """Whole pages were copied from ``src``: the destination carries the source's paint."""
        painted = src._painted_by.index_select(0, src_pages).to(self.device)
        self._painted_by.index_copy_(0, dst_pages, painted)

    @staticmethod
    def suspect(k: Tensor, valid: Tensor) -> Tensor:
        """Whether any valid slot's first K element holds the sentinel: a 0-d bool tensor,
        no host sync. Cheap and a superset of real hits; :meth:`findings` confirms."""
        t, s = valid.shape
        return ((k.reshape(t, s, -1)[..., 0] == SENTINEL) & valid).any()

    def findings(
        self, pages: Tensor, readers: Tensor, k: Tensor, v: Tensor, valid: Tensor
    ) -> list[CanaryFinding]:
        """Pages whose valid slots hold the sentinel (first and last K element and first V
        element of a slot's row), grouped by (reader, painting tenant). The rare path: syncs
        and loops over hit pages."""
        t, s = valid.shape
        kf = k.reshape(t, s, -1)
        vf = v.reshape(t, s, -1)
        slot = (kf[..., 0] == SENTINEL) & (kf[..., -1] == SENTINEL) & (vf[..., 0] == SENTINEL)
        idx = (slot & valid).any(1).nonzero().squeeze(1)
        hit_pages = pages.index_select(0, idx)
        painted = self._painted_by.index_select(0, hit_pages)
        groups: dict[tuple[int, int], list[int]] = {}
        for page, reader, tenant in zip(
            hit_pages.tolist(), readers.index_select(0, idx).tolist(), painted.tolist(), strict=True
        ):
            groups.setdefault((reader, tenant), []).append(page)
        return [CanaryFinding(r, t, p) for (r, t), p in groups.items()]
