"""Errors of the SGLang adapter: one base, so callers catch the package's failures at once."""

from __future__ import annotations


class SGLangProbeError(Exception):
    """Base of the SGLang adapter's errors."""


class NotAttachableError(SGLangProbeError, TypeError):
    """An object handed to :func:`engine_probe.adapters.sglang.attach` is not the SGLang class the
    adapter hooks (or lacks the method it wraps): the SGLang version differs from the one
    the adapter was written against."""
