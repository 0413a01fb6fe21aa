"""Times as kvwatch writes and reads them: one ISO 8601 format for every JSON output, and the
microseconds since the epoch that the database stores.

The format is UTC with a ``Z``, microseconds written only when there are some::

    2026-09-01T12:00:00Z
    2026-09-01T12:00:00.123456Z

It is what pydantic writes for the datetimes the HTTP API serialises (requests, pool samples,
page events, probes, ...), so the documents kvwatch builds by hand (reports, alerts,
incidents, webhooks, the verifier's report) read the same. Fields documented as microsecond
integers (their names end in ``_us``) stay integers.

This module imports only the standard library: the CLI, the verifier and the gateway use it
without loading the collector's database stack.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final, overload

EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_US: Final = timedelta(microseconds=1)


def to_micros(dt: datetime) -> int:
    """Microseconds since the epoch of an aware datetime (a naive one is a bug: kvwatch stores
    UTC instants only)."""
    if dt.tzinfo is None:
        raise ValueError("naive datetime: kvwatch stores UTC instants only")
    return (dt - EPOCH) // _US


def from_micros(us: int) -> datetime:
    """The aware UTC datetime of microseconds since the epoch."""
    return EPOCH + timedelta(microseconds=us)


def now_micros() -> int:
    """The current time in microseconds since the epoch."""
    return to_micros(datetime.now(UTC))


@overload
def as_micros(value: None) -> None: ...
@overload
def as_micros(value: int | datetime) -> int: ...
def as_micros(value: int | datetime | None) -> int | None:
    """Microseconds since the epoch, from microseconds or an aware datetime (Core selects on
    the models' tables return datetimes, raw ones integers); None stays None."""
    if value is None or isinstance(value, int):
        return value
    return to_micros(value)


@overload
def as_datetime(value: None) -> None: ...
@overload
def as_datetime(value: int | datetime) -> datetime: ...
def as_datetime(value: int | datetime | None) -> datetime | None:
    """An aware datetime, from microseconds since the epoch or a datetime; None stays None."""
    if value is None or isinstance(value, datetime):
        return value
    return from_micros(value)


@overload
def iso(value: None) -> None: ...
@overload
def iso(value: int | datetime) -> str: ...
def iso(value: int | datetime | None) -> str | None:
    """The ISO 8601 UTC text of an instant (microseconds since the epoch, or a datetime: an
    aware one in any zone, a naive one taken as UTC); None stays None."""
    if value is None:
        return None
    dt = from_micros(value) if isinstance(value, int) else value
    dt = dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
    return dt.isoformat().removesuffix("+00:00") + "Z"


def utc(dt: datetime) -> datetime:
    """``dt`` as an aware UTC datetime (naive: taken as UTC). Raises ``ValueError`` when its
    UTC instant falls outside the years 1-9999 (0001-01-01T00:00+00:01 is year 0 in UTC):
    nothing could format or store it."""
    if dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    try:
        return dt.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{dt.isoformat()} is outside the years 1-9999 in UTC") from None


# The instants a query, a report scope or a stored document may name. Outside them window
# arithmetic (a default 90-day window before 0001-01-05) and pandas' nanosecond timestamps
# (until 2262) overflow; nothing kvwatch records lies before the epoch.
EARLIEST: Final = EPOCH
LATEST: Final = datetime(2200, 1, 1, tzinfo=UTC)


def bounded(dt: datetime) -> datetime:
    """``dt`` as :func:`utc` gives it, if it lies in [``EARLIEST``, ``LATEST``); else
    ``ValueError`` saying the range. For every time a caller passes in."""
    at = utc(dt)
    if not EARLIEST <= at < LATEST:
        raise ValueError(
            f"{iso(at)} is outside the range kvwatch accepts "
            f"({EARLIEST:%Y-%m-%d} to {LATEST:%Y-%m-%d} UTC)"
        )
    return at


def parse_bounded(text: str) -> datetime:
    """:func:`parse_iso`, then :func:`bounded`: a time a person or a client typed."""
    return bounded(parse_iso(text))


def parse_iso(text: str) -> datetime:
    """An aware UTC datetime from ISO 8601 text (``Z`` or an offset; none: UTC). Raises
    ``ValueError`` on anything else, or on an instant outside the years 1-9999 in UTC."""
    return utc(datetime.fromisoformat(text))
