"""What every benchmark shares: its failure type and its entry point's contract (human lines,
then one JSON object as the last line; exit 1 when it could not run or its results are
wrong)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


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
