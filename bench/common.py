"""What every benchmark shares: its failure type and its entry point's contract (human lines,
then one JSON object as the last line; exit 1 when it could not run or its results are
wrong), and the small helpers the collector benchmarks time and set up with."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class BenchError(RuntimeError):
    """The benchmark could not run or its results are wrong: exit 1, loudly."""


def bench_main(
    name: str,
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
) -> int:
    try:
        result = run(args)
    except BenchError as exc:
        print(f"BENCHMARK FAILED: {exc}", file=sys.stderr)
        print(json.dumps({"bench": name, "error": str(exc)}))
        return 1
    print(json.dumps(result))
    return 0


def load_at_start(less_noisy: str = "the ratios less so") -> float:
    """The 1-minute load average now; above 0.5 a note says what it does to the figures
    (``less_noisy``: what it spares)."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(
            f"note: load average {load:.2f} on {os.cpu_count()} CPUs before starting; other "
            f"work on this machine makes every figure noisier ({less_noisy})",
            flush=True,
        )
    return load


def finished(result: dict[str, Any], load0: float, t_start: float) -> dict[str, Any]:
    """``result`` with the machine's figures (CPUs, load average at the start and now) and
    the wall time since ``t_start`` (``time.perf_counter``) added; the total printed."""
    result["cpus"] = os.cpu_count()
    result["loadavg_1m_at_start"] = round(load0, 2)
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(f"total {result['wall_s']} s", flush=True)
    return result


def run_parallel(jobs: Sequence[Callable[[], None]]) -> float:
    """Run jobs on threads released together; seconds until the last one finishes. Any
    job's exception is re-raised."""
    barrier = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []
    finished: list[float] = []

    def run(job: Callable[[], None]) -> None:
        barrier.wait()
        try:
            job()
        except BaseException as exc:
            errors.append(exc)
        finally:
            finished.append(time.perf_counter())

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(finished) - t0


@contextlib.contextmanager
def entered_together(cms: Sequence[contextlib.AbstractContextManager[T]]) -> Iterator[list[T]]:
    """Enter context managers at once, one thread each (several collectors start in the
    time of one), and exit them likewise; what they yielded, in order. Those that entered
    are exited even when another failed to."""
    with ThreadPoolExecutor(max(1, len(cms))) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
    entered: list[contextlib.AbstractContextManager[T]] = []
    values: list[T] = []
    error: BaseException | None = None
    for cm, f in zip(cms, futures, strict=True):
        try:
            values.append(f.result())
            entered.append(cm)
        except BaseException as exc:
            error = error or exc

    def exit_all(exc: BaseException | None) -> None:
        info = (None, None, None) if exc is None else (type(exc), exc, exc.__traceback__)
        with ThreadPoolExecutor(max(1, len(entered))) as pool:
            list(pool.map(lambda cm: cm.__exit__(*info), entered))

    try:
        if error is not None:
            raise error
        yield values
    except BaseException as exc:
        exit_all(exc)
        raise
    exit_all(None)


def rotated_rounds(
    runs: Sequence[T], rounds: int, one: Callable[[T, int], None], done: Callable[[int], None]
) -> None:
    """For round k = 0, 1, .. ``rounds - 1``: ``one(run, k)`` for every run, in an order
    rotated by one from round to round (none always first or last, so drift and other load
    fall on all alike), then ``done(k)``. The cycle collector is off meanwhile."""
    gc.collect()
    gc.disable()
    try:
        for k in range(rounds):
            shift = k % len(runs)
            for r in [*runs[shift:], *runs[:shift]]:
                one(r, k)
            done(k)
    finally:
        gc.enable()


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0 when empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (None when unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def ingest_tokens(url: str, n: int = 1) -> list[tuple[int, str]]:
    """Migrate the database at ``url`` and create ``n`` ingest tokens in it, each named
    ``bench-`` and a random suffix (a name is unique among valid tokens, and a benchmark may
    ask twice for one database): (token id, which is also its lineage, and secret) each."""
    from collector import migrate
    from collector.db import Database
    from collector.tokens import create_token

    migrate.upgrade(url)
    db = Database(url)
    try:
        with db.write() as conn:
            now_us = int(time.time() * 1e6)
            return [
                create_token(
                    conn,
                    kind="ingest",
                    now_us=now_us,
                    name=f"bench-{uuid.uuid4().hex[:12]}",
                    actor="bench",
                )
                for _ in range(n)
            ]
    finally:
        db.dispose()


def ingest_token(url: str) -> str:
    """Migrate the database at ``url``; the secret of a new ingest token in it."""
    return ingest_tokens(url)[0][1]
