"""RL-shaped HTTP load: a GRPO step's G groups sent at once, each ONE request with n=8 samples
and the sampled tokens' logprobs, as slime, AReaL, verl and prime-rl drive a rollout server.

Workload: G groups (``--groups``, 8 and 32 by default), each a 128-token prompt of random ids
(seeded, ``--prompt-len``; made as ``bench_offline.py`` makes them), n=8,
128 new tokens (``--new-tokens``, ``ignore_eos``), temperature 1, logprobs of the sampled
tokens; all G requests in flight together, wall time from the first send to the last answer,
tok/s = G x 8 x new / wall. Every answer is checked (8 samples, exactly ``new`` tokens each, a
finite logprob per token); one that is wrong stops that side and the run exits 1. Each timed
wave follows a warm-up wave of the same shape (8 new tokens) and starts from an empty prefix
cache. Sides, each started and stopped by this script, never two at once:

- ours: our server (``launch_server``) on SGLang's ``/generate`` (``input_ids``,
  ``sampling_params.n``, ``return_logprob``) and on ``/v1/completions`` (a token-id prompt,
  ``n``, ``logprobs: 0``, ``ignore_eos``); then our Engine offline on the same G x 8 requests
  (``bench_offline.py``'s run: a worker process whose scheduler is a child process, as the
  server's is), so server tok/s / engine tok/s is what the server path costs;
- vllm: vLLM's OpenAI server (``vllm_peer.py``'s venv and environment) on ``/v1/completions``
  with the same body.

``--rounds`` rounds of every side in turn (ours, vLLM, ours, ...); the best per side is reported
and each round's ours / vLLM is printed too. ``--shape`` names a real checkpoint's shape with
random weights (``rollout_engine/testing/real_shapes.py``); a side may carry its own dtype
(``vllm:bfloat16``) as in ``bench_offline.py``.

    ROLLOUT_VLLM_VENV=/path/to/.vllm-venv python benchmarks/bench_rl_http.py
    python benchmarks/bench_rl_http.py --shape qwen3-0.6b --groups 8 \
        --sides ours,vllm,vllm:bfloat16
    python benchmarks/bench_rl_http.py --sides ours --groups 8 --new-tokens 32 --rounds 1

Results: ``benchmarks/results/bench_rl_http.json`` (``bench_rl_http_<shape>.json`` for a
``--shape`` other than 55m). The last line printed is ours / vLLM per route at the largest G.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's engine, even if another checkout is the installed (editable) one
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import bench_offline  # noqa: E402
import common  # noqa: E402
import http_load  # noqa: E402
import vllm_peer  # noqa: E402

N_SAMPLES = bench_offline.N_SAMPLES
WARM_TOKENS = 8
ENGINE = "engine"        # the key of our Engine's offline rate beside a side's routes
VLLM_ROUTE = "/v1/completions"


def _routes(base: str, rnd: int) -> list[str]:
    """A side's routes, our two in alternating order by round (neither always goes first)."""
    if base == "vllm":
        return [VLLM_ROUTE]
    return list(http_load.ROUTES) if rnd % 2 == 0 else list(reversed(http_load.ROUTES))


