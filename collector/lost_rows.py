"""The rows of requests lost with their probe (see :mod:`collector.lost`, which owns the
rules): closing a gone probe's open requests, marking it gone, and counting what was lost.
Every statement is indexed: ``ix_requests_open`` (the open rows only) for closing,
``ix_requests_lost`` (the lost rows only) for counting."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from collector.timefmt import from_micros

STOPPED, REPLACED, SILENT = "probe_stopped", "probe_replaced", "probe_silent"
REASONS = (STOPPED, REPLACED, SILENT)

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
