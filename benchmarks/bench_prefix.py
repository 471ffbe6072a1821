"""Radix (prefix) cache on vs ``disable_radix_cache=True``, side by side in one run.

Three workloads on the ~55M tiny qwen2 (float32, 2 torch threads), every request streamed and
submitted concurrently through ``async_generate(stream=True)``:

  (a) hot prefix: 64 requests sharing a 1,024-token system prompt, distinct 32-token tails
  (b) GRPO:       16 prompts x n=8 samples (128-token prompts)
  (c) diverse:    64 requests of 256 distinct random tokens
  each with 64 new tokens, ``ignore_eos``, seeded sampling at temperature 1.0.

For each: prefill tokens computed (``stats.prefill_tokens`` delta), time to first token p50 / p90
(first streamed chunk after the request's submission), generated tokens / wall second, and
on/off ratios. Both engines live for the whole run; each workload runs on both, each run starting
from an empty cache (``flush_cache``); with ``--repeats`` (default 1 quick, 2 full) the order
alternates and the best run per engine is kept (the machines are shared and noisy).

    python benchmarks/bench_prefix.py --quick   # 16 requests, 512-token prefix, 16 new tokens
    python benchmarks/bench_prefix.py           # full

The last line printed is the throughput ratio cache on / off per workload (a, b, c).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's engine, even if another checkout is the installed (editable) one
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import torch  # noqa: E402

VOCAB = 32000


@dataclass
class Workload:
    name: str
    description: str
    prompts: list[list[int]]        # one per request (GRPO siblings repeat their prompt)
    seeds: list[int]
    new_tokens: int


def _rand(g: torch.Generator, n: int, length: int) -> list[list[int]]:
    return torch.randint(5, VOCAB, (n, length), generator=g).tolist()


def make_workloads(quick: bool, seed: int = 0) -> list[Workload]:
    g = torch.Generator().manual_seed(seed)
    if quick:
        a_n, a_prefix, a_tail, b_prompts, b_n, b_len, c_n, c_len, new = 16, 512, 32, 4, 4, 128, 16, 256, 16
    else:
        a_n, a_prefix, a_tail, b_prompts, b_n, b_len, c_n, c_len, new = 64, 1024, 32, 16, 8, 128, 64, 256, 64
    system = _rand(g, 1, a_prefix)[0]
    hot = [system + tail for tail in _rand(g, a_n, a_tail)]
    grpo_base = _rand(g, b_prompts, b_len)
    grpo = [p for p in grpo_base for _ in range(b_n)]
    diverse = _rand(g, c_n, c_len)
    return [
        Workload("a_hot_prefix", f"{a_n} requests, shared {a_prefix}-token prefix + distinct "
                 f"{a_tail}-token tails", hot, list(range(1000, 1000 + a_n)), new),
        Workload("b_grpo", f"{b_prompts} prompts x n={b_n}, {b_len}-token prompts", grpo,
                 list(range(2000, 2000 + len(grpo))), new),
        Workload("c_diverse", f"{c_n} requests of {c_len} distinct tokens", diverse,
                 list(range(3000, 3000 + c_n)), new),
    ]


async def _run_async(engine: Any, wl: Workload) -> dict[str, Any]:
    t0 = time.perf_counter()
    # submit every request first (a burst), then read all streams concurrently
    streams = []
    for ids, seed in zip(wl.prompts, wl.seeds):
        sp = {"max_new_tokens": wl.new_tokens, "temperature": 1.0, "ignore_eos": True,
              "sampling_seed": seed}
        it = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True)
        streams.append((time.perf_counter(), it))

    async def one(submitted: float, it: Any) -> tuple[float, float, list[int]]:
        first = None
        out: list[int] = []
        async for chunk in it:
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - submitted   # time to first token of this request
            out = chunk["output_ids"]   # cumulative, as SGLang streams
        return (first if first is not None else float("nan")), time.perf_counter() - t0, out

    res = await asyncio.gather(*(one(sub, it) for sub, it in streams))
    wall = time.perf_counter() - t0
    ttft = [r[0] for r in res]
    outs = [r[2] for r in res]
    gen = sum(len(o) for o in outs)
    assert all(len(o) == wl.new_tokens for o in outs), "ignore_eos: lengths differ"
    return {"wall_s": wall, "generated_tokens": gen, "tok_s": gen / wall,
            "ttft_p50_s": common.p50(ttft), "ttft_p90_s": common.p90(ttft),
            "ttft_max_s": max(ttft), "e2e_p50_s": common.p50([r[1] for r in res]),
            "_outputs": outs}


def run_workload(engine: Any, wl: Workload) -> dict[str, Any]:
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused (engine busy?)")
    before = engine.get_server_info()["stats"]
    load0 = os.getloadavg()[0]
    r = asyncio.run(_run_async(engine, wl))
    after = engine.get_server_info()["stats"]
    stats = {k: after[k] - before.get(k, 0) for k in after}
    r.update(prefill_tokens=stats["prefill_tokens"], stats_delta=stats,
             loadavg_1m=[load0, os.getloadavg()[0]])
    return r


def make_engine(model_dir: str, threads: int, cache: bool, max_tokens: int) -> Any:
    from rollout_engine import Engine

    eng = Engine(model_path=model_dir, dtype="float32", device="cpu", num_threads=threads,
                 max_total_tokens=max_tokens, max_running_requests=256,
                 disable_radix_cache=not cache, random_seed=0)
    # warm-up: a tiny call through prefill, decode and streaming
    eng.generate(input_ids=[[5, 6, 7, 8] * 4] * 2,
                 sampling_params={"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 1})
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--max-total-tokens", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=0,
                    help="runs per workload and engine, best kept (default 1 quick, 2 full)")
    ap.add_argument("--only", default="", help="comma list of workload names (prefix match)")
    ap.add_argument("--name", default="bench_prefix", help="results/<name>.json")
    args = ap.parse_args()

    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    mach = common.measure_machine()
    params = common.model_params(model_dir)
    roof = common.compute_roofline_tok_s(mach["matmul_fp32_gflops"], params["matmul"])
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']}, torch {mach['torch']}, "
          f"{mach['device']}, {threads} threads; matmul {mach['matmul_fp32_gflops']:.1f} GFLOP/s, "
          f"copy {mach['copy_gbps']:.1f} GB/s; compute roofline {roof:.0f} tok/s "
          f"(2P, P = {params['matmul'] / 1e6:.1f}M matmul params)", flush=True)

    workloads = make_workloads(args.quick)
    repeats = args.repeats or (1 if args.quick else 2)
    if args.only:
        keep = tuple(args.only.split(","))
        workloads = [w for w in workloads if w.name.startswith(keep)]
    on = make_engine(model_dir, threads, True, args.max_total_tokens)
    off = make_engine(model_dir, threads, False, args.max_total_tokens)
    results: dict[str, Any] = {}
    rows = []
    try:
        for wl in workloads:
            print(f"[{wl.name}] {wl.description}, {wl.new_tokens} new tokens", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            outputs: dict[str, list[list[int]]] = {}
            for r in range(repeats):
                # alternate which engine goes first so load drift does not favour one side
                order = ("on", "off") if r % 2 == 0 else ("off", "on")
                for side in order:
                    res_ = run_workload(on if side == "on" else off, wl)
                    outputs[side] = res_.pop("_outputs")
                    runs[side].append(res_)
                    print(f"  [{r}] cache {side:3s}: {res_['tok_s']:7.1f} tok/s, prefill "
                          f"{res_['prefill_tokens']}, ttft p50 {res_['ttft_p50_s']:.2f} s, wall "
                          f"{res_['wall_s']:.1f} s, load {res_['loadavg_1m'][0]:.1f}", flush=True)
            r_on = max(runs["on"], key=lambda x: x["tok_s"])
            r_off = max(runs["off"], key=lambda x: x["tok_s"])
            same = sum(a == b for a, b in zip(outputs["on"], outputs["off"]))
            res = {
                "description": wl.description, "requests": len(wl.prompts),
                "prompt_tokens": sum(len(p) for p in wl.prompts), "new_tokens": wl.new_tokens,
                "cache_on": r_on, "cache_off": r_off,
                "cache_on_runs": runs["on"], "cache_off_runs": runs["off"],
                "throughput_ratio_on_over_off": r_on["tok_s"] / r_off["tok_s"],
                "ttft_p50_ratio_off_over_on": r_off["ttft_p50_s"] / r_on["ttft_p50_s"],
                "prefill_ratio_off_over_on": r_off["prefill_tokens"] / max(1, r_on["prefill_tokens"]),
                "identical_outputs": f"{same}/{len(wl.prompts)}",
            }
            results[wl.name] = res
            for label, r_ in (("on", r_on), ("off", r_off)):
                rows.append([wl.name, label, r_["prefill_tokens"], r_["ttft_p50_s"],
                             r_["ttft_p90_s"], r_["tok_s"], r_["wall_s"]])
            rows.append([wl.name, "on/off", f"1/{res['prefill_ratio_off_over_on']:.1f}",
                         f"1/{res['ttft_p50_ratio_off_over_on']:.1f}", "",
                         f"{res['throughput_ratio_on_over_off']:.2f}x", ""])
    finally:
        on.shutdown()
        off.shutdown()

    print(common.table(rows, ["workload", "cache", "prefill tok", "TTFT p50 s", "TTFT p90 s",
                              "tok/s", "wall s"]))
    path = common.save_result(args.name, {
        "mode": "quick" if args.quick else "full", "machine": mach, "params": params,
        "roofline_tok_s": roof, "threads": threads, "repeats": repeats,
        "engine_flags": {"dtype": "float32", "max_total_tokens": args.max_total_tokens,
                         "max_running_requests": 256, "sampling": "T=1.0 seeded, ignore_eos",
                         "cache_state_at_start": "flushed (cold)",
                         "arrival": "burst: all requests submitted, then streams read",
                         "best_of": "highest tok/s run per engine"},
        "workloads": results,
    })
    print(f"saved {path}")
    summary = ", ".join(f"{k[:1]}: {v['throughput_ratio_on_over_off']:.2f}x"
                        for k, v in results.items())
    print(f"cache on / off throughput ratio, best of {repeats} ({summary})")


if __name__ == "__main__":
    main()
