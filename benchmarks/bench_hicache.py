"""Hierarchical KV cache: multi-turn conversations whose KV is ~4x the device pool.

32 conversations x 6 turns on the ~55M tiny qwen2 (float32, 2 torch threads), each turn resending
its whole history: a 256-token opening, then per turn the previous reply and a 32-token user
message; 16 new tokens per turn (``ignore_eos``, greedy). The device pool holds ~1/4 of the last
turn's KV, so without a lower tier most of every history is recomputed. Two ways to send it,
both measured in every run:

  burst        each turn of every conversation is submitted at once (streamed through
               ``async_generate``); the next turn starts when the whole burst is answered.
  closed loop  as SGLang's HiCache benchmark (benchmark/hicache/bench_multiturn.py) drives a
               server: each conversation is a client that queues its next round when its
               previous answer arrives; a sender takes a random ready round (SGLang's default
               ready-queue policy) at Poisson arrivals of ``--request-rates`` requests/s, at
               most ``--max-parallel`` in flight (it waits for a round to be ready or a slot to
               free; SGLang skips an arrival that finds nothing ready). SGLang's defaults:
               --request-rate 1.0 (its single-rate setting), an auto-run sweep of 16 .. 1
               req/s, --max-parallel 128 for --num-clients 256. Here: the sweep's two ends,
               16 req/s (above what either configuration serves: in flight stays at the cap)
               and 1 req/s (below it: TTFT is a round's own admission and prefill), and a cap
               of half the conversations (16 of 32, SGLang's 128 of 256). Nothing is tuned to
               this engine's speed; the seeds are fixed.

Configurations, one engine each, per mode:
  (1) HiCache off (the radix cache alone), L2 only (host tier 8x the pool, write_through),
      L2 + L3 (file storage in a temporary directory); in burst mode also the same two with a
      host tier of 2x the pool (half the working set: L3 serves the rest);
  (2) two engines, one after the other (a conversation moving to another replica): engine A
      serves turns 1-3, engine B turns 4-6, B sharing A's L3 directory vs B on its own.

Reported per configuration: wall seconds, requests/s, prompt + generated tokens/s, TTFT p50 /
p99 (first streamed chunk after submission), prefill tokens computed, hit tokens per tier.
Outputs are checked identical across configurations (greedy) and modes. In closed loop at
1 req/s the throughput is the arrival rate's, not the engine's: compare TTFT there.

    python benchmarks/bench_hicache.py --quick   # 8 conversations x 3 turns
    python benchmarks/bench_hicache.py           # full (~25 min: 1 req/s paces 192 rounds)
    python benchmarks/bench_hicache.py --request-rates 16,8,4,2,1   # a longer sweep
    python benchmarks/bench_hicache.py --profile [--repeats 3]   # where TTFT goes (off vs L2)

The last line printed is the L2-vs-off throughput and TTFT p50 ratios, burst and closed loop.

``--profile`` drives the scheduler in this process (the same workload, each turn's burst queued
before the first step) and splits every configuration's wall time into decode forwards,
prefill forwards and HiCache work (admission: matching, L3 fetch, device slots; the bulk
host -> device copies; the device -> host backups done while a batch is processed). Its "floor"
is each request's TTFT minus the HiCache work done in its turn before its first token: the TTFT
L2 would have if every hit cost nothing but its forward.

What bounds L2's TTFT in burst mode: the pool holds only ~7-13 requests' histories at once,
so each turn's burst drains in waves, and a request waits for every wave ahead of it to prefill
and then decode its 16 tokens. The decode steps are the same work with HiCache off and on;
HiCache removes only the recompute of each wave's history (and the first turn, 1/6 of the
samples, is computed from scratch in both). Where decode forwards are a large share of L2's
wall (about half on a quiet 2-core CPU), the TTFT ratio stays close to the throughput ratio.
In closed loop at a rate below capacity a round rarely waits behind another's decode, so its
TTFT is mostly its own prefill: the recompute HiCache removes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

# in-process runs (--profile) need what the engine's child process gets (runtime/spawn.py)
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


@dataclass(frozen=True)
class ClosedLoop:
    """SGLang-style closed-loop clients: Poisson sends at ``rate`` req/s, at most
    ``max_parallel`` in flight, a random ready round each time (``seed``)."""

    rate: float
    max_parallel: int
    seed: int = 1

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.rate}")
        if self.max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {self.max_parallel}")


Replies = dict[tuple[int, int], list[int]]     # (conversation, turn) -> output ids


async def _stream(engine: Any, ids: list[int], new: int) -> tuple[float, list[int]]:
    """One streamed request: (seconds from submission to the first chunk with tokens, ids)."""
    sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    submitted = time.perf_counter()
    it = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True)
    first: Optional[float] = None
    out: list[int] = []
    async for chunk in it:
        if first is None and chunk["output_ids"]:
            first = time.perf_counter() - submitted
        out = chunk["output_ids"]
    return (first if first is not None else float("nan")), out


async def _burst_turns(engine: Any, wl: Workload, histories: list[list[int]], turns: range
                       ) -> tuple[list[float], Replies, int]:
    """Every conversation's turn at once, turn after turn; (TTFTs, replies, prompt tokens)."""
    ttft: list[float] = []
    replies: Replies = {}
    prompt_tokens = 0
    for turn in turns:
        prompts = [h + wl.user_msgs[c][turn] for c, h in enumerate(histories)]
        prompt_tokens += sum(len(p) for p in prompts)
        res = await asyncio.gather(*(_stream(engine, p, wl.new) for p in prompts))
        for c, (t, out) in enumerate(res):
            ttft.append(t)
            replies[(c, turn)] = out
            histories[c] = prompts[c] + out
    return ttft, replies, prompt_tokens


