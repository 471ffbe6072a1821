"""Prefill-decode disaggregation on two cores: TTFT and inter-token latency under a mixed load.

Three setups, each given the same two cores, each started and stopped by this script, one after
the other (never at once; ``pd_setups.py``):

- ``pd``: one prefill server and one decode server (``--disaggregation-mode prefill|decode``,
  one torch thread each, separate processes) behind the real sglang-router in PD mode
  (``--pd-disaggregation``), which sends each request to both with bootstrap fields added;
- ``colocated``: one server, two threads;
- ``dp2``: one server with ``--dp-size 2`` (two scheduler replicas, one thread each, behind
  the server's own dispatcher).

Each request streams through ``/generate`` with token ids, ``ignore_eos``, T=1. Per setup:

- ``solo``: a long prompt with nothing else running, three times: its TTFT is what one
  prefill (and, in PD, the transfer) costs;
- ``alone``: the long decodes only (``decodes`` streams of ``decode_new`` tokens from short
  prompts): their ITL without interference;
- ``mixed N ms``: the same decodes while long prompts arrive (``longs`` of them, one every N
  ms, ``long_len``-token prompts, ``long_new`` new tokens each), the first once every decode
  has its first token; once per interval, each with its own prompts (no cached prefixes).

Reported: TTFT of the long prompts, ITL of the decodes (gaps between stream chunks: p50, p99
and the longest, since a stall of every decode at once is under 1% of the gaps), generated
tokens per second.

    python benchmarks/bench_pd.py --quick                   # 55M tiny qwen2, short run
    python benchmarks/bench_pd.py                           # 55M: 8 x 256 decodes, 1024 prompts
    python benchmarks/bench_pd.py --shape qwen2.5-0.5b      # a real shape (smaller workload)

The last line printed: PD's decode ITL p99 and long-prompt TTFT p50 against colocated's at
the slowest arrival rate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import pd_setups  # noqa: E402

MS = 1000.0
SOLO_RUNS = 3


@dataclasses.dataclass(frozen=True)
class Workload:
    """The mixed load: running decodes plus long prompts arriving at a fixed interval (one
    run per entry of ``intervals_ms``)."""

    decodes: int = 8
    decode_len: int = 16          # prompt tokens of each long decode
    decode_new: int = 256
    longs: int = 6
    long_len: int = 1024
    long_new: int = 16
    intervals_ms: tuple[float, ...] = (2500.0, 1000.0)
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("decodes", "decode_len", "decode_new", "longs", "long_len", "long_new"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")
        if not self.intervals_ms or min(self.intervals_ms) < 0:
            raise ValueError(f"Workload.intervals_ms must be >= 0 ms each (at least one), "
                             f"got {self.intervals_ms}")
        if self.vocab <= 5:
            raise ValueError(f"Workload.vocab must be > 5, got {self.vocab}")


@dataclasses.dataclass(frozen=True)
class Requests:
    """The prompts of one setup's runs: the decodes' (the same in every run), one list of long
    prompts per interval, the solo prompts and a warm-up prompt, all different."""

    decode_prompts: list[list[int]]
    long_prompts: dict[float, list[list[int]]]
    solo_prompts: list[list[int]]
    warm_prompt: list[int]

    def offsets_s(self, interval_ms: float) -> list[float]:
        """When each long prompt of ``interval_ms``'s run is sent, s after the decodes run."""
        return [i * interval_ms / MS for i in range(len(self.long_prompts[interval_ms]))]


def build_requests(w: Workload) -> Requests:
    """Seeded random token ids (no special ids below 5)."""
    import torch

    g = torch.Generator().manual_seed(w.seed)
    dec = torch.randint(5, w.vocab, (w.decodes, w.decode_len), generator=g).tolist()
    n_long = len(w.intervals_ms) * w.longs + SOLO_RUNS + 1
    lng = torch.randint(5, w.vocab, (n_long, w.long_len), generator=g).tolist()
    runs = {ms: lng[i * w.longs:(i + 1) * w.longs] for i, ms in enumerate(w.intervals_ms)}
    return Requests(dec, runs, lng[-SOLO_RUNS - 1:-1], lng[-1])


