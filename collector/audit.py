"""The append-only, hash-chained audit log.

Invariant: for consecutive entries a, b (by id): ``b.prev_hash == a.hash`` and every
``hash == sha256(prev_hash + canonical_json(ts, actor, action, subject, detail_sha256))``
with ``detail_sha256 == sha256(detail)``; the first entry's ``prev_hash`` is 64 zeros. Any
edit, deletion, insertion or reordering inside the chain breaks it, and :func:`verify` names
the first entry where it breaks. (Without an anchor kept elsewhere, removing entries from the
very end, or appending correctly chained ones, cannot be told from history: that is what
publishing the head hash is for.)

The chain covers a detail's *digest*, so a detail can be erased (GDPR Art. 17) without
breaking the chain: :func:`redact` replaces it with a marker naming the erasure entry, and
:func:`verify` accepts a redacted detail only when that later entry exists and lists it.
Entries written before the digest column (``detail_sha256`` NULL) hash the detail itself and
cannot be redacted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
from sqlalchemy import Connection, insert, select, text, update

from collector import models as m
from collector.timefmt import as_micros

GENESIS = "0" * 64
_PG_LOCK = 0x6B7677617564  # serialises appenders across collector replicas
_enc = msgspec.json.Encoder(order="sorted")


def _digest(prev: str, ts: int, actor: str, action: str, subject: str | None, detail: str) -> str:
    """An entry's hash; ``detail`` is the detail's SHA-256 (or, before it existed, the
    detail itself)."""
    body = _enc.encode([ts, actor, action, subject, detail])
    return hashlib.sha256(prev.encode() + body).hexdigest()


def _sha(detail_json: str) -> str:
    return hashlib.sha256(detail_json.encode()).hexdigest()


def redaction_marker(erasure_entry_id: int) -> str:
    return _enc.encode({"redacted_by_entry": erasure_entry_id}).decode()


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
    detail_sha = _sha(detail_json)
    h = _digest(prev, now_us, actor, action, subject, detail_sha)
    conn.execute(
        insert(m.AuditEntry).values(
            ts=now_us,
            actor=actor,
            action=action,
            subject=subject,
            detail=detail_json,
            detail_sha256=detail_sha,
            prev_hash=prev,
            hash=h,
        )
    )
    return h


def last_id(conn: Connection) -> int:
    return int(conn.execute(select(m.AuditEntry.id).order_by(m.AuditEntry.id.desc())).scalar() or 0)


def redact(conn: Connection, entry_ids: list[int], erasure_entry_id: int) -> int:
    """Replace these entries' details with a marker naming the erasure entry (which must list
    them under ``redacted_entries``); entries without a detail digest are left alone.
    Returns how many were redacted."""
    n = 0
    for i in entry_ids:
        n += conn.execute(
            update(m.AuditEntry)
            .where(m.AuditEntry.id == i, m.AuditEntry.detail_sha256.is_not(None))
            .values(detail=redaction_marker(erasure_entry_id), redacted_by=erasure_entry_id)
        ).rowcount
    return n


@dataclass(frozen=True, slots=True)
class ChainCheck:
    ok: bool
    entries: int
    first_bad_id: int | None = None
    problem: str | None = None
    head: str | None = None  # the last entry's hash when intact: an anchor to keep elsewhere


_COLUMNS = (
    "id",
    "ts",
    "actor",
    "action",
    "subject",
    "detail",
    "detail_sha256",
    "redacted_by",
    "prev_hash",
    "hash",
)


def entries(conn: Connection) -> Iterator[dict[str, Any]]:
    """Every entry in id order, as plain values (``ts`` in microseconds): what
    :func:`verify_entries` checks and an export bundle holds."""
    cols = [getattr(m.AuditEntry, c) for c in _COLUMNS]
    for row in conn.execute(select(*cols).order_by(m.AuditEntry.id)):
        values = dict(zip(_COLUMNS, row, strict=True))
        values["ts"] = as_micros(values["ts"])
        yield values


def verify(conn: Connection) -> ChainCheck:
    """Walk the database's chain (see :func:`verify_entries`)."""
    return verify_entries(entries(conn))


def verify_entries(rows: Iterable[dict[str, Any]]) -> ChainCheck:
    """Walk the chain in id order; the first entry whose content does not match its hash
    (edited, or forged) or whose ``prev_hash`` is not the previous entry's hash (an entry
    deleted, inserted or moved before it) is named. Needs no database: an exported bundle
    is checked the same way."""
    prev = GENESIS
    prev_id: int | None = None
    seen: set[str] = set()
    redactions: dict[int, int] = {}  # redacted entry id -> the erasure entry that claims it
    checked: set[int] = set()  # erasure entries reached and found to list their redactions
    n = 0
    for values in rows:
        row = SimpleNamespace(**values)
        n += 1
        ts = int(row.ts)
        covered = row.detail if row.detail_sha256 is None else row.detail_sha256
        edited = "entry content does not match its hash (edited or forged)"
        if _digest(row.prev_hash, ts, row.actor, row.action, row.subject, covered) != row.hash:
            return ChainCheck(False, n, row.id, edited)
        if row.detail_sha256 is not None and _sha(row.detail) != row.detail_sha256:
            marker_ok = (
                row.redacted_by is not None
                and row.redacted_by > row.id
                and row.detail == redaction_marker(row.redacted_by)
            )
            if not marker_ok:
                return ChainCheck(False, n, row.id, edited)
            redactions[row.id] = row.redacted_by
        if row.id in redactions.values():
            checked.add(row.id)
            claimed = set(msgspec.json.decode(row.detail).get("redacted_entries", []))
            missing = [i for i, by in redactions.items() if by == row.id and i not in claimed]
            if missing:
                return ChainCheck(
                    False, n, missing[0], f"redacted without being listed by erasure {row.id}"
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
    orphan = [i for i, by in redactions.items() if by not in checked]
    if orphan:
        return ChainCheck(False, n, orphan[0], "redacted, but no erasure entry claims it")
    return ChainCheck(True, n, head=prev if n else None)
