"""Prefix-cache verification benchmark: how well ``kvwatch verify``'s prefix-cache phase tells a
shared cache from an isolated one, and what it spends per verdict.

Against the reference engine's real server on 127.0.0.1 (monolithic, hardened, page 16) in
two modes, ``--runs`` phases each, every run with fresh random prefixes and salts:

* **shared** (vLLM's keys: tokens and the request's ``cache_salt``; tenants whose clients do
  not salt share): every verdict should be ``shared_across_tenants``. The share that is, is
  the **detection rate**;
* **salted** (the server salts by tenant): every verdict should be ``isolated``. The share of
  ``shared_across_tenants`` verdicts is the **false-positive rate**.

Each by both methods the phase has:

* **cached_tokens**: the engine's ``usage.prompt_tokens_details.cached_tokens``, exact;
* **timing**: ``cached_tokens`` taken out of every answer before the phase sees it (as from
  an endpoint that does not report it, e.g. vLLM without ``--enable-prompt-tokens-details``),
  so the verdict rests on answer times, the exact one-sided Mann-Whitney U at alpha 0.01.
  ``--timing-runs`` of them. Measured here: on the reference engine a hit saves too little
  of a request's time for timing to see (its lab model's K/V projection of the prefix is
  cheap next to the first token's attention over the whole prompt, which a hit still
  reads, and the HTTP round trip), even with a heavier model (``--timing-heads``,
  ``--timing-head-dim``, ``--timing-prefix``): its verdicts come out ``inconclusive``,
  which is the phase saying so rather than guessing, never a false ``caching_off`` nor a
  false ``shared_across_tenants``. On an engine whose prefill dominates (a real model on a
  GPU) the same test separates them.

Requests per verdict are counted (goal: at most 40 per model), with their ratio to that
ceiling. Goals: 100% detection, 0 false positives. ``inconclusive`` verdicts (timing) are
counted apart: neither a detection nor a false positive, and reported.

    python -m bench.prefix_verify --quick
    python -m bench.prefix_verify [--runs N] [--timing-runs N] [--tenants N]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.common import BenchError, bench_main, finished, load_at_start
from kvwatch.embedded import serve_in_thread
from kvwatch.verify import prefix
from kvwatch.verify.canaries import LeakMatcher, TenantText, new_canaries
from kvwatch.verify.client import EndpointClient, Reply
from kvwatch.verify.session import Session
from refengine import Engine, EngineConfig
from refengine.server import create_app

GOAL_MAX_REQUESTS = 40
GOAL_DETECTION = 1.0
GOAL_FALSE_POSITIVES = 0.0
PREFIX_BYTES = 1024  # the phase's default prefix (tokens = bytes on this byte-level engine)
MODES = ("shared", "salted")


class _NoCachedTokens(EndpointClient):
    """An endpoint that does not report ``cached_tokens``: the timing method's view."""

    def send(
        self, tenant: str, text: str, max_tokens: int, extra: dict[str, Any] | None = None
    ) -> Reply:
        return dataclasses.replace(
            super().send(tenant, text, max_tokens, extra), cached_tokens=None
        )