async def _closed_loop_turns(engine: Any, wl: Workload, histories: list[list[int]],
                             turns: range, load: ClosedLoop
                             ) -> tuple[list[float], Replies, int]:
    """Each conversation a client: its next round is ready when its answer arrives; the
    sender takes a random ready round at Poisson times, at most ``max_parallel`` in flight.
    Returns (TTFTs, replies, prompt tokens)."""
    rng = random.Random(load.seed)
    ready = list(range(len(histories)))
    next_turn = [turns.start] * len(histories)
    slots = asyncio.Semaphore(load.max_parallel)   # rounds in flight
    became_ready = asyncio.Condition()
    ttft: list[float] = []
    replies: Replies = {}
    prompt_lens: list[int] = []

    async def client_round(c: int) -> None:
        turn = next_turn[c]
        prompt = histories[c] + wl.user_msgs[c][turn]
        prompt_lens.append(len(prompt))
        t, out = await _stream(engine, prompt, wl.new)
        ttft.append(t)
        replies[(c, turn)] = out
        histories[c] = prompt + out
        next_turn[c] = turn + 1
        slots.release()
        if turn + 1 < turns.stop:
            async with became_ready:
                ready.append(c)
                became_ready.notify_all()

    sent = []
    for _ in range(len(histories) * len(turns)):
        await slots.acquire()
        async with became_ready:
            await became_ready.wait_for(lambda: bool(ready))
            c = ready.pop(rng.randrange(len(ready)))
        sent.append(asyncio.create_task(client_round(c)))
        await asyncio.sleep(rng.expovariate(load.rate))     # the next Poisson arrival
    await asyncio.gather(*sent)
    return ttft, replies, sum(prompt_lens)


def run_turns(engine: Any, wl: Workload, histories: list[list[int]], turns: range,
              load: Optional[ClosedLoop] = None) -> dict[str, Any]:
    """Run ``turns`` of every conversation on ``engine`` (burst, or closed loop under
    ``load``), extending ``histories`` in place."""
    before = engine.get_server_info()
    t0 = time.perf_counter()
    if load is None:
        run = _burst_turns(engine, wl, histories, turns)
    else:
        run = _closed_loop_turns(engine, wl, histories, turns, load)
    ttft, replies, prompt_tokens = asyncio.run(run)
    wall = time.perf_counter() - t0
    gen_tokens = sum(len(o) for o in replies.values())
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


