"""A Prometheus text exposition read back (prometheus-client's own parser), for tests that
scrape /metrics and compare what they find."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Samples:
    rows: tuple[tuple[str, dict[str, str], float], ...]

    def all(self) -> Iterator[tuple[str, dict[str, str], float]]:
        return iter(self.rows)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, value) for n, labels, value in self.rows if n == name]

    def get(self, name: str, labels: dict[str, str]) -> float | None:
        """The value of the one sample ``name{labels}`` (labels matched exactly), else None."""
        found = [v for n, lb, v in self.rows if n == name and lb == labels]
        assert len(found) <= 1, f"{name}{labels} is ambiguous"
        return found[0] if found else None


def samples(text: str) -> Samples:
    return Samples(
        tuple(
            (s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )
    )
