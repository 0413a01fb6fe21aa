"""Observer hooks: how a probe attaches to the engine from outside.

refengine imports no probe; a probe subclasses :class:`EngineObserver`, overrides what it
needs and calls ``engine.add_observer(obs)``. The engine calls the hooks synchronously, in
the thread that is driving it, with its lock held: never two hooks at once. An exception
raised by a hook propagates out of the engine call (an observer bug must be seen, and the
probe core already swallows its own runtime failures).

Page ids are int64 tensors on the pool's device; request and tenant identities on the
vectorised hooks are the int handles ``Request.handle`` / ``Request.tenant_handle``. The
tensors passed in are the engine's own: read them, do not modify them (the pool's K/V, on
the other hand, may be painted by a canary observer inside ``on_free``).

At ``submit`` (in the caller's thread): ``on_request_admitted``, or ``on_request_rejected``
when the prompt is over the advertised context (or, ``hardened``, over the pool). Then, within
one engine step: prefill (``on_request_rejected`` for a prompt over a disaggregated prefill
pool, which still gets a one-token placeholder; else maybe ``on_request_truncated``; then,
with a prefix-cache hit, ``on_prefix_hit``; then ``on_free`` of any cached pages evicted to
make room, ``on_alloc`` and ``on_kv_write``, and with a hit ``on_kv_read`` of the granted
pages, which the first token attends to), transfers (``on_alloc`` on the decode pool,
``on_kv_transfer``, ``on_free`` of the prefill pages), decode (``on_kv_write_batch`` for the
tokens fed back, then ``on_kv_read`` of everything attended), finishes (``on_free``,
``on_request_finished``), then ``on_step``.

With no observer attached the engine skips building hook arguments entirely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from refengine.engine import Engine
    from refengine.pool import KVPool
    from refengine.request import Request


class EngineObserver:
    """Base class with a no-op for every hook."""

    def on_attach(self, engine: Engine) -> None:
        """Added to ``engine``; ``engine.config`` and ``engine.pools`` are readable."""

    def on_request_admitted(self, req: Request) -> None:
        """``submit`` accepted the request (it passed the advertised-context check, and in
        hardened mode the pool check)."""

    def on_request_rejected(
        self, req: Request, reason: str, limit_tokens: int, prompt_tokens: int
    ) -> None:
        """Clean rejection in ``submit`` (``req.status == "rejected"``, nothing allocated,
        ``ContextLengthExceeded`` follows), or the legacy prefill rejection
        (``reason == "prefill_pool_exceeded"``, ``req.prefill_rejected``): the request goes on
        to a placeholder prefill, a transfer and decode."""

    def on_request_truncated(self, req: Request, limit_tokens: int, prompt_tokens: int) -> None:
        """Legacy monolithic: the prompt was silently cut to ``limit_tokens`` before prefill."""

    def on_request_finished(self, req: Request) -> None:
        """Final: ``req.status`` is ``finished`` or ``aborted``; its pages are already freed."""

    def on_alloc(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        """``pages`` now belong to ``req`` (contents unchanged: whatever they held)."""

    def on_free(self, pool: KVPool, pages: torch.Tensor, zeroized: bool) -> None:
        """``pages`` returned to the free list (after zeroizing, when ``zeroized``). With the
        prefix cache on, a request's cached pages do not come here when it ends (they stay
        cached, still holding their KV); they come when the cache evicts them."""

    def on_prefix_hit(
        self, pool: KVPool, pages: torch.Tensor, req: Request, owners: torch.Tensor
    ) -> None:
        """Prefill grants ``req`` the cached ``pages`` (the head of its block table, in
        order) instead of computing them: ``pages[i]`` was computed and written by the
        request with handle ``owners[i]`` (same length; maybe finished, maybe another
        tenant's), and holds exactly that write. ``req`` reads them as it reads its own
        pages but never writes them. Fired before the request's ``on_alloc``."""

    def on_kv_write(self, pool: KVPool, pages: torch.Tensor, req: Request) -> None:
        """``req`` just wrote slots in ``pages`` (prefill; decode via the batch hook)."""

    def on_tier_store(
        self,
        pool: KVPool,
        pages: torch.Tensor,
        keys: Sequence[bytes],
        writers: Sequence[int],
        tenants: Sequence[int],
    ) -> None:
        """The prefix cache evicted ``pages`` and their content went to the offload tier
        under ``keys`` (``keys[i]`` for ``pages[i]``), as written by the request with handle
        ``writers[i]`` of the tenant with handle ``tenants[i]``. Fired before the pages'
        ``on_free``."""

    def on_tier_load(
        self,
        pool: KVPool,
        pages: torch.Tensor,
        req: Request,
        keys: Sequence[bytes],
        writers: Sequence[int],
        tenants: Sequence[int],
    ) -> None:
        """Prefill loaded the offload tier's entries under ``keys`` into ``req``'s fresh
        ``pages`` (in order; fired after their ``on_alloc`` and the ``on_kv_write`` of
        that copy): ``pages[i]`` now holds what request ``writers[i]`` (tenant
        ``tenants[i]``) wrote, as the engine says; an observer checks that against what it
        recorded at the store."""

    def on_kv_write_batch(
        self,
        pool: KVPool,
        pages: torch.Tensor,
        writers: torch.Tensor,
        reqs: Sequence[Request],
    ) -> None:
        """A decode step wrote one slot per request: ``pages[i]`` by request handle
        ``writers[i]`` (= ``reqs[i].handle``). The default forwards to ``on_kv_write`` per
        request; a vectorised observer overrides this instead."""
        for i, req in enumerate(reqs):
            self.on_kv_write(pool, pages[i : i + 1], req)

    def on_kv_transfer(
        self,
        src_pool: KVPool,
        src_pages: torch.Tensor,
        dst_pool: KVPool,
        dst_pages: torch.Tensor,
        req: Request,
        prefill_rejected: bool,
    ) -> None:
        """Contents of ``src_pages[i]`` were copied into ``dst_pages[i]`` (same lengths).
        Only pages actually copied are listed; the rest of ``req``'s decode block table was
        just allocated (``on_alloc``) and holds whatever it held."""

    def on_kv_read(
        self,
        pool: KVPool,
        pages: torch.Tensor,
        readers: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """A decode step gathered ``pages`` (the batch's block-table prefixes, concatenated)
        for ``readers`` (request handles, same length). ``k``/``v`` are the gathered copies,
        ``[len(pages), page_size, heads, head_dim]``; ``valid`` ``[len(pages), page_size]``
        marks the slots attention actually used (a page's tail beyond the reader's length is
        gathered but masked)."""

    def on_step(self, engine: Engine) -> None:
        """After each ``engine.step()`` that did anything."""
