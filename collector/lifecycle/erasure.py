"""Erasure (GDPR Art. 17): remove one tenant's name and request ids from every table.

**What is looked for.** The tenant's name, and every request id of its: collected first, in
the same transaction, from its requests and from the page events it read, owned or was the
other party of. A request id is unique only within its deployment: the structural steps
below use (deployment, request id) pairs; the walk of free text and documents, which cannot
tell deployments apart, uses the bare ids.

**The rule for a name inside a value** (:class:`Names`). A column holding a JSON object or
array is decoded and walked: every key and every string value, at any depth; any other text
column is one string. Inside a string, a name counts where it stands as a whole id: take
each maximal run of id characters (letters, digits and ``._:/@+=-``, the id rule of
:mod:`engine_probe.events`); the name must be all of the run but punctuation at its two ends.
So ``globex->acme`` names both tenants (the run ``globex-`` ends in punctuation), as do
``(r-7).`` and ``acme, globex``; ``acme-eu``, ``r-70``, ``tenant:acme`` and
``notice-acme.pdf`` are other ids and do not name ``acme`` (reading them as the tenant would
rewrite other tenants' names too). Names compare exactly (case matters, as in ids). Each
occurrence is replaced by :data:`ERASED`, the punctuation around it kept
(``<erased>->acme``); a decoded document is stored again as JSON.

**What happens, table by table** (one transaction):

- its requests (with their PostgreSQL keys and the OTLP spans stored as them), its rollup
  rows, the page events it read or owned, its deployment-tenant rows and its tenant-scoped
  tokens: deleted; the all-tenant (``'*'``) rollup buckets they fed are marked for
  recomputation;
- page events where it was the other party: that party (tenant and request id) is blanked,
  so the reader's evidence stays; another request naming one of its requests as the one it
  shares a prompt with: that link is blanked;
- alerts (with their history), notifications (with their delivery attempts), silences and
  stored reports whose documents name the tenant: deleted whole, as they are about it (one
  naming only a request id, which may be another deployment's, is rewritten instead);
- every other string column of every table (:func:`_walked`): the rule above, for the name
  and the request ids. Not walked: keys, which identify rows (the tenant's own rows are
  deleted above), the columns the structural steps own, and the columns naming kvwatch's
  own objects or vocabularies (:data:`_OWN`): a deployment, node, model or rule that shares
  the tenant's name is not the tenant;
- the audit log: an entry whose detail names it or one of its request ids has that detail
  redacted (:func:`collector.audit.redact`), listed by the erasure's own ``tenant.erase``
  entry, which holds counts per table, never the name.

**What is kept, and why** (:data:`KEPT`, also in the result): the audit chain's hashes and
what they cover. Each entry's ``ts``, ``actor``, ``action``, ``subject``, ``prev_hash`` and
``hash``, and a redacted detail's ``detail_sha256``, stay as they were: changing any of them
breaks the chain, and ``kvwatch audit verify`` would report the entry as edited. A digest
does not reveal its detail (though it confirms a detail someone guesses exactly). Entries
whose actor or subject (``kind:id``, the id read on its own) name the tenant or a request
id, and entries from before detail digests whose detail does, cannot be changed either: the
result lists their ids for a person to judge.

**The bytes on disk.** Deleted and rewritten rows leave their old bytes where the database
keeps free space until it reuses it. On SQLite the erasure runs with ``secure_delete`` (what
it frees is overwritten with zeros) and then checkpoints the WAL and truncates it (unless a
reader kept the checkpoint from finishing: the result says so); earlier versions of rows
that named the tenant, left in free space by updates made before the erasure, stay until
``compact``, which runs ``VACUUM``: the file is rewritten from its live rows, and then
neither it nor its WAL holds the erased values. On PostgreSQL the old row versions stay in the
table files until VACUUM (autovacuum) reuses their space; ``compact`` runs ``VACUUM FULL`` on
the tables the erasure changed, which rewrites them (taking an exclusive lock meanwhile).
Either way, copies outside the database (backups, PostgreSQL's WAL archive, file-system
blocks) are not reached: the result's ``storage.remains`` says what may still hold them.

Erasing twice is safe: the second run finds nothing and refuses, changing nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Column, Connection, Table, select

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput, NotFound
from collector.rollups import refresh as rollups
from collector.rollups.buckets import REQUEST_BUCKET_US, floor_to
from collector.timefmt import iso, to_micros
from engine_probe.events import is_valid_id

ERASED = "<erased>"

# The tables whose columns name a tenant or a request id by their own name (tenant,
# request_id, ...): the walk skips those columns (_OWN), so the structural steps below must
# handle each of these tables. A new table with such a column that is not listed here
# fails tests/test_erasure_everywhere.py until a step handles it.
STEPS_COVER = frozenset(
    {
        "api_tokens",  # _delete: its tenant-scoped tokens
        "deployment_tenants",  # _delete
        "otlp_spans",  # _delete: the spans stored as its requests
        "page_events",  # _delete (its own), _blank (where it is the other party)
        "request_keys",  # _delete
        "request_rollups",  # _delete, the '*' buckets recomputed
        "request_rollups_hourly",  # _delete
        "requests",  # _delete, _blank (prompt_shared_with)
    }
)

# The id rule's punctuation (engine_probe.events: letters, digits and these; an id starts
# with a letter or digit). A run of id characters is one id, give or take punctuation at
# its ends.
_PUNCT = "._:/@+=-"
_RUN = re.compile(r"[A-Za-z0-9._:/@+=-]+")

# Columns naming kvwatch's own objects (deployments, probes, nodes, models, rules, ...) or
# holding its fixed vocabularies and digests: never a tenant's data, and walking them would
# rewrite a deployment or rule that merely shares the tenant's name. The tenant and request
# id columns are the structural steps' (deployment-scoped: a bare request id matches other
# deployments' requests too).
_OWN = frozenset(
    {
        "deployment_id",
        "probe_id",
        "node",
        "role",
        "kind",
        "state",
        "status",
        "severity",
        "mode",
        "health",
        "engine",
        "engine_version",
        "model_id",
        "dtype",
        "quantization",
        "config_hash",
        "fingerprint",
        "rule",
        "cause_rule",
        "event_type",
        "format",
        "prefix",
        "token_hash",
        "secret",
        "sha256",
        "msg_id",
        "report_id",
        "target_key",
        "lease_owner",
        "reject_reason",
        "reason",
        "from_state",
        "to_state",
        "last_trigger",
        "last_result",
        "tenant",
        "other_tenant",
        "request_id",
        "other_request_id",
        "prompt_shared_with",
    }
)

KEPT = {
    "audit_log": (
        "every entry's ts, actor, action, subject, prev_hash and hash, and each redacted "
        "detail's detail_sha256: the chain covers them, so changing one would make "
        "`kvwatch audit verify` report the entry as edited; a digest does not reveal the "
        "detail it was taken of. Entries naming the tenant or a request id in those fields "
        "(or, written before detail digests, in their detail) are listed under "
        "audit_log.named_in_hashed_fields."
    ),
    "not walked": (
        "keys, and the columns naming kvwatch's own objects or vocabularies (deployment, "
        "probe, node, model and rule ids, states, digests): a deployment or rule that shares "
        "the tenant's name is not the tenant; its own rows were deleted by their tenant "
        "and (deployment, request id) columns."
    ),
}


class Names:
    """The tenant's name and request ids, and the rule for finding them in a value (see the
    module's docstring)."""

    def __init__(self, tenant: str, request_ids: Iterable[str] = ()):
        self.tenant = tenant
        self.only_tenant = frozenset({tenant})
        self.every = frozenset({tenant, *request_ids})

    def _hit(self, core: str, within: frozenset[str]) -> str | None:
        """The name a run of id characters (leading punctuation stripped) stands for: the
        run less some of its trailing punctuation, the longest such name first (an id may
        end in punctuation)."""
        base = core.rstrip(_PUNCT)
        for end in range(len(core), len(base) - 1, -1):
            if end and core[:end] in within:
                return core[:end]
        return None

    def _text(self, s: str, within: frozenset[str]) -> str:
        if s in within:
            return ERASED

        def one(run: re.Match[str]) -> str:
            r = run.group()
            core = r.lstrip(_PUNCT)
            hit = self._hit(core, within)
            return r if hit is None else r[: len(r) - len(core)] + ERASED + core[len(hit) :]

        return _RUN.sub(one, s)

    def scrub(self, value: Any, *, tenant_only: bool = False) -> Any:
        """``value`` (a string or decoded JSON) with every name replaced by :data:`ERASED`;
        ``tenant_only``: the tenant's name alone."""
        within = self.only_tenant if tenant_only else self.every
        return self._scrub(value, within)

    def _scrub(self, v: Any, within: frozenset[str]) -> Any:
        if isinstance(v, str):
            return self._text(v, within)
        if isinstance(v, dict):
            return {self._text(k, within): self._scrub(x, within) for k, x in v.items()}
        if isinstance(v, list):
            return [self._scrub(x, within) for x in v]
        return v

    def _may_name(self, raw: str, within: frozenset[str]) -> bool:
        # A JSON escape could hide an id character from the runs: those are decoded first.
        if "\\" in raw or raw in within:
            return True
        return any(self._hit(r.lstrip(_PUNCT), within) for r in _RUN.findall(raw))

    def rewrite(self, raw: str | None, *, tenant_only: bool = False) -> str | None:
        """A stored column value with the names replaced, or None when it names none."""
        within = self.only_tenant if tenant_only else self.every
        if not raw or not self._may_name(raw, within):
            return None
        doc = _document(raw)
        if doc is not None:
            new_doc = self._scrub(doc, within)
            return None if new_doc == doc else json.dumps(new_doc, sort_keys=True)
        new = self._text(raw, within)
        return None if new == raw else new

    def names(self, raw: str | None, *, tenant_only: bool = False) -> bool:
        return self.rewrite(raw, tenant_only=tenant_only) is not None


