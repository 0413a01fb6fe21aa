"""Requests, their streaming deltas, and finished completions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from refengine.tokenizer import EOS, ByteTokenizer, IncrementalDecoder

Status = Literal[
    "queued",  # accepted, waiting for prefill
    "prefilling",  # (transient, within a step)
    "transferring",  # disaggregated: prefilled, waiting for decode-pool pages
    "decoding",
    "finished",
    "rejected",  # clean rejection: nothing allocated, no output
    "aborted",
]
FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenDelta:
    """What one step added to one request: for streaming (SSE) and progress."""

    request: Request
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class Completion:
    """A finished request, as a server answers it."""

    request_id: str
    tenant: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    #: The engine marked the request rejected (legacy prefill rejection) yet answered.
    rejected: bool
    #: Legacy monolithic: the prompt was silently cut to the pool before prefill.
    truncated: bool
    #: Prompt tokens served from the prefix cache instead of computed (vLLM's
    #: ``usage.prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0


@dataclass(eq=False)
class Request:
    """One request's state. The engine mutates it under its lock; readers in other threads
    may read ``status``, ``text`` and ``output_tokens`` (append-only) and wait on ``done``.

    Invariants:

    * ``prompt`` holds the prompt tokens (ids 0..255) one per byte;
      ``prompt_tokens == len(prompt)`` is what the client sent;
      ``cached_prompt_tokens <= prompt_tokens`` is what prefill actually wrote (smaller only
      for legacy truncation, or 1 for the legacy placeholder).
    * ``block_table`` is ``None`` or an int64 tensor of page ids in pool ``pool_name``,
      covering at least ``cache_len`` positions; position ``p`` lives in slot
      ``p % page_size`` of page ``block_table[p // page_size]``.
    * ``assumed_prompt_tokens`` is the prompt length decode trusts when it takes the
      request over; ``cache_len`` (the positions decode believes valid) starts there and
      grows by one per decode step. It equals what was written except on the legacy
      rejection path, where decode trusts the client's prompt length while prefill wrote one
      placeholder — the incident.
    * ``reserve_tokens`` = ``assumed_prompt_tokens + max_new_tokens - 1`` is what the decode
      block table covers, allocated up front, so decode never waits for a page mid-request
      (the last generated token is never fed back, hence the -1).
    * ``1 <= max_new_tokens <= max_tokens``; ``len(output_tokens) <= max_new_tokens``.
    * ``cached_tokens`` (a multiple of ``page_size``, ``< cached_prompt_tokens``) is the part
      of the prompt granted from the prefix cache: the first ``cached_tokens // page_size``
      pages of ``block_table`` are cached pages other requests computed, and prefill
      computed and wrote only positions ``[cached_tokens, cached_prompt_tokens)``. 0 with the
      cache off, and for a prompt prefill does not write whole (legacy truncation or
      placeholder): those neither use nor fill the cache.
    * ``page_keys`` are the prefix-cache keys of the prompt's full pages (empty when the
      request takes no part in the cache); ``cached_pages`` the cached pages its block table
      holds a reference on (its hits, then the pages it cached itself), host ints.
    * ``tier_keys`` are the keys its full pages go to the offload tier under (its
      ``page_keys``, or the unsalted chain under the ``offload_drops_salt`` fault);
      ``tier_entries`` what the tier holds of the pages past its pool hits, found when it
      was picked and loaded by prefill into its first fresh pages (host-side; empty without
      a tier).
    * ``handle`` (>= 1) is unique per engine; ``tenant_handle`` (>= 1) is the same for every
      request of a tenant. Both are stable ints for vectorised observers.
    """

    request_id: str
    tenant: str
    handle: int
    tenant_handle: int
    prompt: bytes
    max_tokens: int
    max_new_tokens: int
    model: str
    route: str | None = None
    cache_salt: str | None = None
    status: Status = "queued"
    prefill_rejected: bool = False
    truncated: bool = False
    cached_prompt_tokens: int = 0
    assumed_prompt_tokens: int = 0
    reserve_tokens: int = 0
    cache_len: int = 0
    cached_tokens: int = 0
    page_keys: list[bytes] = field(default_factory=list, repr=False)
    cached_pages: list[int] = field(default_factory=list, repr=False)
    tier_keys: list[bytes] = field(default_factory=list, repr=False)
    tier_entries: list[Any] = field(default_factory=list, repr=False)
    output_tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    block_table: torch.Tensor | None = None
    pool_name: str | None = None
    created: float = field(default_factory=time.time)
    finished_at: float | None = None
    on_delta: Callable[[TokenDelta], None] | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    _decoder: IncrementalDecoder = field(default_factory=IncrementalDecoder, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_tokens)

    @property
    def rejected(self) -> bool:
        return self.status == "rejected" or self.prefill_rejected

    @property
    def finished(self) -> bool:
        return self.status in ("finished", "rejected", "aborted")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request finished (or timed out); True if finished."""
        return self.done.wait(timeout)

    def completion(self) -> Completion:
        if self.finish_reason is None:
            raise RuntimeError(f"request {self.request_id} has not finished")
        return Completion(
            request_id=self.request_id,
            tenant=self.tenant,
            text=ByteTokenizer().decode(self.output_tokens),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason,
            rejected=self.rejected,
            truncated=self.truncated,
            cached_tokens=self.cached_tokens,
        )

    # -- engine side ----------------------------------------------------------------------

    def _emit(self, token: int) -> TokenDelta:
        """Append one generated token and decide whether the request is done (EOS, or
        ``max_new_tokens`` reached). Called by the engine only."""
        self.output_tokens.append(token)
        if token == EOS:
            self.finish_reason = "stop"
        elif len(self.output_tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        finished = self.finish_reason is not None
        piece = self._decoder.feed((token,), final=finished)
        self.text += piece
        return TokenDelta(self, (token,), piece, finished, self.finish_reason)

    def _close(self, status: Status, reason: FinishReason | None) -> str:
        """Final state; returns text still held by the incremental decoder (abort only)."""
        self.status = status
        if reason is not None and self.finish_reason is None:
            self.finish_reason = reason
        piece = self._decoder.feed((), final=True)
        self.text += piece
        self.finished_at = time.time()
        return piece
