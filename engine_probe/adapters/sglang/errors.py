"""Errors of the SGLang adapter: one base, so callers catch the package's failures at once."""

from __future__ import annotations

from engine_probe.errors import ProbeError


class SGLangProbeError(ProbeError):
    """Base of the SGLang adapter's errors (a :class:`ProbeError` like every error of the
    package)."""


class NotAttachableError(SGLangProbeError, TypeError):
    """An object handed to :func:`engine_probe.adapters.sglang.attach` is not the SGLang class the
    adapter hooks (or lacks the method it wraps): the SGLang version differs from the one
    the adapter was written against."""
