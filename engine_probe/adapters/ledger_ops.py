"""A host-side engine's ledger operations, gathered over many steps, applied in a few calls.

A scheduler that decides allocations and KV writes in Python, one request at a time (vLLM's),
would pay a few dozen small torch operations per step to apply each of them to the
:class:`~engine_probe.ledger.PageLedger` as it happens; most steps only append one token to
each running request's last block. :class:`PendingLedgerOps` keeps them as Python data and
:meth:`~PendingLedgerOps.flush` applies them as *layers*: per layer one
:meth:`~engine_probe.ledger.PageLedger.alloc_counts` call for its allocations, then one
:meth:`~engine_probe.ledger.PageLedger.write` call for its writes.

Invariant: applying the layers in order, each layer's allocations before its writes, leaves
the ledger exactly as applying every operation in the order it was recorded would, and the
reuse counts flush returns are the sum of those the allocations would have returned one by
one. Why: operations on different pages commute, so only the order of each page's own
operations matters. An allocation goes into the layer after the last one holding an
operation on its page (the first layer when there is none); a write goes into the last
layer holding an operation on its page when that operation is an allocation (allocations
come first within a layer) or a write by the same writer ending exactly where this one
starts (merged with it: writes ``[a, b)`` then ``[b, c)`` by one writer leave a page as
``[a, c)`` does under every rule of ``PageLedger.write``, owner's or not), and into the
layer after it otherwise. So within a layer each page has at most one allocation and one
write, as the ledger's batched calls require.

Reads of the ledger must come after a :meth:`~PendingLedgerOps.flush`; the owner flushes
before every check it needs the ledger for.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine_probe.ledger import PageLedger

__all__ = ["PendingLedgerOps", "longs"]


@dataclass(eq=False, slots=True)
class _Layer:
    alloc_pages: list[int] = field(default_factory=list)
    alloc_requests: list[int] = field(default_factory=list)
    alloc_tenants: list[int] = field(default_factory=list)
    #: page -> [writer, start slot, end slot, writer's tenant]
    writes: dict[int, list[int]] = field(default_factory=dict)


class PendingLedgerOps:
    """Allocations and writes for one ledger, not applied yet (see the module docstring)."""

    __slots__ = ("_last", "_layers", "ledger", "pending")

    def __init__(self, ledger: PageLedger) -> None:
        self.ledger = ledger
        self._layers: list[_Layer] = []
        #: page -> index of the last layer holding an operation on it
        self._last: dict[int, int] = {}
        #: operations recorded since the last flush (merged writes count once)
        self.pending = 0

    def alloc(self, pages: Iterable[int], request: int, tenant: int) -> None:
        """``pages`` become ``request``'s (of ``tenant``), in a new generation."""
        last, layers = self._last, self._layers
        for p in pages:
            k = last.get(p)
            k = 0 if k is None else k + 1
            if k == len(layers):
                layers.append(_Layer())
            layer = layers[k]
            layer.alloc_pages.append(p)
            layer.alloc_requests.append(request)
            layer.alloc_tenants.append(tenant)
            last[p] = k
            self.pending += 1

    def write(self, page: int, writer: int, start: int, end: int, tenant: int) -> None:
        """``writer`` (of ``tenant``) wrote slots ``[start, end)`` of ``page``."""
        last, layers = self._last, self._layers
        k = last.get(page)
        if k is None:
            k = 0
        else:
            prior = layers[k].writes.get(page)
            if prior is not None:
                if prior[0] == writer and prior[2] == start:
                    prior[2] = end  # an exact append by the same writer: one write
                    return
                k += 1
        if k == len(layers):
            layers.append(_Layer())
        layers[k].writes[page] = [writer, start, end, tenant]
        last[page] = k
        self.pending += 1

    def flush(self) -> torch.Tensor | None:
        """Apply everything recorded, in order; returns the allocations' summed reuse counts
        (``[reused, cross_tenant, zeroized]``, as ``alloc_counts``), None if there were none."""
        layers = self._layers
        if not layers:
            return None
        self._layers = []
        self._last = {}
        self.pending = 0
        ledger = self.ledger
        counts: torch.Tensor | None = None
        for layer in layers:
            if layer.alloc_pages:
                requests, tenants = layer.alloc_requests, layer.alloc_tenants
                single = requests.count(requests[0]) == len(requests)
                c = ledger.alloc_counts(
                    longs(layer.alloc_pages),
                    requests[0] if single else longs(requests),
                    tenants[0] if single else longs(tenants),
                )
                counts = c if counts is None else counts + c
            if layer.writes:
                rows = list(zip(*layer.writes.values(), strict=True))
                ledger.write(
                    longs(list(layer.writes)),
                    longs(rows[0]),
                    start=longs(rows[1]),
                    end=longs(rows[2]),
                    tenant=longs(rows[3]),
                )
        return counts


def longs(values: Iterable[int]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor: through an ``array`` (a C loop), several times
    faster than ``torch.tensor`` on a list of Python ints (the tensor keeps the array)."""
    buf = array("q", values)
    if not buf:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(buf, dtype=torch.long)
