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

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's engine, even if another checkout is the installed (editable) one
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import torch  # noqa: E402


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # skip the special ids (0..4) so no prompt contains EOS / pad
    return torch.randint(5, vocab, (num, length), generator=g).tolist()


class EngineSide:
    """Our Engine, started and warmed up once; ``run()`` times one generate call."""

    def __init__(self, model_dir: str, prompts: list[list[int]], n: int, new_tokens: int,
                 threads: int, extra: dict[str, Any]) -> None:
        from rollout_engine import Engine

        self.prompts, self.n, self.new_tokens = prompts, n, new_tokens
        total_seqs = len(prompts) * n
        max_tokens = max(65536, total_seqs * (len(prompts[0]) + new_tokens))
        self.flags = dict(model_path=model_dir, dtype="float32", device="cpu",
                          num_threads=threads, max_running_requests=max(256, total_seqs),
                          max_total_tokens=max_tokens, random_seed=0, **extra)
        t0 = time.perf_counter()
        self.engine = Engine(**self.flags)
        self.startup_s = time.perf_counter() - t0
        self.sp = {"n": n, "max_new_tokens": new_tokens, "temperature": 1.0,
                   "ignore_eos": True, "sampling_seed": 1234}
        # warm-up: a tiny call through the whole path (prefill + a few decode steps)
        self.engine.generate(input_ids=[p[:16] for p in prompts[:2]],
                             sampling_params={**self.sp, "n": 2, "max_new_tokens": 4})

    def run(self) -> dict[str, Any]:
        eng = self.engine
        eng.flush_cache()  # every timed run starts from an empty prefix cache
        before = eng.get_server_info()["stats"]
        load = os.getloadavg()[0]
        cpu0 = common.cpu_seconds(self.engine.tm.host.pid)
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=self.prompts, sampling_params=self.sp)
        wall = time.perf_counter() - t0
        cpu = common.cpu_seconds(self.engine.tm.host.pid) - cpu0
        after = eng.get_server_info()["stats"]
        assert len(outs) == len(self.prompts) * self.n, len(outs)
        assert all(len(o["output_ids"]) == self.new_tokens for o in outs), "ignore_eos lengths"
        gen = sum(len(o["output_ids"]) for o in outs)
        return {"wall_s": wall, "generated_tokens": gen, "tok_s": gen / wall,
                "cpu_s": cpu, "tok_per_cpu_s": gen / cpu, "loadavg_1m_at_start": load,
                "stats_delta": {k: after[k] - before.get(k, 0) for k in after}}

    def close(self) -> None:
        self.engine.shutdown()


