"""The audit chain, keyed: signed checkpoints of its head.

Anyone can recompute a hash chain: an edited entry with every later hash recomputed verifies
as a chain. A *checkpoint* is an ``audit.checkpoint`` entry whose detail holds a JWS (the
collector's signing key, :mod:`collector.signing`) over ``{entry_id, head, count}``: the id
and hash of the entry it signs and how many entries the chain held up to it. The collector
appends one every ``KVWATCH_AUDIT_CHECKPOINT_S`` (when anything was appended since), and
``kvwatch audit export`` appends one before it exports.

:func:`verify_keyed` fails a chain that was rewritten without the key, because a rewritten
entry changes every later hash and no longer matches the signed heads; and a chain whose
checkpoints were deleted (and hashes recomputed), because it has entries older than the
checkpoint period that no checkpoint covers (``2 x period`` after the entry, or after the
first published key was made, whichever is later: one period for the pass to come, one for
slack).

Invariant: a checkpoint signs an entry before it, never itself; a chain whose last entry is a
checkpoint gets no new one (a quiet log does not grow by a checkpoint every period).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select, text

from collector import audit
from collector import models as m
from collector.audit import ChainCheck, verify_entries
from collector.signing import KeyRing, SignatureInvalid, statement, verify
from collector.timefmt import iso, parse_iso, to_micros

CHECKPOINT = "audit.checkpoint"
SUBJECT = "audit:head"


def checkpoint(conn: Connection, ring: KeyRing, *, actor: str, now: datetime) -> int | None:
    """Sign the chain's head inside the caller's transaction; returns the entry id signed,
    or None when there is nothing new to sign (an empty log, or a checkpoint already last)."""
    if conn.dialect.name == "postgresql":  # the head read here is the one appended after
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": audit._PG_LOCK})
    last = conn.execute(
        select(m.AuditEntry.id, m.AuditEntry.hash, m.AuditEntry.action)
        .order_by(m.AuditEntry.id.desc())
        .limit(1)
    ).first()
    if last is None or last.action == CHECKPOINT:
        return None
    count = int(conn.execute(select(func.count()).select_from(m.AuditEntry)).scalar() or 0)
    head = {"entry_id": int(last.id), "head": last.hash, "count": count}
    token = ring.sign(statement(sub=SUBJECT, iat=now, conclusions=head), now=now)
    audit.append(
        conn,
        now_us=to_micros(now),
        actor=actor,
        action=CHECKPOINT,
        subject=SUBJECT,
        detail={**head, "jws": token},
    )
    return int(last.id)


@dataclass
class KeyedCheck:
    """The chain's check and its checkpoints'. ``signed_through``: the last entry a valid
    checkpoint signs (None: none); ``keys``: the key ids that signed them."""

    chain: ChainCheck
    ok: bool
    problem: str | None = None
    first_bad_id: int | None = None
    checkpoints: int = 0
    signed_through: int | None = None
    signed_entries: int = 0
    keyed: bool = True  # False: no published key, the chain is checked unkeyed only
    keys: dict[str, str | None] = field(default_factory=dict)  # kid -> retired at


def verify_keyed(
    rows: Iterable[dict[str, Any]],
    key_set: Mapping[str, Any],
    *,
    period_s: float,
    now: datetime,
) -> KeyedCheck:
    """The chain (:func:`collector.audit.verify_entries`), then every checkpoint's signature
    against ``key_set`` and its signed head against the chain, then that no entry older than
    the checkpoint period is left unsigned. An empty ``key_set``: the chain alone, said to
    be unkeyed."""
    entries = list(rows)
    chain = verify_entries(entries)
    if not chain.ok:
        return KeyedCheck(chain, False, chain.problem, chain.first_bad_id)
    if not key_set.get("keys"):
        return KeyedCheck(chain, True, keyed=False)
    at: dict[int, tuple[int, str]] = {}  # entry id -> (position, hash)
    for i, row in enumerate(entries):
        at[int(row["id"])] = (i, row["hash"])
    out = KeyedCheck(chain, True)
    for row in entries:
        if row["action"] != CHECKPOINT:
            continue
        out.checkpoints += 1
        rid = int(row["id"])
        try:
            detail = json.loads(row["detail"])
            v = verify(detail["jws"], key_set)
            signed = v.claims["conclusions"]
            eid, head, count = int(signed["entry_id"]), str(signed["head"]), int(signed["count"])
        except SignatureInvalid as exc:
            return _fail(out, rid, f"checkpoint {rid}: its signature does not verify: {exc}")
        except (ValueError, KeyError, TypeError) as exc:
            return _fail(out, rid, f"checkpoint {rid}: not a signed checkpoint ({exc})")
        found = at.get(eid)
        if found is None or eid >= rid:
            return _fail(out, rid, f"checkpoint {rid} signs entry {eid}, which is not before it")
        pos, got = found
        if got != head or pos + 1 != count:
            return _fail(
                out,
                eid,
                f"checkpoint {rid} signed entry {eid} as head {head} of {count} entries; the "
                f"chain has {got} of {pos + 1} there: rewritten without the signing key",
            )
        out.keys[v.kid] = v.retired_at
        if out.signed_through is None or eid > out.signed_through:
            out.signed_through, out.signed_entries = eid, count
    # Entries no checkpoint covers must be younger than the period (plus one for slack),
    # counted from when the first key existed: a chain from before keys gets its first
    # checkpoint within a period of the key being made.
    made = [
        parse_iso(k["kvwatch_created_at"]) for k in key_set["keys"] if k.get("kvwatch_created_at")
    ]
    since_us = to_micros(min(made)) if made else 0
    limit_us = to_micros(now) - int(2 * period_s * 1_000_000)
    for row in entries:
        if out.signed_through is not None and int(row["id"]) <= out.signed_through:
            continue
        if row["action"] == CHECKPOINT:
            continue
        if max(int(row["ts"]), since_us) < limit_us:
            return _fail(
                out,
                int(row["id"]),
                f"entry {row['id']} ({iso(int(row['ts']))}) is older than twice the checkpoint "
                f"period ({period_s:g} s) and no signed checkpoint covers it: checkpoints were "
                "deleted, or no collector has run to sign the head (kvwatch audit checkpoint)",
            )
    return out


def _fail(out: KeyedCheck, entry_id: int, problem: str) -> KeyedCheck:
    out.ok, out.problem, out.first_bad_id = False, problem, entry_id
    return out
