"""The collector's exception tree: one base, :class:`CollectorError`, and a subclass per HTTP
status. Services raise these; the HTTP layer translates them into
``{"error": {"code", "message", "details"}}`` with the status each class names."""

from __future__ import annotations

from typing import Any


class CollectorError(Exception):
    """Base class of every error the collector raises on purpose: bad input, a refused token,
    something missing or conflicting, the database unavailable.

    Translated at two boundaries: the exception handler in :mod:`collector.app` answers it
    with ``status`` and ``{"error": {"code", "message", "details"}}``; the ``kvwatch``
    commands that open the database (``kvwatch.cli_common.database``) print ``message`` and
    exit 2. Errors of the parts the collector calls are translated into it where it calls
    them (a wire-contract ``DecodeError`` in :mod:`collector.ingest`, a driver error in
    :mod:`collector.db`).
    """

    status = 500
    code = "internal"
    #: seconds, answered as ``Retry-After`` (a 503 that says when to come back)
    retry_after_s: int | None = None

    def __init__(self, message: str, details: Any = None):
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidInput(CollectorError):
    status = 422
    code = "invalid_input"


class BadRequest(CollectorError):
    status = 400
    code = "bad_request"


class Unauthorized(CollectorError):
    status = 401
    code = "unauthorized"


class Forbidden(CollectorError):
    status = 403
    code = "forbidden"


class NotFound(CollectorError):
    status = 404
    code = "not_found"


class Conflict(CollectorError):
    status = 409
    code = "conflict"


class PayloadTooLarge(CollectorError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(CollectorError):
    status = 415
    code = "unsupported_media_type"


class TooManyNewNames(CollectorError):
    """A token named more new deployments, nodes, models or routes in the last hour than
    its limit allows. Retrying later succeeds (a probe keeps its events meanwhile)."""

    status = 429
    code = "too_many_new_names"


class Unavailable(CollectorError):
    """The database is unreachable: retry later. Never a 500 for an outage."""

    status = 503
    code = "unavailable"


class TransientConflict(Unavailable):
    """A deadlock or serialization failure between concurrent writers: safe to retry."""

    code = "conflict_retry"


class BusUnavailable(Unavailable):
    """The ingest bus (NATS JetStream) did not acknowledge a batch: not reachable, no stream
    leader (an election), or it timed out. Nothing was accepted: retry later."""

    code = "bus_unavailable"

    def __init__(self, message: str, retry_after_s: int, details: Any = None):
        super().__init__(message, details)
        self.retry_after_s = retry_after_s


class BusFull(BusUnavailable):
    """The ingest stream is at its limits (bytes, batches): the writers are behind. The probe
    spools and retries after ``Retry-After``."""

    code = "bus_full"
