"""The ingest path's cache of deployment facts never keeps what a change made stale.

The CI failure it answers: ``kvwatch verify`` uploaded a passing verification while its own
prompts were still being flushed; a batch read the deployment's verifications just before
the upload committed and cached them for seconds, so the next prompt refused over the newly
verified limit was judged against an unverified one and paged as critical."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from collector import migrate
from collector.alerting import facts_cache
from collector.alerting.facts_cache import FactsCache
from collector.db import Database
from tests import factories as f


def test_a_read_under_way_when_facts_are_forgotten_is_not_remembered(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate.upgrade(sqlite_url)
    db = Database(sqlite_url)
    real = facts_cache.F.verdicts
    calls = 0
    have_read, may_go = threading.Event(), threading.Event()

    def verdicts(conn: Any, deps: Any) -> Any:
        nonlocal calls
        calls += 1
        out = real(conn, deps)
        if calls == 1:  # the first read has its answer; a writer commits and forgets now
            have_read.set()
            assert may_go.wait(10)
        return out

    monkeypatch.setattr(facts_cache.F, "verdicts", verdicts)
    cache = FactsCache(ttl_s=3600)
    batch = [f.admitted(1, "r1")]

    def read() -> None:
        with db.read() as conn:
            cache.prior_configs(conn, batch)

    try:
        t = threading.Thread(target=read)
        t.start()
        assert have_read.wait(10)
        cache.forget("glm-prod")
        may_go.set()
        t.join(10)
        with db.read() as conn:
            cache.prior_configs(conn, batch)
        assert calls == 2, "the read begun before forget() was remembered"
        # and without a forget in between, the next batch does reuse what it read
        with db.read() as conn:
            cache.prior_configs(conn, batch)
        assert calls == 2
    finally:
        db.dispose()
