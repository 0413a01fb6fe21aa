"""Requests lost with their probe: no request stays ``admitted`` forever.

A request's row names the probe and node of its admission (``requests.probe_id``/``node``).
When that probe is known to be gone, the collector closes its requests still ``admitted``
(neither finished nor rejected) as ``lost``, with the reason:

- ``probe_stopped``: the probe said so (``probe.stopped``), closed in the transaction that
  stores that event;
- ``probe_replaced``: a new probe announced itself (``engine.config``) on the same node of
  the same deployment, and the old one had been quiet for ``KVWATCH_PROBE_REPLACED_QUIET_S``
  before the new one was first heard from (an engine's restart takes far longer, the model
  loads; two probes sending side by side are replicas reporting one node id, not a
  restart); closed in the transaction that stores the announcement, for that node's
  requests;
- ``probe_silent``: nothing heard from it for ``KVWATCH_PROBE_LOST_AFTER_S``, closed by a
  periodic pass (:meth:`LostRequests.close_silent`, time passed in).

Invariants: ``probes.gone_at``/``gone_reason`` are set exactly when the collector has closed
all of that probe's open requests (a probe replaced on one of several nodes it reported, a
prefill and a decode node, runs on: only that node's requests are closed); and
``probes.lost_requests`` counts every request it closed. A silent probe heard from again
is running again (cleared), a stopped or replaced one stays gone and the requests its later
batches leave open (a crash journal replayed under its id) are closed in the transaction
storing them. Closing is one indexed ``UPDATE`` per gone probe, on ``ix_requests_open``
(a partial index over the open rows only), never a scan of history. A finish that arrives
later for a lost request wins (``STATUS_RANK`` in :mod:`collector.store`): the row takes the
real status and its ``lost_reason`` goes. Rows without a probe (a gateway's; OTLP spans,
which carry their finish with their admission) are never open, so never closed.

Locks: every closing holds the gone probe's ``probes`` row (``FOR UPDATE`` on PostgreSQL),
as that probe's ingest does, so the two serialise per probe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import text

from collector.db import Database
from collector.lost_rows import SILENT, close, mark_gone
from collector.timefmt import to_micros

log = logging.getLogger("kvwatch.lost")
_US = 1_000_000


@dataclass(frozen=True, slots=True)
class SilentPass:
    """What one pass of :meth:`LostRequests.close_silent` did."""

    probes: int  # probes found silent past the bound (now marked gone)
    lost: int  # their requests closed as lost


class LostRequests:
    """The periodic pass that closes silent probes' requests (``probe_silent``).

    ``lost_after_s``: how long a probe may be silent before it is gone
    (``KVWATCH_PROBE_LOST_AFTER_S``); ``counted``: told how many requests a pass closed, after
    their transaction committed (the collector's metrics); ``listening_since``: since when
    this collector could hear probes (default: now, when it is built).

    Silence is only judged over time the collector was listening: a pass closes nothing
    until the collector has been up, with its database, for the bound. After an outage of
    the collector or its database every probe's ``last_seen`` is old, though the probes
    were only buffering; a pass that fails (the database is down) starts the wait again."""

    def __init__(
        self,
        db: Database,
        lost_after_s: float,
        counted: Callable[[str, int], object] | None = None,
        *,
        listening_since: datetime | None = None,
    ):
        self.db = db
        self.lost_after_us = round(lost_after_s * _US)
        self._counted = counted
        self._since: int | None = to_micros(listening_since or datetime.now(UTC))

    def close_silent(self, now: datetime) -> SilentPass:
        """Close the requests of every probe silent for longer than the bound at ``now``, one
        transaction per probe (a probe heard from meanwhile is left running)."""
        now_us = to_micros(now)
        if self._since is None:  # the first pass after a failed one
            self._since = now_us
        if now_us - self._since < self.lost_after_us:
            return SilentPass(0, 0)
        try:
            return self._close_silent(now_us)
        except Exception:
            self._since = None
            raise

    def _close_silent(self, now_us: int) -> SilentPass:
        cutoff = now_us - self.lost_after_us
        find = (
            "SELECT probe_id FROM probes WHERE gone_at IS NULL AND last_seen < :cutoff "
            "ORDER BY probe_id"
        )
        with self.db.read() as conn:
            quiet = list(conn.execute(text(find), {"cutoff": cutoff}).scalars())
        probes = lost = 0
        for probe_id in quiet:
            with self.db.write() as conn:
                # Again under its lock: a batch may have arrived since.
                still = conn.execute(
                    text(
                        "SELECT probe_id FROM probes WHERE probe_id = :p AND gone_at IS NULL "
                        "AND last_seen < :cutoff" + ("" if self.db.is_sqlite else " FOR UPDATE")
                    ),
                    {"p": probe_id, "cutoff": cutoff},
                ).first()
                if still is None:
                    continue
                n = close(conn, probe_id, SILENT)
                mark_gone(conn, probe_id, SILENT, now_us, n)
            probes += 1
            lost += n
            if n:
                log.info("probe %s silent: %d request(s) closed as lost", probe_id, n)
                if self._counted is not None:
                    self._counted(SILENT, n)
        return SilentPass(probes, lost)
