"""The limit the guard enforces: the collector's decision, obeyed, never re-derived.

The collector decides the limit in force for each model of the deployment
(:mod:`policies.limits`: the verified safe context while it holds, else min(advertised
context, prefill pool), tightened by a failed verification) and serves it at
``GET /v1/limits?deployment_id=D``; the gateway reads it with its ingest token at start and
every ``gateway_verification_refresh_s``. Its own configured limits (``MODEL=N``, ``*=N`` for
every model) join that decision through :func:`policies.limits.with_configured`, the same
rule: a configured limit only ever tightens.

What each setting does:

- ``on_failed_verification=refuse`` (the default) enforces the decision as served: under a
  failed verification, prompts are held below the shortest that leaked, and every prompt is
  refused where nothing was measured clean or configured. ``warn`` enforces what would hold
  without the failure (``without_failure``) and passes the failure on as a warning.
- While the collector cannot be read, the last decision read stays in force for
  ``gateway_limits_keep_s``; past that it is no longer trusted: ``refuse`` refuses every
  prompt (source ``none``) and ``warn`` keeps the last decision with a warning. Before any
  decision was read, only the configured limits hold, for the same time.
- A request whose model has no limit (an alias, an unverified model, no ``model`` at all)
  gets the smallest known one, once any is known: the guard is never bypassed by naming
  another model, or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from kvwatch.gateway.settings import GatewaySettings, OnFailed
from policies.limits import (
    LimitInForce,
    LimitSource,
    configured_only,
    from_json,
    strictest,
    with_configured,
)

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it


@dataclass(frozen=True, slots=True)
class Limit:
    """The limit applied to one request: ``tokens`` (0: every prompt is refused), its source
    (:data:`policies.limits.LimitSource`), and a warning to pass on (a failed verification
    the gateway only warns about, a stale verification, a decision it could not refresh)."""

    tokens: int
    source: LimitSource
    warning: str | None = None


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


class SafeContexts:
    """The limits the guard applies: the collector's decisions (replaced whole on each
    refresh, never partly) and the configured limits.

    ``keep_s``: how long a decision stays in force after the last successful read (and how
    long only the configured limits hold before any read), ``clock``: seconds, for tests."""

    def __init__(
        self,
        configured: Mapping[str, int],
        on_failed: OnFailed = "refuse",
        *,
        deployment_id: str = "",
        keep_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._configured = dict(configured)
        self.on_failed = on_failed
        self.deployment_id = deployment_id
        self.keep_s = keep_s
        self._clock = clock
        self._served: dict[str, LimitInForce] = {}
        self.started_at = clock()
        self.loaded_at: float | None = None

    def set_served(self, limits: Mapping[str, LimitInForce]) -> None:
        """The collector's decisions, model id -> limit in force: replace what was held."""
        self._served = dict(limits)
        self.loaded_at = self._clock()

    def served(self) -> dict[str, LimitInForce]:
        return dict(self._served)

    def _configured_for(self, model: str | None) -> int | None:
        return self._configured.get(model or "*", self._configured.get("*"))

    def _own(self, model: str | None) -> LimitInForce | None:
        """The model's own decision, with its configured limit (``*`` counts as every
        model's, a missing model's too)."""
        configured = self._configured_for(model)
        served = self._served.get(model) if model is not None else None
        if served is not None:
            return with_configured(served, configured)
        return configured_only(self.deployment_id, model or "*", configured)

    def _decision(self, model: str | None) -> LimitInForce | None:
        if (own := self._own(model)) is not None:
            return own
        return strictest(lim for m in self.models() if (lim := self._own(m)) is not None)

    def _expired(self) -> str | None:
        """Why the decisions can no longer be trusted (None: they can)."""
        if self.keep_s is None:
            return None
        since = self.loaded_at if self.loaded_at is not None else self.started_at
        if self._clock() - since <= self.keep_s:
            return None
        if self.loaded_at is None:
            return f"the collector's limits could not be read since {_iso(self.started_at)}"
        return f"the collector's limits could not be read since {_iso(self.loaded_at)}"

    def limit(self, model: str | None) -> Limit | None:
        """The limit for a request naming ``model`` (None: nothing is known; unguarded)."""
        expired = self._expired()
        if expired is not None and self.on_failed == "refuse":
            return Limit(0, "none", f"{expired}: every prompt is refused")
        lim = self._decision(model)
        if lim is None or lim.tokens is None:
            return None
        tokens, source = lim.tokens, lim.source
        if (
            source == "failed-verification"
            and self.on_failed == "warn"
            and lim.without_failure is not None
        ):
            if lim.without_failure.tokens is None:
                return None
            tokens, source = lim.without_failure.tokens, lim.without_failure.source
        warning = "; ".join(w for w in (lim.warning, expired) if w) or None
        return Limit(tokens, source, warning)

    def models(self) -> set[str]:
        """Every model a limit names (``*`` included when configured)."""
        return {*self._configured, *self._served}

    def in_force(self) -> dict[str, Limit]:
        """Each named model's own limit (see :meth:`models`): what /metrics publishes."""
        out = {}
        for m in sorted(self.models()):
            if self._own(m) is not None and (lim := self.limit(m)) is not None:
                out[m] = lim
        return out


