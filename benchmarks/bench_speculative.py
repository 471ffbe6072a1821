"""Speculative decoding (n-gram and STANDALONE), off vs on in one run, batch 1 and 16, on a
repetitive workload.

A random tiny model does not copy, so the benchmark first makes one that does: the tiny qwen2
(hidden 128, 2 layers, vocab 512) trained briefly (``--train-steps``, ~1 minute on two cores,
cached under $ROLLOUT_ENGINE_CACHE) on sequences that repeat a random passage (an induction
task). Workload: each prompt is noise + a random passage + the passage's first ``--cue`` tokens;
the model continues the passage (and then repeats it), greedy, ``--new-tokens`` per request.
The n-gram proposer finds the passage in the prompt, so acceptance is real; the measured
acceptance (accepted proposals per verify, meta_info's spec_accept_length) is reported as it
comes out, with how far the trained model actually copies (``copy_fraction``: output tokens that
equal the passage continued periodically).

STANDALONE rows: the draft (DRAFT_MODEL: the target's depth and vocabulary, half its width) is
trained on the same copy task (``--draft-train-steps``, cached likewise), drafting
``--draft-steps`` tokens per verify. Its acceptance is real (it learned the copy task too), and
the row shows what a draft model costs here: a step of ``k = --draft-steps`` runs the draft k
times and the target once for up to k + 1 tokens, and on these tiny CPU models a draft forward
costs about as much as the target's (per-forward overhead, not FLOPs, dominates), so even a
draft that is always right gives ~1x; a draft pays when it is much cheaper than its target. With
speculation switched off (batch 16) the draft does not run at all (its KV is caught up later in
one EXTEND), so that row must show no slowdown.

Each batch size runs every engine (scheduler processes, float32, ``--threads``), alternating
the order, best of ``--repeats``; outputs must be token-identical (greedy parity). At batch 16
the default ``speculative_max_batch_size`` (8) switches speculation off; the ``forced`` rows run
it anyway (``speculative_max_batch_size=16``) to show what it would cost.

    python benchmarks/bench_speculative.py --quick
    python benchmarks/bench_speculative.py

Goal (CPU, batch 1): >= 1.8x tok/s with speculation on; batch 16: no slowdown.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402

MODEL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)
# the STANDALONE draft: half as wide (a cut to one layer does not copy: the task needs both
# layers' circuit, and a one-layer draft trained from scratch stayed at chance for 400 steps)
DRAFT_MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=128)
TRAIN_LEN = 224          # tokens per training sequence (covers prompt + new tokens below)
TRAIN_BATCH = 24
TRAIN_LR = 2e-3
PASSAGE_LEN = 40         # the period the model learns to repeat (the workload's passage length)


def copy_batch(gen: Any, batch: int, vocab: int) -> Any:
    """Sequences of a random PASSAGE_LEN-token passage repeated up to TRAIN_LEN, after 0..8
    noise tokens; returns (ids, mask of the positions whose next token is a repetition). One
    period keeps training to about a minute (the model learns to copy from PASSAGE_LEN tokens
    back; variable periods need induction heads, thousands of steps)."""
    import torch

    ids = torch.empty(batch, TRAIN_LEN, dtype=torch.int64)
    mask = torch.zeros(batch, TRAIN_LEN - 1, dtype=torch.bool)
    for b in range(batch):
        length = PASSAGE_LEN
        noise = int(torch.randint(0, 9, (1,), generator=gen))
        passage = torch.randint(5, vocab, (length,), generator=gen)
        reps = -(-(TRAIN_LEN - noise) // length)
        ids[b, :noise] = torch.randint(5, vocab, (noise,), generator=gen)
        ids[b, noise:] = passage.repeat(reps)[:TRAIN_LEN - noise]
        mask[b, noise + length - 1:] = True      # predicting the second copy onwards
    return ids, mask


def train_copy_model(steps: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
    """The tiny qwen2 trained on copy_batch; cached by everything that shapes the training."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_engine.testing.tiny_model import tiny_model_path

    base = tiny_model_path("qwen2", **MODEL)
    key = hashlib.sha256(json.dumps([MODEL, steps, seed, TRAIN_LEN, PASSAGE_LEN, TRAIN_BATCH,
                                     TRAIN_LR, base.name]).encode()).hexdigest()[:12]
    out = _bench_dir() / f"copy-{key}"
    if (out / "train_info.json").is_file():
        return str(out), json.loads((out / "train_info.json").read_text())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    info = {**_train(model, steps, seed), "base": base.name, "model": MODEL}
    _save(model, info, out, str(base))
    return str(out), info


