"""The HTTP side of the sweep: one OpenAI-compatible request, and what its answer means.

:func:`classify` is pure (status, headers, body -> :class:`Reply`); :class:`EndpointClient`
sends and times the request. Nothing here decides whether an outcome is a finding: that
depends on what the sweep has seen before (see ``session.py``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx

Route = Literal["chat", "completions"]
ROUTES: dict[str, str] = {"chat": "/chat/completions", "completions": "/completions"}


class Outcome(StrEnum):
    #: 2xx with a completion.
    ACCEPTED = "accepted"
    #: 4xx in OpenAI's error shape, no completion text: the clean refusal.
    REJECTED = "rejected"
    #: 4xx without OpenAI's error shape, or carrying completion text.
    UNCLEAN_REJECTION = "unclean_rejection"
    SERVER_ERROR = "server_error"
    TIMEOUT = "timeout"
    #: Could not connect at all (refused, DNS, TLS).
    UNREACHABLE = "unreachable"
    #: Connected, but the exchange broke (reset, protocol error).
    TRANSPORT_ERROR = "transport_error"
    #: A 2xx that is not a completion, or a status no client expects (1xx, 3xx).
    MALFORMED = "malformed"
    #: 401 or 403: the key was refused.
    AUTH_REFUSED = "auth_refused"
    #: 429: rate limited, says nothing about the prompt.
    THROTTLED = "throttled"


@dataclass(frozen=True)
class Reply:
    """One answer. ``text`` is what came back (kept in memory for the leak check only: it is
    never written to a report, since a leaking endpoint may return other people's data)."""

    outcome: Outcome
    status: int | None = None
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    request_id: str | None = None
    detail: str | None = None
    elapsed_s: float = 0.0
    retry_after_s: float | None = None
    #: ``usage.prompt_tokens_details.cached_tokens``, where the endpoint reports it
    cached_tokens: int | None = None

    @property
    def error_line(self) -> str:
        """``HTTP 400 context_length_exceeded: message`` (or what is known of it)."""
        parts = [f"HTTP {self.status}" if self.status is not None else self.outcome.value]
        if self.error_code or self.error_type:
            parts.append(str(self.error_code or self.error_type))
        line = " ".join(parts)
        why = self.error_message or self.detail
        return f"{line}: {why}" if why else line


class KeyRedactor:
    """Replaces every configured tenant key with ``***`` in text that came from upstream (an
    endpoint may echo the bearer key in its error messages)."""

    MASK = "***"

    def __init__(self, keys: Iterable[str]) -> None:
        # longest first, so a key that contains another is masked whole
        self._keys = sorted({k for k in keys if k}, key=len, reverse=True)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        for key in self._keys:
            text = text.replace(key, self.MASK)
        return text

    def reply(self, reply: Reply) -> Reply:
        """``reply`` with every kept upstream text redacted (``text``, the completion, is
        kept for the leak check only and never written anywhere)."""
        return replace(
            reply,
            error_message=self(reply.error_message),
            error_code=self(reply.error_code),
            error_type=self(reply.error_type),
            request_id=self(reply.request_id),
            detail=self(reply.detail),
        )


# Prompt token counts in context-length messages: refengine/OpenAI ("your prompt has N
# tokens", "your messages resulted in N tokens"), vLLM ("N in the messages", "your request
# has N input tokens").
_PROMPT_TOKENS_RES = (
    re.compile(r"prompt has (\d+) tokens"),
    re.compile(r"messages resulted in (\d+) tokens"),
    re.compile(r"\((\d+) in the messages"),
    re.compile(r"request has (\d+) input tokens"),
)
_LIMIT_RE = re.compile(r"maximum (?:context length|input length) is (\d+) tokens")


def prompt_tokens_in_message(message: str | None) -> int | None:
    """The prompt's token count when a rejection message states it."""
    if message:
        for rx in _PROMPT_TOKENS_RES:
            m = rx.search(message)
            if m:
                return int(m.group(1))
    return None


def limit_in_message(message: str | None) -> int | None:
    """The context limit when a rejection message states it."""
    m = _LIMIT_RE.search(message or "")
    return int(m.group(1)) if m else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _completion_text(body: dict[str, Any]) -> str | None:
    """The text of ``choices`` (chat or completions shape); None when there are none."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    out = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        message = choice.get("message")
        if isinstance(message, dict):
            text = message.get("content")
        if isinstance(text, str):
            out.append(text)
    return "".join(out)


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, dict) else None


def _retry_after(headers: httpx.Headers) -> float | None:
    raw = headers.get("retry-after")
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None


def classify(status: int, headers: httpx.Headers, content: bytes, elapsed_s: float) -> Reply:
    """What one HTTP answer to a completion request means."""
    rid = headers.get("x-request-id")
    try:
        body: Any = json.loads(content) if content else None
    except ValueError:
        body = None
    obj: dict[str, Any] = body if isinstance(body, dict) else {}
    err = obj.get("error")
    if not isinstance(err, dict) and obj.get("object") == "error":
        # vLLM's and SGLang's older error body: the error object itself, not nested
        err = obj
    error: dict[str, Any] = err if isinstance(err, dict) else {}
    message = error.get("message") if isinstance(error.get("message"), str) else None
    code = error.get("code")
    etype = error.get("type")
    raw_usage = obj.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    text = _completion_text(obj)
    common: dict[str, Any] = {
        "status": status,
        "elapsed_s": elapsed_s,
        "request_id": obj.get("id") if isinstance(obj.get("id"), str) else rid,
        "error_message": message,
        "error_code": None if code is None else str(code),
        "error_type": etype if isinstance(etype, str) else None,
        "prompt_tokens": _int(usage.get("prompt_tokens")),
        "completion_tokens": _int(usage.get("completion_tokens")),
        "cached_tokens": _cached_tokens(usage),
    }
    if 200 <= status < 300:
        if text is None:
            what = "not JSON" if body is None else "a JSON body without choices"
            return Reply(Outcome.MALFORMED, detail=f"a {status} answer that is {what}", **common)
        return Reply(Outcome.ACCEPTED, text=text, **common)
    if status in (401, 403):
        return Reply(Outcome.AUTH_REFUSED, **common)
    if status == 429:
        return Reply(Outcome.THROTTLED, retry_after_s=_retry_after(headers), **common)
    if 400 <= status < 500:
        if text:
            return Reply(
                Outcome.UNCLEAN_REJECTION,
                text=text,
                detail=f"a {status} refusal that carries {len(text)} characters of completion",
                **common,
            )
        if message is None or "type" not in error or "code" not in error:
            # what the body is, never what it says (it may echo credentials or other data)
            kind = headers.get("content-type", "").split(";")[0].strip()[:80]
            return Reply(
                Outcome.UNCLEAN_REJECTION,
                detail=f"a {status} refusal not in OpenAI's error shape "
                '({"error": {"message", "type", "code"}}, or vLLM\'s flat '
                f'{{"object": "error", ...}}): {len(content)} bytes of {kind or "no content type"}',
                **common,
            )
        return Reply(Outcome.REJECTED, **common)
    if status >= 500:
        return Reply(Outcome.SERVER_ERROR, text=text or "", detail=f"HTTP {status}", **common)
    return Reply(Outcome.MALFORMED, detail=f"unexpected HTTP status {status}", **common)


def redact_url(url: str) -> str:
    """``url`` without credentials: no user or password, and query values whose names look
    like secrets replaced."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    secret = re.compile(r"key|token|secret|sig|pass|auth|credential", re.IGNORECASE)
    query = urlencode(
        [
            (k, "REDACTED" if secret.search(k) else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def base_url(endpoint: str) -> str:
    """The OpenAI base URL (``.../v1``): a bare host gets ``/v1``; a path is kept as given."""
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--endpoint must be an http:// or https:// URL, not {endpoint!r}")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class EndpointClient:
    """Sends completion requests for named tenants. Thread-safe: one ``httpx.Client`` (its
    connection pool is shared safely between threads)."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        keys: dict[str, str],
        *,
        route: Route = "chat",
        timeout_s: float = 120.0,
        max_connections: int = 16,
    ) -> None:
        self.base = base_url(endpoint)
        self.model = model
        self.route = route
        self.path = ROUTES[route]
        self._keys = dict(keys)
        self.redact = KeyRedactor(self._keys.values())
        parts = urlsplit(self.base)
        url = urlunsplit((parts.scheme, parts.netloc, parts.path + self.path, parts.query, ""))
        self._url = url
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=max_connections),
            follow_redirects=False,
        )

    def body(
        self, text: str, max_tokens: int, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``extra``: more body fields (``cache_salt``)."""
        if self.route == "chat":
            body: dict[str, Any] = {
                "model": self.model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": False,
            }
        else:
            body = {
                "model": self.model,
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": False,
            }
        return body | (extra or {})

    def send(
        self, tenant: str, text: str, max_tokens: int, extra: dict[str, Any] | None = None
    ) -> Reply:
        """One request; every upstream text the reply keeps has the tenant keys masked."""
        return self.redact.reply(self._send(tenant, text, max_tokens, extra))

    def _send(
        self, tenant: str, text: str, max_tokens: int, extra: dict[str, Any] | None = None
    ) -> Reply:
        headers = {"Authorization": f"Bearer {self._keys[tenant]}"}
        start = time.monotonic()
        try:
            body = self.body(text, max_tokens, extra)
            r = self._http.post(self._url, json=body, headers=headers)
        except httpx.ConnectTimeout as exc:
            return Reply(Outcome.UNREACHABLE, detail=f"connect timeout: {exc}")
        except httpx.TimeoutException as exc:
            why = str(exc) or type(exc).__name__
            return Reply(Outcome.TIMEOUT, detail=why, elapsed_s=time.monotonic() - start)
        except httpx.ConnectError as exc:
            return Reply(Outcome.UNREACHABLE, detail=str(exc) or type(exc).__name__)
        except httpx.TransportError as exc:
            why = str(exc) or type(exc).__name__
            return Reply(Outcome.TRANSPORT_ERROR, detail=why, elapsed_s=time.monotonic() - start)
        return classify(r.status_code, r.headers, r.content, time.monotonic() - start)

    def close(self) -> None:
        self._http.close()
