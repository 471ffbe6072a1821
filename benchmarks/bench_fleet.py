"""Many engines: a fleet refit by one broadcast for 1, 2 and 4 engines, and rollout throughput
with --dp-size 1 vs 2 on the same workload, in one run.

  (1) refit: 4 process-mode engines on the ~55M tiny qwen2 (float32) are started once; a
      `RolloutFleet` over the first 1, 2 and 4 of them forms one weight-update group
      (gloo, trainer rank 0 + one rank per engine) and refits them from a trainer state dict
      `--reps` times (the first refit of each fleet is a warm-up). The trainer hands each
      tensor to one broadcast whatever the fleet size; gloo on loopback still writes each
      peer's copy from the trainer process, so on a CPU box the cost grows with the bytes
      the machine moves, not with trainer-side calls. Reported: seconds per refit (best and
      median), GB/s per engine, CPU seconds of the trainer process and of the engines per
      refit (the trainer's share is what "sent once" saves), and the 4-vs-1 ratio.
  (2) throughput: the same GRPO-shaped workload (P prompts x n samples, T=1, logprobs, one
      generate call per group, all groups in flight at once) on --dp-size 1 (one child,
      2 torch threads, and again with 1 thread: the same thread count as a replica) and
      --dp-size 2 (two children, 1 thread each; cache_aware dispatch).

Caveat: this machine has 2 cores, so DP=2 splits the same two cores between two replicas;
it measures the dispatcher's and the frontend's overhead and the batching trade-off, not the
scaling a GPU per replica would give. A busy machine (other processes) moves every figure.

    python benchmarks/bench_fleet.py --quick
    python benchmarks/bench_fleet.py

The last line printed is the 4-vs-1 refit ratio and the DP=2 / DP=1 throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import torch  # noqa: E402

FLEET_SIZES = (1, 2, 4)


def _trainer_tensors(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights: the checkpoint's tensors, perturbed so a refit changes them."""
    from rollout_engine.weights.loader import iter_safetensors

    return [(n, (t.float() * 1.0001).to(t.dtype)) for n, t in iter_safetensors(model_dir)]


def bench_refit(model_dir: str, reps: int) -> dict[str, Any]:
    from rollout_engine import Engine
    from trainer_bridge import RolloutFleet

    tensors = _trainer_tensors(model_dir)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    engines = [Engine(model_path=model_dir, dtype="float32", device="cpu",
                      max_total_tokens=2048, num_threads=1) for _ in range(max(FLEET_SIZES))]
    out: dict[str, Any] = {"payload_bytes": nbytes}
    try:
        for size in FLEET_SIZES:
            with RolloutFleet(engines[:size], transport="distributed", timeout_s=300) as fleet:
                times, trainer_cpu, engines_cpu = [], 0.0, 0.0
                for rep in range(reps + 1):
                    cpu0 = common.cpu_seconds()
                    both0 = common.cpu_seconds(*(e.tm.host.pid for e in engines[:size]))
                    report = fleet.refit(tensors, version=f"n{size}-{rep}")
                    assert report.ok and set(report.versions.values()) == {f"n{size}-{rep}"}
                    if rep:
                        times.append(report.seconds)
                        trainer_cpu += common.cpu_seconds() - cpu0
                        engines_cpu += common.cpu_seconds(
                            *(e.tm.host.pid for e in engines[:size])) - both0
            best, median = min(times), statistics.median(times)
            trainer_cpu, engines_cpu = trainer_cpu / reps, (engines_cpu - trainer_cpu) / reps
            out[f"engines_{size}"] = {"best_s": best, "median_s": median, "all_s": times,
                                      "gbps_per_engine": nbytes / best / 1e9,
                                      "trainer_cpu_s_per_refit": trainer_cpu,
                                      "engines_cpu_s_per_refit": engines_cpu}
            print(f"refit {size} engine(s): best {best:.3f} s, median {median:.3f} s "
                  f"({nbytes / best / 1e9:.2f} GB/s per engine); CPU per refit: trainer "
                  f"{trainer_cpu:.3f} s, engines {engines_cpu:.3f} s")
    finally:
        for e in engines:
            e.shutdown()
    out["ratio_4_over_1"] = out["engines_4"]["best_s"] / out["engines_1"]["best_s"]
    return out


def _workload(num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 32000, (prompt_len,), generator=g).tolist()
            for _ in range(num_prompts)]


async def _run_groups(engine: Any, prompts: list[list[int]], n: int, new: int) -> int:
    """Every group in flight at once; returns generated tokens."""
    calls = [engine.async_generate(input_ids=p, return_logprob=True, sampling_params={
        "n": n, "temperature": 1.0, "max_new_tokens": new, "ignore_eos": True,
        "sampling_seed": i}) for i, p in enumerate(prompts)]
    outs = await asyncio.gather(*calls)
    return sum(len(o["output_ids"]) for group in outs for o in group)


def bench_dp(model_dir: str, num_prompts: int, n: int, prompt_len: int, new: int
             ) -> dict[str, Any]:
    from rollout_engine import Engine

    prompts = _workload(num_prompts, prompt_len)
    warm = _workload(2, prompt_len, seed=1)
    out: dict[str, Any] = {}
    for name, dp, threads in (("dp_1", 1, 2), ("dp_1_1thread", 1, 1), ("dp_2", 2, 1)):
        engine = Engine(model_path=model_dir, dtype="float32", device="cpu", dp_size=dp,
                        num_threads=threads, load_balance_method="cache_aware",
                        max_total_tokens=num_prompts * n * (prompt_len + new) * 2 // dp + 512)
        try:
            asyncio.run(_run_groups(engine, warm, n, 8))
            engine.flush_cache()
            start = time.perf_counter()
            generated = asyncio.run(_run_groups(engine, prompts, n, new))
            wall = time.perf_counter() - start
        finally:
            engine.shutdown()
        out[name] = {"wall_s": wall, "generated_tokens": generated, "tok_s": generated / wall,
                     "torch_threads_per_replica": threads}
        print(f"{name} ({threads} thread(s) a replica): {generated} tokens in {wall:.2f} s = "
              f"{generated / wall:.0f} tok/s")
    out["ratio_dp2_over_dp1"] = out["dp_2"]["tok_s"] / out["dp_1"]["tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args()
    common.set_threads(1)   # the trainer side; engines set their own threads
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    reps = args.reps or (2 if args.quick else 5)
    load_before = os.getloadavg()[0]
    refit = bench_refit(model_dir, reps)
    shape = (4, 8, 64, 32) if args.quick else (8, 8, 128, 64)
    dp = bench_dp(model_dir, *shape)
    payload = {"machine": common.machine(), "quick": args.quick,
               "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
               "model": "qwen2 55M float32", "refit": refit,
               "dp_workload": dict(zip(("prompts", "n", "prompt_len", "new_tokens"), shape)),
               "dp": dp,
               "caveat": "2 CPU cores: DP=2 splits the same cores between two replicas; "
                         "gloo on loopback copies each engine's bytes through this machine"}
    path = common.save_result("fleet_quick" if args.quick else "fleet", payload)
    print(f"saved {path} (load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})")
    print(f"refit 4 engines / 1 engine: x{refit['ratio_4_over_1']:.2f}; "
          f"DP=2 / DP=1 throughput: x{dp['ratio_dp2_over_dp1']:.2f}")


if __name__ == "__main__":
    main()
