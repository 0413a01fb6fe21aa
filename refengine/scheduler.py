"""Queues and admission policy (which requests move to the next phase, and when).

The scheduler decides; the engine executes (allocates, runs the model, fires hooks). It
never touches tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from refengine.request import Request


class Scheduler:
    """The three queues of one engine.

    Invariants:

    * every live request is in exactly one of ``waiting`` (status ``queued``: holds no
      pages), ``transferring`` (disaggregated only, status ``transferring``: holds its
      prefill pages) or ``running`` (status ``decoding``: holds its decode block table);
    * each queue is in arrival order, and admission is strict FIFO: a head that does not fit
      blocks those behind it, so a long prompt waiting for pages is never starved by a stream
      of short ones;
    * ``len(running) <= max_batch`` and ``len(transferring) <= max_batch``.
    """

    def __init__(self, *, max_batch: int, max_prefill_tokens: int) -> None:
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.transferring: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.transferring or self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.transferring) + len(self.running)

    def pick_prefills(
        self, *, free_pages: int, pages_needed: Callable[[Request], int], slots: int
    ) -> list[Request]:
        """Pop the waiting requests to prefill this step.

        Limits: ``slots`` requests (room left in the next queue), ``free_pages`` pages of the
        pool prefill allocates from, and the per-step prefill token budget — except that the
        first prefill of a step always runs if it fits, so no prompt waits forever on the
        budget.
        """
        picked: list[Request] = []
        tokens = 0
        while self.waiting and len(picked) < slots:
            head = self.waiting[0]
            need = pages_needed(head)
            if need > free_pages:
                break
            if picked and tokens + head.cached_prompt_tokens > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            picked.append(head)
            free_pages -= need
            tokens += head.cached_prompt_tokens
        return picked

    def pick_transfers(
        self, *, free_pages: int, pages_needed: Callable[[Request], int]
    ) -> list[Request]:
        """Pop the prefilled requests whose decode block tables fit now."""
        picked: list[Request] = []
        room = self.max_batch - len(self.running)
        while self.transferring and len(picked) < room:
            need = pages_needed(self.transferring[0])
            if need > free_pages:
                break
            picked.append(self.transferring.popleft())
            free_pages -= need
        return picked

    def remove(self, req: Request) -> bool:
        """Take ``req`` out of whichever queue holds it; False if none does."""
        for queue in (self.waiting, self.transferring):
            if req in queue:
                queue.remove(req)
                return True
        if req in self.running:
            self.running.remove(req)
            return True
        return False
