"""The pieces every engine adapter shares (``engine_probe/adapters/``): the bounded maps and
the request registry, the hook guard, the reporter. The adapters' own tests run them inside
the engines (``tests/engines/``); these pin down the rules each adapter relies on, without
an engine."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import pytest

from engine_probe.adapters.common import UNKNOWN
from engine_probe.adapters.guard import HookGuard
from engine_probe.adapters.registry import Bounded, RequestRegistry, TenantHandles
from engine_probe.adapters.reporting import Reporter, RequestIds
from engine_probe.events import Event, PageReuse, PrefixCacheHit, RequestFinished
from engine_probe.ledger import UNKNOWN_TENANT
from engine_probe.probe import NoopProbe


def test_bounded_forgets_the_least_recently_set() -> None:
    b: Bounded[str, int] = Bounded(2)
    b["a"], b["b"] = 1, 2
    b["a"] = 3  # set again: the newest now
    b["c"] = 4
    assert list(b.items()) == [("a", 3), ("c", 4)]


def test_tenant_handles_are_never_reused() -> None:
    t = TenantHandles(2)
    a, b = t.handle("a"), t.handle("b")
    assert (a, b) == (0, 1) and t.handle("a") == a  # a used again: b is the oldest
    c = t.handle("c")
    assert len(t) == 2 and t.name(b) is None and t.name(a) == "a" and t.name(c) == "c"
    assert t.handle("b") not in (a, b, c)  # back after its eviction: a fresh handle


def test_request_registry_names_and_tenants() -> None:
    r = RequestRegistry(2)
    h0 = r.add("r-0", "t-a")
    h1 = r.add("r-1", None)
    assert r.names(h0) == ("r-0", "t-a") and r.known(h1) == ("r-1", UNKNOWN)
    assert r.tenant_handle(h0) == r.tenants.handle("t-a")
    assert r.tenant_handle(h1) == UNKNOWN_TENANT  # no tenant: none interned
    assert r.add("r-2", UNKNOWN) not in (h0, h1)  # "unknown" given by name: interned
    assert r.known(h0) is None and r.names(h0) == (f"handle-{h0}", UNKNOWN)
    assert r.tenant_handle(h0) == UNKNOWN_TENANT


def test_request_registry_loses_one_request_of_the_test_tenant() -> None:
    r = RequestRegistry(8, lose_writes_of="t-x")
    r.add("r-0", "t-a")
    first = r.add("r-1", "t-x")
    r.add("r-2", "t-x")
    assert r.lost == first and r.lose_writes_of is None


def test_hook_guard_counts_logs_and_swallows(caplog: pytest.LogCaptureFixture) -> None:
    counters: dict[str, int] = {}
    guard = HookGuard(counters, "errors", logging.getLogger("t.guard"), "hook %s failed")

    def boom() -> int:
        raise ValueError("no")

    with caplog.at_level(logging.ERROR, "t.guard"):
        assert guard.call(boom) is None
        assert guard.call(lambda: 7) == 7
        with guard.at("here"):
            raise KeyError("k")
        with guard.at("quiet"):
            pass
    assert counters == {"errors": 2}
    assert [r.getMessage() for r in caplog.records] == ["hook boom failed", "hook here failed"]
    assert all(r.exc_info is not None for r in caplog.records)


def test_hook_guard_lets_the_engine_see_what_is_not_an_exception() -> None:
    counters = {"errors": 0}
    guard = HookGuard(counters, "errors", logging.getLogger("t.guard"), "%s")
    with pytest.raises(KeyboardInterrupt), guard.at("stop"):
        raise KeyboardInterrupt
    assert counters == {"errors": 0}


class _Recording(NoopProbe):
    def __init__(self) -> None:
        self.sent: list[tuple[type[Event], str | None, dict[str, Any]]] = []

    def emit(
        self,
        event_type: type[Event],
        /,
        *,
        ts: datetime | None = None,
        deployment_id: str | None = None,
        **fields: Any,
    ) -> bool:
        self.sent.append((event_type, deployment_id, fields))
        return True


def test_reporter_builds_request_events_from_the_identity() -> None:
    probe = _Recording()
    reporter = Reporter(probe, "dep", {})
    reporter.finished(
        RequestIds("r-1", "t-a", "m", route="chat"),
        prompt_tokens=5,
        completion_tokens=2,
        status="completed",
        node="n",
    )
    ((kind, deployment, fields),) = probe.sent
    assert kind is RequestFinished and deployment == "dep"
    assert fields["request_id"] == "r-1" and fields["tenant"] == "t-a"
    assert fields["route"] == "chat" and fields["model_id"] == "m"


def test_reporter_sends_reuse_only_when_pages_were_reused() -> None:
    probe = _Recording()
    reporter = Reporter(probe, None, {})
    assert not reporter.page_reuse(node="n", role="both", step=1, counts=[0, 0, 0])
    assert reporter.page_reuse(node="n", role="both", step=2, counts=[0, 0, 3])  # zeroized
    assert [(k, f["step"]) for k, _, f in probe.sent] == [(PageReuse, 2)]


def test_reporter_counts_every_prefix_hit_and_sends_the_cross_tenant_ones() -> None:
    probe = _Recording()
    counters = {"prefix_hits_same_tenant": 0, "prefix_hits_cross_tenant": 0}
    reporter = Reporter(probe, None, counters)
    for owner in (("o-1", "t-a"), ("o-2", "t-b")):
        reporter.prefix_hit(
            node="n", role="both", reader=("r", "t-a"), owner=owner, pages=1, tokens=16,
            salted=False,
        )  # fmt: skip
    assert counters == {"prefix_hits_same_tenant": 1, "prefix_hits_cross_tenant": 1}
    assert [(k, f["owner_request_id"]) for k, _, f in probe.sent] == [(PrefixCacheHit, "o-2")]
