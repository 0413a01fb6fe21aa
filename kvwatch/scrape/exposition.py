"""Prometheus text exposition → an index of samples, and the checked reads the translations
need. Parsing is prometheus-client's own parser; nothing here knows an engine."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from engine_probe.events import MAX_TOKENS
from kvwatch.scrape.errors import MalformedMetrics

Labels = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Series:
    """One sample line: its labels and value."""

    labels: Labels
    value: float


class Exposition:
    """Samples by sample name (``vllm:prompt_tokens_total``, ``..._bucket``), as written.

    Indexed by sample name rather than family name: the parser renames counter families
    (drops ``_total``), and translations name exactly the lines an engine writes.
    """

    def __init__(self, samples: dict[str, list[Series]], source: str) -> None:
        self._samples = samples
        self.source = source

    def __contains__(self, name: str) -> bool:
        return bool(self._samples.get(name))

    def series(self, name: str) -> list[Series]:
        return self._samples.get(name, [])

    def names(self) -> Iterable[str]:
        return self._samples.keys()


def parse(text: str, source: str) -> Exposition:
    """Parse exposition text; :class:`MalformedMetrics` names ``source`` when it is not one."""
    samples: dict[str, list[Series]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append(Series(dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MalformedMetrics(f"{source} is not Prometheus text exposition ({exc})") from None
    return Exposition(samples, source)


def as_tokens(value: float | str, what: str, source: str) -> int:
    """A count of tokens (or blocks, pages): finite, whole, 0..MAX_TOKENS."""
    try:
        number = float(value)
    except ValueError:
        raise MalformedMetrics(f"{what} at {source} is {value!r}, not a number") from None
    if not math.isfinite(number) or number < 0 or number != int(number) or number > MAX_TOKENS:
        raise MalformedMetrics(f"{what} at {source} is {value!r}, not a count")
    return int(number)


def as_ratio(value: float, what: str, source: str) -> float:
    """A usage fraction: finite, 0..1."""
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise MalformedMetrics(f"{what} at {source} is {value!r}, not a fraction in 0..1")
    return value


def as_bool(value: str) -> bool:
    return value.strip().lower() in ("true", "1", "yes", "on")


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram of one series: (upper bound, cumulative count), +Inf last."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    total: float

    def at_most(self, bound: float) -> int:
        """Observations in buckets whose upper bound is <= ``bound``."""
        seen = 0
        for le, cumulative in self.buckets:
            if le > bound:
                break
            seen = cumulative
        return seen

    def above(self, value: int) -> tuple[int, int]:
        """How many observations exceed ``value``: (at least, at most), as far as the
        bucket bounds can tell."""
        upper = next((le for le, _ in self.buckets if le >= value), math.inf)
        return self.count - self.at_most(upper), self.count - self.at_most(value)

    def covering_bound(self) -> float | None:
        """The smallest finite upper bound holding every observation (None: some lie past
        the last finite bound, or there are none)."""
        if self.count == 0:
            return None
        for le, cumulative in self.buckets:
            if cumulative >= self.count:
                return le if math.isfinite(le) else None
        return None


def histogram(exp: Exposition, name: str, mine: Callable[[Series], bool]) -> Histogram | None:
    """The histogram ``name`` summed over the series ``mine`` picks (several label sets of
    one histogram share their bucket bounds); None if it is not there."""
    buckets: dict[float, int] = {}
    for s in exp.series(f"{name}_bucket"):
        if mine(s):
            try:
                le = float(s.labels.get("le", ""))
            except ValueError:
                raise MalformedMetrics(
                    f"{name} at {exp.source} has a bucket without a numeric le label"
                ) from None
            buckets[le] = buckets.get(le, 0) + as_tokens(s.value, f"{name} bucket", exp.source)
    counts = [
        as_tokens(s.value, f"{name}_count", exp.source)
        for s in exp.series(f"{name}_count")
        if mine(s)
    ]
    sums = [s.value for s in exp.series(f"{name}_sum") if mine(s) and math.isfinite(s.value)]
    if not buckets or not counts:
        return None
    return Histogram(tuple(sorted(buckets.items())), sum(counts), sum(sums))