def single_engines(model_dir: str, threads: int, pool: int, wl: Workload, tmp: str,
                   tiers: tuple[str, ...], load: Optional[ClosedLoop]) -> dict[str, Any]:
    """One fresh engine (and storage directory) per configuration, every turn."""
    results: dict[str, Any] = {}
    mode = "burst" if load is None else f"closed{load.rate:g}"
    for tier in tiers:
        eng = make_engine(model_dir, threads, pool, tier, os.path.join(tmp, mode, tier))
        try:
            results[tier] = run_turns(eng, wl, [list(o) for o in wl.openings], range(wl.turns),
                                      load)
        finally:
            eng.shutdown()
        r = results[tier]
        print(f"  {tier:12s} wall {r['wall_s']:.1f} s, {r['tok_s']:.0f} tok/s, ttft p50 "
              f"{r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, prefill "
              f"{r['prefill_tokens']}, tiers {r['tiers']}")
    return results


def two_engines(model_dir: str, threads: int, pool: int, wl: Workload, tmp: str,
                load: Optional[ClosedLoop]) -> dict[str, Any]:
    """Engine A serves the first half of the turns, then engine B the rest, B on A's L3
    directory or on its own; B's figures."""
    results: dict[str, Any] = {}
    half = wl.turns // 2
    mode = "burst" if load is None else f"closed{load.rate:g}"
    for shared in (False, True):
        name = "two_engines_shared_l3" if shared else "two_engines_own_l3"
        dirs = (os.path.join(tmp, mode, name, "a"),
                os.path.join(tmp, mode, name, "a" if shared else "b"))
        histories = [list(o) for o in wl.openings]
        eng_a = make_engine(model_dir, threads, pool, "l2+l3", dirs[0])
        try:
            run_turns(eng_a, wl, histories, range(half), load)
        finally:
            eng_a.shutdown()      # its queued block writes land before B starts
        eng_b = make_engine(model_dir, threads, pool, "l2+l3", dirs[1])
        try:
            results[name] = run_turns(eng_b, wl, histories, range(half, wl.turns), load)
        finally:
            eng_b.shutdown()
        r = results[name]
        print(f"  {name}: engine B wall {r['wall_s']:.1f} s, {r['tok_s']:.0f} tok/s, ttft "
              f"p50 {r['ttft_p50_s']:.3f} s, storage hits {r['tiers'].get('storage_hit_tokens')}")
    return results


def ratios(results: dict[str, Any]) -> dict[str, float]:
    res = results
    out = {
        "l2_tok_s_over_off": res["l2"]["tok_s"] / res["off"]["tok_s"],
        "l2_ttft_p50_off_over_l2": res["off"]["ttft_p50_s"] / res["l2"]["ttft_p50_s"],
        "l2_ttft_p99_off_over_l2": res["off"]["ttft_p99_s"] / res["l2"]["ttft_p99_s"],
        "l2l3_tok_s_over_off": res["l2+l3"]["tok_s"] / res["off"]["tok_s"],
        "l2l3_ttft_p50_off_over_l2l3": res["off"]["ttft_p50_s"] / res["l2+l3"]["ttft_p50_s"],
        "shared_l3_tok_s_over_own": (res["two_engines_shared_l3"]["tok_s"]
                                     / res["two_engines_own_l3"]["tok_s"]),
        "shared_l3_ttft_p50_own_over_shared": (res["two_engines_own_l3"]["ttft_p50_s"]
                                               / res["two_engines_shared_l3"]["ttft_p50_s"]),
    }
    if "l2_small+l3" in res:
        out["l2_small_l3_tok_s_over_l2_small"] = (res["l2_small+l3"]["tok_s"]
                                                  / res["l2_small"]["tok_s"])
    return out