def _document(raw: str) -> Any:
    """The decoded JSON object or array a column holds, else None (a text, even one that
    happens to parse as a JSON scalar)."""
    if raw[:1] not in "[{":
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict | list) else None


def _walked(table: Table, col: Column[Any]) -> bool:
    if not isinstance(col.type, sa.String) or col.name in _OWN:
        return False
    keyed = {c.name for u in table.constraints if isinstance(u, sa.UniqueConstraint) for c in u}
    return not (col.primary_key or col.unique or col.foreign_keys or col.name in keyed)


Pair = tuple[str, str]  # (deployment_id, request_id)


class ErasureService:
    def __init__(self, db: Database):
        self.db = db

    def erase_tenant(
        self, tenant: str, *, by: str, now: datetime, compact: bool = False
    ) -> dict[str, Any]:
        tenant = tenant.strip()
        if not is_valid_id(tenant):
            raise InvalidInput(
                f"{tenant!r} is not a tenant id (1-128 letters, digits and ._:/@+=-, "
                "starting with a letter or digit)",
                {"field": "tenant"},
            )
        with self.db.write() as conn:
            if self.db.is_sqlite:  # freed content is zeroed as it is freed (module docstring)
                conn.exec_driver_sql("PRAGMA secure_delete = ON")
            pairs = _request_ids(conn, tenant)
            names = Names(tenant, {rid for _, rid in pairs})
            removed = _delete(conn, names, pairs)
            rewritten = _blank(conn, pairs, tenant)
            for table, n in _walk(conn, names):
                rewritten[table] = rewritten.get(table, 0) + n
            redact, held = _audit_scan(conn, names)
            if not redact and not any(removed.values()) and not any(rewritten.values()):
                held_note = (
                    f"; {len(held)} audit entries name it in fields the chain hashes"
                    if held
                    else ""
                )
                raise NotFound(f"no records of tenant {tenant!r} to erase{held_note}")
            removed = {t: n for t, n in removed.items() if n}
            audit.append(
                conn,
                now_us=to_micros(now),
                actor=by,
                action="tenant.erase",
                subject=None,
                detail={"removed": removed, "rewritten": rewritten, "redacted_entries": redact},
            )
            entry = audit.last_id(conn)
            redacted = audit.redact(conn, redact, entry)
            if self.db.is_sqlite:
                conn.exec_driver_sql("PRAGMA secure_delete = OFF")
        changed = {*removed, *rewritten, m.AuditEntry.__tablename__}
        storage = _settle_storage(self.db, sorted(changed), compact)
        return {
            "erased_at": iso(now),
            "request_ids": len({rid for _, rid in pairs}),
            "removed": removed,
            "rewritten": rewritten,
            "audit_log": {
                "erasure_entry": entry,
                "redacted": redacted,
                "named_in_hashed_fields": held,
            },
            "kept": KEPT,
            "storage": storage,
        }


