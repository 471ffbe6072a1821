"""Weight-sync benchmark: one full refit of an Engine by transport and bucket size, each path next
to its own physical limit measured in the same run, and vLLM CPU's ``reload_weights`` as the peer.

    python benchmarks/bench_weight_sync.py --quick --repeats 3   # 55M, buckets 16 / 256 MB
    python benchmarks/bench_weight_sync.py --repeats 3           # 55M and ~540M, 16 MB .. 1 GB
    python benchmarks/bench_weight_sync.py --models 55M --repeats 7 --name bench_weight_sync_55m

A trainer-side ``transformers`` model (the engine's own checkpoint, its parameters copied into
memory of its own as a trainer's are: transformers leaves them mapped from the file, whose
pages the kernel may drop and read again mid-sync) is pushed with ``WeightSyncer``. Every row
and roofline is best-of ``--repeats`` (after a warm-up); medians are saved too, and each
round's refit over the rooflines timed in that round (``round_ratios``; the verdicts print their
median next to the best-of ratio). The rooflines:

- tensor handles: a copy of the same bytes between two preallocated tensors, the fastest of
  ``copy_``, one thread's and two threads' memcpy (the engine's apply is one such copy out of
  the trainer's shared memory);
- distributed: a raw ``torch.distributed`` (gloo) broadcast of the same bytes, as one flat
  buffer, from this process to a second one, on the same kind of group the transport uses;
- disk: a raw read of the same files into a preallocated buffer plus a ``copy_`` of the bytes
  into preallocated tensors. The files are in the page cache (just written / read; dropping it
  needs root), so "read" is a copy out of the page cache. The disk row is the engine's
  ``update_weights_from_disk`` of the model directory itself; "disk (syncer)" also writes it.

vLLM's CPU build (``benchmarks/vllm_peer.py``, its own venv) loads the same directory and times
``collective_rpc("reload_weights")`` (vLLM 0.32's in-place reload from disk).

``engine apply`` is the scheduler's own time for the update calls (receive + validate + copy);
``tensor/<B>`` rows are the CPU default (a bucket is a group of shared-memory handles: no
packing copy); ``tensor-packed/<B>`` force flattened buckets (``pack=True``, the layout CUDA
uses), and their ``pack s`` is packing alone into the transport's two reused buffers (warm).
Likewise ``distributed/<B>`` is the gloo default (a call of per-tensor broadcasts per bucket)
and ``distributed-packed/<B>`` one flattened broadcast per bucket (the NCCL default). The
cast row pushes a bf16 copy of the trainer into the fp32 engine (cast fused into the copy; its
roofline is a bf16 -> fp32 ``copy_``). Quick runs save under ``bench_weight_sync_quick``.

This process, the trainer, runs with ``OMP_WAIT_POLICY=PASSIVE`` (unless set otherwise): by
default its OpenMP workers spin for milliseconds after each parallel op (the rooflines timed
just before every refit are such ops), on one of the two cores the engine's copy runs on,
which put ~1-4 ms on a 55M refit (measured 2026-12-02: engine apply 9.8-9.9 -> 8.4-8.6 ms).
A CPU trainer sharing the engine's cores wants the same setting (the engine's scheduler runs
with it already); vLLM's reload runs with OpenMP's defaults.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads OpenMP (docstring)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, measure_machine, save_result, set_threads, table  # noqa: E402
from benchmarks.weight_sync_limits import (  # noqa: E402
    CAST,
    ROUND_ROBIN_BYTES,
    Rooflines,
    timed,
    vllm_reload_seconds,
)
from benchmarks.weight_sync_report import (  # noqa: E402
    GOALS,
    ROOFLINE,
    ROOFLINE_KEY,
    chart,
    roofline_of,
    verdicts_of,
)
from benchmarks.weight_sync_rows import MB, ApplyRecorder, Row, configs  # noqa: E402
from rollout_engine import Engine  # noqa: E402
from rollout_engine.protocol.bucket import plan_buckets  # noqa: E402
from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path  # noqa: E402
from trainer_bridge.bucketing import nbytes, state_dict_items  # noqa: E402
from trainer_bridge.transports.tensor import BucketBuffers  # noqa: E402
from trainer_bridge.weight_syncer import WeightSyncer  # noqa: E402

MODELS = {
    "55M": dict(PRESET_55M, tie_word_embeddings=False),
    "540M": dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=4,
                 intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False),
}


def pack_seconds(source: Any, bucket_bytes: int) -> float:
    """One pass packing every bucket into the tensor transport's two reused buffers, warm
    (their pages already touched by a first pass), as each sync after the first pays it. A
    tensor bigger than a bucket is sent over its own bytes, unpacked, so it is skipped."""
    plans = [p for p in plan_buckets(state_dict_items(source), bucket_bytes)
             if len(p.entries) > 1 or p.num_bytes <= bucket_bytes]
    if not plans:
        return 0.0
    size = max(p.num_bytes for p in plans)
    buffers = BucketBuffers()

    def fill_all() -> None:
        for i, p in enumerate(plans):
            p.fill(buffers.slot(i, size, p.device))

    try:
        fill_all()
        return timed(fill_all)
    finally:
        buffers.release()


def bench_model(name: str, spec: dict[str, Any], args: argparse.Namespace, threads: int
                ) -> dict[str, Any]:
    """Rows of one transport at a time, in rounds: each round times every row of that
    transport once (a model over ROUND_ROBIN_BYTES: one row at a time) and every roofline
    once; a figure is its best round."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    path = str(tiny_model_path("qwen2", **spec))
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():   # memory of its own, as a trainer's weights are (module docstring)
        for p in trainer.parameters():
            p.data = p.data.clone()
    total = nbytes(state_dict_items(trainer))
    print(f"[{name}] {total / 4 / 1e6:.1f}M params, {total / 1e9:.3f} GB fp32 "
          f"(model ready in {time.perf_counter() - t0:.1f}s)", flush=True)
    half = [(n, t.to(CAST)) for n, t in state_dict_items(trainer)]   # a bf16 trainer's weights
    limits = Rooflines(path, total, [t for _, t in state_dict_items(trainer)])
    limits.time()   # warm-up, not kept: the first copy into a buffer takes its page faults
    limit_times: dict[str, list[float]] = {}
    out: dict[str, Any] = {"model": name, "params": total // 4, "bytes": total, "spec": spec,
                           "page_cache": "warm (files just read; dropping it needs root)",
                           "rows": [], "sleep_wake": []}
    eng = Engine(model_path=path, scheduler_mode="process", dtype="float32", device="cpu",
                 max_total_tokens=args.max_total_tokens, num_threads=threads, random_seed=0)
    rec = ApplyRecorder(eng)
    try:
        for family in ("tensor", "distributed", "disk"):
            specs = [c for c in configs(args.quick) if c[0].startswith(family)
                     # a big model has no room for two 1 GB send buffers more (OOM at 540M)
                     and not (c[0] == "distributed-packed" and total > ROUND_ROBIN_BYTES
                              and (c[1] or 0) > 256 * MB)]
            # a small model's rows are open together and take turns; a big one's one at a
            # time (each row's buffers are a model's worth, or a bucket's)
            groups = [specs] if total <= ROUND_ROBIN_BYTES else [[c] for c in specs]
            rows = []
            for group in groups:
                open_rows = [Row(eng, rec, t, b, d, trainer if d == torch.float32 else half,
                                 path, len(rows) + i) for i, (t, b, d) in enumerate(group)]
                rows += open_rows
                try:
                    for i in range(args.repeats):
                        for row in open_rows:
                            # tensor rows together exceed what the engine keeps mapped (twice
                            # the model): each timed sync follows a warm one, as every sync of
                            # a trainer with one syncer is warm
                            if i == 0 or (family == "tensor" and len(open_rows) > 1):
                                row.sync(f"{row.label}-warm", record=False)
                            # the limits of this row's path, timed just before it
                            this_round = limits.time(family)
                            for key, value in this_round.items():
                                limit_times.setdefault(key, []).append(value)
                            row.round_limits.append(this_round)
                            row.sync(f"{row.label}-{i}")
                finally:
                    for row in open_rows:
                        row.close()
            for row in rows:
                # the cast row really cast every tensor, the others none
                assert row.num_cast == (0 if row.dtype == torch.float32
                                        else len(half) * args.repeats)
                pack_s = (pack_seconds(row.source, row.bucket)
                          if row.bucket is not None and row.transport.endswith("-packed")
                          else None)
                s = min(row.seconds)
                out["rows"].append({
                    "label": row.label, "transport": family, "bucket_bytes": row.bucket,
                    "source_dtype": str(row.dtype).removeprefix("torch."), "bytes": row.bytes,
                    "seconds": s, "median_seconds": statistics.median(row.seconds),
                    "all_seconds": row.seconds, "gbps": row.bytes / s / 1e9,
                    "engine_apply_seconds": min(row.applies), "pack_seconds": pack_s,
                    "syncer_writes_the_files": row.transport == "disk-syncer",
                    "round_limits": row.round_limits})
                print(f"  {row.label:32s} {s:7.3f}s  {row.bytes / s / 1e9:6.2f} GB/s  (engine "
                      f"apply {min(row.applies):.3f}s)", flush=True)
        for tags in (["weights"], ["kv_cache"], None):
            t0 = time.perf_counter()
            rel = eng.release_memory_occupation(tags)
            rel_wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = eng.resume_memory_occupation(tags)
            res_wall = time.perf_counter() - t0
            out["sleep_wake"].append({
                "tags": "all" if tags is None else ",".join(tags),
                "bytes_freed": rel["bytes_freed"], "release_seconds": rel["seconds"],
                "release_wall_seconds": rel_wall, "resume_seconds": res["seconds"],
                "resume_wall_seconds": res_wall, "weights_stale": res.get("weights_stale")})
        # resumed weights are zeros (no CPU backup): refit so the engine is usable again
        with WeightSyncer(eng, transport="tensor", bucket_bytes=None) as syncer:
            syncer.sync(trainer, version="final")
    finally:
        eng.shutdown()
        gc.collect()
        limits.close()
    out.update({k: min(v) for k, v in limit_times.items()})
    out["roofline_all_seconds"] = limit_times
    out["memcpy_gbps"] = total / out["memcpy_seconds"] / 1e9
    out["vllm_reload"] = vllm_reload_seconds(path, args.repeats) if args.vllm else None
    for row in out["rows"]:
        row["roofline"] = roofline_of(row)
        row["roofline_seconds"] = out[ROOFLINE_KEY[row["roofline"]]]
        row["ratio_to_roofline"] = row["seconds"] / row["roofline_seconds"]
        # each refit over the roofline timed just before it (the machine is shared: a best-of
        # over best-of pairs moments that may be far apart)
        key = ROOFLINE_KEY[row["roofline"]]
        limits_of = row.pop("round_limits")
        row["round_ratios"] = [t / lim[key] for t, lim in zip(row["all_seconds"], limits_of)]
        row["median_round_ratio"] = statistics.median(row["round_ratios"])
        if row["transport"] == "tensor":   # the goal stated over torch's copy_ as well
            row["ratio_to_torch_copy"] = row["seconds"] / out["memcpy_torch_seconds"]
            row["median_round_ratio_torch_copy"] = statistics.median(
                t / lim["memcpy_torch_seconds"] for t, lim in zip(row["all_seconds"], limits_of))
        row["ratio_to_memcpy"] = row["seconds"] / out["memcpy_seconds"]
        row["ratio_to_shm_copy"] = (row["seconds"] / out["shm_copy_seconds"]
                                    if "shm_copy_seconds" in out else None)
        row["ratio_to_per_tensor_broadcast"] = (
            row["seconds"] / out["raw_per_tensor_broadcast_seconds"]
            if row["transport"] == "distributed" else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="55M only, 2 bucket sizes")
    ap.add_argument("--repeats", type=int, default=None, help="timed syncs per row (default 3)")
    ap.add_argument("--models", default=None, help="comma list of " + ",".join(MODELS))
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-vllm", dest="vllm", action="store_false",
                    help="skip vLLM's reload_weights (its venv: benchmarks/vllm_peer.py)")
    ap.add_argument("--name", default=None, help="results/<name>.json and .png")
    args = ap.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    names = (args.models.split(",") if args.models else ["55M"] if args.quick else list(MODELS))
    threads = set_threads(args.threads)
    mach = measure_machine()
    results = [bench_model(n, MODELS[n], args, threads) for n in names]

    print(f"\nCPU: {mach['cpu_model']} ({mach['cores']} cores), torch {mach['torch']}, "
          f"best of {args.repeats} (x roofline: best over best; paired: median over rounds of "
          "each refit over the roofline timed just before it)")
    for res in results:
        rows = [[r["label"], f"{r['bytes'] / 1e6:.1f}", r["seconds"], r["gbps"],
                 r["engine_apply_seconds"], r["pack_seconds"] or "-", r["roofline"],
                 r["roofline_seconds"], r["ratio_to_roofline"], r["median_round_ratio"],
                 r["ratio_to_memcpy"], r.get("ratio_to_torch_copy") or "-",
                 r["ratio_to_shm_copy"] if r["transport"] == "tensor"
                 and r["ratio_to_shm_copy"] is not None else "-",
                 r["seconds"] / res["raw_per_tensor_broadcast_seconds"]
                 if r["transport"] == "distributed" else "-"]
                for r in res["rows"]]
        peer = res["vllm_reload"]
        if peer:
            rows.append([f"vLLM {peer['vllm']} reload_weights", "-", peer["best_seconds"],
                         res["bytes"] / peer["best_seconds"] / 1e9, "-", "-", "read + copy",
                         res["read_copy_seconds"], peer["best_seconds"] / res["read_copy_seconds"],
                         "-", peer["best_seconds"] / res["memcpy_seconds"], "-", "-", "-"])
        print(f"\n## {res['model']} ({res['params'] / 1e6:.1f}M params, {res['bytes'] / 1e6:.1f}"
              f" MB). Rooflines: memcpy {res['memcpy_seconds']:.4f}s (out of shared memory "
              f"{res.get('shm_copy_seconds', float('nan')):.4f}s), bf16 -> fp32 copy_ "
              f"{res['cast_copy_seconds']:.4f}s, raw gloo broadcast "
              f"{res['raw_broadcast_seconds']:.4f}s (one broadcast per tensor "
              f"{res['raw_per_tensor_broadcast_seconds']:.4f}s), read + copy {res['read_copy_seconds']:.4f}s "
              f"(read alone {res['read_seconds']:.4f}s; page cache {res['page_cache']})")
        print(table(rows, ["path", "MB moved", "s/refit", "GB/s", "engine apply s", "pack s",
                           "roofline", "roofline s", "x roofline", "paired", "x memcpy", "x copy_",
                           "x shm copy", "x per-tensor bcast"]))
        sw = [[w["tags"], f"{w['bytes_freed'] / 1e6:.1f}", w["release_seconds"],
               w["resume_seconds"], w["release_wall_seconds"], w["resume_wall_seconds"]]
              for w in res["sleep_wake"]]
        print(table(sw, ["tags", "MB freed", "release s", "resume s", "release wall s",
                         "resume wall s"]))

    verdicts = [v for res in results for v in verdicts_of(res)]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = args.name or ("bench_weight_sync" + ("_quick" if args.quick else ""))
    png = RESULTS_DIR / f"{name}.png"
    chart(results, png)
    path = save_result(name, {
        "machine": mach, "mode": "quick" if args.quick else "full", "repeats": args.repeats,
        "statistic": "verdicts: median over rounds of each refit over its roofline timed just "
                     "before it (met), and best-of repeats over the best roofline (met_best_of)",
        "goals_x_roofline": GOALS, "rooflines": ROOFLINE,
        "models": results, "verdicts": verdicts, "chart": png.name})
    print(f"\nsaved {path} and {png}")
    for v in verdicts:
        print(f"[{v['model']}] {v['goal']}: {v['best']} paired {v['value']:.2f} "
              f"({'MET' if v['met'] else 'NOT MET'}), best-of {v['best_of']:.2f} "
              f"({'met' if v['met_best_of'] else 'not met'})")

if __name__ == "__main__":
    main()
