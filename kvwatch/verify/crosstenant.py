"""The cross-tenant phase: one tenant plants its canary while the others send prompts near
and over the limit, under background load; any other tenant's canary in an answer is a leak
(the session checks every answer).

One round per tenant as the owner:

1. **plant** — the owner sends prompts of 1/2, 1/4 and 1/8 of the largest accepted length
   (its canary repeated throughout, so they fill whole KV pages with it), one after the
   other, smallest last: engines hand recently freed pages out first, so the owner's pages
   are the ones the next requests get;
2. **read** — at the same time every other tenant sends prompts of 1/2, 3/4, (limit - the
   read length) and the limit itself, plus one at the smallest refused length, each asking
   for enough tokens to read a whole canary back; meanwhile the owner keeps a bounded
   background load running (small prompts, a few in parallel), so pages are freed and
   reused while the readers are admitted.

Threads, not asyncio: the sweep is a handful of blocking requests at a time, the CLI is
synchronous, and one shared ``httpx.Client`` is safe across threads; two small pools
(readers, background) bound the concurrency exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final

from kvwatch.verify.canaries import SEPARATOR, canary_length
from kvwatch.verify.session import (
    BudgetExhausted,
    CouldNotRun,
    EndpointGone,
    ProbeRecord,
    Session,
)
from kvwatch.verify.sweep import SweepResult

PLANT_FRACTIONS: Final = (1 / 2, 1 / 4, 1 / 8)
#: Two tokens: enough for a disaggregated engine to move the request to decode (so the
#: decode pool holds the canary too), little enough to cost nothing.
PLANT_MAX_TOKENS: Final = 2
READ_FRACTIONS: Final = (1 / 2, 3 / 4)
#: Reads per other tenant per round: the fractions, limit - read, the limit, one over it.
READS_PER_TENANT: Final = len(READ_FRACTIONS) + 3
READ_PARALLEL: Final = 4
BACKGROUND_REQUESTS: Final = 4
BACKGROUND_PARALLEL: Final = 2
BACKGROUND_FRACTION: Final = 1 / 16
BACKGROUND_MAX_TOKENS: Final = 8


def planned_requests(n_tenants: int) -> int:
    """The most requests the phase sends (the budget reserves them before the sweep)."""
    per_round = len(PLANT_FRACTIONS) + (n_tenants - 1) * READS_PER_TENANT + BACKGROUND_REQUESTS
    return n_tenants * per_round


def read_tokens(period: int) -> int:
    """Tokens a reader asks for: two canary periods and some, at least 64."""
    return max(64, 2 * period + 16)


def reader_max_tokens(min_fragment: int) -> int:
    """What a reader asks for with canaries sized for ``min_fragment``."""
    return read_tokens(canary_length(min_fragment) + len(SEPARATOR))


@dataclass(frozen=True)
class Plan:
    plant_bytes: tuple[int, ...]
    #: Near the limit, ascending; the last is the largest accepted prompt itself.
    read_bytes: tuple[int, ...]
    #: The smallest refused prompt of the sweep (None when nothing was refused).
    over_bytes: int | None
    background_bytes: int
    read_tokens: int


def make_plan(session: Session, sweep: SweepResult, *, min_bytes: int, period: int) -> Plan:
    cal = session.calibration
    top_t, top_b = sweep.largest_accepted_tokens, sweep.largest_accepted_bytes
    reads_for = read_tokens(period)

    def at(tokens: float) -> int:
        return min(max(cal.bytes_for(tokens), min_bytes), top_b)

    plants = tuple(dict.fromkeys(at(top_t * f) for f in PLANT_FRACTIONS))
    reads = {at(top_t * f) for f in READ_FRACTIONS} | {at(top_t - reads_for), top_b}
    over = sweep.rejected.prompt_bytes if sweep.rejected is not None else None
    return Plan(
        plant_bytes=plants,
        read_bytes=tuple(sorted(reads)),
        over_bytes=over,
        background_bytes=at(top_t * BACKGROUND_FRACTION),
        read_tokens=reads_for,
    )


def run_cross_tenant(session: Session, tenants: list[str], plan: Plan) -> None:
    """One round per owner tenant. Raises what a request raised (``CouldNotRun``,
    ``EndpointGone``, ``BudgetExhausted``) once the round's requests have all ended."""
    sizes = [*plan.read_bytes, *([plan.over_bytes] if plan.over_bytes is not None else [])]
    for owner in tenants:
        for n in plan.plant_bytes:
            session.probe(owner, n, PLANT_MAX_TOKENS, "plant")
        readers = [(t, n) for n in sizes for t in tenants if t != owner]
        with (
            ThreadPoolExecutor(READ_PARALLEL, thread_name_prefix="kvw-read") as reads,
            ThreadPoolExecutor(BACKGROUND_PARALLEL, thread_name_prefix="kvw-load") as load,
        ):
            futures: list[Future[ProbeRecord]] = [
                load.submit(
                    session.probe, owner, plan.background_bytes, BACKGROUND_MAX_TOKENS, "background"
                )
                for _ in range(BACKGROUND_REQUESTS)
            ]
            futures += [
                reads.submit(session.probe, t, n, plan.read_tokens, "read") for t, n in readers
            ]
            wait(futures)
        _raise_first(futures)


def _raise_first(futures: list[Future[ProbeRecord]]) -> None:
    errors = [e for f in futures if (e := f.exception()) is not None]
    rank: dict[type[BaseException], int] = {CouldNotRun: 0, EndpointGone: 1, BudgetExhausted: 2}
    key: Callable[[BaseException], int] = lambda e: rank.get(type(e), -1)  # noqa: E731
    if errors:
        raise min(errors, key=key)
