"""The policies package's exceptions: one tree, so callers catch ``PolicyError``."""

from __future__ import annotations

import re
from collections.abc import Sequence


class PolicyError(Exception):
    """Anything the policies package refuses.

    :class:`PackError` (a rule pack that does not load) reaches whoever loads the packs,
    with every problem found in one pass (:class:`PackErrors` when there are several):
    ``kvwatch policies check`` prints them all and exits 1, and the collector refuses to
    start with them. :class:`RuleError` (a rule failing while it evaluates) is recorded as that
    rule's health and never reaches ingest or the HTTP API.
    """


class PackError(PolicyError):
    """A rule pack that does not load: names the file, the line and the field.

    ``line`` is 1-based (``None`` when the problem is the file as a whole); ``field`` is a
    dotted path such as ``rules[2].params.warn_ratio``; ``rule`` is the name of the rule that
    path is in, when it has one (the message then reads ``rules[2] (my_rule).params...``).
    ``errors`` is every problem found: this one alone, or all of a :class:`PackErrors`.
    """

    def __init__(
        self,
        path: str,
        line: int | None,
        field: str | None,
        message: str,
        *,
        rule: str | None = None,
    ):
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        self.rule = rule
        super().__init__(self.describe())

    def __str__(self) -> str:
        return self.describe()

    @property
    def errors(self) -> tuple[PackError, ...]:
        return (self,)

    def describe(self) -> str:
        """``file:line: field: message``, the field with its rule's name."""
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        field = self.field
        if field and self.rule:
            field = re.sub(r"^(rules\[\d+\])", lambda m: f"{m.group(1)} ({self.rule})", field)
        return f"{where}: {field}: {self.message}" if field else f"{where}: {self.message}"

    @staticmethod
    def of(errors: Sequence[PackError]) -> PackError:
        """One error for these (at least one): itself when alone, else a :class:`PackErrors`."""
        flat = [e for err in errors for e in err.errors]
        return flat[0] if len(flat) == 1 else PackErrors(flat)


class PackErrors(PackError):
    """Several problems of one or more packs, found in one pass, so an operator fixes them all
    at once. Its ``path``, ``line``, ``field``, ``message`` and ``rule`` are the first
    problem's; ``errors`` lists them all, in file order; ``str()`` gives one line each."""

    def __init__(self, errors: Sequence[PackError]):
        if not errors:
            raise ValueError("PackErrors needs at least one error")
        self._errors = tuple(errors)
        first = errors[0]
        super().__init__(first.path, first.line, first.field, first.message, rule=first.rule)

    @property
    def errors(self) -> tuple[PackError, ...]:
        return self._errors

    def __str__(self) -> str:
        return "\n".join(e.describe() for e in self._errors)


class RuleError(PolicyError):
    """A rule that failed while evaluating (recorded as the rule's health, never raised to
    ingest)."""
