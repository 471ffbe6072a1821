"""LoRA for RL on CPU, one run, side by side: an adapter-only refit next to a full refit, a
batch mixing adapters next to the base model, and vLLM's CPU build beside.

(a) refit: adapters of rank 8 and rank 64 on every projection (q k v o gate up down) of the
    ~55M qwen2 (``tiny_model_path("qwen2", **PRESET_55M)``), pushed by ``LoraSyncer`` over
    "tensor" (shared-memory handles, ``load_lora_adapter_from_tensors`` with upsert; each
    tensor its own handle, the CPU default, and packed into one flattened bucket) and "disk"
    (PEFT's ``save_pretrained`` + ``load_lora_adapter``), next to a full refit of the 55M
    weights by the same transport (``WeightSyncer``, its CPU defaults). The trainer is a ``transformers`` model
    (float32, its parameters in memory of its own) wrapped by peft. Median and best of
    ``--repeats`` syncs after a warm-up one; before each, the trainer changes the weights it
    sends in place (as an optimizer step does). The engine runs in its own process.
(b) rollout: 8 prompts x n=8 (batch 64), 128-token prompts (random ids, seeded), 128 new
    tokens, temperature 1, ``ignore_eos``, logprobs; the mixed batch gives prompt i adapter
    i % 4 (four rank-8 adapters, 16 rows each), the base batch no adapter; the same engine,
    runs alternating, the prefix cache flushed before each. Goal: mixed >= 80% of base tok/s.
(c) vLLM CPU (``vllm_peer.py``'s venv): the same adapter directories and batch, base vs mixed,
    and ``add_lora`` of the rank 8 / rank 64 directories; or its error, verbatim.

    python benchmarks/bench_lora.py              # the recorded run (results/bench_lora.json)
    python benchmarks/bench_lora.py --quick      # the tiny model, a few tokens (bench_lora_quick)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as bench_weight_sync: a sharing trainer

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.lora_vllm import vllm_lora  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REFIT_RANKS = (8, 64)
NUM_ADAPTERS, ROLLOUT_RANK, NUM_PROMPTS, N = 4, 8, 8, 8
GOAL = 0.8   # mixed-adapter tok/s over base tok/s


def trainer_model(model_dir: str) -> Any:
    """The trainer's model, its parameters copied out of the file's mapped pages."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def with_adapters(model: Any, ranks: dict[str, int]) -> Any:
    """``model`` under peft adapters ``name -> rank`` on every projection, A and B random."""
    from peft import LoraConfig, get_peft_model

    def config(r: int) -> Any:
        return LoraConfig(r=r, lora_alpha=2 * r, target_modules=MODULES, lora_dropout=0.0)

    names = list(ranks)
    peft_model = get_peft_model(model, config(ranks[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config(ranks[name]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return peft_model


def lora_params(peft_model: Any, adapter: str) -> list[torch.Tensor]:
    return [p for n, p in peft_model.named_parameters() if f".{adapter}." in n and "lora_" in n]


def timed_syncs(sync: Callable[[], Any], step: Callable[[], None], repeats: int
                ) -> tuple[list[float], int]:
    """Seconds of ``repeats`` syncs after a warm-up one, ``step()`` before each; and bytes."""
    report = sync()
    seconds = []
    for _ in range(repeats):
        step()
        report = sync()
        seconds.append(report.seconds)
    return seconds, report.bytes


def nudge(tensors: list[torch.Tensor]) -> Callable[[], None]:
    """An in-place change of ``tensors``, as an optimizer step makes."""
    def step() -> None:
        with torch.no_grad():
            for t in tensors:
                t.mul_(1.0 + 1e-6)
    return step


def refit_rows(engine: Any, peft_model: Any, base: list[tuple[str, Any]], repeats: int
               ) -> list[dict[str, Any]]:
    from trainer_bridge import LoraSyncer, WeightSyncer

    rows = []
    for transport, variants in (("tensor", {"tensor": False, "tensor, packed": True}),
                                ("disk", {"disk": None})):
        with WeightSyncer(engine, transport=transport) as full:
            seconds, moved = timed_syncs(lambda: full.sync(base), nudge([t for _, t in base]),
                                         repeats)
        full_row = {"transport": transport, "what": "full weights", "rank": None,
                    "bytes": moved, "seconds": seconds}
        rows.append(full_row)
        for label, pack in variants.items():
            for rank in REFIT_RANKS:
                name = f"r{rank}"
                with LoraSyncer(engine, f"refit-{name}-{transport}", transport=transport,
                                pack=pack, adapter_name=name) as syncer:
                    seconds, moved = timed_syncs(lambda: syncer.sync(peft_model),
                                                 nudge(lora_params(peft_model, name)), repeats)
                    syncer.unload()
                rows.append({"transport": label, "what": f"adapter r{rank}", "rank": rank,
                             "bytes": moved, "seconds": seconds, "full": full_row})
    for row in rows:
        row["median_s"], row["best_s"] = statistics.median(row["seconds"]), min(row["seconds"])
    for row in rows:
        full_row = row.pop("full", row)
        row["full_over_this"] = full_row["median_s"] / row["median_s"]
    return rows


def rollout_tok_s(engine: Any, prompts: list[list[int]], lora_path: Any, new_tokens: int
                  ) -> float:
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, return_logprob=True, lora_path=lora_path,
                           sampling_params={"n": N, "temperature": 1.0, "ignore_eos": True,
                                            "max_new_tokens": new_tokens})
    wall = time.perf_counter() - t0
    tokens = [len(o["output_ids"]) for o in outs]
    assert tokens == [new_tokens] * (N * len(prompts)), tokens[:4]
    return sum(tokens) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 16 new tokens")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each row")
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's column")
    ap.add_argument("--no-vllm-setup", action="store_true",
                    help="use vLLM only if its venv is already set up")
    ap.add_argument("--name", default=None, help="result name (default bench_lora[_quick])")
    args = ap.parse_args()
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    threads = common.set_threads(args.threads)
    mach = common.measure_machine()
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']} ({', '.join(mach['cpu_flags'])}),"
          f" torch {mach['torch']}, {threads} threads; fp32 matmul {mach['matmul_fp32_gflops']}"
          f" GFLOP/s, copy {mach['copy_gbps']} GB/s", flush=True)
    model_dir = str(tiny_model_path("qwen2") if args.quick
                    else tiny_model_path("qwen2", **PRESET_55M))
    prompt_len, new_tokens = (32, 16) if args.quick else (128, 128)
    model = trainer_model(model_dir)
    base = [(n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False)]
    ranks = {f"r{r}": r for r in REFIT_RANKS} | {f"a{i}": ROLLOUT_RANK
                                                  for i in range(NUM_ADAPTERS)}
    peft_model = with_adapters(model, ranks)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(5, vocab, (NUM_PROMPTS, prompt_len), generator=gen).tolist()
    result: dict[str, Any] = {"machine": mach, "threads": threads, "quick": args.quick,
                              "model": 'tiny_model_path("qwen2")' if args.quick else
                              'tiny_model_path("qwen2", **PRESET_55M)', "repeats": args.repeats,
                              "workload": {"prompts": NUM_PROMPTS, "n": N,
                                           "prompt_len": prompt_len, "new_tokens": new_tokens,
                                           "adapters": NUM_ADAPTERS, "rank": ROLLOUT_RANK}}
    with tempfile.TemporaryDirectory(prefix="bench_lora-") as tmp:
        dirs = {}
        for name in ranks:
            peft_model.save_pretrained(tmp, selected_adapters=[name])
            dirs[name] = os.path.join(tmp, name)
        engine = Engine(model_path=model_dir, dtype="float32", device="cpu",
                        num_threads=threads, enable_lora=True, max_lora_rank=max(REFIT_RANKS),
                        lora_target_modules=["all"], random_seed=0)
        try:
            result["refit"] = refit_rows(engine, peft_model, base, args.repeats)
            mixed = [f"a{i % NUM_ADAPTERS}" for i in range(NUM_PROMPTS)]
            for name in set(mixed):
                engine.load_lora_adapter(name, dirs[name])
            rollout_tok_s(engine, prompts, None, 8)      # warm-up, each path once
            rollout_tok_s(engine, prompts, mixed, 8)
            base_runs, lora_runs = [], []
            for _ in range(args.repeats):
                base_runs.append(rollout_tok_s(engine, prompts, None, new_tokens))
                lora_runs.append(rollout_tok_s(engine, prompts, mixed, new_tokens))
            engine.check_integrity()
        finally:
            engine.shutdown()
        result["rollout"] = _rollout_figures(base_runs, lora_runs)
        if not args.no_vllm:
            print("vLLM CPU: running the same adapters ...", flush=True)
            result["vllm"] = vllm_lora({
                "model_dir": model_dir, "max_lora_rank": max(REFIT_RANKS),
                "adapters": [dirs[f"a{i}"] for i in range(NUM_ADAPTERS)],
                "refit_adapters": {str(r): dirs[f"r{r}"] for r in REFIT_RANKS},
                "prompts": prompts, "n": N, "prompt_len": prompt_len,
                "new_tokens": new_tokens, "repeats": args.repeats}, not args.no_vllm_setup)
    report(result)
    path = common.save_result(args.name or ("bench_lora_quick" if args.quick else "bench_lora"),
                              result)
    print(f"saved {path}")


def _rollout_figures(base_runs: list[float], lora_runs: list[float]) -> dict[str, Any]:
    best_base, best_lora = max(base_runs), max(lora_runs)
    return {"base_tok_s": base_runs, "lora_tok_s": lora_runs, "best_base_tok_s": best_base,
            "best_lora_tok_s": best_lora, "lora_over_base": best_lora / best_base,
            "lora_over_base_median": statistics.median(lora_runs) / statistics.median(base_runs),
            "goal": GOAL, "meets_goal": best_lora / best_base >= GOAL}


def report(result: dict[str, Any]) -> None:
    print("\n(a) refit: seconds per sync (median / best of the repeats)")
    print(common.table([[r["transport"], r["what"], f"{r['bytes'] / 1e6:.3g}",
                         f"{1e3 * r['median_s']:.2f}", f"{1e3 * r['best_s']:.2f}",
                         f"{r['full_over_this']:.1f}x"] for r in result["refit"]],
                       ["transport", "payload", "MB", "median ms", "best ms",
                        "full / this"]))
    ro = result["rollout"]
    rows = [["ours", f"{ro['best_base_tok_s']:.0f}", f"{ro['best_lora_tok_s']:.0f}",
             f"{ro['lora_over_base']:.2f}"]]
    vl = result.get("vllm")
    if vl and "lora_tok_s" in vl:
        rows.append(["vLLM CPU", f"{max(vl['base_tok_s']):.0f}", f"{max(vl['lora_tok_s']):.0f}",
                     f"{max(vl['lora_tok_s']) / max(vl['base_tok_s']):.2f}"])
    print(f"\n(b) rollout tok/s, batch {N * NUM_PROMPTS} ({NUM_PROMPTS} prompts x n={N}), "
          f"{NUM_ADAPTERS} rank-{ROLLOUT_RANK} adapters mixed vs the base (best of the repeats)")
    print(common.table(rows, ["engine", "base tok/s", "mixed LoRA tok/s", "LoRA / base"]))
    print(f"goal LoRA / base >= {GOAL}: {'met' if ro['meets_goal'] else 'NOT met'} "
          f"(median ratio {ro['lora_over_base_median']:.2f})")
    if vl is not None:
        if "error" in vl:
            print(f"\n(c) vLLM CPU {vl.get('vllm', '')}: {vl['error']}")
        else:
            adds = {r: (f"{1e3 * statistics.median(s):.1f} ms" if isinstance(s, list) else s)
                    for r, s in vl.get("add_lora_seconds", {}).items()}
            print(f"\n(c) vLLM CPU {vl['vllm']}: add_lora (disk, median) "
                  + ", ".join(f"rank {r}: {v}" for r, v in adds.items()))


if __name__ == "__main__":
    main()