def summarize(decodes: list[dict[str, Any]], longs: list[dict[str, Any]], wall_s: float
              ) -> dict[str, Any]:
    """One run's figures from its requests' records (each: ``ttft`` s, ``itl`` list of s,
    ``tokens``, ``e2e`` s): TTFT of the long prompts, ITL of the decodes, tokens per second."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    itl = [x for r in decodes for x in r["itl"]]
    ttft = [r["ttft"] for r in longs]
    tokens = sum(r["tokens"] for r in decodes) + sum(r["tokens"] for r in longs)
    out: dict[str, Any] = {
        "wall_s": round(wall_s, 3), "generated_tokens": tokens,
        "tok_s": round(tokens / wall_s, 2),
        "decode_itl_ms": {"p50": round(common.p50(itl) * MS, 2),
                          "p99": round(common.p99(itl) * MS, 2),
                          "max": round(max(itl, default=float("nan")) * MS, 2)}}
    if longs:
        out["long_ttft_ms"] = {"p50": round(common.p50(ttft) * MS, 1),
                               "p99": round(common.p99(ttft) * MS, 1)}
    return out


async def stream_one(client: Any, prompt: list[int], new: int, started: Optional[asyncio.Event]
                     = None, counter: Optional[list[int]] = None) -> dict[str, Any]:
    """One streamed ``/generate``; chunk arrival times give TTFT and the ITL gaps."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            n = chunk.get("meta_info", {}).get("completion_tokens", 0)
            if n > tokens:
                times.append(time.perf_counter())
                tokens = n
                if len(times) == 1 and counter is not None and started is not None:
                    counter[0] -= 1
                    if counter[0] == 0:
                        started.set()
    if tokens != new:
        raise RuntimeError(f"asked for {new} tokens (ignore_eos), got {tokens}")
    return {"ttft": times[0] - t0, "e2e": times[-1] - t0, "tokens": tokens,
            "itl": [b - a for a, b in zip(times, times[1:])], "chunks": len(times)}


