"""The ``vllm.general_plugins`` entry point, as vLLM itself loads it (runs in .venv-vllm)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_probe.adapters import common
from engine_probe.probe import get_probe, shutdown_probe


@pytest.fixture
def pristine_scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's Scheduler class, its original __init__ put back afterwards; the plugin's
    default spool/journal directory (per user) in this test's own directory."""
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    original = Scheduler.__dict__["__init__"]
    yield Scheduler
    Scheduler.__init__ = original  # type: ignore[method-assign]
    if "_kvwatch_patched" in Scheduler.__dict__:
        delattr(Scheduler, "_kvwatch_patched")
    shutdown_probe(0.1)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def vllm_log() -> Iterator[_Lines]:
    """The plugin's lines in vLLM's log (the ``vllm`` loggers do not propagate to root)."""
    logger = logging.getLogger("vllm.kvwatch")
    lines = _Lines()
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(lines)
    logger.setLevel(level)


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
    # journaled in the plugin's default directory: every event so far
    journal = probe.stats()["journal"]
    assert journal["enabled"] and journal["appends"] == probe.stats()["emitted"]
    spool = Path(os.environ["XDG_STATE_HOME"]) / "kvwatch" / "probe-spool"
    assert probe.settings.probe_spool_dir == spool  # type: ignore[attr-defined]


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
    vllm_log: _Lines,
) -> None:
    """vLLM calls every plugin's ``register`` without catching: had the scheduler module
    moved (another vLLM version), an import error would stop every vLLM process. The
    operator who configured a collector is told, in vLLM's log, why there is no probe."""
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    # the import system's own answer for a module that is not there
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", None)
    before = pristine_scheduler.__dict__["__init__"]
    _load_plugins()
    (warning,) = vllm_log.at(logging.WARNING)
    assert "KVWATCH_COLLECTOR_URL is set but the probe cannot attach" in warning
    assert "could not patch vLLM's scheduler (ModuleNotFoundError" in warning
    assert vllm_log.at(logging.INFO) == []
    monkeypatch.undo()
    assert pristine_scheduler.__dict__["__init__"] is before
    assert not hasattr(make_scheduler(), "_kvwatch_adapter")


def test_attaching_logs_one_info_line_without_credentials(
    pristine_scheduler: Any,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    vllm_log: _Lines,
) -> None:
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://kv:s3cret@127.0.0.1:9/base?token=t0k")
    monkeypatch.setenv("KVWATCH_DEPLOYMENT_ID", "plugin-log-test")
    _load_plugins()
    make_scheduler()
    (line,) = vllm_log.at(logging.INFO)
    assert "probe attached to vLLM's Scheduler" in line
    assert "collector http://***@127.0.0.1:9/base?***" in line
    assert "s3cret" not in line and "t0k" not in line
    assert "deployment plugin-log-test" in line
    assert "Scheduler.update_from_output" in line and "KVCacheManager.allocate_slots" in line
    assert "journal on in " in line and "KVWATCH_PROBE_JOURNAL_BYTES=0: off" in line
    assert vllm_log.at(logging.WARNING) == []


def test_kvwatch_probe_journal_bytes_0_runs_the_probe_memory_only(
    pristine_scheduler: Any,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    vllm_log: _Lines,
) -> None:
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("KVWATCH_PROBE_JOURNAL_BYTES", "0")
    _load_plugins()
    make_scheduler()
    (line,) = vllm_log.at(logging.INFO)
    assert "journal off (no spool directory" in line
    assert get_probe().stats()["journal"]["enabled"] is False
    assert not (Path(os.environ["XDG_STATE_HOME"]) / "kvwatch").exists()


def test_a_probe_that_cannot_be_configured_is_one_warning_saying_why(
    pristine_scheduler: Any,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    vllm_log: _Lines,
) -> None:
    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("KVWATCH_DEPLOYMENT_ID", "not a valid id")
    _load_plugins()
    scheduler = make_scheduler()  # vLLM still builds its scheduler
    assert not hasattr(scheduler, "_kvwatch_adapter")
    (warning,) = vllm_log.at(logging.WARNING)
    assert "KVWATCH_COLLECTOR_URL is set but the probe cannot attach" in warning
    assert "KVWATCH_DEPLOYMENT_ID" in warning  # the settings' own complaint
    assert vllm_log.at(logging.INFO) == []


def test_fault_injection_needs_its_exact_test_flag(
    pristine_scheduler: Any,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    vllm_log: _Lines,
) -> None:
    """The positive control's test-only switch: the tenant variable alone does nothing."""
    from engine_probe.adapters.vllm import plugin

    monkeypatch.setenv("KVWATCH_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv(common.LOSE_WRITE_VAR, "t-x")
    for flag in (None, "1", "true"):
        if flag is None:
            monkeypatch.delenv(common.TEST_FAULTS_VAR, raising=False)
        else:
            monkeypatch.setenv(common.TEST_FAULTS_VAR, flag)
        assert plugin._test_faults() == {}
    monkeypatch.setenv(common.TEST_FAULTS_VAR, common.TEST_FAULTS_ON)
    _load_plugins()
    adapter = make_scheduler()._kvwatch_adapter
    assert adapter._registry.lose_writes_of == "t-x"
    assert any("TEST FAULT INJECTION ON" in w for w in vllm_log.at(logging.WARNING))
