"""Generated reports, stored with the SHA-256 of their evidence and recorded in the audit log
in the same transaction: a report that exists was audited, and one that was audited exists.

Report ids carry their kind's prefix: ``rpt_`` breach assessments, ``rev_`` quarterly
reviews.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, select, type_coerce

from collector import audit
from collector import models as m
from collector.db import Database
from collector.errors import NotFound
from collector.timefmt import iso, to_micros

ID_PATTERN = r"(rpt|rev)_[A-Za-z0-9]{1,60}"


def canonical(obj: Any) -> bytes:
    """The bytes an evidence hash is taken over: sorted keys, compact, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class ReportStore:
    def __init__(self, db: Database):
        self.db = db

    def save(
        self,
        report: dict[str, Any],
        *,
        created_by: str,
        now: datetime,
        signature: str | None = None,
    ) -> None:
        """Store ``report`` (with ``report_id``, ``kind``, ``scope``, ``evidence_sha256``) and
        the JWS over its files (:mod:`collector.reports.signed`)."""
        now_us = to_micros(now)
        with self.db.write() as conn:
            conn.execute(
                sa.insert(m.Report).values(
                    report_id=report["report_id"],
                    kind=report["kind"],
                    scope=json.dumps(report["scope"], sort_keys=True),
                    created_at=now_us,
                    created_by=created_by,
                    sha256=report["evidence_sha256"],
                    body=json.dumps(report, sort_keys=True, ensure_ascii=False),
                    signature=signature,
                )
            )
            audit.append(
                conn,
                now_us=now_us,
                actor=created_by,
                action="report.generate",
                subject=f"report:{report['report_id']}",
                detail={
                    "kind": report["kind"],
                    "scope": report["scope"],
                    "sha256": report["evidence_sha256"],
                    "signature_sha256": None
                    if signature is None
                    else hashlib.sha256(signature.encode()).hexdigest(),
                },
            )

    def get(self, report_id: str) -> dict[str, Any]:
        with self.db.read() as conn:
            body = conn.execute(
                select(m.Report.body).where(m.Report.report_id == report_id)
            ).scalar()
        if body is None:
            raise NotFound(f"no report {report_id!r}")
        report: dict[str, Any] = json.loads(body)
        return report

    def signature(self, report_id: str) -> str | None:
        """The report's JWS (None: stored before reports were signed)."""
        with self.db.read() as conn:
            row = conn.execute(
                select(m.Report.signature).where(m.Report.report_id == report_id)
            ).first()
        if row is None:
            raise NotFound(f"no report {report_id!r}")
        return row[0]

    def listing(self, limit: int, kind: str | None = None) -> list[dict[str, Any]]:
        """Stored reports, newest first: identity, scope and evidence hash (not the body)."""
        r = m.Report
        q = (
            select(
                r.report_id,
                r.kind,
                r.scope,
                type_coerce(r.created_at, BigInteger).label("created_at"),
                r.created_by,
                r.sha256,
            )
            .order_by(r.created_at.desc(), r.id.desc())
            .limit(limit)
        )
        if kind is not None:
            q = q.where(r.kind == kind)
        with self.db.read() as conn:
            rows = conn.execute(q).all()
        return [
            {
                "report_id": x.report_id,
                "kind": x.kind,
                "scope": json.loads(x.scope),
                "generated_at": iso(x.created_at),
                "created_by": x.created_by,
                "evidence_sha256": x.sha256,
            }
            for x in rows
        ]