def _settle_storage(db: Database, tables: list[str], compact: bool) -> dict[str, Any]:
    """After the erasure committed: what it takes for the erased bytes to leave the
    database's own files, done where it can be, and said where it cannot."""
    outside = "backups, replicas' copies and file-system blocks are not reached"
    if db.is_sqlite:
        raw = db.engine.raw_connection()
        try:
            cur = raw.cursor()
            if compact:
                cur.execute("VACUUM")
            busy, frames, done = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            cur.close()
        finally:
            raw.close()
        settled = not busy and frames in (done, -1, 0)
        before = (
            []
            if compact
            else [
                "earlier versions of rows that named it, left in the file's free space by "
                "updates before the erasure (kvwatch erase --compact rewrites the file)"
            ]
        )
        if not settled:
            before.append("the WAL until its next checkpoint")
        return {
            "backend": "sqlite",
            "secure_delete": True,
            "wal": "checkpointed and truncated"
            if settled
            else f"{frames - done} of {frames} WAL frames wait for readers to finish",
            "vacuumed": compact,
            "remains": "; ".join([*before, outside]),
        }
    if compact:
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in tables:
                conn.exec_driver_sql(f'VACUUM (FULL) "{table}"')
    return {
        "backend": "postgresql",
        "vacuumed_full": tables if compact else [],
        "remains": (
            f"PostgreSQL's WAL and its archive until they rotate; {outside}"
            if compact
            else "the old row versions in the changed tables' files until VACUUM reuses their "
            "space (autovacuum; kvwatch erase --compact runs VACUUM FULL on them now), and "
            f"PostgreSQL's WAL and its archive until they rotate; {outside}"
        ),
    }


