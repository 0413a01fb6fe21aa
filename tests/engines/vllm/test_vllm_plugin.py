"""The ``vllm.general_plugins`` entry point, as vLLM itself loads it (runs in .venv-vllm)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from engine_probe.probe import get_probe, shutdown_probe


@pytest.fixture
def pristine_scheduler() -> Iterator[Any]:
    """vLLM's Scheduler class, its original __init__ put back afterwards."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__dict__["__init__"]
    yield Scheduler
    Scheduler.__init__ = original  # type: ignore[method-assign]
    if "_kvwatch_patched" in Scheduler.__dict__:
        delattr(Scheduler, "_kvwatch_patched")
    shutdown_probe(0.1)


def _load_plugins() -> None:
    """vLLM's own loader, which every vLLM process calls at start."""
    import vllm.plugins as plugins

    plugins.plugins_loaded = False
    plugins.load_general_plugins()


def test_without_a_collector_url_the_plugin_changes_nothing(
    pristine_scheduler: Any, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWATCH_COLLECTOR_URL", raising=False)
    before = pristine_scheduler.__dict__["__init__"]
    _load_plugins()
    assert pristine_scheduler.__dict__["__init__"] is before
    assert not hasattr(make_scheduler(), "_kvwatch_adapter")
    assert get_probe().enabled is False


def test_with_a_collector_url_every_scheduler_gets_the_adapter(
    pristine_scheduler: Any, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_probe.adapters.vllm.adapter import VllmAdapter

    # nothing listens there: the exporter retries in the background, the engine never waits
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("KVWATCH_DEPLOYMENT_ID", "plugin-test")
    _load_plugins()
    _load_plugins()  # vLLM may load plugins more than once: still one patch
    scheduler = make_scheduler()
    adapter = scheduler._kvwatch_adapter
    assert isinstance(adapter, VllmAdapter)
    probe = get_probe()
    assert probe.enabled is True
    assert probe.stats()["emitted"] >= 2  # engine.config and the first pool.sample


def test_kvwatch_vllm_probe_0_keeps_it_off(
    pristine_scheduler: Any, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("KVWATCH_VLLM_PROBE", "0")
    _load_plugins()
    assert not hasattr(make_scheduler(), "_kvwatch_adapter")


def test_a_vllm_without_the_scheduler_it_patches_still_starts(
    pristine_scheduler: Any,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM calls every plugin's ``register`` without catching: had the scheduler module
    moved (another vLLM version), an import error would stop every vLLM process."""
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    # the import system's own answer for a module that is not there
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", None)
    before = pristine_scheduler.__dict__["__init__"]
    with caplog.at_level(logging.ERROR, logger="engine_probe.vllm"):
        _load_plugins()
    assert "could not patch vLLM's scheduler" in caplog.text
    monkeypatch.undo()
    assert pristine_scheduler.__dict__["__init__"] is before
    assert not hasattr(make_scheduler(), "_kvwatch_adapter")
