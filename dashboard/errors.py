"""The dashboard's exceptions: one tree under :class:`DashboardError`.

The collector client (:mod:`dashboard.client`) turns every failure of an HTTP call into one
of these: :class:`CollectorDown` (unreachable, timed out, 5xx), :class:`TokenRejected`
(401/403) and :class:`BadRequest` (other 4xx, with the collector's own message).
"""

from __future__ import annotations

from typing import Any


class DashboardError(Exception):
    """Anything that keeps a page from its data; ``message`` is for people.

    Raised by :class:`dashboard.client.CollectorClient` (and by a page refusing a form it
    cannot send); translated once, at the page boundary: :func:`dashboard.ui.guarded` and
    :func:`dashboard.ui.act` show it as a message (:func:`dashboard.ui.show_error`), never a
    traceback.
    """

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class CollectorDown(DashboardError):
    """No usable answer: connection refused, timeout, or a server error."""


class TokenRejected(DashboardError):
    """401 (missing, unknown or revoked token) or 403 (the token may not do this)."""

    @property
    def forbidden(self) -> bool:
        return self.status == 403


class BadRequest(DashboardError):
    """Another 4xx: the collector refused the request and said why."""

    def __init__(
        self, message: str, *, status: int, code: str | None = None, details: Any = None
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.details = details
