"""Hierarchical KV cache: multi-turn conversations whose KV is ~4x the device pool.

32 conversations x 6 turns on the ~55M tiny qwen2 (float32, 2 torch threads). Each turn of every
conversation is submitted at once (a burst, streamed through ``async_generate``), each resending
its whole history: a 256-token opening, then per turn the previous reply and a 32-token user
message; 16 new tokens per turn (``ignore_eos``, greedy). The device pool holds ~1/4 of the last
turn's KV, so without a lower tier most of every history is recomputed.

  (1) one engine per configuration, in one run: HiCache off (the radix cache alone), L2 only
      (host tier 8x the pool, write_through), L2 + L3 (file storage in a temporary directory),
      and the same two with a host tier of 2x the pool (half the working set: L3 serves the rest);
  (2) two engines, one after the other (a conversation moving to another replica): engine A
      serves turns 1-3, engine B turns 4-6, B sharing A's L3 directory vs B on its own.

Reported per configuration: wall seconds, requests/s, prompt + generated tokens/s, TTFT p50 /
p99 (first streamed chunk after submission), prefill tokens computed, hit tokens per tier.
Outputs are checked identical across configurations (greedy).

    python benchmarks/bench_hicache.py --quick   # 8 conversations x 3 turns
    python benchmarks/bench_hicache.py           # full
    python benchmarks/bench_hicache.py --profile [--repeats 3]   # where TTFT goes (off vs L2)

The last line printed is the L2-vs-off throughput ratio and TTFT p50 ratio.

``--profile`` drives the scheduler in this process (the same workload, each turn's burst queued
before the first step) and splits every configuration's wall time into decode forwards,
prefill forwards and HiCache work (admission: matching, L3 fetch, device slots; the bulk
host -> device copies; the device -> host backups done while a batch is processed). Its "floor" is each request's TTFT minus the HiCache work done in its
turn before its first token: the TTFT L2 would have if every hit cost nothing but its forward.

What bounds L2's TTFT on this workload: the pool holds only ~7-13 requests' histories at once,
so each turn's burst drains in waves, and a request waits for every wave ahead of it to prefill
and then decode its 16 tokens. The decode steps are the same work with HiCache off and on;
HiCache removes only the recompute of each wave's history (and the first turn, 1/6 of the
samples, is computed from scratch in both). Where decode forwards are a large share of L2's
wall (about half on a quiet 2-core CPU), the TTFT ratio stays close to the throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

# in-process runs (--profile) need what the engine's child process gets (scheduler/loop.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

import common  # noqa: E402
import torch  # noqa: E402

VOCAB = 32000


def _rand(g: torch.Generator, length: int) -> list[int]:
    return torch.randint(5, VOCAB, (length,), generator=g).tolist()


_GAUGES = {"host_cached_tokens", "host_total_tokens", "host_pool_bytes"}


class Workload:
    """Conversations whose next user messages are fixed up front (so every configuration sees
    the same prompts once the replies agree)."""

    def __init__(self, num_convs: int, turns: int, opening: int, user: int, new: int,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.turns, self.new = turns, new
        self.openings = [_rand(g, opening) for _ in range(num_convs)]
        self.user_msgs = [[_rand(g, user) for _ in range(turns)] for _ in range(num_convs)]

    def kv_tokens_last_turn(self) -> int:
        per = len(self.openings[0]) + (self.turns - 1) * (len(self.user_msgs[0][0]) + self.new)
        return per * len(self.openings)


async def _burst(engine: Any, prompts: list[list[int]], new: int) -> tuple[list, list, float]:
    t0 = time.perf_counter()
    sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    streams = []
    for ids in prompts:
        it = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True)
        streams.append((time.perf_counter(), it))

    async def one(submitted: float, it: Any) -> tuple[float, list[int]]:
        first: Optional[float] = None
        out: list[int] = []
        async for chunk in it:
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - submitted
            out = chunk["output_ids"]
        return (first if first is not None else float("nan")), out

    res = await asyncio.gather(*(one(s, it) for s, it in streams))
    return [r[0] for r in res], [r[1] for r in res], time.perf_counter() - t0


def run_turns(engine: Any, wl: Workload, histories: list[list[int]], turns: range
              ) -> dict[str, Any]:
    """Run ``turns`` of every conversation on ``engine``, extending ``histories`` in place."""
    before = engine.get_server_info()
    ttft: list[float] = []
    wall = prompt_tokens = gen_tokens = 0
    replies: list[list[int]] = []
    for turn in turns:
        prompts = [h + wl.user_msgs[c][turn] for c, h in enumerate(histories)]
        t, outs, w = asyncio.run(_burst(engine, prompts, wl.new))
        ttft += t
        wall += w
        prompt_tokens += sum(len(p) for p in prompts)
        gen_tokens += sum(len(o) for o in outs)
        replies += outs
        for c, out in enumerate(outs):
            histories[c] = prompts[c] + out
    after = engine.get_server_info()
    tiers_a, tiers_b = after.get("hicache") or {}, before.get("hicache") or {}
    return {
        "wall_s": wall, "requests": len(ttft), "req_s": len(ttft) / wall,
        "tok_s": (prompt_tokens + gen_tokens) / wall, "prompt_tokens": prompt_tokens,
        "ttft_p50_s": common.p50(ttft), "ttft_p99_s": common.p99(ttft),
        "prefill_tokens": after["stats"]["prefill_tokens"] - before["stats"]["prefill_tokens"],
        "cached_tokens": after["stats"]["cached_tokens"] - before["stats"]["cached_tokens"],
        "tiers": {k: v if k in _GAUGES else v - tiers_b.get(k, 0) for k, v in tiers_a.items()},
        "_replies": replies,
    }


def tier_flags(tier: str, storage_dir: Optional[str]) -> dict[str, Any]:
    """``tier``: off | l2 | l2+l3 (host tier 8x the pool: the whole working set fits) |
    l2_small | l2_small+l3 (host tier 2x the pool: half of it fits, the rest is in L3)."""
    flags: dict[str, Any] = {}
    if tier != "off":
        flags.update(enable_hierarchical_cache=True,
                     hicache_ratio=2.0 if tier.startswith("l2_small") else 8.0,
                     hicache_write_policy="write_through")
    if tier.endswith("+l3"):
        flags.update(hicache_storage_backend="file", hicache_storage_dir=storage_dir,
                     hicache_storage_prefetch_policy="wait_complete")
    return flags


def make_engine(model_dir: str, threads: int, pool: int, tier: str,
                storage_dir: Optional[str] = None) -> Any:
    from rollout_engine import Engine

    eng = Engine(model_path=model_dir, dtype="float32", device="cpu", num_threads=threads,
                 max_total_tokens=pool, max_running_requests=64, random_seed=0,
                 **tier_flags(tier, storage_dir))
    eng.generate(input_ids=[[5, 6, 7, 8] * 4] * 2,
                 sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    eng.flush_cache()
    return eng


def profile_tier(model_dir: str, threads: int, pool: int, tier: str, wl: Workload
                 ) -> dict[str, Any]:
    """One configuration in this process: TTFT per request (burst queued, then stepped) and
    seconds per kind of work; see the module docstring."""
    from rollout_engine.config import EngineConfig
    from rollout_engine.protocol.messages import GenerateReq
    from rollout_engine.sampling_params import SamplingParams
    from rollout_engine.scheduler.scheduler import Scheduler

    s = Scheduler(EngineConfig(model_path=model_dir, dtype="float32", device="cpu",
                               num_threads=threads, max_total_tokens=pool,
                               max_running_requests=64, random_seed=0, scheduler_mode="thread",
                               **tier_flags(tier, None)))
    secs = {"decode_s": 0.0, "prefill_s": 0.0, "hicache_s": 0.0}
    nested = [0.0]   # HiCache seconds inside the running call (backups inside run_batch)
    tree = s.kv.tree

    def timed(fn: Any, kind: Any) -> Any:
        def call(*a: Any) -> Any:
            t0, inner0 = time.perf_counter(), nested[0]
            out = fn(*a)
            took = time.perf_counter() - t0
            k = kind(a) if callable(kind) else kind
            secs[k] += took - (nested[0] - inner0)    # the nested HiCache part is counted
            if k == "hicache_s":
                nested[0] = inner0 + took             # callers subtract all of it
            return out
        return call

    s.schedule_prefill = timed(s.schedule_prefill, "hicache_s")   # matching, fetch, slots
    s.run_batch = timed(s.run_batch, lambda a: "decode_s" if a[0].mode.name == "DECODE"
                        else "prefill_s")
    if hasattr(tree, "commit_loads") and hasattr(tree, "_backup"):
        tree.commit_loads = timed(tree.commit_loads, "hicache_s")   # bulk host -> device
        tree._backup = timed(tree._backup, "hicache_s")             # device -> host copies
    sp = SamplingParams.from_dict({"max_new_tokens": wl.new, "temperature": 0,
                                   "ignore_eos": True})
    histories = [list(o) for o in wl.openings]
    ttft: list[float] = []
    floor: list[float] = []
    t_all = time.perf_counter()
    for turn in range(wl.turns):
        prompts = [h + wl.user_msgs[c][turn] for c, h in enumerate(histories)]
        t0, hicache0 = time.perf_counter(), secs["hicache_s"]
        for c, ids in enumerate(prompts):
            s.handle(GenerateReq(rid=f"{turn}-{c}", input_ids=ids, seed=0, sampling_params=sp,
                                 stream=True))
        outs: dict[str, list[int]] = {}
        finished: set[str] = set()
        while len(finished) < len(prompts):
            for o in s.step().outputs:
                if o.rid not in outs and o.token_ids:
                    ttft.append(time.perf_counter() - t0)
                    floor.append(ttft[-1] - (secs["hicache_s"] - hicache0))
                outs.setdefault(o.rid, []).extend(o.token_ids)
                if o.finished_reason is not None:
                    finished.add(o.rid)
        for c in range(len(prompts)):
            histories[c] = prompts[c] + outs[f"{turn}-{c}"]
    wall = time.perf_counter() - t_all
    s.shutdown()
    return {"wall_s": wall, "ttft_p50_s": common.p50(ttft), "ttft_floor_p50_s": common.p50(floor),
            **secs, "other_s": wall - sum(secs.values()),
            "forward_passes": s.stats["forward_passes"], "prefill_tokens": s.stats["prefill_tokens"]}


def profile(model_dir: str, threads: int, pool: int, wl: Workload, quick: bool,
            repeats: int) -> None:
    """off and L2 alternately ``repeats`` times; per configuration the run with the lowest
    TTFT p50 is kept (on a shared machine, the least disturbed one)."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "l2": []}
    for _ in range(repeats):
        for tier, out in runs.items():
            out.append(profile_tier(model_dir, threads, pool, tier, wl))
    res = {tier: min(out, key=lambda r: r["ttft_p50_s"]) for tier, out in runs.items()}
    keys = ["wall_s", "ttft_p50_s", "ttft_floor_p50_s", "decode_s", "prefill_s", "hicache_s",
            "other_s"]
    print(common.table([[t] + [r[k] for k in keys] for t, r in res.items()], ["config"] + keys))
    off, l2 = res["off"], res["l2"]
    ratios = {"ttft_p50_off_over_l2": off["ttft_p50_s"] / l2["ttft_p50_s"],
              "ttft_p50_off_over_l2_floor": off["ttft_p50_s"] / l2["ttft_floor_p50_s"],
              "l2_decode_share_of_wall": l2["decode_s"] / l2["wall_s"]}
    path = common.save_result("hicache_profile_quick" if quick else "hicache_profile",
                              {"machine": common.machine(), "threads": threads,
                               "loadavg_1m": os.getloadavg()[0], "repeats": repeats,
                               "results": res, "all_runs": runs, "ratios": ratios})
    print(f"saved {path}; L2 decode forwards: {ratios['l2_decode_share_of_wall']:.0%} of its "
          f"wall (the same decode work as off)")
    print(f"TTFT p50 off / L2: x{ratios['ttft_p50_off_over_l2']:.2f}; with free HiCache work "
          f"(floor) at most x{ratios['ttft_p50_off_over_l2_floor']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="split off's and L2's time into decode / prefill / HiCache work")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--profile: runs of each configuration (the best one is reported)")
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    if args.quick:
        wl = Workload(num_convs=8, turns=3, opening=128, user=32, new=8)
    else:
        wl = Workload(num_convs=32, turns=6, opening=256, user=32, new=16)
    pool = wl.kv_tokens_last_turn() // 4
    print(f"workload: {len(wl.openings)} conversations x {wl.turns} turns, last-turn KV "
          f"{wl.kv_tokens_last_turn()} tokens, device pool {pool} tokens")
    if args.profile:
        profile(model_dir, threads, pool, wl, args.quick, args.repeats)
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_hicache_") as tmp:
        for tier in ("off", "l2", "l2+l3", "l2_small", "l2_small+l3"):
            eng = make_engine(model_dir, threads, pool, tier, os.path.join(tmp, tier))
            try:
                results[tier] = run_turns(eng, wl, [list(o) for o in wl.openings],
                                          range(wl.turns))
            finally:
                eng.shutdown()
            r = results[tier]
            print(f"{tier:6s} wall {r['wall_s']:.1f} s, {r['tok_s']:.0f} tok/s, ttft p50 "
                  f"{r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, prefill "
                  f"{r['prefill_tokens']}, tiers {r['tiers']}")
        half = wl.turns // 2
        for shared in (False, True):
            name = "two_engines_shared_l3" if shared else "two_engines_own_l3"
            dirs = (os.path.join(tmp, name, "a"),
                    os.path.join(tmp, name, "a" if shared else "b"))
            histories = [list(o) for o in wl.openings]
            eng_a = make_engine(model_dir, threads, pool, "l2+l3", dirs[0])
            try:
                run_turns(eng_a, wl, histories, range(half))
            finally:
                eng_a.shutdown()      # its queued block writes land before B starts
            eng_b = make_engine(model_dir, threads, pool, "l2+l3", dirs[1])
            try:
                results[name] = run_turns(eng_b, wl, histories, range(half, wl.turns))
            finally:
                eng_b.shutdown()
            r = results[name]
            print(f"{name}: engine B wall {r['wall_s']:.1f} s, {r['tok_s']:.0f} tok/s, ttft "
                  f"p50 {r['ttft_p50_s']:.3f} s, storage hits {r['tiers'].get('storage_hit_tokens')}")
    same = all(results[k]["_replies"] == results["off"]["_replies"]
               for k in ("l2", "l2+l3", "l2_small", "l2_small+l3"))
    for r in results.values():
        r.pop("_replies")
    ratios = {
        "l2_tok_s_over_off": results["l2"]["tok_s"] / results["off"]["tok_s"],
        "l2_ttft_p50_off_over_l2": results["off"]["ttft_p50_s"] / results["l2"]["ttft_p50_s"],
        "l2l3_tok_s_over_off": results["l2+l3"]["tok_s"] / results["off"]["tok_s"],
        "l2_small_l3_tok_s_over_l2_small": (results["l2_small+l3"]["tok_s"]
                                            / results["l2_small"]["tok_s"]),
        "shared_l3_tok_s_over_own": (results["two_engines_shared_l3"]["tok_s"]
                                     / results["two_engines_own_l3"]["tok_s"]),
        "shared_l3_ttft_p50_own_over_shared": (
            results["two_engines_own_l3"]["ttft_p50_s"]
            / results["two_engines_shared_l3"]["ttft_p50_s"]),
    }
    rows = [[k, r["wall_s"], r["tok_s"], r["ttft_p50_s"], r["ttft_p99_s"], r["prefill_tokens"]]
            for k, r in results.items()]
    print(common.table(rows, ["config", "wall s", "tok/s", "ttft p50 s", "ttft p99 s",
                              "prefill tok"]))
    payload = {"machine": common.machine(), "threads": threads, "quick": args.quick,
               "loadavg_1m": os.getloadavg()[0], "device_pool_tokens": pool,
               "last_turn_kv_tokens": wl.kv_tokens_last_turn(),
               "outputs_identical": same, "results": results, "ratios": ratios}
    path = common.save_result("hicache_quick" if args.quick else "hicache", payload)
    print(f"saved {path}; outputs identical across every single-engine config: {same}")
    print(f"L2 vs off: throughput x{ratios['l2_tok_s_over_off']:.2f}, TTFT p50 "
          f"1/{ratios['l2_ttft_p50_off_over_l2']:.1f}")


if __name__ == "__main__":
    main()
