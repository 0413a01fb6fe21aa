"""What an engine adapter sends, built the same way by every adapter: the probe and the
deployment every event goes to, a request's ``request.admitted`` / ``request.rejected`` /
``request.finished`` from its identity, ``page.reuse`` only when something was reused, and
the classification of a prefix-cache hit on another request's pages.

What the engine says (its finish reasons, its token counts) is each adapter's to translate;
here is only how the events are built from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_probe.events import (
    Event,
    PageReuse,
    PrefixCacheHit,
    RequestAdmitted,
    RequestFinished,
    RequestRejected,
)
from engine_probe.probe import BaseProbe, get_probe

__all__ = ["Reporter", "Reporting", "RequestIdentity", "RequestIds"]


class RequestIdentity(Protocol):
    """What every request event names: the request and its tenant as wire ids (see
    ``adapters.common.safe_id``), its route and model where the adapter knows them."""

    @property
    def request_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def route(self) -> str | None: ...
    @property
    def model_id(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class RequestIds:
    """A :class:`RequestIdentity` for an adapter that keeps no record per request."""

    request_id: str
    tenant: str
    model_id: str | None
    route: str | None = None


def _identity(who: RequestIdentity) -> dict[str, Any]:
    """The fields every request event names ``who`` by."""
    return {
        "request_id": who.request_id,
        "tenant": who.tenant,
        "route": who.route,
        "model_id": who.model_id,
    }


class Reporter:
    """One adapter's way out: every event through ``probe`` (the process's probe,
    :func:`~engine_probe.probe.get_probe`, when None: looked up at each event, so a probe
    configured after the attach is used), under ``deployment_id``.

    Invariant: a prefix-cache hit between two known requests counts once in ``counters``,
    under ``prefix_hits_same_tenant`` or ``prefix_hits_cross_tenant``, and only a
    cross-tenant one is sent."""

    __slots__ = ("_probe", "counters", "deployment_id")

    def __init__(
        self, probe: BaseProbe | None, deployment_id: str | None, counters: dict[str, int]
    ) -> None:
        self._probe = probe
        self.deployment_id = deployment_id
        self.counters = counters

    @property
    def probe(self) -> BaseProbe:
        return self._probe if self._probe is not None else get_probe()

    def emit(self, event_type: type[Event], **fields: Any) -> None:
        self.probe.emit(event_type, deployment_id=self.deployment_id, **fields)

    def admitted(
        self,
        who: RequestIdentity,
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        node: str | None,
        prompt_shared_with: str | None = None,
    ) -> None:
        self.emit(
            RequestAdmitted,
            **_identity(who),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            node=node,
            prompt_shared_with=prompt_shared_with,
        )

    def rejected(
        self,
        who: RequestIdentity,
        *,
        reason: str,
        prompt_tokens: int,
        limit_tokens: int | None,
        node: str | None,
    ) -> None:
        self.emit(
            RequestRejected,
            **_identity(who),
            reason=reason,
            prompt_tokens=prompt_tokens,
            limit_tokens=limit_tokens,
            node=node,
        )

    def finished(
        self,
        who: RequestIdentity,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        status: str,
        node: str | None,
        cached_tokens: int | None = None,
    ) -> None:
        self.emit(
            RequestFinished,
            **_identity(who),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            status=status,
            node=node,
            cached_tokens=cached_tokens,
        )

    def page_reuse(self, *, node: str, role: str, step: int, counts: Sequence[int]) -> bool:
        """One ``page.reuse`` for ``counts`` (``[reused, cross_tenant, zeroized]`` pages, as
        the ledger's allocations return them), if any page was reused or zeroized; whether
        it was sent."""
        reused, cross, zeroized = counts
        if not (reused or zeroized):
            return False
        self.emit(
            PageReuse,
            node=node,
            role=role,
            step=step,
            reused_pages=reused,
            cross_tenant_pages=cross,
            zeroized_pages=zeroized,
        )
        return True

    def prefix_hit(
        self,
        *,
        node: str,
        role: str,
        reader: tuple[str, str],
        owner: tuple[str, str],
        pages: int,
        tokens: int,
        salted: bool,
    ) -> None:
        """``reader`` (request id, tenant) was handed ``pages`` (``tokens``) of prefix cache
        that ``owner`` computed: counted, and sent if the tenants differ (every turn of a
        conversation hits its own tenant's prefix, and no rule needs those)."""
        if owner[1] == reader[1]:
            self.counters["prefix_hits_same_tenant"] += 1
            return
        self.counters["prefix_hits_cross_tenant"] += 1
        self.emit(
            PrefixCacheHit,
            node=node,
            role=role,
            reader_request_id=reader[0],
            reader_tenant=reader[1],
            owner_request_id=owner[0],
            owner_tenant=owner[1],
            pages=pages,
            tokens=tokens,
            salted=salted,
        )


class Reporting:
    """Base of an adapter whose events go through its :class:`Reporter`: its ``probe`` and
    ``deployment_id``, read-only."""

    _reporter: Reporter

    @property
    def probe(self) -> BaseProbe:
        return self._reporter.probe

    @property
    def deployment_id(self) -> str | None:
        return self._reporter.deployment_id
