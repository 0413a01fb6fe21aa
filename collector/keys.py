"""The signing keys as an audited service: generating and rotating a key is written to the
audit log (who, which key) in the same step, so the log says which key was current when.

The keys themselves are :class:`collector.signing.KeyRing`'s; this only adds the record.
"""

from __future__ import annotations

from datetime import datetime

from collector import audit
from collector.db import Database
from collector.signing import KeyRing
from collector.timefmt import to_micros


class KeyAdmin:
    def __init__(self, db: Database, ring: KeyRing):
        self.db = db
        self.ring = ring

    def generate(self, *, actor: str, now: datetime) -> str:
        """The first key (an error naming the current one when there is one)."""
        kid = self.ring.generate(now)
        self._record(actor, now, "signing_key.generate", kid, None)
        return kid

    def rotate(self, *, actor: str, now: datetime) -> tuple[str | None, str]:
        """A new current key; the old one retired (its public half stays published)."""
        old, new = self.ring.rotate(now)
        self._record(actor, now, "signing_key.rotate", new, old)
        return old, new

    def _record(self, actor: str, now: datetime, action: str, kid: str, old: str | None) -> None:
        with self.db.write() as conn:
            audit.append(
                conn,
                now_us=to_micros(now),
                actor=actor,
                action=action,
                subject=f"signing_key:{kid}",
                detail={"kid": kid, "retired": old, "key_dir": str(self.ring.directory)},
            )
