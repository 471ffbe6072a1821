"""Where one decode step of the real Engine goes at batch 256 (GRPO: 32 prompts x n=8, 128-token
prompts, 128 new tokens, T=1, logprobs; the sequence is ~192 in the profiled steps), and what
share of the whole rollout the prefill takes.

The Engine runs in-process (``scheduler_mode="thread"``). Inside the scheduler thread, every
``Scheduler.step`` is timed, and the decode steps whose sequence length falls in the window are
run under ``torch.profiler`` (started and stopped on that thread). Labels (``record_function``)
mark the model's pieces; each profiler event's *self* time goes to the nearest label, and the
matmuls to their projection by weight shape:

    step (wall, perf_counter)
      forward   -> matmul qkv / o / gate_up / down, lm_head, attention, norms, rope,
                   activation (silu * up), residual adds, embedding, other ops,
                   python (model forward)
      sample    -> sampler
      the rest  -> scheduler python (schedule, batch building, postprocess)

The machine is shared: each category is reported as its best over the profiled steps of
``--repeats`` rollouts (and the median); the step wall without the profiler is reported too.

    python benchmarks/profile_decode.py                    # results/profile_decode.json
    python benchmarks/profile_decode.py --name profile_decode_before
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
from profile_categories import categorize, projection_of, summarize  # noqa: E402

N_SAMPLES = 8


@contextlib.contextmanager
def patched(owner: Any, attr: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``owner.attr`` replaced by ``wrap(original)`` for the block (this benchmark only)."""
    original = owner.__dict__[attr]
    fn = original.__func__ if isinstance(original, staticmethod) else original
    new = wrap(fn)
    setattr(owner, attr, staticmethod(new) if isinstance(original, staticmethod) else new)
    try:
        yield
    finally:
        setattr(owner, attr, original)


def labelled(label: str) -> Callable[[Callable], Callable]:
    import torch

    def wrap(fn: Callable) -> Callable:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return inner
    return wrap


