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
that probe's open requests; a silent probe heard from again is running again (cleared), a
stopped or replaced one stays gone and the requests its later batches leave open (a crash
journal replayed under its id) are closed in the transaction storing them. Closing is one
indexed ``UPDATE`` per gone probe, on ``ix_requests_open`` (a partial index over the open
rows only), never a scan of history. A finish that arrives later for a lost request wins
(``STATUS_RANK`` in :mod:`collector.store`): the row takes the real status and its
``lost_reason`` goes. Rows without a probe (a gateway's; OTLP spans, which carry their
finish with their admission) are never open, so never closed.

Locks: every closing holds the gone probe's ``probes`` row (``FOR UPDATE`` on PostgreSQL),
as that probe's ingest does, so the two serialise per probe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from collector.db import Database
from collector.timefmt import from_micros, to_micros

log = logging.getLogger("kvwatch.lost")

STOPPED, REPLACED, SILENT = "probe_stopped", "probe_replaced", "probe_silent"
REASONS = (STOPPED, REPLACED, SILENT)
_US = 1_000_000

_CLOSE = (
    "UPDATE requests SET status = 'lost', lost_reason = :reason "
    "WHERE probe_id = :probe AND status = 'admitted'"
)
_CLOSE_NODE = _CLOSE + " AND node = :node"


def close(conn: Connection, probe_id: str, reason: str, node: str | None = None) -> int:
    """Close ``probe_id``'s open requests (on ``node`` only, if given) as lost; how many."""
    params = {"reason": reason, "probe": probe_id}
    if node is None:
        return conn.execute(text(_CLOSE), params).rowcount
    return conn.execute(text(_CLOSE_NODE), {**params, "node": node}).rowcount


def mark_gone(conn: Connection, probe_id: str, reason: str, now_us: int, lost: int) -> None:
    """Record ``probe_id`` gone, and ``lost`` more of its requests closed."""
    conn.execute(
        text(
            "UPDATE probes SET gone_at = :at, gone_reason = :r, "
            "lost_requests = lost_requests + :n WHERE probe_id = :p"
        ),
        {"at": now_us, "r": reason, "n": lost, "p": probe_id},
    )


def replace_on_node(
    conn: Connection,
    deployment_id: str,
    node: str,
    probe_id: str,
    first_seen_us: int,
    now_us: int,
    quiet_us: int,
) -> int:
    """``probe_id`` (first heard from at ``first_seen_us``) announced itself as ``node`` of
    ``deployment_id``: close the open requests on that node of the probes it replaced, those
    quiet for ``quiet_us`` before it (see the module); how many. The old probes are locked
    in id order (one order for every caller), and marked gone when they had requests open
    there and have none open elsewhere."""
    sqlite = conn.dialect.name == "sqlite"
    olds = conn.execute(
        text(
            "SELECT probe_id FROM probes WHERE deployment_id = :d AND probe_id <> :p "
            "AND gone_at IS NULL AND last_seen <= :before ORDER BY probe_id"
            + ("" if sqlite else " FOR UPDATE")
        ),
        {"d": deployment_id, "p": probe_id, "before": first_seen_us - quiet_us},
    ).scalars()
    total = 0
    for old in list(olds):
        n = close(conn, old, REPLACED, node)
        if not n:
            continue
        total += n
        # Gone when nothing of it is left open; one probe reporting several nodes (a
        # prefill and a decode node) whose other nodes were not replaced runs on there.
        left = conn.execute(
            text("SELECT 1 FROM requests WHERE probe_id = :p AND status = 'admitted' LIMIT 1"),
            {"p": old},
        ).first()
        if left is None:
            mark_gone(conn, old, REPLACED, now_us, n)
        else:
            conn.execute(
                text("UPDATE probes SET lost_requests = lost_requests + :n WHERE probe_id = :p"),
                {"n": n, "p": old},
            )
    return total


@dataclass(frozen=True, slots=True)
class SilentPass:
    """What one pass of :meth:`LostRequests.close_silent` did."""

    probes: int  # probes found silent past the bound (now marked gone)
    lost: int  # their requests closed as lost


class LostRequests:
    """The periodic pass that closes silent probes' requests (``probe_silent``).

    ``lost_after_s``: how long a probe may be silent before it is gone
    (``KVWATCH_PROBE_LOST_AFTER_S``); ``counted``: told how many requests a pass closed, after
    their transaction committed (the collector's metrics)."""

    def __init__(
        self,
        db: Database,
        lost_after_s: float,
        counted: Callable[[str, int], object] | None = None,
    ):
        self.db = db
        self.lost_after_us = round(lost_after_s * _US)
        self._counted = counted

    def close_silent(self, now: datetime) -> SilentPass:
        """Close the requests of every probe silent for longer than the bound at ``now``, one
        transaction per probe (a probe heard from meanwhile is left running)."""
        now_us = to_micros(now)
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


#: The window the fleet counts lost requests over.
RECENT_S = 86_400


def recent(conn: Connection, since_us: int) -> dict[str, dict[str, Any]]:
    """Per deployment, its requests lost since ``since_us`` (by first_ts): how many, by
    reason, and when the latest of them was last heard of. Reads ``ix_requests_lost`` (the
    lost rows only), bounded on part_ts too so PostgreSQL skips older months."""
    out: dict[str, dict[str, Any]] = {}
    for dep, reason, n, latest in conn.execute(
        text(
            "SELECT deployment_id, lost_reason, count(*), max(last_ts) FROM requests "
            "WHERE status = 'lost' AND first_ts >= :since AND part_ts >= :since "
            "GROUP BY deployment_id, lost_reason"
        ),
        {"since": since_us},
    ):
        d = out.setdefault(dep, {"count": 0, "by_reason": {}, "latest_at": None})
        d["count"] += int(n)
        d["by_reason"][reason or "unknown"] = int(n)
        at = from_micros(int(latest))
        d["latest_at"] = at if d["latest_at"] is None else max(d["latest_at"], at)
    return out