async def run_mixed(url: str, req: Requests, w: Workload, interval_ms: Optional[float]
                    ) -> dict[str, Any]:
    """The decodes, and (an ``interval_ms``) that run's long prompts arriving once every
    decode runs."""
    import httpx

    limits = httpx.Limits(max_connections=w.decodes + w.longs + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        started, counter = asyncio.Event(), [w.decodes]
        t0 = time.perf_counter()
        dec = [asyncio.create_task(stream_one(client, p, w.decode_new, started, counter))
               for p in req.decode_prompts]
        longs: list[asyncio.Task] = []
        if interval_ms is not None:
            await started.wait()
            t1 = time.perf_counter()
            for p, at in zip(req.long_prompts[interval_ms], req.offsets_s(interval_ms)):
                await asyncio.sleep(max(0.0, t1 + at - time.perf_counter()))
                longs.append(asyncio.create_task(stream_one(client, p, w.long_new)))
        dres = await asyncio.gather(*dec)
        lres = await asyncio.gather(*longs)
        wall = time.perf_counter() - t0
    out = summarize(dres, lres, wall)
    out["chunks_per_decode"] = sum(r["chunks"] for r in dres) / len(dres)
    return out


async def warm_up_and_solo(url: str, req: Requests, w: Workload) -> float:
    """Warm the setup (a long prompt, the decodes' prompts), then the median TTFT (ms) of the
    solo prompts sent one at a time."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        await stream_one(client, req.warm_prompt, 4)
        await asyncio.gather(*(stream_one(client, p, 8) for p in req.decode_prompts))
        solo = [(await stream_one(client, p, w.long_new))["ttft"] for p in req.solo_prompts]
    return round(common.p50(solo) * MS, 1)


def workload_for(shape: str, quick: bool) -> Workload:
    if shape == "55m":
        return (Workload(decode_new=96, longs=3, intervals_ms=(1500.0,)) if quick
                else Workload())
    vocab = 151936
    return (Workload(decodes=4, decode_new=32, longs=2, long_len=512, intervals_ms=(3000.0,),
                     vocab=vocab) if quick else
            Workload(decodes=4, decode_new=64, longs=3, long_len=512, intervals_ms=(4000.0,),
                     vocab=vocab))


def _model_dir(shape: str) -> str:
    if shape == "55m":
        from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

        return str(tiny_model_path("qwen2", **PRESET_55M))
    from rollout_engine.testing.real_shapes import real_shape_path

    return str(real_shape_path(shape))


def _mixed_key(interval_ms: float) -> str:
    return f"mixed {interval_ms:g} ms"


def verdict(found: dict[str, dict[str, Any]]) -> list[str]:
    """Plain sentences: where PD pays on these cores and where it does not (a latency ratio
    under 1 is PD's lower than the other setup's; a throughput ratio over 1 is PD's higher)."""
    lines = []
    keys = sorted({k for ph in found.values() for k in ph if k.startswith("mixed")},
                  key=lambda k: -float(k.split()[1]))
    for setup, phases in found.items():
        alone = phases.get("alone")
        for key in keys:
            if alone and phases.get(key):
                ratio = phases[key]["decode_itl_ms"]["p99"] / alone["decode_itl_ms"]["p99"]
                lines.append(f"{setup}, {key}: the arriving prompts raise the decodes' ITL p99 "
                             f"{ratio:.2f}x over the decodes alone")
    for key in keys:
        pd = found.get("pd", {}).get(key)
        for other in ("colocated", "dp2"):
            o = found.get(other, {}).get(key)
            if not (pd and o):
                continue
            itl = pd["decode_itl_ms"]["p99"] / o["decode_itl_ms"]["p99"]
            worst = pd["decode_itl_ms"]["max"] / o["decode_itl_ms"]["max"]
            ttft = pd["long_ttft_ms"]["p50"] / o["long_ttft_ms"]["p50"]
            pays = ("PD pays: the running decodes are kept from the prefills"
                    if itl < 1 and worst < 1 else "PD does not pay here" if itl >= 1 and
                    worst >= 1 else "PD pays on one of the two")
            lines.append(
                f"{key}, pd vs {other}: decode ITL p99 {itl:.2f}x and longest stall "
                f"{worst:.2f}x ({pays}), long-prompt TTFT p50 {ttft:.2f}x ("
                + ("lower" if ttft < 1 else "the transfer and a one-core prefill cost")
                + f"), throughput {pd['tok_s'] / o['tok_s']:.2f}x")
    return lines


def rows_of(found: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """The printed table's rows: per setup, solo TTFT, then each load."""
    rows = []
    for setup, phases in found.items():
        rows.append([setup, "solo", "-", "-", "-", "-", phases["solo_ttft_ms"], "-"])
        for phase, r in phases.items():
            if phase == "solo_ttft_ms":
                continue
            t = r.get("long_ttft_ms", {})
            d = r["decode_itl_ms"]
            rows.append([setup, phase, r["tok_s"], d["p50"], d["p99"], d["max"],
                         t.get("p50", "-"), t.get("p99", "-")])
    return rows


def run_setup(setup: str, model_dir: str, context_len: int, req: Requests, w: Workload
              ) -> dict[str, Any]:
    """Start ``setup``, measure solo, alone and each mixed load, stop it."""
    procs, url = pd_setups.start_setup(setup, model_dir, context_len)
    try:
        found: dict[str, Any] = {"solo_ttft_ms": asyncio.run(warm_up_and_solo(url, req, w))}
        print(f"{setup} solo: long-prompt TTFT {found['solo_ttft_ms']:.0f} ms", flush=True)
        for interval in (None, *w.intervals_ms):
            key = "alone" if interval is None else _mixed_key(interval)
            r = found[key] = asyncio.run(run_mixed(url, req, w, interval))
            ttft = r.get("long_ttft_ms")
            print(f"{setup} {key}: {r['tok_s']:.1f} tok/s, decode ITL p50 "
                  f"{r['decode_itl_ms']['p50']:.1f} / p99 {r['decode_itl_ms']['p99']:.1f} / max "
                  f"{r['decode_itl_ms']['max']:.0f} ms"
                  + (f", long TTFT p50 {ttft['p50']:.0f} / p99 {ttft['p99']:.0f} ms"
                     if ttft else ""), flush=True)
        return found
    finally:
        for p in procs:
            pd_setups.stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter run (fewer tokens, prompts)")
    ap.add_argument("--shape", default="55m", help="55m, or a real shape: qwen2.5-0.5b")
    ap.add_argument("--setups", default=",".join(pd_setups.SETUPS))
    ap.add_argument("--intervals-ms", default=None, help="comma-separated arrival intervals")
    ap.add_argument("--name", default=None, help="results/<name>.json")
    args = ap.parse_args()

    w = workload_for(args.shape, args.quick)
    if args.intervals_ms:
        w = dataclasses.replace(w, intervals_ms=tuple(
            float(x) for x in args.intervals_ms.split(",")))
    req = build_requests(w)
    model_dir = _model_dir(args.shape)
    context_len = max(w.long_len + w.long_new, w.decode_len + w.decode_new) + 64
    common.set_threads(2)
    mach = common.measure_machine()
    print(f"machine: {mach['cores']} cores, {mach['cpu_model']} ({', '.join(mach['cpu_flags'])}),"
          f" torch {mach['torch']}; matmul {mach['matmul_fp32_gflops']:.1f} GFLOP/s", flush=True)
    print(f"model: {args.shape} ({model_dir}), float32; workload: {dataclasses.asdict(w)}",
          flush=True)

    found: dict[str, dict[str, Any]] = {}
    loads: dict[str, float] = {}
    setups = [s for s in args.setups.split(",") if s]
    for setup in setups:
        loads[setup] = round(os.getloadavg()[0], 2)
        try:
            found[setup] = run_setup(setup, model_dir, context_len, req, w)
        except RuntimeError as exc:
            print(f"{setup}: skipped ({exc})", flush=True)
    print(common.table(rows_of(found), ["setup", "load", "tok/s", "ITL p50 ms", "ITL p99 ms",
                                        "ITL max ms", "TTFT p50 ms", "TTFT p99 ms"]))
    notes = verdict(found)
    for line in notes:
        print(line)
    name = args.name or ("bench_pd" + ("" if args.shape == "55m" else f"_{args.shape}")
                         + ("_quick" if args.quick else ""))
    path = common.save_result(name, {
        "machine": mach, "setups": pd_setups.DESCRIPTIONS, "model": args.shape,
        "dtype": "float32", "route": "/generate (stream, input_ids)",
        "workload": dataclasses.asdict(w), "load_avg_1m_before": loads, "results": found,
        "verdict": notes})
    print(f"saved {path}")
    key = _mixed_key(max(w.intervals_ms))
    pd, co = found.get("pd", {}).get(key), found.get("colocated", {}).get(key)
    if pd and co:
        print(f"pd / colocated, {key}: decode ITL p99 {pd['decode_itl_ms']['p99']:.1f} vs "
              f"{co['decode_itl_ms']['p99']:.1f} ms (longest stall {pd['decode_itl_ms']['max']:.0f}"
              f" vs {co['decode_itl_ms']['max']:.0f} ms), long TTFT p50 "
              f"{pd['long_ttft_ms']['p50']:.0f} vs {co['long_ttft_ms']['p50']:.0f} ms, "
              f"{pd['tok_s']:.0f} vs {co['tok_s']:.0f} tok/s")
    else:
        print("pd / colocated: no pair measured")


if __name__ == "__main__":
    main()