class StepRecorder:
    """Times every step; profiles the decode steps of batch ``batch`` in the sequence window
    (and, when ``profile_extend``, every prefill step)."""

    def __init__(self, batch: int, window: tuple[int, int], profile_extend: bool) -> None:
        self.batch, self.window, self.profile_extend = batch, window, profile_extend
        self.steps: list[dict[str, Any]] = []       # one per step that ran a batch
        self.profiles: list[dict[str, float]] = []  # decode steps in the window
        self.extend_profiles: list[dict[str, float]] = []
        self.current: Optional[dict[str, Any]] = None
        self.arch: Any = None

    def wrap_step(self, fn: Callable) -> Callable:
        import torch

        rec = self

        def step(sched: Any) -> Any:
            rec.arch = sched.runner.arch
            running = sched.running
            seq = max((r.kv_len for r in running), default=0) + 1
            decoding = not sched.waiting and sched.chunked is None and len(running) == rec.batch
            want = decoding and rec.window[0] <= seq <= rec.window[1]
            want = want or (rec.profile_extend and bool(sched.waiting))
            info: dict[str, Any] = {"forward": 0.0, "sample": 0.0}
            rec.current = info
            # the wall excludes starting and stopping the profiler (tens of ms)
            profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               record_shapes=True)
                        if want else contextlib.nullcontext())
            try:
                with profiler as prof:
                    t0 = time.perf_counter()
                    out = fn(sched)
                    wall = time.perf_counter() - t0
            finally:
                rec.current = None
            if "mode" in info:
                info.update(wall=wall, seq=seq, profiled=want)
                rec.steps.append(info)
                if want:
                    t1 = time.perf_counter()
                    split = categorize(prof.events(), rec.arch)
                    info["profiler_s"] = time.perf_counter() - t1
                    split["scheduler python"] = max(
                        0.0, 1e3 * (wall - info["forward"] - info["sample"]))
                    split["step"] = 1e3 * wall
                    (rec.profiles if info["mode"] == "decode" else rec.extend_profiles).append(
                        split | {"batch": info["batch"], "tokens": info["tokens"]})
            return out
        return step

    def wrap_run_batch(self, fn: Callable) -> Callable:
        rec = self

        def run_batch(sched: Any, batch: Any) -> Any:
            assert rec.current is not None
            rec.current.update(mode=batch.mode.value, batch=len(batch.reqs),
                               tokens=sum(batch.extend_lens))
            return fn(sched, batch)
        return run_batch

    def timed(self, key: str) -> Callable[[Callable], Callable]:
        """Adds the wrapped call's wall to the running step's ``key`` (and labels it)."""
        import torch

        rec = self

        def wrap(fn: Callable) -> Callable:
            def inner(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                with torch.profiler.record_function(key):
                    out = fn(*args, **kwargs)
                if rec.current is not None:
                    rec.current[key] += time.perf_counter() - t0
                return out
            return inner
        return wrap


def instrument(rec: StepRecorder) -> contextlib.ExitStack:
    from rollout_engine_kernels.cpu import paged_decode as cpu_paged
    from rollout_engine_kernels.cpu import small_gemm

    from rollout_engine.memory.kv_pool import KVPool
    from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend
    from rollout_engine.model_runner.model_runner import ModelRunner
    from rollout_engine.models import layers, llama
    from rollout_engine.scheduler import scheduler as sched_mod
    try:
        from rollout_engine.models import cpu_decode
    except ImportError:     # a version of the engine before the flat decode loop
        cpu_decode = None

    stack = contextlib.ExitStack()
    plan = [(sched_mod.Scheduler, "step", rec.wrap_step),
            (sched_mod.Scheduler, "run_batch", rec.wrap_run_batch),
            (ModelRunner, "forward", rec.timed("forward")),
            (sched_mod, "sample", rec.timed("sample")),
            (TorchNativeBackend, "forward", labelled("attention")),
            (llama.LlamaForCausalLM, "compute_logits", labelled("lm_head")),
            (layers.RMSNorm, "forward", labelled("norms")),
            (layers.RotaryEmbedding, "apply", labelled("rope")),
            (layers.RotaryEmbedding, "cos_sin", labelled("rope"))]
    # pieces that exist only in some versions of the model code
    for owner, attr, label in ((layers.RMSNorm, "add_forward", "norms"),
                               (layers.RotaryEmbedding, "apply_qk", "rope"),
                               (llama, "silu_mul", "activation")):
        if attr in owner.__dict__:
            plan.append((owner, attr, labelled(label)))
    # the small-GEMM kernel (a ctypes call, invisible to the profiler): labelled by shape
    plan.append((small_gemm.SmallGemm, "__call__", functools.partial(gemm_labelled, rec)))
    # the flat decode loop (models/cpu_decode.py) calls the C functions itself: its instance's
    # functions are labelled at its first call; the K/V write and the kernel are attention
    plan += [(cpu_paged.PagedDecodeOp, "prepared", prepared_labelled),
             (KVPool, "set_kv", labelled("attention"))]
    if cpu_decode is not None:
        plan.append((cpu_decode.CpuDecodeForward, "__call__",
                     functools.partial(flat_labelled, rec)))
    for owner, attr, wrap in plan:
        stack.enter_context(patched(owner, attr, wrap))
    return stack


def gemm_labelled(rec: StepRecorder, fn: Callable) -> Callable:
    import torch

    def inner(op: Any, x: Any, weight: Any, *args: Any) -> Any:
        out_f, in_f = weight.shape
        label = ("lm_head" if out_f == rec.arch.vocab_size
                 else projection_of(out_f, in_f, rec.arch))
        with torch.profiler.record_function(label):
            return fn(op, x, weight, *args)
    return inner


def prepared_labelled(fn: Callable) -> Callable:
    def prepared(*args: Any, **kwargs: Any) -> Any:
        return labelled("attention")(fn(*args, **kwargs))
    return prepared


def flat_labelled(rec: StepRecorder, fn: Callable) -> Callable:
    """The flat loop's ``__call__``, its instance's C functions labelled first (once)."""
    import torch

    def gemm(raw: Callable) -> Callable:
        def inner(*args: Any) -> Any:   # (x, M, K, ldx, w, N, ...)
            out_f, in_f = args[5], args[2]
            label = ("lm_head" if out_f == rec.arch.vocab_size
                     else projection_of(out_f, in_f, rec.arch))
            with torch.profiler.record_function(label):
                return raw(*args)
        return inner

    def call(flat: Any, *args: Any) -> Any:
        if not getattr(flat, "_profile_labelled", False):
            for attr, label in (("_rmsnorm", "norms"), ("_add_rmsnorm", "norms"),
                                ("_rope_store", "rope"), ("_silu_mul", "activation")):
                setattr(flat, attr, labelled(label)(getattr(flat, attr)))
            if flat._gemm is not None:
                flat._gemm = gemm(flat._gemm)
            flat._profile_labelled = True
        return fn(flat, *args)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--window", default="188,196", help="profiled sequence lengths, lo,hi")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--profile-prefill", action="store_true",
                    help="also profile the prefill steps (each once per repeat)")
    ap.add_argument("--name", default="profile_decode")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)

    from bench_offline import make_prompts

    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    batch = args.prompts * N_SAMPLES
    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    lo, hi = (int(x) for x in args.window.split(","))
    engine = Engine(model_path=model_dir, dtype="float32", device="cpu", num_threads=threads,
                    max_running_requests=max(256, batch), scheduler_mode="thread",
                    max_total_tokens=max(65536, batch * (args.prompt_len + args.new_tokens)),
                    random_seed=0)
    sp = {"n": N_SAMPLES, "max_new_tokens": args.new_tokens, "temperature": 1.0,
          "ignore_eos": True, "sampling_seed": 1234}
    prompts = make_prompts(args.prompts, args.prompt_len, seed=0)
    rollouts: list[dict[str, Any]] = []
    rec = StepRecorder(batch, (lo, hi), profile_extend=args.profile_prefill)
    try:
        engine.generate(input_ids=make_prompts(args.prompts, args.prompt_len, seed=1000),
                        sampling_params={**sp, "max_new_tokens": 8}, return_logprob=True)
        with instrument(rec):
            for _ in range(args.repeats):
                engine.flush_cache()
                first = len(rec.steps)
                t0 = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
                wall = time.perf_counter() - t0
                mine = rec.steps[first:]
                plain = [s for s in mine if not s["profiled"]]
                ext = [s for s in mine if s["mode"] == "extend"]
                dec = [s for s in plain if s["mode"] == "decode"]
                rollouts.append({
                    "wall_s": wall, "tok_s": batch * args.new_tokens / wall,
                    "extend_steps": [{"batch": s["batch"], "tokens": s["tokens"],
                                      "ms": 1e3 * s["wall"]} for s in ext],
                    "extend_share": sum(s["wall"] for s in ext) / wall,
                    # the rest of the wall: the loop between steps, channels, the frontend
                    "in_steps_s": sum(s["wall"] for s in mine),
                    "profiler_processing_s": sum(s.get("profiler_s", 0.0) for s in mine),
                    "decode_steps": len([s for s in mine if s["mode"] == "decode"]),
                    "decode_step_best_ms": 1e3 * min(s["wall"] for s in dec),
                    "decode_step_median_ms": 1e3 * statistics.median(s["wall"] for s in dec),
                    "decode_forward_median_ms": 1e3 * statistics.median(s["forward"] for s in dec),
                    "decode_sample_median_ms": 1e3 * statistics.median(s["sample"] for s in dec),
                })
    finally:
        engine.shutdown()

    decode = summarize(rec.profiles)
    arch = rec.arch
    flops = {"matmul qkv": arch.hidden_size * (arch.num_heads + 2 * arch.num_kv_heads)
             * arch.head_dim, "matmul o": arch.num_heads * arch.head_dim * arch.hidden_size,
             "matmul gate_up": 2 * arch.hidden_size * arch.intermediate_size,
             "matmul down": arch.intermediate_size * arch.hidden_size,
             "lm_head": arch.vocab_size * arch.hidden_size}
    rates = {}
    for c, per_token in flops.items():
        layers_ = 1 if c == "lm_head" else arch.num_layers
        ms = decode["best_ms"].get(c)
        if ms:
            rates[c] = 2.0 * per_token * layers_ * batch / (ms / 1e3) / 1e9
    decode["gflops"] = rates
    mach = common.measure_machine()
    print(f"machine: {mach['cpu_model']}, {threads} threads, matmul "
          f"{mach['matmul_fp32_gflops']:.1f} GFLOP/s; load {os.getloadavg()[0]:.1f}")
    step = decode["step_best_ms"]
    rows = [[c, decode["best_ms"][c], decode["median_ms"][c],
             decode["best_ms"][c] / decode["sum_of_best_ms"], rates.get(c, "")]
            for c in decode["best_ms"]]
    print("(rollout walls include the profiled steps and reading their profiles: not a "
          "throughput figure; see bench_offline.py)")
    print(f"decode step at batch {batch}, seq {lo}-{hi}: best of {decode['num_steps']} "
          f"profiled steps (profiled step best {step:.1f} ms)")
    print(common.table(rows, ["category", "best ms", "median ms", "share", "GFLOP/s"]))
    for r in rollouts:
        ext = ", ".join(f"{s['batch']} reqs / {s['tokens']} tok {s['ms']:.0f} ms"
                        for s in r["extend_steps"])
        print(f"rollout: {r['wall_s']:.2f} s, {r['tok_s']:.0f} tok/s; prefill {ext} = "
              f"{r['extend_share']:.1%}; decode step (unprofiled) best "
              f"{r['decode_step_best_ms']:.1f} ms, median {r['decode_step_median_ms']:.1f} ms; "
              f"{r['in_steps_s']:.1f} s inside Scheduler.step, "
              f"{r['profiler_processing_s']:.1f} s reading profiles")
    extend = summarize(rec.extend_profiles) if rec.extend_profiles else None
    if extend:
        print("prefill steps, best over repeats:")
    by_shape: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    for p in rec.extend_profiles:
        by_shape[(int(p["batch"]), int(p["tokens"]))].append(p)
    extend_by_shape = {f"{b} reqs x {t} tokens": summarize(ps) for (b, t), ps in by_shape.items()}
    for shape, s in extend_by_shape.items():
        print(f"  {shape}: step {s['step_best_ms']:.1f} ms: " + ", ".join(
            f"{c} {v:.1f}" for c, v in s["best_ms"].items() if v >= 0.5))
    path = common.save_result(args.name, {
        "machine": mach, "load_avg": os.getloadavg(),
        "workload": {"prompts": args.prompts, "n": N_SAMPLES, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "window": [lo, hi], "threads": threads},
        "decode": decode, "extend_by_shape": extend_by_shape, "rollouts": rollouts})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
