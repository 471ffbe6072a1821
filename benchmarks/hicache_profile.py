"""`bench_hicache.py --profile`: the scheduler driven in this process, each configuration's
wall time split into decode forwards, prefill forwards and HiCache work, and the TTFT "floor"
(each request's TTFT minus the HiCache work done in its turn before its first token); see
`bench_hicache.py`'s docstring.
"""

from __future__ import annotations

import os
import time
from typing import Any

import common
from hicache_workload import Workload, tier_flags


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