def run_mode(model_dir: str, threads: int, pool: int, wl: Workload, tmp: str,
             load: Optional[ClosedLoop]) -> dict[str, Any]:
    """Every configuration under one way of sending; results, ratios, replies identical."""
    tiers = ("off", "l2", "l2+l3") + (("l2_small", "l2_small+l3") if load is None else ())
    print("burst:" if load is None else
          f"closed loop: {load.rate:g} req/s (Poisson), at most {load.max_parallel} in flight")
    results = single_engines(model_dir, threads, pool, wl, tmp, tiers, load)
    results.update(two_engines(model_dir, threads, pool, wl, tmp, load))
    rows = [[k, r["wall_s"], r["req_s"], r["tok_s"], r["ttft_p50_s"], r["ttft_p99_s"],
             r["prefill_tokens"]] for k, r in results.items()]
    print(common.table(rows, ["config", "wall s", "req/s", "tok/s", "ttft p50 s", "ttft p99 s",
                              "prefill tok"]))
    replies = {k: results[k].pop("_replies") for k in list(results)}
    return {"rate_req_s": None if load is None else load.rate,
            "max_parallel": None if load is None else load.max_parallel,
            "outputs_identical": all(replies[k] == replies["off"] for k in tiers),
            "results": results, "ratios": ratios(results), "_replies": replies["off"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="split off's and L2's time into decode / prefill / HiCache work")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--profile: runs of each configuration (the best one is reported)")
    ap.add_argument("--request-rates", default="16,1",
                    help="closed loop: Poisson send rates, req/s, comma-separated (the ends "
                         "of SGLang's auto-run sweep 16 .. 1; 1.0 is its --request-rate)")
    ap.add_argument("--max-parallel", type=int, default=None,
                    help="closed loop: most rounds in flight (default: half the "
                         "conversations, as SGLang's 128 for 256 clients)")
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    try:
        rates = [float(r) for r in args.request_rates.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--request-rates must be numbers separated by commas, got "
                 f"{args.request_rates!r}")
    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    if args.quick:
        wl = Workload(num_convs=8, turns=3, opening=128, user=32, new=8)
    else:
        wl = Workload(num_convs=32, turns=6, opening=256, user=32, new=16)
    pool = wl.kv_tokens_last_turn() // 4
    max_parallel = args.max_parallel or max(1, len(wl.openings) // 2)
    try:
        loads = [ClosedLoop(rate, max_parallel) for rate in rates]
    except ValueError as e:
        ap.error(str(e))
    print(f"workload: {len(wl.openings)} conversations x {wl.turns} turns, last-turn KV "
          f"{wl.kv_tokens_last_turn()} tokens, device pool {pool} tokens; closed loop at "
          f"{', '.join(f'{r:g}' for r in rates)} req/s, at most {max_parallel} in flight")
    if args.profile:
        profile(model_dir, threads, pool, wl, args.quick, args.repeats)
        return
    load_start = os.getloadavg()[0]
    modes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_hicache_") as tmp:
        modes["burst"] = run_mode(model_dir, threads, pool, wl, tmp, None)
        for load in loads:
            modes[f"closed_loop_{load.rate:g}"] = run_mode(model_dir, threads, pool, wl, tmp,
                                                           load)
    burst_replies = modes["burst"]["_replies"]
    same_modes = True
    for mode in modes.values():
        same_modes &= mode.pop("_replies") == burst_replies
    same = same_modes and all(m["outputs_identical"] for m in modes.values())
    burst = modes["burst"]
    payload = {"machine": common.machine(), "threads": threads, "quick": args.quick,
               "loadavg_1m_start": load_start, "loadavg_1m": os.getloadavg()[0],
               "device_pool_tokens": pool,
               "last_turn_kv_tokens": wl.kv_tokens_last_turn(),
               "closed_loop": {"request_rates": rates, "max_parallel": max_parallel,
                               "arrivals": "poisson", "ready_policy": "random", "seed": 1},
               "outputs_identical": same,
               # the burst mode's figures where earlier runs had them
               "results": burst["results"], "ratios": burst["ratios"],
               "modes": modes}
    path = common.save_result("hicache_quick" if args.quick else "hicache", payload)
    print(f"saved {path}; outputs identical across every single-engine config and mode: "
          f"{same}")
    parts = [f"burst throughput x{burst['ratios']['l2_tok_s_over_off']:.2f}, TTFT p50 "
             f"1/{burst['ratios']['l2_ttft_p50_off_over_l2']:.2f}"]
    for load in loads:
        r = modes[f"closed_loop_{load.rate:g}"]["ratios"]
        parts.append(f"closed loop {load.rate:g} req/s throughput x{r['l2_tok_s_over_off']:.2f}, "
                     f"TTFT p50 1/{r['l2_ttft_p50_off_over_l2']:.2f}")
    print("L2 vs off: " + "; ".join(parts))


if __name__ == "__main__":
    main()
