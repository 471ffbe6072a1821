"""Structured output's cost on the GRPO shape: tok/s with a JSON-schema constraint vs none,
same engine, same run.

Workload: P prompts x n = 8 samples (default P = 8: batch 64), 128-token prompts (random ids,
seeded), 128 new tokens, temperature 1.0, the sampled token's logprob returned, on the ~55M
tiny qwen2 (vocab 32000), float32, 2 threads, the scheduler in its own process. Unconstrained
rows use ``ignore_eos`` (every row 128 tokens). The constrained rows share one schema that
needs far more than 128 tokens (40 strings of >= 10 characters), so a random model runs every
row to ``max_new_tokens`` too; tok/s is reported both per 128 x rows and over the tokens
actually generated, with how many rows ended early. Runs alternate (none, json, none, ...),
best of ``--repeats``; the grammar's compile is timed first (cold) and again (cached), and the
constrained runs start warm (the compile cached, as for every GRPO step after the first).

    python benchmarks/bench_structured.py --quick   # batch 16, 32 new tokens
    python benchmarks/bench_structured.py           # batch 64, 128 new tokens

Goal: the constrained run under 10% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402

N_SAMPLES = 8
SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]},
    "steps": {"type": "array", "items": {"type": "string", "minLength": 10, "maxLength": 16},
              "minItems": 40, "maxItems": 40}},
    "required": ["answer", "steps"]}


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (num, length), generator=g).tolist()


def compile_times(model_dir: str, vocab: int) -> dict[str, float]:
    """Cold and cached compile of SCHEMA with the engine's backend class (in this process)."""
    from transformers import AutoTokenizer

    from rollout_engine.constrained import XGrammarBackend, make_constraint

    t0 = time.perf_counter()
    backend = XGrammarBackend(AutoTokenizer.from_pretrained(model_dir), vocab,
                              any_whitespace=False)
    tokenizer_info_s = time.perf_counter() - t0
    c = make_constraint("json_schema", SCHEMA)
    t0 = time.perf_counter()
    backend.compile(c).result()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.compile(c).result()
    cached = time.perf_counter() - t0
    backend.shutdown()
    return {"tokenizer_info_s": tokenizer_info_s, "first_compile_s": first,
            "cached_compile_s": cached}


def run(engine: Any, prompts: list[list[int]], new_tokens: int, constrained: bool
        ) -> dict[str, Any]:
    params: dict[str, Any] = {"n": N_SAMPLES, "max_new_tokens": new_tokens, "temperature": 1.0,
                              "ignore_eos": True}
    if constrained:
        params["json_schema"] = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    seconds = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    early = sum(o["meta_info"]["finish_reason"]["type"] != "length" for o in outs)
    return {"seconds": seconds, "tokens": tokens, "rows": len(outs), "ended_early": early,
            "tok_s_generated": tokens / seconds,
            "tok_s_nominal": len(outs) * new_tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    args = ap.parse_args()
    common.set_threads(args.threads)
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    num_prompts = 2 if args.quick else args.prompts
    new_tokens = 32 if args.quick else 128
    prompt_len = 128
    compiles = compile_times(model_dir, vocab)
    print(f"compile: first {compiles['first_compile_s'] * 1e3:.1f} ms, cached "
          f"{compiles['cached_compile_s'] * 1e3:.3f} ms (tokenizer info "
          f"{compiles['tokenizer_info_s']:.2f} s)")
    engine = Engine(model_path=model_dir, dtype="float32", device="cpu",
                    num_threads=args.threads, constrained_json_disable_any_whitespace=True)
    try:
        warm = make_prompts(num_prompts, prompt_len, vocab, seed=99)
        run(engine, warm, 4, False)
        run(engine, warm, 4, True)          # the grammar compiled and cached
        rows: dict[str, list[dict[str, Any]]] = {"none": [], "json_schema": []}
        for rep in range(args.repeats):
            prompts = make_prompts(num_prompts, prompt_len, vocab, seed=rep)
            for name in ("none", "json_schema") if rep % 2 == 0 else ("json_schema", "none"):
                engine.flush_cache()      # both runs prefill the same prompts from scratch
                rows[name].append(run(engine, prompts, new_tokens, name == "json_schema"))
                r = rows[name][-1]
                print(f"rep {rep} {name:11s} {r['seconds']:.2f} s  "
                      f"{r['tok_s_generated']:.1f} tok/s generated  ({r['tokens']} tokens, "
                      f"{r['ended_early']} of {r['rows']} rows ended early)")
    finally:
        engine.shutdown()
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in rows.items()}
    slowdown_generated = 1 - best["json_schema"]["tok_s_generated"] / best["none"][
        "tok_s_generated"]
    slowdown_nominal = 1 - best["json_schema"]["tok_s_nominal"] / best["none"]["tok_s_nominal"]
    print(common.table([[k, r["seconds"], r["tok_s_generated"], r["tok_s_nominal"],
                         r["ended_early"]] for k, r in best.items()],
                       ["constraint", "s (best)", "tok/s generated", "tok/s nominal",
                        "rows ended early"]))
    verdict = "met" if slowdown_generated < 0.10 else "missed"
    print(f"json_schema vs none: {slowdown_generated:+.1%} slower over generated tokens, "
          f"{slowdown_nominal:+.1%} nominal; goal < 10%: {verdict}")
    result = {
        "machine": common.machine(), "model_dir": os.path.basename(model_dir), "vocab": vocab,
        "workload": {"prompts": num_prompts, "n": N_SAMPLES, "batch": num_prompts * N_SAMPLES,
                     "prompt_len": prompt_len, "new_tokens": new_tokens, "temperature": 1.0,
                     "threads": args.threads, "repeats": args.repeats, "schema": SCHEMA},
        "compile": compiles, "runs": rows, "best": best,
        "slowdown_generated": slowdown_generated, "slowdown_nominal": slowdown_nominal,
        "goal_under_10pct": verdict,
    }
    path = common.save_result("bench_structured_quick" if args.quick else "bench_structured",
                              result)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