def run_server_side(base: str, spec: dict[str, Any], rnd: int, log_dir: Path,
                    vllm_py: Optional[str]) -> dict[str, dict[str, float]]:
    """One server's tok/s per route and G (a fresh server, stopped on return)."""
    n, new = spec["n"], spec["new_tokens"]
    biggest = max(spec["batches"])
    flags = {"dtype": spec["dtype"], "threads": spec["threads"],
             "max_seqs": max(256, biggest),
             "max_total_tokens": max(65536, biggest * (spec["prompt_len"] + new))}
    if base == "vllm":
        flags.update(vllm_python=vllm_py, max_model_len=spec["prompt_len"] + new + 64)
    out: dict[str, dict[str, float]] = {}
    with http_load.Server.start(base, spec["model_dir"], log_dir, **flags) as server:
        model = http_load.model_name(server.url)
        for route in _routes(base, rnd):
            out[route] = {}
            for batch, prompts in bench_offline._shapes(spec):
                warm = bench_offline.make_prompts(batch // n, spec["prompt_len"], spec["vocab"],
                                                  seed=1000 + batch)
                http_load.send_wave(server.url, route, model, warm, n, min(WARM_TOKENS, new))
                if base == "ours":
                    http_load.flush_cache(server.url)
                wall = http_load.send_wave(server.url, route, model, prompts, n, new)
                out[route][str(batch // n)] = batch * new / wall
    return out


def run_engine(spec: dict[str, Any]) -> Optional[dict[str, float]]:
    """Our Engine offline on the same G x n requests: tok/s per G, or None if it failed."""
    got = bench_offline._run_side("ours", spec)
    if got is None:
        return None
    return {str(b // spec["n"]): max(got[str(b)]) for b in spec["batches"]}


def _ratios(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {g: a[g] / b[g] for g in a if g in b}


def compare(sides: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """From per-side rates ({side: {route or ENGINE: {G: tok/s}}}): each of our routes over
    our Engine, and over each vLLM side's ``/v1/completions``."""
    ours = [s for s in sides if s.partition(":")[0] == "ours"]
    vllms = [s for s in sides if s.partition(":")[0] == "vllm"]
    server_over_engine = {
        s: {r: _ratios(sides[s][r], sides[s][ENGINE]) for r in http_load.ROUTES
            if r in sides[s] and ENGINE in sides[s]} for s in ours}
    ours_over_vllm = {
        f"{o} / {v}": {r: _ratios(sides[o][r], sides[v][VLLM_ROUTE]) for r in http_load.ROUTES
                       if r in sides[o] and VLLM_ROUTE in sides[v]}
        for o in ours[:1] for v in vllms}
    return {"server_over_engine": server_over_engine, "ours_over_vllm": ours_over_vllm}


def _best(runs: list[dict[str, Any]], side: str) -> dict[str, dict[str, float]]:
    best: dict[str, dict[str, float]] = {}
    for rnd in runs:
        for key, by_g in rnd.get(side, {}).items():
            for g, v in by_g.items():
                best.setdefault(key, {})[g] = max(v, best.get(key, {}).get(g, 0.0))
    return best


def _machine_line(mach: dict[str, Any], threads: int) -> str:
    rates = (f"; matmul {mach['matmul_fp32_gflops']:.1f} GFLOP/s fp32, "
             f"{mach['matmul_bf16_gflops']:.1f} bf16, copy {mach['copy_gbps']:.1f} GB/s"
             if "matmul_fp32_gflops" in mach else "")
    return (f"machine: {mach['cores']} cores, {mach['cpu_model']} "
            f"({', '.join(mach['cpu_flags'])}), torch {mach['torch']}, {threads} threads"
            f"{rates}; load {os.getloadavg()[0]:.1f}")


def _save(name: str, out: Optional[str], result: dict[str, Any]) -> Path:
    if out is None:
        return common.save_result(name, result)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **result}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="8,32", help="comma-separated G (requests of n=8)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--sides", default="ours,vllm",
                    help="comma-separated ours / vllm; SIDE:DTYPE runs a side in another dtype")
    ap.add_argument("--shape", default="55m", help="55m, or a real checkpoint's shape: "
                    "qwen3-0.6b, qwen2.5-0.5b, llama-3.2-1b (random weights)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model-dir", help="a model directory instead of --shape's")
    ap.add_argument("--no-vllm-setup", action="store_true",
                    help="skip vLLM's column instead of building its venv when missing")
    ap.add_argument("--skip-rates", action="store_true",
                    help="describe the machine without measuring its matmul / copy rates")
    ap.add_argument("--name", help="results/<name>.json")
    ap.add_argument("--out", help="write the result here instead of benchmarks/results/")
    args = ap.parse_args()
    for side in args.sides.split(","):
        base, _, dtype = side.partition(":")
        if base not in ("ours", "vllm") or dtype not in ("", "float32", "bfloat16"):
            ap.error(f"--sides: {side!r} is not ours / vllm, optionally :float32 / :bfloat16")
    if args.rounds < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        ap.error("--rounds, --new-tokens and --prompt-len must be >= 1")
    return args


def main() -> int:
    import httpx

    args = _parse()
    threads = common.set_threads(args.threads)
    from rollout_engine.testing.real_shapes import real_shape_path
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    if args.model_dir:
        model_dir, label = args.model_dir, f"{os.path.basename(args.model_dir)} (--model-dir)"
    elif args.shape == "55m":
        model_dir, label = str(tiny_model_path("qwen2", **PRESET_55M)), "tiny qwen2 PRESET_55M"
    else:
        model_dir, label = str(real_shape_path(args.shape)), f"{args.shape} shape, random weights"
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    groups = [int(g) for g in args.groups.split(",")]
    spec = {"model_dir": model_dir, "batches": [g * N_SAMPLES for g in groups], "n": N_SAMPLES,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "threads": threads,
            "repeats": 1, "vocab": vocab, "dtype": args.dtype}
    mach = common.machine() if args.skip_rates else common.measure_machine()
    print(_machine_line(mach, threads), flush=True)
    print(f"workload: G {groups} requests at once, each n={N_SAMPLES}, {args.prompt_len}-token "
          f"prompts, {args.new_tokens} new, T=1, logprobs; {label}, {args.dtype}", flush=True)
    log_dir = Path(args.out).parent if args.out else common.RESULTS_DIR

    sides = [s for s in args.sides.split(",") if s]
    failed: dict[str, str] = {}      # a side that ran and failed: the run exits 1
    skipped: dict[str, str] = {}     # a side that could not run here
    vllm_py: Optional[str] = None
    if any(s.startswith("vllm") for s in sides):
        vllm_py = vllm_peer.vllm_python(setup=not args.no_vllm_setup)
        if vllm_py is None:
            skipped.update({s: "vLLM is not available" for s in sides if s.startswith("vllm")})
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        this: dict[str, Any] = {}
        for side in sides:
            if side in failed or side in skipped:
                continue
            base, side_spec = bench_offline._side_spec(side, spec)
            t0 = time.perf_counter()
            try:
                got: dict[str, Any] = run_server_side(base, side_spec, rnd, log_dir, vllm_py)
            except (RuntimeError, OSError, httpx.HTTPError) as exc:   # BadAnswer included
                failed[side] = f"{type(exc).__name__}: {exc}"
                print(f"round {rnd + 1}, {side}: FAILED ({failed[side]})", flush=True)
                continue
            if base == "ours":
                engine = run_engine(side_spec)
                if engine is None:
                    failed[side] = "the offline Engine run failed"
                    continue
                got[ENGINE] = engine
            this[side] = got
            print(f"round {rnd + 1}, {side}: {json.dumps(got)} "
                  f"({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
        runs.append(this)

    best = {s: _best(runs, s) for s in sides if s not in failed and s not in skipped}
    overall = compare(best)
    by_round = [compare(r) for r in runs]
    rows = []
    for g in map(str, groups):
        for s in best:
            for key, by_g in best[s].items():
                ratio = overall["server_over_engine"].get(s, {}).get(key, {}).get(g)
                rows.append([g, s, key, by_g.get(g, "-"), "-" if ratio is None else ratio])
    print(common.table(rows, ["G", "side", "path", "tok/s", "server / engine"]))
    name = args.name or "_".join(["bench_rl_http"] + [args.shape.replace(".", "_")] * (
        args.shape != "55m" and not args.model_dir))
    path = _save(name, args.out, {
        "machine": mach,
        "workload": {k: v for k, v in spec.items() if k not in ("model_dir", "batches")} | {
            "groups": groups, "model": label, "temperature": 1.0, "ignore_eos": True,
            "logprobs": "sampled token", "routes": {"ours": list(http_load.ROUTES),
                                                    "vllm": [VLLM_ROUTE]}},
        "sides": sides, "rounds": args.rounds, "runs_by_round": runs, "best_tok_s": best,
        **overall, "ratios_by_round": by_round, "failed": failed, "skipped": skipped})
    print(f"saved {path}")
    for i, r in enumerate(by_round):
        for pair, per_route in r["ours_over_vllm"].items():
            print(f"round {i + 1}: {pair} " + ", ".join(
                f"{route} G={g} {x:.2f}x" for route, by_g in per_route.items()
                for g, x in by_g.items()))
    top = str(max(groups))
    pairs = overall["ours_over_vllm"]
    if pairs:
        print(f"ours / vLLM at G={top}: " + "; ".join(
            f"{pair}: " + ", ".join(f"{route} {by_g[top]:.2f}x" for route, by_g in per.items()
                                    if top in by_g) for pair, per in pairs.items()))
    else:
        print(f"ours / vLLM at G={top}: no pair measured (sides {sides}, failed {failed}, "
              f"skipped {skipped})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