def _request_ids(conn: Connection, tenant: str) -> set[Pair]:
    r, pe = m.Request, m.PageEvent
    qs = (
        select(r.deployment_id, r.request_id).where(r.tenant == tenant),
        select(pe.deployment_id, pe.request_id).where(pe.tenant == tenant),
        select(pe.deployment_id, pe.other_request_id).where(pe.other_tenant == tenant),
    )
    return {(d, i) for q in qs for d, i in conn.execute(q) if i is not None}


def _chunks(items: Iterable[Any], n: int = 500) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for x in items:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _delete_ids(conn: Connection, model: Any, ids: Iterable[int]) -> int:
    return sum(conn.execute(sa.delete(model).where(model.id.in_(c))).rowcount for c in _chunks(ids))


def _delete(conn: Connection, names: Names, pairs: set[Pair]) -> dict[str, int]:
    """Delete the tenant's own rows and the documents about it; rows deleted per table."""
    t = names.tenant
    r, pe, k = m.Request, m.PageEvent, m.RequestKey
    out: dict[str, int] = {}
    # The all-tenant rollup rows hold its counts too: their buckets are recomputed without.
    first = sa.type_coerce(r.first_ts, sa.BigInteger)
    touched = conn.execute(select(r.deployment_id, first).where(r.tenant == t).distinct())
    rollups.mark(conn, (("requests", d, floor_to(int(ts), REQUEST_BUCKET_US)) for d, ts in touched))
    mine = select(r.deployment_id, r.request_id).where(r.tenant == t)
    out[k.__tablename__] = conn.execute(
        sa.delete(k).where(sa.tuple_(k.deployment_id, k.request_id).in_(mine))
    ).rowcount
    out[r.__tablename__] = conn.execute(sa.delete(r).where(r.tenant == t)).rowcount
    spans = m.OtlpSpan  # the trace ids of its requests' spans, and their request ids
    out[spans.__tablename__] = sum(
        conn.execute(
            sa.delete(spans).where(sa.tuple_(spans.deployment_id, spans.request_id).in_(chunk))
        ).rowcount
        for chunk in _chunks(sorted(pairs))
    )
    for rollup in (m.RequestRollup, m.RequestRollupHourly):
        out[rollup.__tablename__] = conn.execute(
            sa.delete(rollup).where(rollup.tenant == t)
        ).rowcount
    n = conn.execute(sa.delete(pe).where(pe.tenant == t)).rowcount
    for chunk in _chunks(sorted(pairs)):
        # its requests' events that carry no tenant (or, inconsistently, another)
        n += conn.execute(
            sa.delete(pe).where(sa.tuple_(pe.deployment_id, pe.request_id).in_(chunk))
        ).rowcount
    out[pe.__tablename__] = n
    dt = m.DeploymentTenant
    out[dt.__tablename__] = conn.execute(sa.delete(dt).where(dt.tenant == t)).rowcount
    tok = m.ApiToken
    out[tok.__tablename__] = conn.execute(sa.delete(tok).where(tok.tenant == t)).rowcount

    a, at = m.Alert, m.AlertTransition
    alerts = {
        i
        for i, labels, ann in conn.execute(select(a.id, a.labels, a.annotations))
        if names.names(labels, tenant_only=True) or names.names(ann, tenant_only=True)
    }
    alerts |= {
        i
        for i, detail in conn.execute(select(at.alert_id, at.detail))
        if i not in alerts and names.names(detail, tenant_only=True)
    }
    out[at.__tablename__] = sum(
        conn.execute(sa.delete(at).where(at.alert_id.in_(c))).rowcount
        for c in _chunks(sorted(alerts))
    )
    out[a.__tablename__] = _delete_ids(conn, a, sorted(alerts))

    ob, da = m.OutboxMessage, m.DeliveryAttempt
    msgs = sorted(
        i
        for i, data, err in conn.execute(select(ob.id, ob.data, ob.last_error))
        if names.names(data, tenant_only=True) or names.names(err, tenant_only=True)
    )
    out[da.__tablename__] = sum(
        conn.execute(sa.delete(da).where(da.outbox_id.in_(c))).rowcount for c in _chunks(msgs)
    )
    out[ob.__tablename__] = _delete_ids(conn, ob, msgs)

    s = m.Silence
    out[s.__tablename__] = _delete_ids(
        conn,
        s,
        sorted(
            i
            for i, matchers, comment in conn.execute(select(s.id, s.matchers, s.comment))
            if names.names(matchers, tenant_only=True) or names.names(comment, tenant_only=True)
        ),
    )
    rep = m.Report
    out[rep.__tablename__] = _delete_ids(
        conn,
        rep,
        sorted(
            i
            for i, body, scope in conn.execute(select(rep.id, rep.body, rep.scope))
            if names.names(body, tenant_only=True) or names.names(scope, tenant_only=True)
        ),
    )
    return out


