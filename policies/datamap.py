"""The data map: the data categories (and, where known, the population: how many persons
the data may be about) an operator declares for a tenant, route, model or deployment.
kvwatch never guesses what a prompt held: breach assessments use what is declared here or
carried as request tags, and say "unknown" otherwise.

The file (``KVWATCH_DATA_MAP``), YAML, validated like rule packs (errors name file, line
and field)::

    entries:
      - tenant: hooli                 # selectors: tenant, route, model_id, deployment_id;
        route: /v1/chat/completions   # every one given must match, at least one is needed
        categories: [hr_records, contact]
        special: [health]             # GDPR Art. 9/10 categories
        population: 1200              # optional: persons whose data this traffic carries

A request matches every entry whose selectors all match it; its declared categories are the
union of theirs. ``population`` is the number of persons behind a route or tenant, not the
number an incident concerns (one exposed prompt may be about one of them, or none): a breach
assessment reports it as the population and keeps the persons concerned unknown.
``data_subjects`` is its earlier name, still read (an entry gives one or the other).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from policies.yamlfile import YamlDoc, checked

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
SELECTORS = ("tenant", "route", "model_id", "deployment_id")


class Entry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    tenant: Name | None = None
    route: Name | None = None
    model_id: Name | None = None
    deployment_id: Name | None = None
    categories: list[Name] = []
    special: list[Name] = []
    population: Annotated[int, msgspec.Meta(ge=0)] | None = None
    data_subjects: Annotated[int, msgspec.Meta(ge=0)] | None = None  # population's old name

    def check(self) -> None:
        if all(getattr(self, s) is None for s in SELECTORS):
            raise ValueError(f"tenant: an entry needs at least one of {', '.join(SELECTORS)}")
        if self.population is not None and self.data_subjects is not None:
            raise ValueError("data_subjects: give population only (data_subjects is its old name)")
        if not self.categories and not self.special and self.declared_population is None:
            raise ValueError("categories: declare categories, special or population")

    @property
    def declared_population(self) -> int | None:
        return self.population if self.population is not None else self.data_subjects

    def matches(self, request: Mapping[str, object]) -> bool:
        return all(
            getattr(self, s) is None or getattr(self, s) == request.get(s) for s in SELECTORS
        )


class _File(msgspec.Struct, forbid_unknown_fields=True):
    entries: list[Entry]


@dataclass(frozen=True)
class Declared:
    """What the map declares for one request."""

    categories: frozenset[str]
    special: frozenset[str]
    population: int | None  # summed over matching entries; None when none says

    @property
    def any(self) -> bool:
        return bool(self.categories or self.special)


@dataclass(frozen=True)
class DataMap:
    entries: tuple[Entry, ...] = ()
    source: str | None = None

    @classmethod
    def load(cls, path: Path) -> DataMap:
        """Raises :class:`policies.errors.PackError` naming file, line and field."""
        doc = YamlDoc.read(path)
        parsed = doc.convert(doc.data, _File)
        for i, e in enumerate(parsed.entries):
            checked(doc, ("entries", i), e.check)
        return cls(tuple(parsed.entries), str(path))

    def declared(self, request: Mapping[str, object]) -> Declared:
        hits = [e for e in self.entries if e.matches(request)]
        subjects = [e.declared_population for e in hits if e.declared_population is not None]
        return Declared(
            frozenset(c for e in hits for c in e.categories),
            frozenset(c for e in hits for c in e.special),
            sum(subjects) if subjects else None,
        )
