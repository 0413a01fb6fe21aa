"""vLLM engine killed under load: how many finished requests lose their finish record.

    python -m bench.vllm_crash                 # 10 SIGKILLs
    python -m bench.vllm_crash --quick         # 3
    python -m bench.vllm_crash --kills N [--seed N] [--min-answers N] [--no-journal]

Runs from kvwatch's venv (the collector: in this process, SQLite in a temporary directory);
the engine runs in ``.venv-vllm`` (``bench/vllm_crash_engine.py``: vLLM's ``LLM`` with its
engine core in-process, the tests' tiny Llama, 8 requests always in flight, kvwatch's plugin
configured by ``KVWATCH_*`` only, with the plugin's DEFAULT spool/journal directory, under
``XDG_STATE_HOME`` pointed into the temporary directory). The checkout's ``engine_probe`` is
the one the engine imports (``PYTHONPATH``).

Each round starts an engine, waits until it has answered ``--min-answers`` requests, lets
it run a random 0-0.6 s more (the probe's flush interval is its default, 0.5 s: the last
answers' finish records are still in its memory buffer), and kills it with SIGKILL. The next
round's engine starts on the same node and state directory, so its probe adopts the dead
one's journal. After ``--kills`` rounds, one more engine answers a few requests, waits until
what it adopted is delivered, and exits cleanly. Then every request id an engine logged as
answered (the client's log, written at once) must have a finish row in the collector.

Last line, JSON: ``kills``, ``answered_before_kill`` (answers logged by the killed engines),
``finish_rows_missing`` (of those, the ones without a finish row: the figure), ``answered``
(all engines), ``missing_total``, ``replayed_after_each_kill`` (events the next engine's
probe adopted from the killed one's journal: what it had not yet delivered or spooled),
``engine_start_s_median`` (seconds from process start to the first answer), ``journal``.

``--no-journal``: the same run with ``KVWATCH_PROBE_JOURNAL_BYTES=0`` (memory only, as the
plugin was before the journal): the figure the journal is there to bring to 0.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import BenchError, bench_main

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT / "tests" / "engines" / "vllm" / "tiny_model.py"
DEPLOYMENT = "crash-bench"


def _answers(log: Path) -> tuple[list[str], float | None]:
    ids: list[str] = []
    ready: float | None = None
    if not log.exists():
        return ids, ready
    for line in log.read_text().splitlines():
        if line.startswith("# ready "):
            ready = float(line.split()[2])
        elif line and not line.startswith("#"):
            ids.append(line)
    return ids, ready


def _replayed(log: Path) -> int:
    for line in log.read_text().splitlines() if log.exists() else ():
        if line.startswith("# replayed "):
            return int(line.split()[2])
    return 0


class Rounds:
    """The engines of one run, their logs and the collector they report to."""

    def __init__(
        self, work: Path, collector_url: str, token: str, model: Path, *, journal: bool
    ) -> None:
        self.work = work
        self.model = model
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")},
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "XDG_STATE_HOME": str(work / "state"),
            "KVWATCH_COLLECTOR_URL": collector_url,
            "KVWATCH_INGEST_TOKEN": token,
            "KVWATCH_DEPLOYMENT_ID": DEPLOYMENT,
        }
        if not journal:
            self.env["KVWATCH_PROBE_JOURNAL_BYTES"] = "0"
        self.start_s: list[float] = []

    def start(self, n: int, answers: int = 0) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.work / f"answers-{n}.log"
        cmd = [str(VLLM_PY), "-m", "bench.vllm_crash_engine", str(self.model), str(log), f"k{n}"]
        if answers:
            cmd += ["--answers", str(answers)]
        out = (self.work / f"engine-{n}.out").open("ab")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return proc, log

    def wait_answers(
        self, proc: subprocess.Popen[bytes], log: Path, n: int, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchError(f"engine exited early ({proc.returncode}): {self.tail(log)}")
            if len(_answers(log)[0]) >= n:
                return
            time.sleep(0.05)
        proc.kill()
        raise BenchError(f"engine answered fewer than {n} requests in {timeout:.0f} s")

    def tail(self, log: Path) -> str:
        out = log.with_name(log.name.replace("answers-", "engine-").replace(".log", ".out"))
        return out.read_text(errors="replace")[-3000:] if out.exists() else "(no output)"


def _finish_rows(db_url: str) -> set[str]:
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT request_id FROM requests WHERE deployment_id = :d AND status IN "
                    "('completed', 'length', 'error', 'aborted')"
                ),
                {"d": DEPLOYMENT},
            )
            return {r for (r,) in rows}
    finally:
        engine.dispose()


def crash_run(
    kills: int,
    *,
    seed: int = 0,
    min_answers: int = 20,
    work: Path | None = None,
    journal: bool = True,
) -> dict[str, Any]:
    """``kills`` SIGKILLs of a loaded engine and a clean last one; the figures (see the module
    docstring). ``work``: keep the logs there (else a temporary directory)."""
    from collector import migrate
    from collector.app import create_app
    from collector.db import Database
    from collector.settings import Settings
    from collector.timefmt import to_micros
    from collector.tokens import create_token
    from engine_probe.events import utcnow
    from kvwatch.embedded import serve_in_thread

    if not (ROOT / ".venv-vllm" / ".kvwatch-installed").exists():
        raise BenchError(".venv-vllm is missing (make engines builds it)")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvwatch-crash-") as tmp:
        base = work or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        db_url = f"sqlite:///{base / 'kvwatch.db'}"
        migrate.upgrade(db_url)
        db = Database(db_url)
        try:
            with db.write() as conn:
                token = create_token(conn, kind="ingest", now_us=to_micros(utcnow()))[1]
        finally:
            db.dispose()
        model = base / "tiny"
        subprocess.run([str(VLLM_PY), str(TINY_MODEL), str(model)], check=True, cwd=ROOT)
        settings = Settings(database_url=db_url, auto_migrate=False, rollup_interval_s=0.5)
        with serve_in_thread(create_app(settings)) as url:
            rounds = Rounds(base, url, token, model, journal=journal)
            killed: list[str] = []
            replayed: list[int] = []  # by each engine, from its dead predecessor's journal
            for n in range(kills):
                proc, log = rounds.start(n)
                rounds.wait_answers(proc, log, min_answers, timeout=300)
                time.sleep(rng.uniform(0.0, 0.6))
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                ids, ready = _answers(log)
                killed += ids
                replayed.append(_replayed(log))
                if ready is not None:
                    rounds.start_s.append(ready)
                print(f"kill {n + 1}/{kills}: {len(ids)} answered before it", flush=True)
            proc, log = rounds.start(kills, answers=min_answers)
            try:
                proc.wait(300)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise BenchError("the last engine did not finish") from None
            if proc.returncode != 0:
                raise BenchError(f"the last engine failed: {rounds.tail(log)}")
            last, ready = _answers(log)
            replayed.append(_replayed(log))
            if ready is not None:
                rounds.start_s.append(ready)
            stats = _last_stats(rounds.tail(log))
            # the collector stores what it acknowledged: rows are there once the probe's
            # last POST returned (the engine exited after its flush)
            rows = _finish_rows(db_url)
    missing = [r for r in killed if r not in rows]
    missing_total = [r for r in killed + last if r not in rows]
    for r in missing[:20]:
        print(f"missing finish row: {r}", flush=True)
    result = {
        "bench": "vllm_crash",
        "kills": kills,
        "answered_before_kill": len(killed),
        "finish_rows_missing": len(missing),
        "answered": len(killed) + len(last),
        "missing_total": len(missing_total),
        # engine k+1 replays engine k's journal: what each killed engine had not sent
        "replayed_after_each_kill": replayed[1:],
        "replayed_by_last_engine": stats.get("journal", {}).get("replayed"),
        "engine_start_s_median": round(statistics.median(rounds.start_s), 1)
        if rounds.start_s
        else None,
        "journal": journal,
        "seed": seed,
    }
    print(
        f"{kills} SIGKILLs: {len(killed)} requests answered before a kill, "
        f"{len(missing)} without a finish row; engine start to first answer "
        f"{result['engine_start_s_median']} s (median)",
        flush=True,
    )
    return result


def _last_stats(output: str) -> dict[str, Any]:
    import json

    for line in reversed(output.splitlines()):
        if line.startswith("KVWATCH_CRASH_STATS "):
            value = json.loads(line.split(" ", 1)[1])
            return value if isinstance(value, dict) else {}
    return {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = crash_run(
        args.kills, seed=args.seed, min_answers=args.min_answers, journal=not args.no_journal
    )
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    """Exit 1 when the run failed or a finish row is missing (the JSON line says how many)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_crash", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 kills (--kills overrides)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-answers", type=int, default=20)
    parser.add_argument("--no-journal", action="store_true", help="KVWATCH_PROBE_JOURNAL_BYTES=0")
    outcome: list[dict[str, Any]] = []

    def record(args: argparse.Namespace) -> dict[str, Any]:
        outcome.append(run(args))
        return outcome[-1]

    args = parser.parse_args(argv)
    if args.quick and "--kills" not in (argv if argv is not None else sys.argv):
        args.kills = 3
    rc = bench_main("vllm_crash", args, record)
    # without the journal, losses are the expected figure, not a failure
    return 1 if rc or (outcome[-1]["finish_rows_missing"] and not args.no_journal) else 0


if __name__ == "__main__":
    sys.exit(main())
