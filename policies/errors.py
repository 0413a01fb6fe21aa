"""The policies package's exceptions: one tree, so callers catch ``PolicyError``."""

from __future__ import annotations


class PolicyError(Exception):
    """Anything the policies package refuses."""


class PackError(PolicyError):
    """A rule pack that does not load: names the file, the line and the field.

    ``line`` is 1-based (``None`` when the problem is the file as a whole); ``field`` is a
    dotted path such as ``rules[2].params.warn_ratio``.
    """

    def __init__(self, path: str, line: int | None, field: str | None, message: str):
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")


class RuleError(PolicyError):
    """A rule that failed while evaluating (recorded as the rule's health, never raised to
    ingest)."""
