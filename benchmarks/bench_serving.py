"""Online serving: our server vs vLLM's OpenAI server (CPU build), the same streaming workload.

Both servers get the same requests on the same OpenAI route, ``/v1/completions`` with
``stream: true``: prompts of random token ids (seeded), exactly ``--output-len`` new tokens
(``ignore_eos``), temperature 1.0, on the ~55M tiny qwen2 directory, float32, 2 threads. At most
``--concurrency`` streams are in flight (each of 16 and 64 by default); the servers run one after
the other, never at once, each started and stopped by this script (vLLM in its own venv through
``vllm_peer.py``; skipped with a message when that cannot be set up).

    python benchmarks/bench_serving.py --quick                 # 16 streams x 32 tokens
    python benchmarks/bench_serving.py                         # 16 and 64 streams, 128 tokens
    python benchmarks/bench_serving.py --sides ours --url http://127.0.0.1:30000

Reports throughput, TTFT and inter-token latency (ITL) p50 / p99. The last line printed is
ours / vLLM throughput at the highest concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import vllm_peer  # noqa: E402


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (num, length), generator=g).tolist()  # no special ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(side: str, model_dir: str, threads: int, max_seqs: int
                 ) -> tuple[subprocess.Popen, str]:
    """Our server or vLLM's, on a free loopback port; returns once ``/health`` answers."""
    import httpx

    port = _free_port()
    if side == "ours":
        cmd = [sys.executable, "-m", "rollout_engine.launch_server", "--model-path", model_dir,
               "--port", str(port), "--dtype", "float32", "--device", "cpu",
               "--num-threads", str(threads), "--random-seed", "0",
               "--max-running-requests", str(max_seqs)]
        # this checkout's engine (cwd is "/"), even if another checkout is the installed one
        root = os.path.dirname(_HERE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    else:
        py = vllm_peer.vllm_python()
        if py is None:
            raise RuntimeError("vLLM is not available")
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
               "--enable-prefix-caching", "--max-num-seqs", str(max_seqs), "--seed", "0",
               "--no-enable-log-requests"]
        env = vllm_peer.vllm_env(threads)
    log = open(os.path.join(common.RESULTS_DIR, f".{side}_server.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {side} server exited (rc {proc.returncode}); see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the {side} server did not become healthy within 600 s")


async def one_request(client: Any, model: str, prompt: list[int], output_len: int
                      ) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": times[0] - t0, "e2e": times[-1] - t0, "tokens": tokens,
            "itl": [b - a for a, b in zip(times, times[1:])], "chunks": len(times)}


async def run_load(url: str, prompts: list[list[int]], output_len: int, concurrency: int
                   ) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # warm-up: a full wave of the same kind of request
        await asyncio.gather(*(one_request(client, model, p, 8) for p in prompts[:concurrency]))

        async def gated(p: list[int]) -> dict[str, Any]:
            async with gate:
                return await one_request(client, model, p, output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - t0
    assert all(r["tokens"] == output_len for r in results), "ignore_eos lengths differ"
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    ms = 1000.0
    return {"wall_s": wall, "requests": len(results), "generated_tokens": tokens,
            "tok_s": tokens / wall,
            "chunks_per_request": sum(r["chunks"] for r in results) / len(results),
            "ttft_ms": {"p50": common.p50(ttft) * ms, "p99": common.p99(ttft) * ms},
            "itl_ms": {"p50": common.p50(itl) * ms, "p99": common.p99(itl) * ms}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 streams, 32 new tokens")
    ap.add_argument("--concurrency", default=None, help="comma-separated (default 16,64)")
    ap.add_argument("--requests-per-stream", type=int, default=2,
                    help="requests = concurrency x this")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="ours,vllm")
    ap.add_argument("--url", help="a running server for the first side instead of starting one")
    ap.add_argument("--name", default=None, help="results/<name>.json")
    args = ap.parse_args()
    levels = ([int(c) for c in args.concurrency.split(",")] if args.concurrency
              else [16] if args.quick else [16, 64])
    output_len = args.output_len or (32 if args.quick else 128)

    threads = common.set_threads(args.threads)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    model_dir = str(tiny_model_path("qwen2", **PRESET_55M))
    mach = common.measure_machine()
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']} ({', '.join(mach['cpu_flags'])}),"
          f" torch {mach['torch']}, {threads} threads; matmul {mach['matmul_fp32_gflops']:.1f} "
          f"GFLOP/s", flush=True)
    print(f"workload: concurrency {levels}, {args.requests_per_stream} requests per stream, "
          f"{args.input_len}-token prompts, {output_len} new, T=1, ignore_eos, streaming "
          f"/v1/completions", flush=True)

    found: dict[str, dict[str, Any]] = {}
    sides = [s for s in args.sides.split(",") if s]
    for i, side in enumerate(sides):
        proc = None
        try:
            if args.url and i == 0:
                url = args.url
            else:
                proc, url = start_server(side, model_dir, threads, max(256, max(levels)))
        except RuntimeError as exc:
            print(f"{side}: skipped ({exc})", flush=True)
            continue
        try:
            found[side] = {}
            for c in levels:
                prompts = make_prompts(c * args.requests_per_stream, args.input_len, 32000,
                                       args.seed + c)
                r = asyncio.run(run_load(url, prompts, output_len, c))
                found[side][str(c)] = r
                print(f"{side} x{c}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_ms']['p50']:.0f}"
                      f" / p99 {r['ttft_ms']['p99']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} / "
                      f"p99 {r['itl_ms']['p99']:.1f} ms", flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    rows = []
    for c in levels:
        for side in sides:
            r: Optional[dict[str, Any]] = found.get(side, {}).get(str(c))
            if r is not None:
                rows.append([c, side, r["tok_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"],
                             r["itl_ms"]["p50"], r["itl_ms"]["p99"]])
    print(common.table(rows, ["streams", "server", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                              "ITL p50 ms", "ITL p99 ms"]))
    name = args.name or ("bench_serving_quick" if args.quick else "bench_serving")
    path = common.save_result(name, {
        "machine": mach,
        "workload": {"concurrency": levels, "requests_per_stream": args.requests_per_stream,
                     "input_len": args.input_len, "output_len": output_len,
                     "temperature": 1.0, "ignore_eos": True, "route": "/v1/completions",
                     "model": "tiny qwen2 PRESET_55M", "dtype": "float32", "threads": threads},
        "results": found})
    print(f"saved {path}")
    top = str(max(levels))
    if top in found.get("ours", {}) and top in found.get("vllm", {}):
        o, v = found["ours"][top], found["vllm"][top]
        print(f"ours / vLLM at {top} streams: {o['tok_s'] / v['tok_s']:.2f}x throughput "
              f"({o['tok_s']:.0f} vs {v['tok_s']:.0f} tok/s), ITL p50 {o['itl_ms']['p50']:.1f} "
              f"vs {v['itl_ms']['p50']:.1f} ms")


if __name__ == "__main__":
    main()
