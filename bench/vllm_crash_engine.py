"""One engine incarnation of ``bench.vllm_crash`` (runs in vLLM's venv; ``bench.vllm_crash``
starts it, with kvwatch's plugin configured from ``KVWATCH_*`` in its environment):

    .venv-vllm/bin/python -m bench.vllm_crash_engine MODEL_DIR LOG TAG [--answers N]

vLLM's own ``LLM`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so a SIGKILL of this process is a SIGKILL of the engine core), the tiny Llama of
``tests/engines/vllm/tiny_model.py``; the client is this loop, which keeps 8 requests in
flight through ``llm_engine.add_request``/``step`` and, for every request it gets an answer
for, appends the engine's request id (the id the probe reports) to ``LOG`` at once
(``os.write``: the line outlives a SIGKILL). Ids start with ``TAG``, so incarnations never
share one. First lines of ``LOG``: ``# ready <seconds from start to the first answer>`` and
``# replayed <events this engine's probe adopted from dead predecessors' journals>``.

``--answers N``: after N answers, wait until the probe's spool is empty (batches adopted from
a dead predecessor delivered), then exit cleanly (the probe's shutdown at exit flushes the
rest). Without it, it runs until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

IN_FLIGHT = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("log")
    parser.add_argument("tag")
    parser.add_argument("--answers", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()

    from vllm import LLM, SamplingParams

    from engine_probe.probe import get_probe

    llm = LLM(
        model=args.model,
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        max_num_seqs=IN_FLIGHT,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=64,
        dtype="float32",
        seed=0,
        enable_prefix_caching=True,
    )
    engine = llm.llm_engine
    log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    internal: dict[str, str] = {}
    answered = 0
    i = 0
    while True:
        while len(internal) < IN_FLIGHT:
            ext = f"{args.tag}-{i}"
            params = SamplingParams(
                max_tokens=4 + (i * 7) % 29,
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kvwatch_tenant": f"t{i % 3}"},
            )
            prompt = {"prompt_token_ids": [2 + (i * 13 + k) % 280 for k in range(20 + i % 60)]}
            internal[ext] = engine.add_request(ext, prompt, params)
            i += 1
        for out in engine.step():
            if not out.finished:
                continue
            rid = internal.pop(out.request_id, out.request_id)
            if answered == 0:
                # by now the probe adopted what a dead predecessor left (at its start)
                replayed = get_probe().stats().get("journal", {}).get("replayed", 0)
                os.write(log, f"# ready {time.monotonic() - started:.2f}\n".encode())
                os.write(log, f"# replayed {replayed}\n".encode())
            os.write(log, f"{rid}\n".encode())
            answered += 1
        if args.answers and answered >= args.answers:
            break
    probe = get_probe()
    deadline = time.monotonic() + 60
    while probe.stats().get("spooled", {}).get("files", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    probe.force_flush(10)
    print("KVWATCH_CRASH_STATS " + json.dumps(probe.stats()), flush=True)


if __name__ == "__main__":
    main()
