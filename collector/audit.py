"""The append-only, hash-chained audit log.

Invariant: for consecutive entries a, b (by id): ``b.prev_hash == a.hash`` and every
``hash == sha256(prev_hash + canonical_json(ts, actor, action, subject, detail))``; the first
entry's ``prev_hash`` is 64 zeros. Any edit, deletion, insertion or reordering inside the
chain breaks it, and :func:`verify` names the first entry where it breaks. (Without an anchor
kept elsewhere, removing entries from the very end, or appending correctly chained ones, cannot
be told from history: that is what publishing the head hash is for.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection, insert, select, text

from collector import models as m

GENESIS = "0" * 64
_PG_LOCK = 0x6B7677617564  # serialises appenders across collector replicas
_enc = msgspec.json.Encoder(order="sorted")


def _digest(prev: str, ts: int, actor: str, action: str, subject: str | None, detail: str) -> str:
    body = _enc.encode([ts, actor, action, subject, detail])
    return hashlib.sha256(prev.encode() + body).hexdigest()


def append(
    conn: Connection,
    *,
    now_us: int,
    actor: str,
    action: str,
    subject: str | None = None,
    detail: dict[str, Any] | None = None,
) -> str:
    """Append an entry inside the caller's transaction; returns its hash."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
    prev = conn.execute(
        select(m.AuditEntry.hash).order_by(m.AuditEntry.id.desc()).limit(1)
    ).scalar()
    prev = prev or GENESIS
    detail_json = _enc.encode(detail or {}).decode()
    h = _digest(prev, now_us, actor, action, subject, detail_json)
    conn.execute(
        insert(m.AuditEntry).values(
            ts=now_us,
            actor=actor,
            action=action,
            subject=subject,
            detail=detail_json,
            prev_hash=prev,
            hash=h,
        )
    )
    return h


@dataclass(frozen=True, slots=True)
class ChainCheck:
    ok: bool
    entries: int
    first_bad_id: int | None = None
    problem: str | None = None
    head: str | None = None  # the last entry's hash when intact: an anchor to keep elsewhere


def verify(conn: Connection) -> ChainCheck:
    """Walk the chain in id order; the first entry whose content does not match its hash
    (edited, or forged) or whose ``prev_hash`` is not the previous entry's hash (an entry
    deleted, inserted or moved before it) is named."""
    prev = GENESIS
    prev_id: int | None = None
    seen: set[str] = set()
    n = 0
    for row in conn.execute(
        select(
            m.AuditEntry.id,
            m.AuditEntry.ts,
            m.AuditEntry.actor,
            m.AuditEntry.action,
            m.AuditEntry.subject,
            m.AuditEntry.detail,
            m.AuditEntry.prev_hash,
            m.AuditEntry.hash,
        ).order_by(m.AuditEntry.id)
    ):
        n += 1
        ts = row.ts if isinstance(row.ts, int) else m.to_micros(row.ts)
        if _digest(row.prev_hash, ts, row.actor, row.action, row.subject, row.detail) != row.hash:
            return ChainCheck(
                False, n, row.id, "entry content does not match its hash (edited or forged)"
            )
        if row.prev_hash != prev:
            after = f"entry {prev_id}" if prev_id is not None else "the start of the log"
            if row.prev_hash in seen:
                why = "entries were reordered or one was inserted before it"
            elif prev_id is None:
                why = "entries before it were deleted, or it was inserted"
            else:
                why = "an entry between them was deleted, or this one was inserted or moved"
            return ChainCheck(False, n, row.id, f"not chained to {after}: {why}")
        seen.add(row.hash)
        prev = row.hash
        prev_id = row.id
    return ChainCheck(True, n, head=prev if n else None)
