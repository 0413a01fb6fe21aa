"""Erasure (GDPR Art. 17): remove one tenant's records everywhere kvwatch stores them.

- requests, their rollups, the deployment-tenant index and tenant-scoped tokens: deleted;
- page events the tenant read or owned: deleted; events where it was the other party (the
  exposed writer of another tenant's stale read): that party is blanked, so the other
  tenant's evidence stays;
- alerts whose labels or texts name it (with their history), notifications that name it
  (with their delivery attempts), silences matching it and stored reports that name it:
  deleted; verification evidence and incident texts that name it: the name is replaced;
- audit entries whose details name it: redacted (:func:`collector.audit.redact`), listed by
  the erasure's own entry, which names the tenant only by a count of what was removed.

A name counts as present where a JSON value equals it or a text holds it as a whole word
(so erasing ``acme`` leaves ``acme-eu`` alone). All of it is one transaction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, select

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import InvalidInput, NotFound
from collector.rollups import refresh as rollups
from collector.rollups.buckets import REQUEST_BUCKET_US, floor_to
from collector.timefmt import iso, to_micros

ERASED = "<erased>"


class _Matcher:
    def __init__(self, tenant: str):
        self.tenant = tenant
        self.word = re.compile(rf"(?<![\w.:@/-]){re.escape(tenant)}(?![\w.:@/-])")

    def text(self, s: str | None) -> bool:
        if not s:
            return False
        return s == self.tenant or self.word.search(s) is not None

    def value(self, v: Any) -> bool:
        """Whether a decoded JSON value names the tenant anywhere."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, dict):
            return any(self.text(k) or self.value(x) for k, x in v.items())
        if isinstance(v, list):
            return any(self.value(x) for x in v)
        return False

    def json(self, raw: str | None) -> bool:
        if not raw:
            return False
        try:
            return self.value(json.loads(raw))
        except ValueError:
            return self.text(raw)

    def scrub(self, v: Any) -> Any:
        if isinstance(v, str):
            return (
                self.word.sub(ERASED, v)
                if self.text(v) and v != self.tenant
                else (ERASED if v == self.tenant else v)
            )
        if isinstance(v, dict):
            return {self.scrub(k): self.scrub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [self.scrub(x) for x in v]
        return v


class ErasureService:
    def __init__(self, db: Database):
        self.db = db

    def erase_tenant(self, tenant: str, *, by: str, now: datetime) -> dict[str, Any]:
        tenant = tenant.strip()
        if not tenant or len(tenant) > 128:
            raise InvalidInput("tenant must be 1-128 characters", {"field": "tenant"})
        match = _Matcher(tenant)
        now_us = to_micros(now)
        with self.db.write() as conn:
            if not self._known(conn, tenant):
                raise NotFound(f"no records of tenant {tenant!r}", {"field": "tenant"})
            counts = self._erase(conn, match)
            doomed = [
                i
                for i, detail in conn.execute(select(m.AuditEntry.id, m.AuditEntry.detail))
                if match.json(detail)
            ]
            audit.append(
                conn,
                now_us=now_us,
                actor=by,
                action="tenant.erase",
                subject=None,
                detail={"removed": counts, "redacted_entries": doomed},
            )
            counts["audit_entries_redacted"] = audit.redact(conn, doomed, audit.last_id(conn))
            counts["audit_entries_unredactable"] = len(doomed) - counts["audit_entries_redacted"]
        return {"erased_at": iso(now), "removed": counts}

    @staticmethod
    def _known(conn: Connection, tenant: str) -> bool:
        for q in (
            select(m.Request.id).where(m.Request.tenant == tenant),
            select(m.DeploymentTenant.tenant).where(m.DeploymentTenant.tenant == tenant),
            select(m.PageEvent.id).where(
                sa.or_(m.PageEvent.tenant == tenant, m.PageEvent.other_tenant == tenant)
            ),
            select(m.ApiToken.id).where(m.ApiToken.tenant == tenant),
        ):
            if conn.execute(q.limit(1)).first() is not None:
                return True
        return False

    def _erase(self, conn: Connection, match: _Matcher) -> dict[str, int]:
        t = match.tenant
        r, pe = m.Request, m.PageEvent
        out: dict[str, int] = {}
        # The all-tenant rollup rows hold the tenant's counts too: their buckets are
        # recomputed without them.
        first = sa.type_coerce(r.first_ts, sa.BigInteger)
        touched = select(r.deployment_id, first).where(r.tenant == t).distinct()
        rollups.mark(
            conn,
            (
                ("requests", d, floor_to(int(ts), REQUEST_BUCKET_US))
                for d, ts in conn.execute(touched)
            ),
        )
        k = m.RequestKey  # PostgreSQL's partition keys (SQLite: none)
        mine = select(r.deployment_id, r.request_id).where(r.tenant == t)
        conn.execute(sa.delete(k).where(sa.tuple_(k.deployment_id, k.request_id).in_(mine)))
        out["requests"] = conn.execute(sa.delete(r).where(r.tenant == t)).rowcount
        out["request_rollups"] = conn.execute(
            sa.delete(m.RequestRollup).where(m.RequestRollup.tenant == t)
        ).rowcount
        out["request_rollups"] += conn.execute(
            sa.delete(m.RequestRollupHourly).where(m.RequestRollupHourly.tenant == t)
        ).rowcount
        out["page_events"] = conn.execute(sa.delete(pe).where(pe.tenant == t)).rowcount
        out["page_events_blanked"] = conn.execute(
            sa.update(pe)
            .where(pe.other_tenant == t)
            .values(other_tenant=None, other_request_id=None)
        ).rowcount
        out["deployment_tenants"] = conn.execute(
            sa.delete(m.DeploymentTenant).where(m.DeploymentTenant.tenant == t)
        ).rowcount
        out["tokens"] = conn.execute(
            sa.delete(m.ApiToken).where(sa.or_(m.ApiToken.tenant == t, m.ApiToken.name == t))
        ).rowcount
        a, at = m.Alert, m.AlertTransition
        alerts = [
            i
            for i, labels, ann in conn.execute(select(a.id, a.labels, a.annotations))
            if match.json(labels) or match.json(ann)
        ]
        alerts += [
            i
            for (i,) in conn.execute(
                select(at.alert_id).where(at.alert_id.not_in(alerts)).distinct()
            )
            if any(
                match.json(d) for (d,) in conn.execute(select(at.detail).where(at.alert_id == i))
            )
        ]
        out["alerts"] = 0
        for chunk in _chunks(sorted(set(alerts))):
            conn.execute(sa.delete(at).where(at.alert_id.in_(chunk)))
            out["alerts"] += conn.execute(sa.delete(a).where(a.id.in_(chunk))).rowcount
        ob, da = m.OutboxMessage, m.DeliveryAttempt
        msgs = [
            i
            for i, data, err in conn.execute(select(ob.id, ob.data, ob.last_error))
            if match.json(data) or match.text(err)
        ]
        out["notifications"] = 0
        for chunk in _chunks(msgs):
            conn.execute(sa.delete(da).where(da.outbox_id.in_(chunk)))
            out["notifications"] += conn.execute(sa.delete(ob).where(ob.id.in_(chunk))).rowcount
        s = m.Silence
        silences = [
            i
            for i, mt, c in conn.execute(select(s.id, s.matchers, s.comment))
            if match.json(mt) or match.text(c)
        ]
        out["silences"] = _delete_ids(conn, s, silences)
        rep = m.Report
        reports = [
            i
            for i, body, scope in conn.execute(select(rep.id, rep.body, rep.scope))
            if match.json(body) or match.json(scope)
        ]
        out["reports"] = _delete_ids(conn, rep, reports)
        out["verifications_scrubbed"] = _scrub_column(
            conn, m.Verification, "evidence", match, json_col=True
        )
        out["incidents_scrubbed"] = _scrub_column(conn, m.Incident, "title", match) + _scrub_column(
            conn, m.Incident, "close_reason", match
        )
        return out


def _chunks(ids: list[int], n: int = 500) -> list[list[int]]:
    return [ids[i : i + n] for i in range(0, len(ids), n)]


def _delete_ids(conn: Connection, model: Any, ids: list[int]) -> int:
    return sum(conn.execute(sa.delete(model).where(model.id.in_(c))).rowcount for c in _chunks(ids))


def _scrub_column(
    conn: Connection, model: Any, col: str, match: _Matcher, *, json_col: bool = False
) -> int:
    column = getattr(model, col)
    n = 0
    test: Callable[[str | None], bool] = match.json if json_col else match.text
    for i, raw in conn.execute(select(model.id, column)):
        if raw is None or not test(raw):
            continue
        if json_col:
            try:
                new = json.dumps(match.scrub(json.loads(raw)), sort_keys=True)
            except ValueError:
                new = match.word.sub(ERASED, raw)
        else:
            new = match.word.sub(ERASED, raw)
        conn.execute(sa.update(model).where(model.id == i).values({col: new}))
        n += 1
    return n
