"""Exceptions raised by refengine: one tree under :class:`RefEngineError`.

Every error a client can cause is a subclass of :class:`RefEngineError` and is raised before
the engine allocates, writes or transfers anything for that request, so a server can turn it
into a 4xx answer with nothing to clean up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.request import Request


class RefEngineError(Exception):
    """Base class of every error refengine raises on purpose.

    :class:`InvalidRequest` and :class:`ContextLengthExceeded` are the client's doing;
    :class:`PoolExhausted` is an engine bug. The HTTP server (:mod:`refengine.server`)
    translates them at its boundary into its ``APIError`` (400 in OpenAI's error shape for
    the first two; anything else becomes a 500). ``APIError`` is deliberately not a
    ``RefEngineError``: it is the HTTP answer, raised only inside the server's routes, and
    keeping it apart means an ``except RefEngineError`` around engine calls never swallows
    an answer the route already chose.
    """


class InvalidRequest(RefEngineError, ValueError):
    """The request cannot be served as written (empty prompt, max_tokens < 1, duplicate id)."""

    code = "invalid_request_error"


class ContextLengthExceeded(RefEngineError):
    """The prompt does not fit: longer than the advertised context, or (hardened mode) longer
    than the KV pool that would have to hold it.

    ``limit_tokens`` is the binding limit, ``reason`` says which one bound
    (``"context_length_exceeded"``, ``"kv_pool_exceeded"``). The message follows OpenAI's
    wording so a server can pass it through unchanged; ``code`` is OpenAI's error code.
    """

    code = "context_length_exceeded"

    def __init__(
        self,
        *,
        prompt_tokens: int,
        limit_tokens: int,
        reason: str,
        request: Request | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit_tokens = limit_tokens
        self.reason = reason
        self.request = request
        super().__init__(
            f"This model's maximum context length is {limit_tokens} tokens. "
            f"However, your prompt has {prompt_tokens} tokens. "
            "Please reduce the length of the prompt."
        )


class PoolExhausted(RefEngineError):
    """An allocation asked for more pages than are free.

    The scheduler checks free pages before it allocates, so seeing this is an engine bug,
    never a client error.
    """