class LimitsSource:
    """Keeps :class:`SafeContexts` in step with the collector's decisions
    (``GET /v1/limits``)."""

    def __init__(self, settings: GatewaySettings, limits: SafeContexts) -> None:
        assert settings.collector_url and settings.ingest_token and settings.deployment_id
        self.url = f"{settings.collector_url}/v1/limits"
        self.deployment_id = settings.deployment_id
        self.interval_s = settings.gateway_verification_refresh_s
        self._limits = limits
        self._token = settings.ingest_token
        self._healthy: bool | None = None
        self._task: asyncio.Task[None] | None = None

    async def refresh(self, client: httpx.AsyncClient) -> bool:
        """Read the decisions once; True when they were read (and applied)."""
        try:
            r = await client.get(
                self.url,
                params={"deployment_id": self.deployment_id},
                headers={"Authorization": f"Bearer {self._token}"},
            )
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}")
            doc: Any = r.json()
            if not isinstance(doc, dict) or not isinstance(doc.get("limits"), list):
                raise ValueError("the answer has no list of limits")
            decided = {
                lim.model_id: lim
                for lim in (from_json(x) for x in doc["limits"])
                if lim.deployment_id == self.deployment_id
            }
        except (httpx.HTTPError, ValueError, msgspec.ValidationError) as exc:
            since = self._limits.loaded_at
            kept = (
                f"keeping the limits read at {_iso(since)}"
                if since is not None
                else "no limit from the collector is known yet (configured ones still apply)"
            )
            log.warning(
                "cannot read the limits in force of %s from %s (%s: %s); %s",
                self.deployment_id,
                self.url,
                type(exc).__name__,
                exc,
                kept,
            )
            self._healthy = False
            return False
        before = self._limits.served()
        if self._healthy is not True or {m: x.text for m, x in decided.items()} != {
            m: x.text for m, x in before.items()
        }:
            log.info(
                "limits in force of %s: %s",
                self.deployment_id,
                {m: x.text for m, x in sorted(decided.items())} or "none",
            )
        for model, lim in decided.items():
            was = before.get(model)
            if lim.source == "failed-verification" and (was is None or was.warning != lim.warning):
                log.warning(
                    "%s on %s: %s",
                    model,
                    self.deployment_id,
                    lim.warning,
                )
        self._limits.set_served(decided)
        self._healthy = True
        return True

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh(client)

    async def start(self, client: httpx.AsyncClient) -> None:
        """Read once now (the guard is in force from the first request), then keep reading."""
        await self.refresh(client)
        self._task = asyncio.create_task(self._loop(client), name="kvwatch-limits")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
