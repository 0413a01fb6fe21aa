"""The safe context of each model: configured, and read from the collector's verifications.

A model's limit is the smaller of its configured safe context (``MODEL=N``, or ``*=N`` for
every model) and its latest passing verification for the deployment. Once any limit is known,
a request whose model has none (an alias, an unverified model, no ``model`` at all) gets the
smallest known one: the guard is never bypassed by naming another model or none.

Verifications are read with the ingest token from ``GET /v1/verifications?deployment_id=D``
at start and then every ``gateway_verification_refresh_s``; while the collector cannot be
read the last known values stay in force, and the log says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

from kvwatch.gateway.settings import GatewaySettings

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it


def latest_passing(records: list[Any]) -> dict[str, int]:
    """model id -> safe context of its newest passing verification (``records`` newest first,
    as the collector lists them)."""
    out: dict[str, int] = {}
    for r in records:
        if not isinstance(r, dict):
            continue
        model, safe = r.get("model_id"), r.get("verified_safe_context")
        if (
            isinstance(model, str)
            and model not in out
            and r.get("passed") is True
            and isinstance(safe, int)
            and not isinstance(safe, bool)
            and safe > 0
        ):
            out[model] = safe
    return out


class SafeContexts:
    """The limits the guard applies. Replaced whole on refresh (no partial state)."""

    def __init__(self, configured: Mapping[str, int]) -> None:
        self._configured = dict(configured)
        self._verified: dict[str, int] = {}
        self.verified_loaded_at: float | None = None

    def set_verified(self, verified: Mapping[str, int]) -> None:
        self._verified = dict(verified)
        self.verified_loaded_at = time.time()

    def limit(self, model: str | None) -> int | None:
        bounds = []
        configured = self._configured.get(model) if model is not None else None
        if configured is None:
            configured = self._configured.get("*")
        if configured is not None:
            bounds.append(configured)
        if model is not None and model in self._verified:
            bounds.append(self._verified[model])
        if bounds:
            return min(bounds)
        # No limit of its own (or no model named): the smallest known one, if any is known.
        known = [*self._configured.values(), *self._verified.values()]
        return min(known) if known else None

    def snapshot(self) -> dict[str, Any]:
        return {"configured": dict(self._configured), "verified": dict(self._verified)}


class VerificationSource:
    """Keeps :class:`SafeContexts` in step with the collector's verifications."""

    def __init__(self, settings: GatewaySettings, limits: SafeContexts) -> None:
        assert settings.collector_url and settings.ingest_token and settings.deployment_id
        self.url = f"{settings.collector_url}/v1/verifications"
        self.deployment_id = settings.deployment_id
        self.interval_s = settings.gateway_verification_refresh_s
        self._limits = limits
        self._token = settings.ingest_token
        self._healthy: bool | None = None
        self._task: asyncio.Task[None] | None = None

    async def refresh(self, client: httpx.AsyncClient) -> bool:
        """Read the verifications once; True when they were read (and applied)."""
        try:
            r = await client.get(
                self.url,
                params={"deployment_id": self.deployment_id, "limit": 1000},
                headers={"Authorization": f"Bearer {self._token}"},
            )
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}")
            records = r.json()
            if not isinstance(records, list):
                raise ValueError("the answer is not a list")
        except (httpx.HTTPError, ValueError) as exc:
            since = self._limits.verified_loaded_at
            kept = (
                f"keeping the verified safe contexts read at "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))}"
                if since is not None
                else "no verified safe context is known yet (configured ones still apply)"
            )
            log.warning(
                "cannot read verifications of %s from %s (%s: %s); %s",
                self.deployment_id,
                self.url,
                type(exc).__name__,
                exc,
                kept,
            )
            self._healthy = False
            return False
        verified = latest_passing(records)
        if self._healthy is not True or verified != self._limits.snapshot()["verified"]:
            log.info("verified safe contexts of %s: %s", self.deployment_id, verified or "none")
        self._limits.set_verified(verified)
        self._healthy = True
        return True

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh(client)

    async def start(self, client: httpx.AsyncClient) -> None:
        """Read once now (the guard is in force from the first request), then keep reading."""
        await self.refresh(client)
        self._task = asyncio.create_task(self._loop(client), name="kvwatch-verifications")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