def _blank(conn: Connection, pairs: set[Pair], tenant: str) -> dict[str, int]:
    """Blank the tenant where another tenant's rows name it as a party; rows per table."""
    pe, r = m.PageEvent, m.Request
    other = sa.update(pe).values(other_tenant=None, other_request_id=None)
    n = conn.execute(other.where(pe.other_tenant == tenant)).rowcount
    shared = 0
    for chunk in _chunks(sorted(pairs)):
        n += conn.execute(
            other.where(sa.tuple_(pe.deployment_id, pe.other_request_id).in_(chunk))
        ).rowcount
        # A changed prompt link changes the usage rollups: their buckets are recomputed.
        linked = sa.tuple_(r.deployment_id, r.prompt_shared_with).in_(chunk)
        first = sa.type_coerce(r.first_ts, sa.BigInteger)
        rollups.mark(
            conn,
            (
                ("requests", d, floor_to(int(ts), REQUEST_BUCKET_US))
                for d, ts in conn.execute(select(r.deployment_id, first).where(linked))
            ),
        )
        shared += conn.execute(sa.update(r).where(linked).values(prompt_shared_with=None)).rowcount
    return {t: c for t, c in ((pe.__tablename__, n), (r.__tablename__, shared)) if c}


def _walk(conn: Connection, names: Names) -> Iterator[tuple[str, int]]:
    """Apply the rule to every walked column of every table but the audit log; yields
    (table, rows rewritten) for each table where something was."""
    for table in m.Base.metadata.sorted_tables:
        if table.name == m.AuditEntry.__tablename__:
            continue
        cols = [c for c in table.columns if _walked(table, c)]
        if not cols:
            continue
        key = list(table.primary_key.columns)
        changes: list[tuple[tuple[Any, ...], dict[str, str]]] = []
        # Streamed (a server-side cursor on PostgreSQL); the few rewrites wait until the
        # scan is done rather than write under an open cursor.
        q = select(*key, *cols).execution_options(yield_per=2_000)
        for row in conn.execute(q):
            values = {
                c.name: new
                for c, raw in zip(cols, row[len(key) :], strict=True)
                if (new := names.rewrite(raw)) is not None
            }
            if values:
                changes.append((tuple(row[: len(key)]), values))
        for pk, values in changes:
            conn.execute(
                sa.update(table)
                .where(*(c == v for c, v in zip(key, pk, strict=True)))
                .values(values)
            )
        if changes:
            yield table.name, len(changes)


def _audit_scan(conn: Connection, names: Names) -> tuple[list[int], list[int]]:
    """(entries whose detail can be redacted, entries naming it where the chain hashes the
    name itself: actor, subject, or a detail from before detail digests)."""
    e = m.AuditEntry
    redact: list[int] = []
    held: list[int] = []
    q = select(e.id, e.actor, e.subject, e.detail, e.detail_sha256).order_by(e.id)
    for i, actor, subject, detail, digest in conn.execute(q):
        in_detail = names.names(detail)
        if in_detail and digest is not None:
            redact.append(i)
        # A subject is "kind:id" (endpoint:NAME, ...): its id is a value of its own, which
        # the rule alone would read as part of one longer id.
        hashed = (actor, subject, (subject or "").partition(":")[2])
        if any(names.names(v) for v in hashed) or (in_detail and digest is None):
            held.append(i)
    return redact, held