def train_draft_model(steps: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
    """The STANDALONE draft: a narrower tiny qwen2 (DRAFT_MODEL: half the width, the target's
    vocabulary and depth) trained on copy_batch as the target was; cached likewise."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_engine.testing.tiny_model import tiny_model_path

    base = tiny_model_path("qwen2", **DRAFT_MODEL)
    key = hashlib.sha256(json.dumps([DRAFT_MODEL, steps, seed, TRAIN_LEN, PASSAGE_LEN,
                                     TRAIN_BATCH, TRAIN_LR, base.name]).encode()).hexdigest()[:12]
    out = _bench_dir() / f"draft-{key}"
    if (out / "train_info.json").is_file():
        return str(out), json.loads((out / "train_info.json").read_text())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    info = {**_train(model, steps, seed + 1), "base": base.name, "model": DRAFT_MODEL}
    _save(model, info, out, str(base))
    return str(out), info


def _bench_dir() -> Any:
    from rollout_engine.testing.tiny_model import cache_root

    return cache_root().parent / "spec_bench"


def _train(model: Any, steps: int, seed: int) -> dict[str, Any]:
    """``steps`` AdamW steps of next-token loss on the repetitions of copy_batch."""
    import torch

    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    loss = acc = float("nan")
    for step in range(steps):
        ids, mask = copy_batch(gen, TRAIN_BATCH, vocab)
        logits = model(input_ids=ids).logits[:, :-1]
        target = ids[:, 1:]
        loss_t = torch.nn.functional.cross_entropy(logits[mask], target[mask])
        opt.zero_grad()
        loss_t.backward()
        opt.step()
        loss = float(loss_t.detach())
        acc = float((logits[mask].argmax(-1) == target[mask]).float().mean())
        if step % 100 == 0 or step == steps - 1:
            print(f"train step {step}: loss {loss:.4f}, copy accuracy {acc:.3f}", flush=True)
    return {"steps": steps, "seconds": time.perf_counter() - t0, "final_loss": loss,
            "final_copy_accuracy": acc}


def _save(model: Any, info: dict[str, Any], out: Any, files_from: str) -> None:
    """Save ``model`` at ``out`` (atomically), with the tokenizer files of ``files_from``."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in os.listdir(files_from):     # tokenizer and generation config
        if not (tmp / f).exists() and f != "train_info.json":
            shutil.copy(os.path.join(files_from, f), tmp / f)
    (tmp / "train_info.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def make_workload(batch: int, passage_len: int, cue: int, vocab: int, seed: int
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, passages): noise + passage + passage[:cue]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts, passages = [], []
    for _ in range(batch):
        passage = torch.randint(5, vocab, (passage_len,), generator=gen).tolist()
        noise = torch.randint(5, vocab, (6,), generator=gen).tolist()
        prompts.append(noise + passage + passage[:cue])
        passages.append(passage)
    return prompts, passages


def copy_fraction(outs: list[dict[str, Any]], passages: list[list[int]], cue: int) -> float:
    """Output tokens equal to the passage continued periodically from the cue."""
    hit = total = 0
    for o, p in zip(outs, passages):
        for i, t in enumerate(o["output_ids"]):
            hit += t == p[(cue + i) % len(p)]
            total += 1
    return hit / max(total, 1)


def timed(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Any]]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.flush_cache()              # both engines prefill the same prompts from scratch
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - t0, outs


def summarize(seconds: float, outs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    row: dict[str, Any] = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
    if "spec_verify_ct" in outs[0]["meta_info"]:
        verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
        accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in outs)
        drafted = sum(o["meta_info"]["spec_draft_token_num"] for o in outs)
        row.update({"verify_ct": verify, "accepted": accepted, "drafted": drafted,
                    # SGLang's spec_accept_length: completion tokens per verify forward
                    "accept_length": tokens / verify if verify else None,
                    "accepted_per_verify": accepted / verify if verify else None,
                    "accept_rate": accepted / drafted if drafted else None})
    return row


def bench_batch(engines: dict[str, Any], batch: int, args: argparse.Namespace, vocab: int
                ) -> dict[str, Any]:
    """Best of ``args.repeats``; each repeat has fresh prompts (a finished request's tokens
    feed the shared n-gram table, so repeating a prompt would draft from the last answer)."""
    best: dict[str, Any] = {}
    identical = True
    for rep in range(args.repeats):
        prompts, passages = make_workload(batch, args.passage_len, args.cue, vocab,
                                          seed=1000 * batch + rep)
        outputs: dict[str, list[list[int]]] = {}
        names = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in names:
            seconds, outs = timed(engines[name], prompts, args.new_tokens)
            outputs[name] = [o["output_ids"] for o in outs]
            row = summarize(seconds, outs)
            row["copy_fraction"] = copy_fraction(outs, passages, args.cue)
            print(f"batch {batch:2d} rep {rep} {name:7s} {row['seconds']:.3f} s "
                  f"{row['tok_s']:.1f} tok/s", flush=True)
            if name not in best or row["seconds"] < best[name]["seconds"]:
                best[name] = row
        identical &= all(outputs[n] == outputs["off"] for n in outputs)
    for name, eng in engines.items():
        stats = eng.get_server_info()["stats"]
        best[name]["spec_off_steps_total"] = stats.get("spec_off_steps")
        best[name]["spec_off_low_accept_rows_total"] = stats.get("spec_off_low_accept_rows")
    ratios = {n: best[n]["tok_s"] / best["off"]["tok_s"] for n in best if n != "off"}
    return {"batch": batch, "best": best, "ratio_vs_off": ratios, "outputs_identical": identical}


