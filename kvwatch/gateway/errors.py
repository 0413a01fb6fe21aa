"""The gateway's exceptions, each answered in OpenAI's error shape at the boundary:
``{"error": {"message", "type", "param", "code"}}``.

Each also says how the request is recorded (``outcome``): refused (a ``request.rejected``
with its reason) or failed (a ``request.finished`` with status ``error``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from engine_probe.events import RejectReason
from kvwatch.errors import KvwatchError

Outcome = Literal["rejected", "error"]


class GatewayError(KvwatchError):
    """An error answered to the client with ``status`` and OpenAI's error body (by the
    exception handler in :mod:`kvwatch.gateway.app`)."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    outcome: Outcome = "error"
    reason: RejectReason = "other"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class AuthenticationFailed(GatewayError):
    """A missing or unknown bearer key (never recorded: no tenant is known)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    outcome: Outcome = "rejected"
    reason: RejectReason = "invalid_request"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    outcome: Outcome = "rejected"
    reason: RejectReason = "invalid_request"


class BodyTooLarge(InvalidRequest):
    status = 413


class ContextLengthExceeded(InvalidRequest):
    """A prompt above the model's safe context, refused before the upstream saw it. The
    message names where the limit comes from: a configured limit is never called verified,
    and a model whose latest verification failed says so."""

    code = "context_length_exceeded"
    reason: RejectReason = "context_length_exceeded"

    def __init__(
        self,
        *,
        prompt_tokens: int,
        limit_tokens: int,
        method: str,
        param: str,
        source: str = "verified",
        failure: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        what = "your messages resulted in" if param == "messages" else "your prompt has"
        counted = f"{prompt_tokens} tokens (counted by {method.replace('_', ' ')})"
        if limit_tokens <= 0:
            message = (
                f"This model's latest verification found it unsafe ({failure}), and no earlier "
                "verification or configured limit says which prompts are safe: every request "
                "is refused until a verification passes."
            )
        else:
            said = {"verified": "verified", "configured": "configured"}.get(source, source)
            message = (
                f"This model's {said} safe context is {limit_tokens} tokens. However, {what} "
                f"{counted}. Please reduce the length of the {param}."
            )
            if failure is not None:
                message += f" (The latest verification of this model failed: {failure}.)"
        super().__init__(message, param=param, headers=headers)
        self.prompt_tokens = prompt_tokens
        self.limit_tokens = limit_tokens


class UnsupportedContent(InvalidRequest):
    """Input the safe-context guard cannot count (images, audio, prompt embeddings), sent to a
    guarded model: refused rather than let through uncounted."""

    code = "unsupported_content"

    def __init__(self, param: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(
            f"The safe-context guard cannot count non-text input ({param}) for this model; "
            "send text (or token ids) only.",
            param=param,
            headers=headers,
        )


class UpstreamUnavailable(GatewayError):
    """The upstream could not be reached (connection refused, reset, DNS, TLS)."""

    status = 502
    code = "upstream_unavailable"


class BadUpstreamResponse(GatewayError):
    """The upstream answered 2xx with something that is not an OpenAI-shaped answer."""

    status = 502
    code = "bad_upstream_response"


class UpstreamTimeout(GatewayError):
    """The upstream did not answer (or send its next chunk) within the timeout."""

    status = 504
    code = "upstream_timeout"


class NoTokenizeEndpoint(KvwatchError):
    """The upstream has no ``POST /tokenize`` (it answered 405, 501, or a 404 that is not
    about the model: vLLM answers an unknown model's tokenize request with a 404 too).

    Not a :class:`GatewayError`: it is never answered to a client; the prompt counter catches
    it and counts locally."""


REDACTED = "***"


def redact(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` (a decoded JSON body) with every occurrence of each secret replaced by
    ``***``, in every string, keys included."""
    ordered = sorted({s for s in secrets if s}, key=len, reverse=True)  # longest first
    if not ordered:
        return value

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            for secret in ordered:
                v = v.replace(secret, REDACTED)
            return v
        if isinstance(v, list):
            return [walk(item) for item in v]
        if isinstance(v, dict):
            return {walk(k): walk(item) for k, item in v.items()}
        return v

    return walk(value)


class UpstreamError(GatewayError):
    """An error the upstream answered, passed through with its status. ``upstream_body`` is
    its own OpenAI-shaped body when it sent one (with every key in ``secrets`` replaced by
    ``***``: an upstream may echo the credentials it was sent), else the gateway's wrapping
    of it."""

    def __init__(self, status: int, body: Any, *, secrets: Iterable[str] = ()) -> None:
        self.status = status
        body = redact(body, secrets)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            self.upstream_body: dict[str, Any] | None = body
            code = err.get("code")
            self.code = code if isinstance(code, str) else None
            message = err["message"]
        else:
            self.upstream_body = None
            self.code = "upstream_error"
            message = f"The upstream answered HTTP {status} without an OpenAI-shaped error."
        self.type = "server_error" if status >= 500 else "invalid_request_error"
        if status >= 500:
            self.outcome = "error"
        else:
            self.outcome = "rejected"
            if self.code == "context_length_exceeded":
                self.reason = "context_length_exceeded"
            elif status == 429:
                self.reason = "rate_limited"
            elif status in (401, 403):
                self.reason = "other"
            else:
                self.reason = "invalid_request"
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        return self.upstream_body if self.upstream_body is not None else super().body()
