"""Online serving: streaming /generate requests against a live server, next to the same workload
through ``transformers.generate`` in-process, one request at a time (what a naive server does).

Requests arrive as a Poisson process at ``--rate`` req/s (``inf``: all at once) or are kept at a
fixed ``--concurrency``. Prompts are random ids (seeded); every request generates exactly
``--output-len`` tokens (``ignore_eos``), temperature 1.0, on the ~55M tiny qwen2, float32, with
the same torch thread count on both sides. Without ``--url`` a server is started and stopped.

    python benchmarks/bench_serving.py --quick             # 16 requests x 32 tokens (< 1 min;
                                                           # transformers on the first 4)
    python benchmarks/bench_serving.py --rate 4            # full, Poisson arrivals
    python benchmarks/bench_serving.py --url http://127.0.0.1:30000 --concurrency 8

Reports throughput, TTFT and inter-token latency p50 / p99; the last line printed is the ratio
server tok/s / transformers tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (num, length), generator=g).tolist()  # no special ids


# -- the server ----------------------------------------------------------------------------------
def start_server(model_dir: str, threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_engine.launch_server", "--model-path", model_dir,
         "--port", str(port), "--dtype", "float32", "--device", "cpu",
         "--num-threads", str(threads), "--random-seed", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not become healthy within 300 s")


async def one_request(client: Any, prompt: list[int], output_len: int, seed: int
                      ) -> dict[str, Any]:
    body = {"input_ids": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": output_len, "temperature": 1.0, "ignore_eos": True,
        "sampling_seed": seed}}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if len(chunk["output_ids"]) > tokens:   # chunks are cumulative, as SGLang's
                times.append(time.perf_counter())
                tokens = len(chunk["output_ids"])
    return {"start": t0, "ttft": times[0] - t0, "e2e": times[-1] - t0, "tokens": tokens,
            "itl": [b - a for a, b in zip(times, times[1:])]}


async def run_load(url: str, prompts: list[list[int]], output_len: int, rate: float,
                   concurrency: Optional[int], seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    gate = asyncio.Semaphore(concurrency or len(prompts))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await one_request(client, prompts[0][:8], 4, seed)        # warm-up through the stack

        async def gated(i: int, delay: float) -> dict[str, Any]:
            await asyncio.sleep(delay)
            async with gate:
                return await one_request(client, prompts[i], output_len, seed + i)

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate != float("inf"):
                t += rng.expovariate(rate)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(i, d) for i, d in enumerate(delays)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    assert all(r["tokens"] == output_len for r in results), "ignore_eos lengths differ"
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    e2e = [r["e2e"] for r in results]
    ms = 1000.0
    return {"wall_s": wall, "requests": len(results), "generated_tokens": tokens,
            "tok_s": tokens / wall, "req_s": len(results) / wall,
            "ttft_ms": {"p50": common.p50(ttft) * ms, "p99": common.p99(ttft) * ms,
                        "mean": sum(ttft) / len(ttft) * ms},
            "itl_ms": {"p50": common.p50(itl) * ms, "p99": common.p99(itl) * ms,
                       "mean": sum(itl) / max(len(itl), 1) * ms},
            "e2e_s": {"p50": common.p50(e2e), "p99": common.p99(e2e)}}


# -- the baseline --------------------------------------------------------------------------------
def run_hf(model_dir: str, prompts: list[list[int]], output_len: int, seed: int
           ) -> dict[str, Any]:
    """``transformers.generate`` per request, in arrival order (no batching across requests)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(ids: list[int], new: int) -> int:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0)
        return out.shape[1] - len(ids)

    torch.manual_seed(seed)
    generate(prompts[0][:8], 4)
    e2e = []
    t0 = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        assert generate(p, output_len) == output_len
        e2e.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    tokens = len(prompts) * output_len
    return {"wall_s": wall, "generated_tokens": tokens, "tok_s": tokens / wall,
            "per_token_ms": wall / tokens * 1000.0,
            "e2e_s": {"p50": common.p50(e2e), "p99": common.p99(e2e)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server; default: start one")
    ap.add_argument("--quick", action="store_true", help="16 requests x 32 new tokens")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--rate", type=float, default=float("inf"),
                    help="Poisson arrival rate, requests/s (inf = all at once)")
    ap.add_argument("--concurrency", type=int, help="at most this many requests in flight")
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ap.add_argument("--baseline-requests", type=int,
                    help="requests run through transformers (default: all; 4 with --quick). "
                         "Sequential tok/s does not depend on how many are run.")
    ap.add_argument("--name", default="bench_serving", help="results/<name>.json")
    args = ap.parse_args()
    num = args.num_requests or (16 if args.quick else 64)
    output_len = args.output_len or (32 if args.quick else 128)

    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    mach = common.measure_machine()
    params = common.model_params(model_dir)
    roof = common.compute_roofline_tok_s(mach["matmul_fp32_gflops"], params["matmul"])
    arrival = (f"concurrency {args.concurrency}" if args.concurrency else
               "all at once" if args.rate == float("inf") else f"Poisson {args.rate:g} req/s")
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']}, torch {mach['torch']}, "
          f"{threads} threads; matmul {mach['matmul_fp32_gflops']:.1f} GFLOP/s", flush=True)
    print(f"workload: {num} requests ({arrival}), {args.input_len}-token prompts, {output_len} "
          f"new tokens, T=1.0, ignore_eos, streaming /generate", flush=True)

    prompts = make_prompts(num, args.input_len, 32000, args.seed)
    proc = None
    url = args.url
    t0 = time.perf_counter()
    if url is None:
        proc, url = start_server(model_dir, threads)
    startup = time.perf_counter() - t0
    try:
        srv = asyncio.run(run_load(url, prompts, output_len, args.rate, args.concurrency,
                                   args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(f"server:       {srv['tok_s']:8.1f} tok/s  {srv['req_s']:.2f} req/s  TTFT p50 "
          f"{srv['ttft_ms']['p50']:.0f} / p99 {srv['ttft_ms']['p99']:.0f} ms  ITL p50 "
          f"{srv['itl_ms']['p50']:.1f} / p99 {srv['itl_ms']['p99']:.1f} ms", flush=True)
    num_hf = args.baseline_requests or (4 if args.quick else num)
    hf = None if args.no_baseline else run_hf(model_dir, prompts[:num_hf], output_len,
                                              args.seed)
    rows = [["server (HTTP, streaming)", srv["tok_s"], srv["wall_s"], srv["tok_s"] / roof]]
    if hf is not None:
        print(f"transformers: {hf['tok_s']:8.1f} tok/s  (sequential, {hf['per_token_ms']:.1f} "
              f"ms/token, first {num_hf} requests)", flush=True)
        rows.append(["transformers (sequential)", hf["tok_s"], hf["wall_s"], hf["tok_s"] / roof])
    rows.append(["compute roofline (2P)", roof, "", 1.0])
    print(common.table(rows, ["", "tok/s", "wall s", "fraction of roofline"]))
    ratio = srv["tok_s"] / hf["tok_s"] if hf is not None else None
    path = common.save_result(args.name, {
        "mode": "quick" if args.quick else "full", "machine": mach,
        "workload": {"requests": num, "arrival": arrival, "rate": args.rate,
                     "concurrency": args.concurrency, "input_len": args.input_len,
                     "output_len": output_len, "temperature": 1.0, "ignore_eos": True,
                     "model": "tiny qwen2 PRESET_55M", "dtype": "float32", "threads": threads,
                     "server": "started by the benchmark" if proc is not None else url},
        "params": params, "roofline_tok_s": roof, "server_startup_s": startup,
        "server": srv, "transformers_sequential": hf, "transformers_requests": num_hf,
        "ratio_server_over_transformers": ratio,
    })
    print(f"saved {path}")
    if ratio is not None:
        print(f"server / transformers (sequential) throughput ratio: {ratio:.2f}x "
              f"({srv['tok_s']:.0f} vs {hf['tok_s']:.0f} tok/s)")


if __name__ == "__main__":
    main()
