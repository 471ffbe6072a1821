"""Quantized rollouts: rollout tok/s of ``--quantization w8a8_int8`` against float32 and
bfloat16 (ours) and against vLLM's CPU build on the same model as a compressed-tensors int8 W8A8
checkpoint and in float32, and the time of a full refit from a trainer's float32 tensors with
and without the quantization, in one run.

Workload per shape: P prompts x n=8 samples at the given batches, 128-token prompts (random
ids, seeded, the same for every side), 128 new tokens (``--quick``: batch 16, 32-token prompts,
32 new tokens, one round), temperature 1.0, ``ignore_eos``, the sampled token's logprob
returned, 2 threads, on the ~55M tiny qwen2 directory and Qwen2.5-0.5B's shape with random
weights (``testing/real_shapes.py``). The sides (``--sides``, ``quant_sides.py``): ours
float32, bfloat16, w8a8_int8 (and fp8), vLLM on the W8A8 directory that
``testing/quantized_checkpoint.write_quantized`` writes (what vLLM made of it, its config's
quantization and the first layer's linear method and kernel, is printed and kept), vLLM float32
(and bfloat16). Refit (ours only): ``Engine.update_weights_from_tensor`` of every weight of the
checkpoint (float32, shared memory, the same tensors each time as a trainer resends its
buffers), the best of ``--refits``. Each side runs in its own process, one after the other,
sides in turn over ``--rounds`` rounds; the best per shape is kept. The int8 product ours uses
(the compiled kernel or oneDNN's) is recorded with each result.

    python benchmarks/bench_quant.py --quick
    python benchmarks/bench_quant.py --shapes 55m,qwen2.5-0.5b --batches 16,64

vLLM's venv: ``vllm_peer.py`` (``$ROLLOUT_VLLM_VENV``); without one its sides are skipped with
a message. The last line printed is ours int8 / float32 tok/s at the largest batch of the last
shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's engine, even if another checkout is the installed (editable) one
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import quant_sides  # noqa: E402
import vllm_peer  # noqa: E402

N_SAMPLES = 8


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (num, length), generator=g).tolist()


def run_side(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine of ours (``spec["dtype"]``, ``spec["quantization"]``): tok/s per batch, then
    refit seconds."""
    from rollout_engine import Engine
    from rollout_engine.quantization import int8
    from rollout_engine.weights.loader import iter_safetensors

    quant = spec["quantization"]
    n, new, plen = N_SAMPLES, spec["new_tokens"], spec["prompt_len"]
    biggest = max(spec["batches"])
    engine = Engine(model_path=spec["model_dir"], dtype=spec["dtype"], device="cpu",
                    num_threads=spec["threads"], max_running_requests=max(64, biggest),
                    max_total_tokens=max(8192, biggest * (plen + new)), random_seed=0,
                    quantization=quant)
    sp = {"n": n, "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True,
          "sampling_seed": 1234}
    out: dict[str, Any] = {"tok_s": {}, "refit_s": None,
                           "int8_product": "kernel" if int8.cpu_kernel() is not None
                           else "onednn" if int8.int8_product_ok() else "reference"}
    try:
        for i, batch in enumerate(spec["batches"]):
            prompts = make_prompts(batch // n, plen, spec["vocab"], seed=i)
            warm = make_prompts(batch // n, plen, spec["vocab"], seed=1000 + i)
            engine.generate(input_ids=warm, sampling_params={**sp, "max_new_tokens": 4},
                            return_logprob=True)
            engine.flush_cache()
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
            wall = time.perf_counter() - t0
            assert len(outs) == batch and all(len(o["output_ids"]) == new for o in outs)
            out["tok_s"][str(batch)] = batch * new / wall
        tensors = [(name, t.contiguous()) for name, t in iter_safetensors(spec["model_dir"])]
        times = []
        for _ in range(spec["refits"]):
            t0 = time.perf_counter()
            ok, message = engine.update_weights_from_tensor(tensors)
            times.append(time.perf_counter() - t0)
            assert ok, message
        out["refit_s"] = min(times)
        out["refit_mb"] = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    finally:
        engine.shutdown()
    return out


def _run_side(spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    proc = subprocess.run([sys.executable, __file__, "--side", json.dumps(spec)],
                          capture_output=True, text=True, timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"{spec['quantization']}: failed (rc {proc.returncode}):\n"
          f"{(proc.stdout + proc.stderr)[-3000:]}")
    return None


def _model_dir(shape: str) -> tuple[str, int]:
    from rollout_engine.testing.real_shapes import REAL_SHAPES, real_shape_path
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    if shape == "55m":
        return str(tiny_model_path("qwen2", **PRESET_55M)), 32000
    return str(real_shape_path(shape)), REAL_SHAPES[shape]["vocab_size"]


def _side_result(side: quant_sides.Side, spec: dict[str, Any], vllm_py: Optional[str],
                 w8a8_dir: Optional[str]) -> Optional[dict[str, Any]]:
    """One side's result on one shape, in its own process (None: it failed or was skipped)."""
    if side.engine == "ours":
        return _run_side({**spec, "dtype": side.dtype, "quantization": side.quantization})
    if vllm_py is None:
        return None
    model_dir = w8a8_dir if side.quantization else spec["model_dir"]
    got = vllm_peer.run_vllm_script(
        vllm_py, quant_sides.VLLM_SCRIPT,
        {**spec, "model_dir": model_dir, "dtype": side.dtype, "n": N_SAMPLES},
        timeout=3600, threads=spec["threads"])
    if got is not None:
        loaded = got["loaded"]
        quantized = loaded["quant_method"] != "UnquantizedLinearMethod"
        print(f"  {side.name} loaded: {loaded} -> "
              f"{'quantized' if quantized else 'NOT quantized'}", flush=True)
        if bool(side.quantization) != quantized:
            print(f"  {side.name}: vLLM's load does not match the side; result dropped")
            return None
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="batch 16, 32 + 32 tokens, one round")
    ap.add_argument("--shapes", default="55m,qwen2.5-0.5b")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--sides", default=quant_sides.DEFAULT_SIDES,
                    help="comma-separated, from: float32, bfloat16, w8a8_int8, fp8, vllm:w8a8, "
                         "vllm:float32, vllm:bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--name", default=None, help="results/<name>.json")
    args = ap.parse_args()
    if args.side is not None:
        print("RESULT " + json.dumps(run_side(json.loads(args.side))), flush=True)
        return
    sides = quant_sides.parse_sides(args.sides)
    if args.quick:
        args.batches, args.prompt_len, args.new_tokens, args.rounds = "16", 32, 32, 1
    common.set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    mach = common.machine()
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']} ({', '.join(mach['cpu_flags'])}),"
          f" torch {mach['torch']}, {args.threads} threads; load {os.getloadavg()[0]:.1f}")
    print(f"workload: batch {batches} (P x n={N_SAMPLES}), {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, T=1, logprobs; sides {[s.name for s in sides]}; "
          "refit: every weight, float32 tensors", flush=True)
    vllm_py = (vllm_peer.vllm_python(setup=False) if any(s.engine == "vllm" for s in sides)
               else None)
    if vllm_py is None and any(s.engine == "vllm" for s in sides):
        print("vLLM: no venv with vLLM (vllm_peer.py); its sides are skipped")
    results: dict[str, Any] = {}
    ratio = None
    for shape in args.shapes.split(","):
        model_dir, vocab = _model_dir(shape)
        spec = {"model_dir": model_dir, "vocab": vocab, "batches": batches,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "threads": args.threads, "refits": args.refits}
        best: dict[str, Optional[dict[str, Any]]] = dict.fromkeys(s.name for s in sides)
        with tempfile.TemporaryDirectory(prefix="bench_quant_w8a8_") as tmp:
            w8a8_dir = None
            if vllm_py and any(s.engine == "vllm" and s.quantization for s in sides):
                from rollout_engine.testing.quantized_checkpoint import write_quantized

                w8a8_dir = str(write_quantized(model_dir, tmp, "w8a8_int8"))
            for rnd in range(args.rounds):
                for side in sides:
                    t0 = time.perf_counter()
                    got = _side_result(side, spec, vllm_py, w8a8_dir)
                    print(f"{shape} round {rnd + 1}, {side.name}: "
                          f"{ {k: v for k, v in (got or {}).items() if k != 'loaded'} or None} "
                          f"({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
                    best[side.name] = quant_sides.best_of(best[side.name], got)
        results[shape] = best
        print(f"{shape}:")
        print(common.table(*reversed(quant_sides.tok_s_rows(best, sides, batches))))
        print(common.table(*reversed(quant_sides.ratio_rows(best, batches))))
        for s in sides:
            got = best[s.name]
            if s.engine == "ours" and got:
                print(f"{shape} refit, {s.name} ({got['refit_mb']:.0f} MB float32): "
                      f"{got['refit_s']:.3f} s; int8 product: {got['int8_product']}")
        f32, q = best.get("float32"), best.get("w8a8_int8")
        ratio = (q["tok_s"][str(batches[-1])] / f32["tok_s"][str(batches[-1])]
                 if f32 and q else None)
    name = args.name or ("bench_quant_quick" if args.quick else "bench_quant")
    path = common.save_result(name, {"machine": mach, "args": vars(args), "results": results})
    print(f"saved {path}")
    print(f"ours int8 / float32 tok/s at batch {batches[-1]}: "
          f"{ratio:.2f}x" if ratio else "ours int8 / float32: no result")


if __name__ == "__main__":
    main()
