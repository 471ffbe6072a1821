"""The decode kernel on the KV layouts the engine really makes: one slot at a time against decode
runs (``KVManager.decode_runs``), side by side in one run.

Two thread-mode schedulers (``ROLLOUT_ENGINE_DECODE_RUN=1`` and the default) run the same GRPO
batch (32 prompts x n=8, 128-token prompts, T=1, the 55M qwen2) to the same decode step; the
kernel's calls of that step's 8 layers are captured in each (its inputs, the pool buffers and the
slot table as the scheduler left them). Then both sets are timed alternately, each set after
evicting the last-level cache (the engine's case: a step reads every layer's KV from DRAM), and
the medians compared.

    python benchmarks/bench_decode_layout.py                  # decode steps 16, 64, 120
    python benchmarks/bench_decode_layout.py --steps 64 --rounds 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import torch  # noqa: E402
from bench_offline import make_prompts  # noqa: E402

from rollout_engine.config import EngineConfig  # noqa: E402
from rollout_engine.model_runner.attention import torch_native  # noqa: E402
from rollout_engine.protocol.messages import GenerateReq  # noqa: E402
from rollout_engine.sampling_params import SamplingParams  # noqa: E402
from rollout_engine.scheduler import kv_manager  # noqa: E402
from rollout_engine.scheduler.scheduler import Scheduler  # noqa: E402

PROMPTS, N, PROMPT_LEN = 32, 8, 128
LAYOUTS = {"one slot at a time": 1, "decode runs": kv_manager.DECODE_RUN}


def capture(model_dir: str, run: int, step: int) -> list[tuple[Any, ...]]:
    """The kernel's calls (8 layers) at decode step ``step`` of a scheduler taking ``run``-token
    runs; the scheduler stays referenced by the calls' tensors."""
    os.environ[kv_manager.DECODE_RUN_ENV] = str(run)
    try:
        s = Scheduler(EngineConfig(model_path=model_dir, device="cpu", dtype="float32",
                                   scheduler_mode="thread", max_total_tokens=65536,
                                   max_running_requests=PROMPTS * N))
    finally:
        del os.environ[kv_manager.DECODE_RUN_ENV]
    for p, prompt in enumerate(make_prompts(PROMPTS, PROMPT_LEN, seed=0)):
        for j in range(N):
            sp = SamplingParams.from_dict({"max_new_tokens": step + 8, "ignore_eos": True,
                                           "temperature": 1.0, "sampling_seed": 1234 + j})
            s.handle(GenerateReq(rid=f"r{p}-{j}", input_ids=prompt, seed=j, sampling_params=sp))
    calls: list[tuple[Any, ...]] = []
    kernel = torch_native.cpu_paged.paged_decode
    recording = False

    def record(op, q, kbuf, vbuf, table, plan, scale):
        if recording:
            calls.append((op, q.clone(), kbuf, vbuf, table.clone(), plan, scale))
        return kernel(op, q, kbuf, vbuf, table, plan, scale)

    torch_native.cpu_paged.paged_decode = record
    try:
        decoded = 0
        while decoded <= step:
            decoding = len(s.running) == PROMPTS * N and not s.waiting
            recording = decoding and decoded == step
            s.step()
            decoded += decoding
    finally:
        torch_native.cpu_paged.paged_decode = kernel
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="16,64,120", help="decode steps to capture at")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--name", default="bench_decode_layout")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    evict = torch.empty(96 * 2**20 // 4)
    rows, found = [], []
    for step in (int(x) for x in args.steps.split(",")):
        calls = {name: capture(model_dir, run, step) for name, run in LAYOUTS.items()}
        seq = PROMPT_LEN + step + 1
        times: dict[str, list[float]] = {name: [] for name in calls}
        for r in range(args.rounds):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for name in order:
                evict.add_(1.0)
                t0 = time.perf_counter()
                for op, *rest in calls[name]:
                    torch_native.cpu_paged.paged_decode(op, *rest)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        best = {name: min(v) * 1e3 for name, v in times.items()}
        one, runs = (med[name] for name in LAYOUTS)
        rows.append([step, seq, f"{one:.2f}", f"{runs:.2f}", f"{one / runs:.3f}"])
        found.append({"step": step, "seq_len": seq, "median_ms": med, "best_ms": best})
    print(f"{threads} threads; 8 layers' decode-kernel calls at batch {PROMPTS * N}, "
          f"median of {args.rounds} rounds, each after evicting the LLC")
    print(common.table(rows, ["decode step", "seq", "one slot ms", "runs ms", "speedup"]))
    path = common.save_result(args.name, {"machine": common.machine(), "threads": threads,
                                          "rounds": args.rounds, "steps": found})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