def one_run(
    url: str, keys: dict[str, str], *, timing: bool, budget: int, prefix_bytes: int
) -> prefix.PrefixResult:
    tenants = list(keys)
    canaries = new_canaries(tenants, 12)
    texts = {t: TenantText(c) for t, c in canaries.items()}
    cls = _NoCachedTokens if timing else EndpointClient
    client = cls(url, "refengine-lab", keys, route="completions", timeout_s=60)
    try:
        session = Session(client, texts, LeakMatcher(canaries, 12), budget)
        return prefix.run_prefix_check(session, tenants, prefix_bytes=prefix_bytes)
    finally:
        client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    load0 = load_at_start("the timing verdicts especially")
    t_start = time.perf_counter()
    keys = {f"tenant-{i}": f"sk-bench-{i}" for i in range(args.tenants)}
    expected = {"shared": "shared_across_tenants", "salted": "isolated"}
    out: dict[str, Any] = {"bench": "prefix_verify", "quick": args.quick, "tenants": args.tenants}
    budget = 10 * prefix.planned_requests(args.tenants)
    for method, runs in (("cached_tokens", args.runs), ("timing", args.timing_runs)):
        if runs == 0:
            continue
        figures: dict[str, Any] = {}
        timing = method == "timing"
        size = {"heads": args.timing_heads, "head_dim": args.timing_head_dim} if timing else {}
        prefix_bytes = args.timing_prefix if timing else PREFIX_BYTES
        for mode in MODES:
            engine = Engine(
                EngineConfig(
                    mode="hardened",
                    advertised_context=2 * prefix_bytes + 64,
                    pool_tokens=max(65_536, 16 * prefix_bytes),
                    page_size=16,
                    prefix_cache=mode,  # type: ignore[arg-type]
                    **size,
                )
            )
            verdicts: Counter[str] = Counter()
            spent: list[int] = []
            t0 = time.perf_counter()
            with serve_in_thread(create_app(engine, tenant_keys=keys)) as base:
                for _ in range(runs):
                    result = one_run(
                        f"{base}/v1", keys, timing=timing, budget=budget, prefix_bytes=prefix_bytes
                    )
                    if result.method != method:
                        raise BenchError(f"asked for {method}, the phase judged by {result.method}")
                    verdicts[result.verdict] += 1
                    spent.append(result.requests)
            right = verdicts[expected[mode]]
            figures[mode] = {
                "runs": runs,
                "verdicts": dict(verdicts),
                "right": right,
                "requests_per_verdict": {
                    "median": statistics.median(spent),
                    "max": max(spent),
                },
                "seconds_per_verdict": round((time.perf_counter() - t0) / runs, 3),
            }
            print(
                f"{method:13} {mode:6} {dict(verdicts)}, requests {max(spent)} at most", flush=True
            )
        shared, salted = figures["shared"], figures["salted"]
        worst = max(shared["requests_per_verdict"]["max"], salted["requests_per_verdict"]["max"])
        figures["detection_rate"] = round(shared["right"] / shared["runs"], 4)
        figures["false_positive_rate"] = round(
            salted["verdicts"].get("shared_across_tenants", 0) / salted["runs"], 4
        )
        figures["inconclusive_rate"] = round(
            (shared["verdicts"].get("inconclusive", 0) + salted["verdicts"].get("inconclusive", 0))
            / (shared["runs"] + salted["runs"]),
            4,
        )
        figures["prefix_tokens"] = prefix_bytes
        figures["engine"] = size or {"heads": 1, "head_dim": 64}
        figures["max_requests_per_verdict"] = worst
        figures["ratio_requests_to_ceiling"] = round(worst / GOAL_MAX_REQUESTS, 3)
        figures["met"] = {
            "detection": figures["detection_rate"] >= GOAL_DETECTION,
            "false_positives": figures["false_positive_rate"] <= GOAL_FALSE_POSITIVES,
            "requests": worst <= GOAL_MAX_REQUESTS,
        }
        out[method] = figures
    out["goal"] = {
        "detection_rate": GOAL_DETECTION,
        "false_positive_rate": GOAL_FALSE_POSITIVES,
        "max_requests_per_verdict": GOAL_MAX_REQUESTS,
    }
    return finished(out, load0, t_start)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefix_verify", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="50 exact runs a mode, 5 timing runs")
    p.add_argument("--runs", type=int, help="cached_tokens runs per mode (default 50; 100 full)")
    p.add_argument("--timing-runs", type=int, help="timing runs per mode (default 5; 20 full)")
    p.add_argument("--tenants", type=int, default=2, help="tenants (2 to 4; default 2)")
    p.add_argument("--timing-heads", type=int, default=1, help="the timing runs' heads")
    p.add_argument("--timing-head-dim", type=int, default=64, help="... and head size")
    p.add_argument("--timing-prefix", type=int, default=PREFIX_BYTES, help="... prefix tokens")
    args = p.parse_args(argv)
    if args.runs is None:
        args.runs = 50 if args.quick else 100
    if args.timing_runs is None:
        args.timing_runs = 5 if args.quick else 20
    if args.runs < 1 or args.timing_runs < 0:
        p.error("--runs must be at least 1 and --timing-runs at least 0")
    if not 2 <= args.tenants <= 4:
        p.error("--tenants must be 2 to 4")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("prefix_verify", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
