"""vLLM probe overhead against a whole engine: the process CPU of vLLM 0.32's own ``LLM``
(engine core in-process: scheduler, model runner, a real forward of a tiny model on the CPU,
sampling, output processing) serving one workload, with kvwatch's adapter attached to its
scheduler, as a ratio to the same engine without it. Runs in vLLM's venv:

    .venv-vllm/bin/python -m bench.vllm_engine_overhead --quick
    .venv-vllm/bin/python -m bench.vllm_engine_overhead [--requests N] [--reps N] [--seed N]

``bench/vllm_overhead.py`` compares the probe with the scheduler alone (no model runner), the
strictest ceiling; this one measures what the issue's live measurement did, engine CPU, in
one process so that it is repeatable: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the tiny random
Llama of ``tests/engines/vllm/tiny_model.py`` (built here, nothing from a hub), eager mode,
block size 32, a 4,096-token KV pool (128 blocks: the workload preempts and evicts), 32
sequences and 128 tokens per step (chunked prefill, as the live tests' server).

**Workload**: ``bench.vllm_overhead``'s requests (4 tenants, shared system prompt, per-tenant
prefixes, follow-ups: cross-tenant prefix-cache hits), all submitted at once through
``LLM.generate`` with the tenant as the ``kvwatch_tenant`` extra arg; no aborts (``generate``
has none). **Variants**: three engines built once each, **off**, **on** (the adapter attached
to the engine core's scheduler with kvwatch's real probe, exporter not started, as in
``bench.vllm_overhead``) and **off_b** (the A/A control); each repetition runs every
variant once, order rotated, prefix cache reset before every run. Timed: ``time.process_time``
around ``generate`` (every thread of the process: the forward's torch threads too). A
variant's figure is its median over the repetitions; ``overhead_ratio`` = on/off - 1.

Checks (exit 1): every variant generates the same tokens (greedy; the adapter must not change
what vLLM does), the adapter reported no stale read and raised nothing, every request was
admitted and finished, the probe dropped nothing.

On a GPU the forward costs the CPU far less than here, so the ratio is lower than a GPU
engine's; the scheduler-only benchmark bounds it from the other side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from bench.common import BenchError, bench_main
from bench.vllm_overhead import GOAL, NOISY_AA, build_workload, new_probe
from engine_probe.events import PageStaleRead, RequestAdmitted, RequestFinished

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "tests" / "engines" / "vllm" / "tiny_model.py"
BLOCK = 32
POOL_BLOCKS = 128


def build_engine(model: Path, max_model_len: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        block_size=BLOCK,
        max_model_len=max_model_len,
        enforce_eager=True,
        max_num_seqs=32,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=POOL_BLOCKS,
        dtype="float32",
        seed=0,
        enable_prefix_caching=True,
    )


def scheduler_of(llm: Any) -> Any:
    """The engine core's scheduler (in-process engine core)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    from engine_probe.adapters.vllm.adapter import attach

    n = args.requests or (48 if args.quick else 160)
    reps = args.reps or (3 if args.quick else 5)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    specs = build_workload(n, args.seed)
    prompts = [{"prompt_token_ids": [t % 280 + 2 for t in s.tokens[:900]]} for s in specs]
    params = [
        SamplingParams(
            max_tokens=min(s.max_tokens, 64),
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kvwatch_tenant": s.tenant},
        )
        for s in specs
    ]
    with tempfile.TemporaryDirectory(prefix="kvwatch-bench-engine-") as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([sys.executable, str(TINY_MODEL), str(model)], check=True)
        variants = ["off", "on", "off_b"]
        engines = {v: build_engine(model, 1024) for v in variants}
        probe = new_probe(1 << 22)
        adapter = attach(scheduler_of(engines["on"]), probe)
        import vllm

        print(
            f"vLLM {vllm.__version__}, in-process engine, tiny Llama on the CPU; {n} requests "
            f"from 4 tenants, pool {POOL_BLOCKS} blocks x {BLOCK} tokens; {reps} reps of "
            f"{', '.join(variants)} (load average {load0:.2f})"
        )
        reference: list[list[int]] | None = None
        times: dict[str, list[float]] = {v: [] for v in variants}
        steps = 0
        for rep in range(reps + 1):  # the first round is the warm-up, untimed
            order = variants[rep % 3 :] + variants[: rep % 3]
            for v in order:
                llm = engines[v]
                llm.reset_prefix_cache()
                before = adapter.counters["steps"]
                c0 = time.process_time()
                result = llm.generate(prompts, params, use_tqdm=False)
                cpu = time.process_time() - c0
                tokens = [list(r.outputs[0].token_ids) for r in result]
                if reference is None:
                    reference = tokens
                elif tokens != reference:
                    raise BenchError(f"{v} generated other tokens: the adapter changed vLLM")
                if v == "on":
                    steps = adapter.counters["steps"] - before
                if rep:
                    times[v].append(cpu)
            if rep:
                print(
                    f"  rep {rep}: "
                    + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in variants)
                    + f" (on/off {times['on'][-1] / times['off'][-1]:.3f}, "
                    f"A/A {times['off_b'][-1] / times['off'][-1]:.3f})"
                )
        adapter.flush()
        events = probe.events()
        kinds = Counter(type(e) for e in events)
        if adapter.counters.get("errors", 0):
            raise BenchError(f"the adapter raised {adapter.counters['errors']} time(s)")
        if kinds[PageStaleRead] or adapter.counters["stale_reads"]:
            raise BenchError("the adapter reported a stale read on a clean workload")
        runs = reps + 1
        if kinds[RequestAdmitted] != n * runs or kinds[RequestFinished] != n * runs:
            raise BenchError(
                f"{kinds[RequestAdmitted]} admitted / {kinds[RequestFinished]} finished "
                f"events for {n * runs} requests"
            )
        stats = probe.stats()
        if any(stats["dropped"].values()):
            raise BenchError(f"the probe dropped events: {stats['dropped']}")
    med = {v: statistics.median(ts) for v, ts in times.items()}
    overhead = med["on"] / med["off"] - 1
    aa = med["off_b"] / med["off"]
    noisy = abs(aa - 1) > NOISY_AA
    per_step = 1e6 * (med["on"] - med["off"]) / steps if steps else None
    print(
        f"median of {reps}: off {med['off']:.2f} s, on {med['on']:.2f} s CPU for {steps} "
        f"steps: overhead {100 * overhead:+.1f}% ({per_step:+.0f} µs/step); A/A {aa:.3f}"
        + (" (noisy)" if noisy else "")
    )
    print(f"goal: overhead <= {100 * GOAL:.0f}%: " + ("met" if overhead <= GOAL else "NOT met"))
    return {
        "bench": "vllm_engine_overhead",
        "vllm": vllm.__version__,
        "requests": n,
        "steps": steps,
        "reps": reps,
        "cpu_s_off": round(med["off"], 3),
        "cpu_s_on": round(med["on"], 3),
        "overhead_ratio": round(overhead, 4),
        "overhead_us_per_step": round(per_step, 1) if per_step is not None else None,
        "aa_ratio": round(aa, 4),
        "noisy": noisy,
        "goal": GOAL,
        "goal_met": overhead <= GOAL,
        "events_by_type": {
            t.__name__: c for t, c in sorted(kinds.items(), key=lambda kv: kv[0].__name__)
        },
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "loadavg_1m_at_start": round(load0, 2),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="48 requests, 3 reps")
    p.add_argument("--requests", type=int, help="requests in the workload (default 160)")
    p.add_argument("--reps", type=int, help="repetitions of every variant (default 5)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("vllm_engine_overhead", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
