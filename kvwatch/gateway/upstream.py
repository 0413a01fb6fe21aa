"""The HTTP client to the upstream: per-request state only.

One connection pool serves every tenant, but nothing else is shared: each request carries its
own credentials (the upstream key, else the caller's own key), cookies are never kept (a
``Set-Cookie`` from the upstream would otherwise be sent with the next tenant's request),
redirects are not followed and proxy or ``.netrc`` settings from the environment are ignored.
Transport failures become :class:`UpstreamTimeout` (504) or :class:`UpstreamUnavailable` (502).
"""

from __future__ import annotations

import logging
from http.cookiejar import Cookie, CookieJar
from typing import Any

import httpx
import msgspec

from kvwatch.gateway.auth import Caller
from kvwatch.gateway.errors import (
    GatewayError,
    NoTokenizeEndpoint,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from kvwatch.gateway.settings import GatewaySettings

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it


class _NoCookies(CookieJar):
    """A cookie jar that keeps nothing."""

    def set_cookie(self, cookie: Cookie) -> None:
        return None

    def set_cookie_if_ok(self, cookie: Cookie, request: Any) -> None:
        return None


def _names_model(content: bytes) -> bool:
    """Whether an error body is about the request's model (not about the route)."""
    try:
        body = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return False
    if err.get("code") == "model_not_found" or err.get("param") == "model":
        return True
    message = err.get("message")
    return isinstance(message, str) and "model" in message.lower()


class _Count(msgspec.Struct):
    """The one field of a tokenize answer the gateway needs; the token list is skipped."""

    count: int | None = None


_count_decoder = msgspec.json.Decoder(_Count)


class Upstream:
    """Requests to the upstream's ``/v1/...`` routes and its ``/tokenize``."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.root = settings.gateway_upstream
        self._upstream_key = settings.gateway_upstream_key
        self._timeout_s = settings.gateway_timeout_s
        self._tokenize_timeout = httpx.Timeout(
            settings.gateway_tokenize_timeout_s, connect=settings.gateway_connect_timeout_s
        )
        self._client = httpx.AsyncClient(
            base_url=self.root,
            timeout=httpx.Timeout(
                settings.gateway_timeout_s,
                connect=settings.gateway_connect_timeout_s,
                pool=settings.gateway_connect_timeout_s,
            ),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
            follow_redirects=False,
            trust_env=False,
        )
        # The jar itself, not httpx.Cookies(jar): that would copy it into a plain jar.
        self._client.cookies = _NoCookies()

    async def aclose(self) -> None:
        await self._client.aclose()

    def headers(self, caller: Caller, request_id: str) -> dict[str, str]:
        key = self._upstream_key or caller.key
        return {
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/json",
            "X-Request-Id": request_id,
        }

    def translate(self, exc: httpx.HTTPError) -> GatewayError:
        """A transport failure as the error the client gets (logged without secrets)."""
        log.warning("upstream %s failed: %s: %s", self.root, type(exc).__name__, exc)
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamTimeout(f"The upstream did not answer within {self._timeout_s:g} s.")
        return UpstreamUnavailable("The upstream server could not be reached.")

    async def send(
        self,
        method: str,
        path: str,
        caller: Caller,
        request_id: str,
        content: bytes | None = None,
        *,
        stream: bool = False,
        extra_headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """The upstream's response (its body still unread when ``stream``); ``extra_headers``
        (the tenant's routing tag) go with the gateway's own."""
        headers = self.headers(caller, request_id)
        if extra_headers:
            headers |= extra_headers
        request = self._client.build_request(method, path, content=content, headers=headers)
        try:
            return await self._client.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise self.translate(exc) from None

    async def tokenize(self, body: dict[str, Any], caller: Caller, request_id: str) -> int | None:
        """The upstream's token count for ``body`` (vLLM's and SGLang's ``POST /tokenize``):
        None when it could not say for this request (it refused the body, failed or timed
        out). Raises :class:`NoTokenizeEndpoint` when it has no such endpoint, and
        :class:`UpstreamError` when it refuses an unverified caller's key (401/403): that key
        is no tenant's, and its request goes no further."""
        try:
            r = await self._client.post(
                "/tokenize",
                content=msgspec.json.encode(body),
                headers=self.headers(caller, request_id),
                timeout=self._tokenize_timeout,
            )
        except httpx.HTTPError as exc:
            log.info("upstream /tokenize failed (%s); counting locally", type(exc).__name__)
            return None
        if r.status_code in (405, 501) or (r.status_code == 404 and not _names_model(r.content)):
            raise NoTokenizeEndpoint
        if r.status_code in (401, 403) and caller.unverified:
            try:
                refusal = msgspec.json.decode(r.content)
            except msgspec.DecodeError:
                refusal = None
            raise UpstreamError(r.status_code, refusal, secrets=(caller.key,))
        if r.status_code != 200:
            log.debug("upstream /tokenize answered %s; counting locally", r.status_code)
            return None
        try:
            count = _count_decoder.decode(r.content).count
        except msgspec.MsgspecError:
            return None
        return count if count is not None and count >= 0 else None
