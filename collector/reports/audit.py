"""The audit log's chain check as a service, for ``GET /v1/audit/verify`` and ``kvwatch audit
verify`` alike."""

from __future__ import annotations

from collector.audit import ChainCheck, verify
from collector.db import Database


class AuditLog:
    """The chain check as a service: a read transaction of its own (``GET /v1/audit/verify``)."""

    def __init__(self, db: Database):
        self.db = db

    def verify(self) -> ChainCheck:
        with self.db.read() as conn:
            return verify(conn)
