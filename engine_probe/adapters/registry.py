"""What an engine adapter remembers about requests and tenants, in bounded memory.

An adapter lives as long as its engine and sees an unbounded stream of request ids and
tenant names (the clients' strings), so everything it keeps per request or per tenant is
bounded: :class:`Bounded` forgets its oldest entries. :class:`TenantHandles` interns tenant
names as the ledger's tenant handles, :class:`RequestRegistry` hands out request handles and
keeps the names a stale read or a prefix-cache hit reports.

Handles are never reused: a request or tenant forgotten and seen again gets a fresh handle,
so two requests, or two tenants, never look like one to a ledger (at worst, a tenant's page
reused after its eviction counts as a cross-tenant reuse: the safe side)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

from engine_probe.adapters.common import UNKNOWN
from engine_probe.ledger import UNKNOWN_TENANT

__all__ = ["Bounded", "RequestRegistry", "TenantHandles"]

_K = TypeVar("_K")
_V = TypeVar("_V")


class Bounded(OrderedDict[_K, _V]):
    """A dict that forgets its oldest entries beyond ``capacity``: setting a key (new or
    not) makes it the newest."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key: _K, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class TenantHandles:
    """Tenant name → the ledger's tenant handle, for the ``capacity`` most recently used
    tenants, and each of those handles → its name.

    Invariants: handles count up from 0 and are never reused; both maps hold exactly the
    same tenants (each use refreshes both)."""

    __slots__ = ("_handles", "_names", "_next")

    def __init__(self, capacity: int) -> None:
        self._handles: Bounded[str, int] = Bounded(capacity)
        self._names: Bounded[int, str] = Bounded(capacity)
        self._next = 0

    def __len__(self) -> int:
        return len(self._handles)

    def handle(self, tenant: str) -> int:
        """``tenant``'s handle (a fresh one if it is new, or was forgotten)."""
        h = self._handles.get(tenant)
        if h is None:
            h = self._next
            self._next += 1
        self._handles[tenant] = h  # (re)inserted: the most recently used goes last
        self._names[h] = tenant
        return h

    def name(self, handle: int) -> str | None:
        """The tenant of ``handle``, None if forgotten (or never handed out)."""
        return self._names.get(handle)


class RequestRegistry:
    """Request handles, and per handle the names the events carry: (request id, tenant) and
    the tenant's ledger handle, for the ``capacity`` most recent requests.

    A request registered without a tenant is tenant ``"unknown"`` under the ledger's
    ``UNKNOWN_TENANT``; ``"unknown"`` given as a tenant name is interned like any other
    (which of the two an adapter does is its choice).

    TEST ONLY (``lose_writes_of``, the plugins' fault injection, see
    ``adapters.common.TEST_FAULTS_VAR``): the first request registered with that tenant
    becomes :attr:`lost`, once: its adapter leaves its KV writes out of the ledger.
    """

    __slots__ = ("_names", "_next", "lose_writes_of", "lost", "tenants")

    def __init__(self, capacity: int, lose_writes_of: str | None = None) -> None:
        self.tenants = TenantHandles(capacity)
        #: handle -> (request id, tenant, tenant handle)
        self._names: Bounded[int, tuple[str, str, int]] = Bounded(capacity)
        self._next = 0
        self.lose_writes_of = lose_writes_of
        self.lost: int | None = None

    def add(self, request_id: str, tenant: str | None) -> int:
        """A new request's handle; ``request_id`` and ``tenant`` as the wire carries them
        (``adapters.common.safe_id``), ``tenant`` None when unknown."""
        handle = self._next
        self._next += 1
        if tenant is None:
            name, th = UNKNOWN, UNKNOWN_TENANT
        else:
            name, th = tenant, self.tenants.handle(tenant)
        self._names[handle] = (request_id, name, th)
        if self.lose_writes_of is not None and name == self.lose_writes_of:
            self.lost, self.lose_writes_of = handle, None  # TEST ONLY, once
        return handle

    def known(self, handle: int) -> tuple[str, str] | None:
        """(request id, tenant) of ``handle``, None if forgotten."""
        known = self._names.get(handle)
        return None if known is None else (known[0], known[1])

    def names(self, handle: int) -> tuple[str, str]:
        """(request id, tenant) of ``handle``; ``(f"handle-{handle}", "unknown")`` if
        forgotten (the stale-read emitter's :data:`~engine_probe.adapters.common.RequestNames`)."""
        known = self._names.get(handle)
        return (f"handle-{handle}", UNKNOWN) if known is None else (known[0], known[1])

    def tenant_handle(self, handle: int) -> int:
        """The ledger tenant of ``handle``; ``UNKNOWN_TENANT`` if unknown or forgotten."""
        known = self._names.get(handle)
        return UNKNOWN_TENANT if known is None else known[2]
