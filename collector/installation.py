"""The installation's identity in what it sends out, and where its pages are.

Two collectors over two databases are two installations; N replicas over one database are
one. What an installation sends (alerts and incidents, to Alertmanager, webhooks and pagers)
carries its ``instance`` as the ``kvwatch_instance`` label, so the receiver's identity of an
alert (Alertmanager's fingerprint of its labels, a pager's dedup key) differs between
installations even where deployment names and incident numbers coincide. The label is added
where documents leave (:mod:`collector.alerting.notifications`), never to the stored alerts:
an alert's stored fingerprint stays a hash of the labels its rule gave it, so silences,
the API and the database do not change with the name an installation is given.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sqlalchemy import Connection, select

from collector import models as m
from collector.settings import Settings

INSTANCE_LABEL = "kvwatch_instance"
_KEY = "instance_id"


@dataclass
class Identity:
    """``configured``: ``KVWATCH_INSTANCE``, which wins; else the id the database was created
    with (read once, then kept). ``dashboard_url``: ``KVWATCH_DASHBOARD_URL``, for links."""

    configured: str | None = None
    dashboard_url: str | None = None
    _stored: str | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def instance(self, conn: Connection) -> str:
        if self.configured:
            return self.configured
        with self._lock:
            if self._stored is None:
                value = conn.execute(
                    select(m.Installation.value).where(m.Installation.key == _KEY)
                ).scalar_one_or_none()
                # A database migrated by this version always has one; "kvwatch" only names a
                # half-made one, and is not cached so the real id is read once it exists.
                if value is None:
                    return "kvwatch"
                self._stored = value
            return self._stored

    @classmethod
    def of(cls, settings: Settings) -> Identity:
        return cls(configured=settings.instance, dashboard_url=settings.dashboard_url)

    def alert_url(self, alert_id: int) -> str | None:
        return f"{self.dashboard_url}/alerts?id={alert_id}" if self.dashboard_url else None

    def incident_url(self, incident_id: int) -> str | None:
        return f"{self.dashboard_url}/incident?id={incident_id}" if self.dashboard_url else None
