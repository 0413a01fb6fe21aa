"""collector.timefmt: the one ISO 8601 format of every JSON output, and the µs conversions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import TypeAdapter

from collector.timefmt import (
    as_datetime,
    as_micros,
    from_micros,
    iso,
    now_micros,
    parse_iso,
    to_micros,
)

T = datetime(2026, 9, 1, 12, 0, 0, tzinfo=UTC)
T_US = 1_788_264_000_000_000


def test_micros_round_trip() -> None:
    assert to_micros(T) == T_US
    assert from_micros(T_US) == T
    assert to_micros(from_micros(T_US + 1)) == T_US + 1
    assert as_micros(T) == as_micros(T_US) == T_US
    assert as_datetime(T_US) == as_datetime(T) == T
    assert as_micros(None) is None and as_datetime(None) is None
    with pytest.raises(ValueError, match="naive"):
        to_micros(T.replace(tzinfo=None))
    before = to_micros(datetime.now(UTC))
    assert before <= now_micros() <= to_micros(datetime.now(UTC))


def test_iso_is_utc_with_z_and_microseconds_only_when_there_are_some() -> None:
    assert iso(T) == iso(T_US) == "2026-09-01T12:00:00Z"
    assert iso(T + timedelta(microseconds=123456)) == "2026-09-01T12:00:00.123456Z"
    assert iso(T_US + 120_000) == "2026-09-01T12:00:00.120000Z"
    assert iso(T.astimezone(timezone(timedelta(hours=2)))) == "2026-09-01T12:00:00Z"
    assert iso(T.replace(tzinfo=None)) == "2026-09-01T12:00:00Z"  # naive: taken as UTC
    assert iso(None) is None


@pytest.mark.parametrize("us", [T_US, T_US + 1, T_US + 120_000, T_US + 999_999, 0])
def test_iso_matches_what_the_api_serialises_and_the_report_columns(us: int) -> None:
    """Hand-built documents and pydantic-serialised models write times alike (the breach CSV's
    PostgreSQL formatting is checked against iso in tests/test_report_breach.py)."""
    dumped: Any = TypeAdapter(datetime).dump_python(from_micros(us), mode="json")
    assert iso(us) == dumped


def test_parse_iso_reads_what_iso_writes_and_offsets() -> None:
    for us in (T_US, T_US + 123_456):
        assert parse_iso(iso(us)) == from_micros(us)
    assert parse_iso("2026-09-01T14:00:00+02:00") == T
    assert parse_iso("2026-09-01T12:00:00") == T  # naive: UTC
    with pytest.raises(ValueError):
        parse_iso("yesterday")
