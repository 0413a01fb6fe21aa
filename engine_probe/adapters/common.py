"""What every engine adapter (refengine, vLLM, SGLang) does the same way when it turns engine
objects into wire events: ids that always pass the wire's id check, page-id lists cut to the
wire's per-event limit, and stale-read reports turned into events (:class:`StaleReadEmitter`).

Imports no torch: the ledger module is imported for its report type only."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from engine_probe.events import MAX_PAGE_IDS, PageStaleRead, is_valid_id

if TYPE_CHECKING:
    from engine_probe.ledger import StaleRead

__all__ = [
    "LOSE_WRITE_VAR",
    "TEST_FAULTS_ON",
    "TEST_FAULTS_VAR",
    "UNKNOWN",
    "StaleReadEmitter",
    "chunks",
    "safe_id",
    "test_faults",
]


def safe_id(value: str, prefix: str) -> str:
    """``value`` if it is a valid wire id, else a stable hashed stand-in (never dropped: an
    engine's request or tenant name may hold characters the wire refuses)."""
    if is_valid_id(value):
        return value
    return f"{prefix}-{hashlib.sha256(value.encode()).hexdigest()[:24]}"


def chunks(pages: list[int]) -> list[list[int]]:
    """``pages`` in runs of at most ``MAX_PAGE_IDS`` (at least one run, maybe empty)."""
    return [pages[i : i + MAX_PAGE_IDS] for i in range(0, len(pages), MAX_PAGE_IDS)] or [[]]


UNKNOWN: Final = "unknown"
"""The tenant (or request) name reported when the adapter cannot name it."""

# TEST ONLY: fault injection for the positive control of kvwatch's own live tests (a probe
# that reports no stale read must be one that could). Read only when TEST_FAULTS_VAR holds
# exactly TEST_FAULTS_ON; then the adapter does not record the KV writes of the first
# request of the tenant LOSE_WRITE_VAR names, so that reads of those pages are reported as
# stale reads. Never set these outside a test engine: that engine's probe then reports a
# stale read that did not happen (the plugin logs a WARNING saying so).
TEST_FAULTS_VAR: Final = "KVWATCH_TEST_FAULT_INJECTION"
TEST_FAULTS_ON: Final = "i-know-this-probe-will-report-false-stale-reads"
LOSE_WRITE_VAR: Final = "KVWATCH_TEST_LOSE_KV_WRITE_OF_TENANT"


def test_faults(log: logging.Logger) -> dict[str, Any]:
    """An adapter's test-only fault options from the environment (see TEST_FAULTS_VAR):
    none unless enabled; logged on ``log`` as a WARNING when they are."""
    if os.environ.get(TEST_FAULTS_VAR, "") != TEST_FAULTS_ON:
        return {}
    tenant = os.environ.get(LOSE_WRITE_VAR, "").strip()
    if not tenant:
        return {}
    log.warning(
        "kvwatch: TEST FAULT INJECTION ON (%s): the KV writes of tenant %r's first request "
        "will not be recorded, so reads of them are reported as stale reads. Never in "
        "production.",
        TEST_FAULTS_VAR,
        tenant,
    )
    return {"test_lose_kv_write_of_tenant": tenant}


#: (request id, tenant name) of a ledger request handle; ``(f"handle-{h}", UNKNOWN)`` when
#: the adapter has no record of it.
RequestNames = Callable[[int], tuple[str, str]]
#: The name of a ledger tenant handle, or ``None`` when the adapter cannot name it.
TenantNames = Callable[[int], str | None]


class StaleReadEmitter:
    """Turns the ledger's :class:`~engine_probe.ledger.StaleRead` reports into
    ``page.stale_read`` events, the same way for every engine adapter.

    Invariants:

    * A reader request reports a given (pool, page, previous writer, zeroized) at most once
      while it is tracked (``dedupe=True``, decode gathers: a decode step re-reads the same
      stale pages every token); :meth:`forget` ends the tracking when the request finishes.
      Transfer reads (``dedupe=False``) are reported every time: each transfer is its own
      exposure.
    * A page read by several tokens of one report is reported once.
    * Each report counts once in ``counters["stale_reads"]`` and becomes one event per
      ``MAX_PAGE_IDS`` pages.
    * Tenants, safe side first. The previous writer's tenant is what the ledger recorded
      when the page was written: unknown to the ledger (``UNKNOWN_TENANT``) is reported as
      ``"unknown"``, which rules treat as another tenant, so a stale read of it is never
      taken for a same-tenant one; a ledger handle the adapter can no longer name (evicted)
      falls back to the adapter's record of the writing request, else ``"unknown"``. The
      reader's tenant is the adapter's record of the reading request, else the ledger's,
      else ``"unknown"``. A never-written page names no previous request nor tenant.
    """

    __slots__ = ("_counters", "_emit", "_request_names", "_seen", "_tenant_names")

    def __init__(
        self,
        emit: Callable[..., None],
        counters: dict[str, int],
        request_names: RequestNames,
        tenant_names: TenantNames,
    ) -> None:
        self._emit = emit
        self._counters = counters
        self._request_names = request_names
        self._tenant_names = tenant_names
        self._seen: dict[int, set[tuple[str, int, int | None, bool]]] = {}

    def forget(self, reader: int) -> None:
        """The request ``reader`` finished: drop what it reported."""
        self._seen.pop(reader, None)

    def report(
        self,
        reports: Iterable[StaleRead],
        *,
        node: str,
        role: str,
        dedupe: bool,
        reader: tuple[int, str, str] | None = None,
    ) -> None:
        """Emit ``reports`` read on ``node`` (of ``role``).

        ``reader``: (handle, request id, tenant) of the request that did the read, when it
        is not the report's ``reader_request`` (vLLM and SGLang check a prefix-cache hit as a
        read by the request that computed the block, but the request that read it is the one
        exposed).
        """
        for r in reports:
            who = r.reader_request if reader is None else reader[0]
            pages = list(dict.fromkeys(r.page_ids))
            if dedupe:
                seen = self._seen.setdefault(who, set())
                keys = [(r.pool, p, r.previous_request, r.zeroized) for p in pages]
                pages = [p for p, key in zip(pages, keys, strict=True) if key not in seen]
                seen.update(keys)
                if not pages:
                    continue
            self._counters["stale_reads"] += 1
            if reader is not None:
                _, reader_id, reader_tenant = reader
            else:
                reader_id, reader_tenant = self._request_names(who)
                if reader_tenant == UNKNOWN:
                    reader_tenant = self._ledger_tenant(r.reader_tenant) or UNKNOWN
            prev_id = prev_tenant = None
            if r.previous_request is not None:
                prev_id, recorded = self._request_names(r.previous_request)
                if r.previous_tenant is None or r.previous_tenant < 0:
                    prev_tenant = UNKNOWN
                else:
                    prev_tenant = self._ledger_tenant(r.previous_tenant) or recorded
            for chunk in chunks(pages):
                self._emit(
                    PageStaleRead,
                    node=node,
                    role=role,
                    read_kind=r.read_kind,
                    reader_request_id=reader_id,
                    reader_tenant=reader_tenant,
                    page_ids=chunk,
                    previous_request_id=prev_id,
                    previous_tenant=prev_tenant,
                    zeroized=r.zeroized,
                )

    def _ledger_tenant(self, handle: int) -> str | None:
        return self._tenant_names(handle) if handle >= 0 else None
