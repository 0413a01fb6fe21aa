"""Reading a target over HTTP (the standard library's client: this package needs nothing but
prometheus-client beside it, wherever it runs, the collector's process included).

A :class:`TargetScraper` remembers the last good answer of each side endpoint (``/v1/models``,
``/version``, ``/server_info``): when one fails for a moment the figures it gave stay as
they were, instead of turning "unknown" and looking like a configuration change.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from engine_probe.events import Role
from engine_probe.node import node_id as derive_node
from engine_probe.node import server_base
from kvwatch.scrape import sglang, vllm
from kvwatch.scrape.errors import BadTarget, MalformedMetrics, TargetUnreachable
from kvwatch.scrape.exposition import Exposition, parse
from kvwatch.scrape.figures import ENGINES, ROLES, Scrape, id_from

MAX_BODY_BYTES: Final = 64 << 20
_ACCEPT: Final = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


@dataclass(frozen=True, slots=True)
class Target:
    """One engine server to scrape. ``url``: its root (``http://host:8000``) or its
    ``/metrics`` URL; ``node``: the node id prefix (default derived from the URL by
    ``engine_probe.node``: ``host:port``, a loopback host being this machine's name);
    ``node_given``: the operator chose ``node`` (--node)."""

    url: str
    engine: str
    base_url: str
    metrics_url: str
    node: str
    role: Role | None = None
    api_key: str | None = field(default=None, repr=False)
    node_given: bool = False

    @property
    def shown(self) -> str:
        """The metrics URL without credentials, for messages and logs."""
        return redact(self.metrics_url)


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def make_target(
    url: str,
    engine: str,
    *,
    node: str | None = None,
    role: str | None = None,
    api_key: str | None = None,
) -> Target:
    """Check and complete a target; :class:`BadTarget` says what is wrong with it."""
    raw = url.strip()
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise BadTarget(f"target {redact(raw)!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadTarget(f"target {redact(raw)!r} must be an http:// or https:// URL with a host")
    if engine not in ENGINES:
        raise BadTarget(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if role is not None and role not in ROLES:
        raise BadTarget(f"role {role!r} is not one of {', '.join(ROLES)}")
    path = parts.path.rstrip("/")
    root_path = path[: -len("/metrics")] if path.endswith("/metrics") else path
    base = urlunsplit((parts.scheme, parts.netloc, root_path, "", "")).rstrip("/")
    metrics = urlunsplit((parts.scheme, parts.netloc, f"{root_path}/metrics", parts.query, ""))
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    node_id = node if node is not None else derive_node(server_base(parts.hostname, port, role))
    if not node_id or len(node_id) > 100 or id_from(node_id, "node") != node_id:
        raise BadTarget(
            f"node {node_id!r} is not a valid id (letters, digits and ._:/@+=-, at most 100)"
        )
    return Target(raw, engine, base, metrics, node_id, role, api_key, node is not None)  # type: ignore[arg-type]


class TargetScraper:
    """Scrapes one target, again and again. Not thread-safe: one caller at a time."""

    def __init__(self, target: Target, timeout_s: float = 10.0) -> None:
        if not timeout_s > 0:
            raise BadTarget(f"timeout {timeout_s!r} must be positive")
        self.target = target
        self.timeout_s = timeout_s
        self._side: dict[str, Any] = {}

    def scrape(self) -> Scrape:
        """Fetch and translate; raises a :class:`ScrapeError` naming the URL and the problem."""
        t = self.target
        text = self._get(t.metrics_url).decode("utf-8", errors="replace")
        exp = parse(text, t.shown)
        side: dict[str, Any] = {}
        # Side endpoints only once the marker says it is the right engine: "not vLLM" is
        # the better message than "/v1/models: 404".
        if t.engine == "vllm" and vllm.MARKER in exp:
            side["models"] = self._side_doc("/v1/models", required=True)
            side["version"] = self._side_doc("/version", required=False)
        elif t.engine == "sglang" and sglang.MARKER in exp:
            side["server_info"] = self._side_doc("/server_info", required=False)
        return _translate(
            t.engine, exp, node=t.node, role=t.role, side=side, base=t.base_url, given=t.node_given
        )

    def exposition(self) -> Exposition:
        """Only the target's /metrics, parsed (no side documents): a cheap reading of its
        counters; raises a :class:`ScrapeError` like :meth:`scrape`."""
        t = self.target
        return parse(self._get(t.metrics_url).decode("utf-8", errors="replace"), t.shown)

    def _side_doc(self, path: str, *, required: bool) -> Any:
        url = f"{self.target.base_url}{path}"
        try:
            doc = json.loads(self._get(url, auth=True))
        except (TargetUnreachable, ValueError) as exc:
            if path in self._side:
                return self._side[path]
            if required:
                if isinstance(exc, TargetUnreachable):
                    raise
                raise MalformedMetrics(f"{redact(url)} did not answer JSON") from None
            return None
        self._side[path] = doc
        return doc

    def _get(self, url: str, *, auth: bool = False) -> bytes:
        headers = {"Accept": _ACCEPT if not auth else "application/json"}
        if auth and self.target.api_key:
            headers["Authorization"] = f"Bearer {self.target.api_key}"
        request = urllib.request.Request(url, headers=headers)
        shown = redact(url)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body: bytes = response.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            hint = ""
            if exc.code == 404:
                hint = " (is the URL the server's root or its /metrics?)"
            elif exc.code in (401, 403):
                # vLLM's --api-key guards its API routes (/v1/models): the engine's own key
                given = "was refused" if self.target.api_key else "is needed"
                hint = (
                    f" (the engine's own API key {given}: --api-key, KVWATCH_SCRAPE_API_KEY, "
                    'or "api_key" in KVWATCH_SCRAPE_TARGETS)'
                )
            raise TargetUnreachable(f"{shown} answered HTTP {exc.code}{hint}") from None
        except urllib.error.URLError as exc:
            raise TargetUnreachable(f"cannot reach {shown}: {exc.reason}") from None
        except TimeoutError:
            raise TargetUnreachable(f"{shown} did not answer within {self.timeout_s:g} s") from None
        except (OSError, ValueError) as exc:  # reset connections, bad status lines
            raise TargetUnreachable(f"cannot read {shown}: {exc}") from None
        if len(body) > MAX_BODY_BYTES:
            raise MalformedMetrics(f"{shown} answered more than {MAX_BODY_BYTES} bytes")
        return body


def translate(
    engine: str,
    text: str,
    *,
    source: str = "metrics",
    node: str = "node-0",
    role: Role | None = None,
    side: dict[str, Any] | None = None,
) -> Scrape:
    """Pure translation of exposition ``text`` (no I/O). ``side``: decoded side documents,
    ``models`` and ``version`` for vLLM, ``server_info`` for SGLang."""
    if engine not in ENGINES:
        raise BadTarget(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    return _translate(engine, parse(text, source), node=node, role=role, side=side or {}, base="")


def _translate(
    engine: str,
    exp: Exposition,
    *,
    node: str,
    role: Role | None,
    side: dict[str, Any],
    base: str,
    given: bool = False,
) -> Scrape:
    if engine == "vllm":
        return vllm.translate(
            exp,
            node_given=given,
            node_prefix=node,
            role=role,
            models=side.get("models"),
            version=side.get("version"),
            models_source=redact(f"{base}/v1/models") if base else "/v1/models",
        )
    return sglang.translate(exp, node_prefix=node, role=role, server_info=side.get("server_info"))
