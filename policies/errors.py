"""The policies package's exceptions: one tree, so callers catch ``PolicyError``."""

from __future__ import annotations


class PolicyError(Exception):
    """Anything the policies package refuses.

    :class:`PackError` (a rule pack that does not load) reaches whoever loads the packs:
    ``kvwatch policies check`` prints it and exits 1, and the collector refuses to start
    with it. :class:`RuleError` (a rule failing while it evaluates) is recorded as that
    rule's health and never reaches ingest or the HTTP API.
    """


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
