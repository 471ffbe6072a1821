"""Tensor parallelism on CPU: --tp-size 2 vs one rank on the same workload, in one run.

On the ~55M tiny qwen2 (float32, 8 heads / 2 KV heads: one KV head a rank) a batch of B
prompts decodes T greedy tokens on a process-mode engine with tp_size 1 (2 torch threads) and
tp_size 2 (two rank processes, 1 thread each: the same two cores). Reported per config: decode
tokens/s (best of --reps), seconds to start the engine, and whether the TP=2 tokens equal the
TP=1 ones (logprob difference too).

Caveat: the machine has 2 cores, so TP=2 splits the same two cores between two ranks and adds
three collectives a layer over loopback gloo; it measures the cost of the TP machinery, not the
scaling a GPU a rank would give. A busy machine (other processes) moves every figure.

    python benchmarks/bench_tp.py --quick
    python benchmarks/bench_tp.py

The last line printed is the TP=2 / TP=1 decode throughput ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402


def run(model_dir: str, tp_size: int, batch: int, tokens: int, reps: int) -> dict[str, Any]:
    from rollout_engine import Engine

    prompts = [[10 + i, 20 + 3 * i, 7, 40 + i, 9] for i in range(batch)]
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    eng = Engine(model_path=model_dir, dtype="float32", device="cpu", tp_size=tp_size,
                 num_threads=2 // tp_size, max_total_tokens=batch * (tokens + 16) * 2)
    start_s = time.perf_counter() - t0
    try:
        eng.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})
        best, outs = float("inf"), None
        for _ in range(reps):
            eng.flush_cache()
            t0 = time.perf_counter()
            outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            best = min(best, time.perf_counter() - t0)
    finally:
        eng.shutdown()
    assert outs is not None
    return {"tp_size": tp_size, "start_s": start_s, "seconds": best,
            "tok_s": batch * tokens / best,
            "ids": [o["output_ids"] for o in outs],
            "logprobs": [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]
                         for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    batch, tokens = (8, 32) if args.quick else (16, 64)
    rows = [run(model_dir, tp, batch, tokens, 1 if args.quick else args.reps) for tp in (1, 2)]
    one, two = rows
    same = one["ids"] == two["ids"]
    worst = max(abs(a - b) for x, y in zip(one["logprobs"], two["logprobs"])
                for a, b in zip(x, y))
    print(common.table([[r["tp_size"], f"{r['start_s']:.1f}", f"{r['seconds']:.2f}",
                         f"{r['tok_s']:.0f}"] for r in rows],
                       ["tp_size", "start s", "decode s", "tok/s"]))
    ratio = two["tok_s"] / one["tok_s"]
    result = {"machine": common.machine(), "model": "qwen2 55M float32", "batch": batch,
              "new_tokens": tokens,
              "rows": [{k: v for k, v in r.items() if k not in ("ids", "logprobs")}
                       for r in rows],
              "tokens_identical": same, "max_logprob_diff": worst, "tp2_over_tp1": ratio}
    common.save_result("bench_tp_quick" if args.quick else "bench_tp", result)
    print(f"tokens identical: {same}, max |logprob diff| {worst:.2e}")
    print(f"TP=2 / TP=1 decode throughput: x{ratio:.2f}")


if __name__ == "__main__":
    main()