def bench_model(model_dir: str, batch: int, args: argparse.Namespace, vocab: int,
                draft_dir: str | None = None) -> dict[str, Any]:
    """Spec off / n-gram on (and forced on above the switch-off batch size) on one model, and
    with ``draft_dir`` STANDALONE likewise, all on the same prompts."""
    from rollout_engine import Engine

    base = dict(model_path=model_dir, dtype="float32", device="cpu", num_threads=args.threads)
    spec = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.num_draft_tokens)
    configs = {"off": base, "on": {**base, **spec}}
    if batch > 8:
        configs["forced"] = {**base, **spec, "speculative_max_batch_size": batch}
    if draft_dir is not None:
        draft = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_dir,
                     speculative_num_steps=args.draft_steps)
        configs["standalone"] = {**base, **draft}
        if batch > 8:
            configs["standalone_forced"] = {**base, **draft, "speculative_max_batch_size": batch}
    engines = {name: Engine(**cfg) for name, cfg in configs.items()}
    try:
        warm, _ = make_workload(batch, args.passage_len, args.cue, vocab, seed=999)
        for eng in engines.values():
            eng.generate(input_ids=warm, sampling_params={"temperature": 0, "max_new_tokens": 16})
        return bench_batch(engines, batch, args, vocab)
    finally:
        for eng in engines.values():
            eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4, 64 new tokens")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--passage-len", type=int, default=40)
    ap.add_argument("--cue", type=int, default=8)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--draft-steps", type=int, default=4,
                    help="STANDALONE: draft tokens proposed per verify (speculative_num_steps)")
    ap.add_argument("--draft-train-steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.new_tokens, args.repeats = [1, 4], 64, 2
    common.set_threads(args.threads)
    model_dir, train_info = train_copy_model(args.train_steps)
    draft_dir, draft_info = train_draft_model(args.draft_train_steps)
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    results = [bench_model(model_dir, batch, args, vocab, draft_dir)
               for batch in args.batch_sizes]
    # control: the same prompts on the untrained base model, which does not copy: proposals
    # from the prompt are mostly rejected, so this is what speculation costs when it misses
    from rollout_engine.testing.tiny_model import tiny_model_path

    control = bench_model(str(tiny_model_path("qwen2", **MODEL)), 1, args, vocab)
    control["model"] = "untrained base (does not copy)"
    rows = [[r["batch"], n, b["tok_s"], b.get("accept_length"), b.get("accept_rate"),
             r["ratio_vs_off"].get(n, 1.0), r["outputs_identical"], b.get("spec_off_steps_total")]
            for r in [*results, control] for n, b in r["best"].items()]
    print(common.table(rows, ["batch", "spec", "tok/s (best)", "accept length", "accept rate",
                              "ratio vs off", "identical", "spec off steps"]))
    print("copy fraction (greedy outputs that continue the passage): "
          + ", ".join(f"batch {r['batch']} {r['best']['off']['copy_fraction']:.3f}"
                      for r in results)
          + f"; control (last rows, untrained): {control['best']['off']['copy_fraction']:.3f}")
    first = results[0]
    goal = "met" if first["ratio_vs_off"]["on"] >= 1.8 else "missed"
    result = {"machine": common.machine(), "model_dir": os.path.basename(model_dir),
              "train": train_info, "draft_dir": os.path.basename(draft_dir),
              "draft_train": draft_info, "workload": {**vars(args), "vocab": vocab},
              "results": results, "control_untrained": control, "goal_batch1_1.8x": goal}
    path = common.save_result("bench_speculative_quick" if args.quick else "bench_speculative",
                              result)
    print(f"saved {path}")
    print(f"batch {first['batch']}: spec on / off = {first['ratio_vs_off']['on']:.2f}x "
          f"(accept length {first['best']['on']['accept_length']:.2f}); goal >= 1.8x: {goal}")
    for r in results:
        b = r["best"]["standalone"]
        print(f"batch {r['batch']}: STANDALONE / off = {r['ratio_vs_off']['standalone']:.2f}x "
              f"(accept length {b['accept_length'] or 0:.2f}, accept rate "
              f"{b['accept_rate'] or 0:.2f}); outputs identical: {r['outputs_identical']}")


if __name__ == "__main__":
    main()
