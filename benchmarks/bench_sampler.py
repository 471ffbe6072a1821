"""Sampler micro-benchmark: the one-pass sampler against the one it replaced, side by side.

At batch 256 and a 32000-token vocabulary (the 55M qwen2's), float32 logits on the CPU, it times
building the sampling batch plus ``sample`` for

    a  default: T = 1, logprobs (always returned)   d  top_k = 50 and top_p = 0.9
    b  top_k = 50                                    e  frequency + presence + repetition
    c  top_p = 0.9                                      penalties (200-token prompts, 300 output)
                                                     f  one row asking for 5 top logprobs

on synthetic logits ``randn * sigma``: sigma 4 is peaked like a language model (the 0.9 nucleus
is ~190 tokens), sigma 1 is flat (the nucleus is ~19,500 tokens: top-p's worst case, where the
new sampler falls back to a sort). The old implementation is not project code: it is loaded at
run time from ``git show <rev>:rollout_engine/sampler.py`` (and that revision's batch builder for
the penalties), ``--old-rev`` (default: the last revision of the previous sampler).

Each figure is set against a decode step of the 55M model at batch 256, measured here with the
scheduler (``Scheduler.step`` of 256 running requests, new sampler included) unless
``--step-seconds`` gives one. Acceptance: top-k and penalties cost at most 10% of that step.

    python benchmarks/bench_sampler.py [--quick] [--old-rev REV] [--step-seconds S] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, save_result, set_threads, table  # noqa: E402
from rollout_engine import sampler as new_sampler  # noqa: E402
from rollout_engine.protocol.messages import GenerateReq  # noqa: E402
from rollout_engine.sampling_params import SamplingParams  # noqa: E402
from rollout_engine.scheduler import batch as new_batch  # noqa: E402
from rollout_engine.scheduler.request import Req  # noqa: E402

OLD_REV = "2527f55ac8ce5ef271eb79d6e15b36afb7e44636"
REPO = Path(__file__).resolve().parent.parent
BATCH, VOCAB = 256, 32000
PROMPT_LEN, OUTPUT_LEN = 200, 300

CASES: dict[str, dict[str, Any]] = {
    "a default (T=1, logprobs)": {},
    "b top_k=50": {"top_k": 50},
    "c top_p=0.9": {"top_p": 0.9},
    "d top_k=50 + top_p=0.9": {"top_k": 50, "top_p": 0.9},
    "e freq+presence+repetition": {"frequency_penalty": 0.5, "presence_penalty": 0.3,
                                   "repetition_penalty": 1.2},
    "f one row: 5 top logprobs": {"top_logprobs_row": 5},
}


def load_old(rev: str) -> tuple[ModuleType, ModuleType]:
    """The sampler and batch builder of ``rev``, as modules of their own (the batch builder
    bound to the old sampler)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout

    tmp = Path(tempfile.mkdtemp(prefix="old_sampler_"))
    (tmp / "old_sampler.py").write_text(show("rollout_engine/sampler.py"))
    (tmp / "old_batch.py").write_text(show("rollout_engine/scheduler/batch.py").replace(
        "from rollout_engine.sampler import", "from old_sampler import"))
    mods = []
    for name in ("old_sampler", "old_batch"):
        spec = importlib.util.spec_from_file_location(name, tmp / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


def make_reqs(case: dict[str, Any], seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    params = {k: v for k, v in case.items() if k != "top_logprobs_row"}
    reqs = []
    for i in range(BATCH):
        msg = GenerateReq(rid=f"r{i}", input_ids=[rng.randrange(VOCAB) for _ in range(PROMPT_LEN)],
                          seed=rng.randrange(1 << 40),
                          sampling_params=SamplingParams.from_dict(
                              {"temperature": 1.0, "max_new_tokens": 1000, **params}),
                          return_logprob=True,
                          top_logprobs_num=case.get("top_logprobs_row", 0) if i == 0 else 0)
        req = Req(msg, i)
        for _ in range(OUTPUT_LEN):
            req.append_output(rng.randrange(VOCAB))
        reqs.append(req)
    return reqs


def timed_pair(old: Callable[[], Any], new: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Best wall time of each, the two interleaved so both see the same machine load (shared
    cores: the minimum is the figure least disturbed by other jobs)."""
    old(), new()   # warm up
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((old, new)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def step_old(old_sampler: ModuleType, old_batch: ModuleType, reqs: list[Req],
             logits: torch.Tensor) -> Callable[[], Any]:
    cpu = torch.device("cpu")

    def run() -> Any:
        sb = old_batch.build_sampling_batch(reqs, VOCAB, frozenset({2}), cpu)
        return old_sampler.sample(logits, sb)
    return run


def step_new(reqs: list[Req], logits: torch.Tensor) -> Callable[[], Any]:
    cpu = torch.device("cpu")
    counts = new_sampler.PenaltyCounts(VOCAB, cpu)

    def run() -> Any:
        sb = new_batch.build_sampling_batch(reqs, VOCAB, frozenset({2}), cpu, counts)
        out = new_sampler.sample(logits, sb)
        rows = [r.penalty_row for r in reqs if r.penalty_row is not None]
        if rows:   # the scheduler's per-step count update (the tokens are not appended here)
            counts.record(rows, out.token_ids[:len(rows)])
        return out
    return run


def measure_decode_step(reps: int) -> float:
    """Best ``Scheduler.step`` of 256 decoding requests on the 55M qwen2 (float32, CPU)."""
    from rollout_engine.config import EngineConfig
    from rollout_engine.scheduler.scheduler import Scheduler
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    path = str(tiny_model_path("qwen2", **PRESET_55M))
    s = Scheduler(EngineConfig(model_path=path, device="cpu", dtype="float32",
                               scheduler_mode="thread", max_running_requests=BATCH))
    rng = random.Random(1)
    for i in range(BATCH):
        s.handle(GenerateReq(
            rid=f"d{i}", input_ids=[rng.randrange(5, VOCAB) for _ in range(32)], seed=i,
            sampling_params=SamplingParams.from_dict(
                {"temperature": 1.0, "max_new_tokens": 4 + reps + 2, "ignore_eos": True}),
            return_logprob=True))
    while len(s.running) < BATCH:
        s.step()
    s.step()   # warm up decode
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        s.step()
        times.append(time.perf_counter() - t0)
    s.shutdown()
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, sigma 4 only")
    ap.add_argument("--old-rev", default=OLD_REV)
    ap.add_argument("--step-seconds", type=float, default=None,
                    help="decode step time to compare against (default: measure it)")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads for both sides and the decode step (1 is steadier on "
                         "busy shared cores)")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    reps = 3 if args.quick else 9
    old_sampler, old_batch = load_old(args.old_rev)
    step = args.step_seconds if args.step_seconds else measure_decode_step(4 if args.quick else 8)
    sigmas = (4.0,) if args.quick else (4.0, 1.0)
    rows, results = [], []
    g = torch.Generator().manual_seed(0)
    for sigma in sigmas:
        logits = torch.randn(BATCH, VOCAB, generator=g) * sigma
        for name, case in CASES.items():
            if sigma != 4.0 and "top_p" not in case:
                continue   # only top-p depends on how flat the distribution is
            old_t, new_t = timed_pair(step_old(old_sampler, old_batch, make_reqs(case), logits),
                                      step_new(make_reqs(case), logits), reps)
            rows.append([name, sigma, old_t * 1e3, new_t * 1e3, old_t / new_t,
                         100 * old_t / step, 100 * new_t / step])
            results.append({"case": name, "sigma": sigma, "old_ms": old_t * 1e3,
                            "new_ms": new_t * 1e3, "speedup": old_t / new_t,
                            "old_pct_of_step": 100 * old_t / step,
                            "new_pct_of_step": 100 * new_t / step})
    print(table(rows, ["case", "sigma", "old ms", "new ms", "old/new", "old % step",
                       "new % step"]))
    worst = max(r["new_pct_of_step"] for r in results
                if r["sigma"] == 4.0 and r["case"][0] in "be")
    name = "bench_sampler_quick" if args.quick else "bench_sampler"
    save_result(name if threads == 2 else f"{name}_{threads}t", {
        "machine": machine(), "batch": BATCH, "vocab": VOCAB, "threads": threads,
        "old_rev": args.old_rev, "decode_step_s": step,
        "decode_step_measured": args.step_seconds is None, "results": results})
    print(f"decode step at batch {BATCH} (55M qwen2): {step * 1e3:.0f} ms; "
          f"top-k / penalties at most {worst:.1f}% of it (acceptance: <= 10%)")
    print(f"default path: {results[0]['speedup']:.2f}x, top_k=50: {results[1]['speedup']:.2f}x, "
          f"penalties: {results[4]['speedup']:.2f}x faster than {args.old_rev[:7]}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