class HFSide:
    """``transformers`` ``model.generate`` on the same directory, in this process."""

    def __init__(self, model_dir: str, prompts: list[list[int]], n: int, new_tokens: int,
                 chunk: int) -> None:
        from transformers import AutoModelForCausalLM

        self.prompts, self.n, self.new_tokens, self.chunk = prompts, n, new_tokens, chunk
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.kwargs = dict(do_sample=True, num_return_sequences=n, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                           pad_token_id=0)
        torch.manual_seed(1234)
        self._generate([p[:16] for p in prompts[:2]], num_return_sequences=2, max_new_tokens=4,
                       min_new_tokens=4)

    def _generate(self, batch: list[list[int]], **kw: Any) -> torch.Tensor:
        ids = torch.tensor(batch, dtype=torch.int64)
        with torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       **{**self.kwargs, **kw})

    def run(self) -> dict[str, Any]:
        load = os.getloadavg()[0]
        cpu0 = common.cpu_seconds()
        t0 = time.perf_counter()
        gen = 0
        for i in range(0, len(self.prompts), self.chunk):
            batch = self.prompts[i:i + self.chunk]
            out = self._generate(batch)
            new = out.shape[1] - len(batch[0])
            assert new == self.new_tokens, (new, self.new_tokens)
            gen += out.shape[0] * new
        wall = time.perf_counter() - t0
        cpu = common.cpu_seconds() - cpu0
        return {"wall_s": wall, "generated_tokens": gen, "tok_s": gen / wall,
                "cpu_s": cpu, "tok_per_cpu_s": gen / cpu, "loadavg_1m_at_start": load}

    def close(self) -> None:
        del self.model
        gc.collect()


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
    ap.add_argument("--repeats", type=int, default=0,
                    help="alternating timed runs per side (default 1 quick, 2 full)")
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
    chunk = args.hf_chunk or num
    repeats = args.repeats or (1 if args.quick else 2)
    # both sides stay loaded; timed runs alternate engine, transformers, engine, ... so drift in
    # the (shared, noisy) machine's load hits both alike; the best run of each side is compared
    eng_side = EngineSide(model_dir, prompts, n, new_tokens, threads,
                          {"scheduler_mode": args.scheduler_mode})
    hf_side = HFSide(model_dir, prompts, n, new_tokens, chunk)
    eng_runs: list[dict[str, Any]] = []
    hf_runs: list[dict[str, Any]] = []
    try:
        for r in range(repeats):
            e = eng_side.run()
            eng_runs.append(e)
            print(f"[{r}] engine:       {e['tok_s']:8.1f} tok/s  ({e['generated_tokens']} tokens "
                  f"in {e['wall_s']:.2f} s, {e['tok_per_cpu_s']:.0f} tok/cpu-s; load {e['loadavg_1m_at_start']:.1f}; "
                  f"stats {e['stats_delta']})", flush=True)
            h = hf_side.run()
            hf_runs.append(h)
            print(f"[{r}] transformers: {h['tok_s']:8.1f} tok/s  ({h['generated_tokens']} tokens "
                  f"in {h['wall_s']:.2f} s, {h['tok_per_cpu_s']:.0f} tok/cpu-s; load {h['loadavg_1m_at_start']:.1f}; "
                  f"{-(-num // chunk)} generate call(s) of {chunk} prompts x {n})", flush=True)
    finally:
        eng_side.close()
        hf_side.close()
    eng = max(eng_runs, key=lambda x: x["tok_s"])
    hf = max(hf_runs, key=lambda x: x["tok_s"])
    ratio = eng["tok_s"] / hf["tok_s"]
    pair_ratios = [e["tok_s"] / h["tok_s"] for e, h in zip(eng_runs, hf_runs)]
    rows = [["engine (best)", eng["tok_s"], eng["wall_s"], eng["tok_s"] / roof],
            ["transformers (best)", hf["tok_s"], hf["wall_s"], hf["tok_s"] / roof],
            ["compute roofline (2P, P=matmul params)", roof, "", 1.0]]
    print(common.table(rows, ["", "tok/s", "wall s", "fraction of roofline"]))
    cpu_ratio = (max(x["tok_per_cpu_s"] for x in eng_runs)
                 / max(x["tok_per_cpu_s"] for x in hf_runs))
    print(f"tokens per CPU-second (contention-robust cross-check, both sides' processes): "
          f"engine / transformers = {cpu_ratio:.2f}x")
    print(f"(roofline with P = total incl. tied head, the '55M' convention: {roof_total:.0f} tok/s;"
          f" per-pair ratios {[round(x, 2) for x in pair_ratios]})")
    path = common.save_result(args.name, {
        "mode": "quick" if args.quick else "full",
        "machine": mach,
        "workload": {"prompts": num, "n": n, "prompt_len": args.prompt_len,
                     "new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
                     "model": "tiny qwen2 PRESET_55M", "dtype": "float32", "threads": threads},
        "params": params,
        "roofline_tok_s": roof,
        "roofline_tok_s_total_params": roof_total,
        "repeats": repeats,
        "engine": {**eng, "startup_s": eng_side.startup_s,
                   "flags": {k: v for k, v in eng_side.flags.items() if k != "model_path"}},
        "transformers": {**hf, "prompt_chunk": chunk, "calls": -(-num // chunk)},
        "engine_runs": eng_runs,
        "transformers_runs": hf_runs,
        "pair_ratios": pair_ratios,
        "ratio_tok_per_cpu_s": cpu_ratio,
        "engine_fraction_of_roofline": eng["tok_s"] / roof,
        "transformers_fraction_of_roofline": hf["tok_s"] / roof,
        "ratio_engine_over_transformers": ratio,
    })
    print(f"saved {path}")
    print(f"engine / transformers throughput ratio (best of {repeats}): {ratio:.2f}x "
          f"({eng['tok_s']:.0f} vs {hf['tok_s']:.0f} tok/s)")


if __name__ == "__main__":
    main()
