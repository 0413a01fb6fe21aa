"""LIVE vLLM: the engine core SIGKILLed under load, twice, then restarted: every request the
client got an answer for before a kill has its finish row in the collector (the client's log
against the collector's rows), through the plugin's default journal directory.

vLLM's ``LLM`` with its engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) restarts
fastest (~12 s to the first answer on 2 CPUs, against the API server's two processes), and a
SIGKILL of that process is a SIGKILL of the engine core. The run is ``bench.vllm_crash``'s
(``python -m bench.vllm_crash`` does it 10 times and prints the figure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.vllm_crash import crash_run
from tests.engine_servers import SERVER_TEST_TIMEOUT, _need_venv

pytestmark = [pytest.mark.slow, pytest.mark.serial, SERVER_TEST_TIMEOUT]


def test_a_sigkilled_vllm_engine_core_loses_no_finish_record(tmp_path: Path) -> None:
    _need_venv()
    result = crash_run(2, min_answers=12, work=tmp_path)
    assert result["kills"] == 2 and result["answered_before_kill"] >= 24
    assert result["finish_rows_missing"] == 0, result
    assert result["missing_total"] == 0, result
    # the plugin journaled in its default directory (XDG_STATE_HOME points into tmp_path)
    spool = tmp_path / "state" / "kvwatch" / "probe-spool"
    for n in range(3):
        out = (tmp_path / f"engine-{n}.out").read_text(errors="replace")
        assert f"journal on in {spool} (64 MiB" in out, out[-3000:]
