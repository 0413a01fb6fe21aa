"""The safe context of each model: configured, and read from the collector's verifications.

A model's limit is the smaller of its configured safe context (``MODEL=N``, or ``*=N`` for
every model) and its latest passing verification for the deployment, and says which of the
two it is (``verified`` / ``configured``). When the model's latest verification failed, every
prompt is refused where no limit is known, and prompts are otherwise held below the shortest
one that leaked too (``on_failed_verification=refuse``, the default; source
``failed-verification``), or the failure is only warned about (``warn``). Once any limit is
known, a request whose model has none (an alias, an unverified model, no ``model`` at all)
gets the smallest known one: the guard is never bypassed by naming another model or none.

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
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import httpx

from kvwatch.gateway.settings import GatewaySettings, OnFailed

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it


Source = Literal["verified", "configured", "failed-verification"]


@dataclass(frozen=True, slots=True)
class Limit:
    """The limit in force for one request: ``tokens`` (0: every prompt is refused), where it
    comes from, and a warning to pass on (a failed verification the gateway only warns
    about, or refuses above a value measured before it)."""

    tokens: int
    source: Source
    warning: str | None = None


@dataclass(frozen=True, slots=True)
class Verdicts:
    """What the collector's verifications say, per model: the newest passing verification's
    safe context, and the failure of those whose newest verdict is a failure (a run that
    could not reach a verdict changes neither)."""

    passing: Mapping[str, int]
    failed: Mapping[str, str]
    leaked_at: Mapping[str, int] = field(default_factory=dict)  # smallest leaking prompt


def read_verdicts(records: list[Any]) -> Verdicts:
    """``records`` newest first, as the collector lists them."""
    passing: dict[str, int] = {}
    failed: dict[str, str] = {}
    leaked_at: dict[str, int] = {}
    decided: set[str] = set()
    for r in records:
        if not isinstance(r, dict) or not isinstance(model := r.get("model_id"), str):
            continue
        result = r.get("result")
        if result is None:  # a collector from before results were named
            result = "pass" if r.get("passed") is True else "fail"
        if model not in decided and result in ("pass", "fail"):
            decided.add(model)
            if result == "fail":
                text = r.get("verdict")
                failed[model] = text if isinstance(text, str) else f"verification {r.get('id')}"
                at = r.get("smallest_leaking_prompt_tokens")
                evidence = r.get("evidence")  # a collector from before lists carried summaries
                if at is None and isinstance(evidence, dict):
                    at = evidence.get("smallest_leaking_prompt_tokens")
                if isinstance(at, int) and not isinstance(at, bool) and at > 0:
                    leaked_at[model] = at
        safe = r.get("verified_safe_context")
        if (
            model not in passing
            and r.get("passed") is True
            and isinstance(safe, int)
            and not isinstance(safe, bool)
            and safe > 0
        ):
            passing[model] = safe
    return Verdicts(passing, failed, leaked_at)


def latest_passing(records: list[Any]) -> dict[str, int]:
    """model id -> safe context of its newest passing verification."""
    return dict(read_verdicts(records).passing)


class SafeContexts:
    """The limits the guard applies. Replaced whole on refresh (no partial state).

    A model's limit is the smaller of its configured and its newest passing verified safe
    context. When its newest verdict is a failure, ``on_failed`` decides: ``refuse`` refuses
    every prompt when neither is known, and otherwise also holds prompts below the shortest
    one that leaked; ``warn`` keeps the limit as it was and only warns. Once any limit is
    known, a model without one gets the smallest known one."""

    def __init__(self, configured: Mapping[str, int], on_failed: OnFailed = "refuse") -> None:
        self._configured = dict(configured)
        self.on_failed = on_failed
        self._verdicts = Verdicts({}, {})
        self.verified_loaded_at: float | None = None

    def set_verified(self, verified: Mapping[str, int]) -> None:
        self.set_verdicts(Verdicts(dict(verified), {}))

    def set_verdicts(self, verdicts: Verdicts) -> None:
        self._verdicts = verdicts
        self.verified_loaded_at = time.time()

    def _own(self, model: str | None) -> Limit | None:
        """The model's own limit (``*`` counts as every model's, a missing model's too)."""
        configured = self._configured.get(model or "*", self._configured.get("*"))
        verified = self._verdicts.passing.get(model) if model is not None else None
        failure = self._verdicts.failed.get(model) if model is not None else None
        known = [
            (n, src)
            for n, src in ((verified, "verified"), (configured, "configured"))
            if n is not None
        ]
        warning = None
        if failure is not None:
            warning = f"the latest verification of {model} failed: {failure}"
            if self.on_failed == "refuse":
                # Nothing measured clean or configured: nothing is known safe (the sweep
                # tries a few lengths, so its shortest leak only bounds where leaks start).
                if not known:
                    return Limit(0, "failed-verification", warning)
                leaked = self._verdicts.leaked_at.get(model) if model is not None else None
                if leaked is not None:
                    known.append((leaked - 1, "failed-verification"))
        if not known:
            return None
        tokens, source = min(known, key=lambda k: k[0])
        return Limit(tokens, cast(Source, source), warning)

    def limit(self, model: str | None) -> Limit | None:
        if (own := self._own(model)) is not None:
            return own
        # No limit of its own (or no model named): the smallest known one, if any is known.
        limits = [lim for m in self.models() if (lim := self._own(m)) is not None]
        return min(limits, key=lambda lim: lim.tokens) if limits else None

    def models(self) -> set[str]:
        """Every model a limit or a verdict names (``*`` included when configured)."""
        v = self._verdicts
        return {*self._configured, *v.passing, *v.failed}

    def in_force(self) -> dict[str, Limit]:
        """Each named model's own limit (see :meth:`models`): what /metrics publishes."""
        return {m: lim for m in sorted(self.models()) if (lim := self._own(m)) is not None}

    def snapshot(self) -> dict[str, Any]:
        return {
            "configured": dict(self._configured),
            "verified": dict(self._verdicts.passing),
            "failed": dict(self._verdicts.failed),
        }


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
        verdicts = read_verdicts(records)
        before = self._limits.snapshot()
        if self._healthy is not True or dict(verdicts.passing) != before["verified"]:
            log.info(
                "verified safe contexts of %s: %s", self.deployment_id, verdicts.passing or "none"
            )
        for model, failure in verdicts.failed.items():
            if before["failed"].get(model) != failure:
                log.warning(
                    "the latest verification of %s on %s failed (%s): %s",
                    model,
                    self.deployment_id,
                    failure,
                    "refusing prompts from the shortest that leaked up, and every prompt "
                    "where no limit is known"
                    if self._limits.on_failed == "refuse"
                    else "warning only (on_failed_verification=warn)",
                )
        self._limits.set_verdicts(verdicts)
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
