"""Offline GRPO-shaped generation: our Engine vs ``transformers.generate``, side by side.

32 prompts x n=8 samples, 128-token prompts (random ids, seeded), 128 new tokens, temperature 1.0,
``ignore_eos`` (equal lengths), on the ~55M tiny qwen2, float32, 2 torch threads on both sides.

    python benchmarks/bench_offline.py --quick     # 8 prompts x n=4, 64 new tokens (< 1 min)
    python benchmarks/bench_offline.py             # full

The last line printed is the ratio engine tok/s / transformers tok/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # skip the special ids (0..4) so no prompt contains EOS / pad
    return torch.randint(5, vocab, (num, length), generator=g).tolist()


def run_engine(model_dir: str, prompts: list[list[int]], n: int, new_tokens: int,
               threads: int, extra: dict[str, Any]) -> dict[str, Any]:
    from rollout_engine import Engine

    total_seqs = len(prompts) * n
    max_tokens = max(65536, total_seqs * (len(prompts[0]) + new_tokens))
    flags = dict(model_path=model_dir, dtype="float32", device="cpu", num_threads=threads,
                 max_running_requests=max(256, total_seqs), max_total_tokens=max_tokens,
                 random_seed=0)
    flags.update(extra)
    t0 = time.perf_counter()
    engine = Engine(**flags)
    startup = time.perf_counter() - t0
    try:
        sp = {"n": n, "max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
              "sampling_seed": 1234}
        # warm-up: a tiny call through the whole path (prefill + a few decode steps)
        engine.generate(input_ids=[p[:16] for p in prompts[:2]],
                        sampling_params={**sp, "n": 2, "max_new_tokens": 4})
        engine.flush_cache()
        before = engine.get_server_info()["stats"]
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        after = engine.get_server_info()["stats"]
    finally:
        engine.shutdown()
    gen = sum(len(o["output_ids"]) for o in outs)
    assert len(outs) == total_seqs, (len(outs), total_seqs)
    assert all(len(o["output_ids"]) == new_tokens for o in outs), "ignore_eos lengths differ"
    stats = {k: after[k] - before.get(k, 0) for k in after}
    return {"wall_s": wall, "generated_tokens": gen, "tok_s": gen / wall,
            "startup_s": startup, "stats_delta": stats, "flags": {k: v for k, v in flags.items()
                                                                 if k != "model_path"}}


def run_hf(model_dir: str, prompts: list[list[int]], n: int, new_tokens: int,
           chunk: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen_kwargs = dict(do_sample=True, num_return_sequences=n, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                      pad_token_id=0)

    def generate(batch: list[list[int]], **kw: Any) -> torch.Tensor:
        ids = torch.tensor(batch, dtype=torch.int64)
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  **{**gen_kwargs, **kw})

    torch.manual_seed(1234)
    generate([p[:16] for p in prompts[:2]], num_return_sequences=2, max_new_tokens=4,
             min_new_tokens=4)
    t0 = time.perf_counter()
    gen = 0
    for i in range(0, len(prompts), chunk):
        batch = prompts[i:i + chunk]
        out = generate(batch)
        new = out.shape[1] - len(batch[0])
        assert new == new_tokens, (new, new_tokens)
        gen += out.shape[0] * new
    wall = time.perf_counter() - t0
    del model
    gc.collect()
    return {"wall_s": wall, "generated_tokens": gen, "tok_s": gen / wall,
            "prompt_chunk": chunk, "chunks": -(-len(prompts) // chunk)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x n=4, 64 new tokens")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--n", type=int)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--hf-chunk", type=int, default=0,
                    help="prompts per transformers.generate call (0 = all at once)")
    ap.add_argument("--scheduler-mode", default="process", choices=["process", "thread"])
    ap.add_argument("--name", default="bench_offline", help="results/<name>.json")
    args = ap.parse_args()
    num = args.prompts or (8 if args.quick else 32)
    n = args.n or (4 if args.quick else 8)
    new_tokens = args.new_tokens or (64 if args.quick else 128)

    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    mach = common.measure_machine()
    params = common.model_params(model_dir)
    roof = common.compute_roofline_tok_s(mach["matmul_fp32_gflops"], params["matmul"])
    roof_total = common.compute_roofline_tok_s(mach["matmul_fp32_gflops"], params["total"])
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']}, torch {mach['torch']}, "
          f"{mach['device']}, {threads} threads; matmul {mach['matmul_fp32_gflops']:.1f} GFLOP/s, "
          f"copy {mach['copy_gbps']:.1f} GB/s", flush=True)
    print(f"workload: {num} prompts x n={n}, {args.prompt_len}-token prompts, {new_tokens} new "
          f"tokens, T=1.0, ignore_eos; params matmul {params['matmul'] / 1e6:.1f}M "
          f"(total incl. tied head {params['total'] / 1e6:.1f}M)", flush=True)

    prompts = make_prompts(num, args.prompt_len, 32000, seed=0)
    eng = run_engine(model_dir, prompts, n, new_tokens, threads,
                     {"scheduler_mode": args.scheduler_mode})
    print(f"engine:       {eng['tok_s']:8.1f} tok/s  ({eng['generated_tokens']} tokens in "
          f"{eng['wall_s']:.2f} s; stats {eng['stats_delta']})", flush=True)
    chunk = args.hf_chunk or num
    hf = run_hf(model_dir, prompts, n, new_tokens, chunk)
    print(f"transformers: {hf['tok_s']:8.1f} tok/s  ({hf['generated_tokens']} tokens in "
          f"{hf['wall_s']:.2f} s; {hf['chunks']} generate call(s) of {chunk} prompts x {n})",
          flush=True)
    ratio = eng["tok_s"] / hf["tok_s"]
    rows = [["engine", eng["tok_s"], eng["wall_s"], eng["tok_s"] / roof],
            ["transformers", hf["tok_s"], hf["wall_s"], hf["tok_s"] / roof],
            ["compute roofline (2P, P=matmul params)", roof, "", 1.0]]
    print(common.table(rows, ["", "tok/s", "wall s", "fraction of roofline"]))
    print(f"(roofline with P = total incl. tied head, the '55M' convention: {roof_total:.0f} tok/s)")
    path = common.save_result(args.name, {
        "mode": "quick" if args.quick else "full",
        "machine": mach,
        "workload": {"prompts": num, "n": n, "prompt_len": args.prompt_len,
                     "new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
                     "model": "tiny qwen2 PRESET_55M", "dtype": "float32", "threads": threads},
        "params": params,
        "roofline_tok_s": roof,
        "roofline_tok_s_total_params": roof_total,
        "engine": eng,
        "transformers": hf,
        "engine_fraction_of_roofline": eng["tok_s"] / roof,
        "transformers_fraction_of_roofline": hf["tok_s"] / roof,
        "ratio_engine_over_transformers": ratio,
    })
    print(f"saved {path}")
    print(f"engine / transformers throughput ratio: {ratio:.2f}x "
          f"({eng['tok_s']:.0f} vs {hf['tok_s']:.0f} tok/s)")


if __name__ == "__main__":
    main()
