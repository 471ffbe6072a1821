"""Weight-sync benchmark: seconds and GB/s of one full refit of an Engine, by transport and bucket
size, against a plain ``tensor.copy_`` of the same bytes measured in the same run.

    python benchmarks/bench_weight_sync.py --quick    # 55M only, buckets 16 MB / 256 MB, 1 repeat
    python benchmarks/bench_weight_sync.py            # 55M and ~540M, buckets 16 MB .. 1 GB, 3

A trainer-side ``transformers`` model (loaded from the engine's own checkpoint directory) is
pushed with ``WeightSyncer`` over "tensor" (shared-memory handles), "distributed" (gloo
broadcast) and "disk" (safetensors). Each row: one warm-up sync, then the median of N timed
syncs. ``engine`` is the scheduler's own apply time (deserialize / receive + validate + copy);
``trainer`` is the rest (packing, serializing, the pipe, broadcast waits); ``pack s`` (tensor
rows) is the packing alone, into the transport's two reused buffers (warm). The memcpy roofline
copies the same number of bytes between two preallocated float32 tensors (median of N).
Goals on CPU: tensor within 3x of memcpy, distributed within 6x. Also sleep/wake timings.

The cast row ("tensor/none, bf16 -> fp32 cast", next to the plain "tensor/none" in the same
run) pushes a bf16 copy of the trainer into the fp32 engine, which casts while copying into its
parameters (as SGLang's loaders do); ``cast_copy_seconds`` is its roofline, one bf16 -> fp32
``copy_`` of the same elements. Quick runs save under ``bench_weight_sync_quick``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, measure_machine, save_result, set_threads, table  # noqa: E402
from rollout_engine import Engine  # noqa: E402
from rollout_engine.protocol.bucket import plan_buckets  # noqa: E402
from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path  # noqa: E402
from trainer_bridge.bucketing import nbytes, state_dict_items  # noqa: E402
from trainer_bridge.transports.tensor import BucketBuffers  # noqa: E402
from trainer_bridge.weight_syncer import WeightSyncer  # noqa: E402

MB = 1 << 20
GOALS = {"tensor": 3.0, "distributed": 6.0}
MODELS = {
    "55M": dict(PRESET_55M, tie_word_embeddings=False),
    "540M": dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=4,
                 intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False),
}


def median_time(fn: Any, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def memcpy_seconds(num_bytes: int, repeats: int, src_dtype: torch.dtype = torch.float32
                   ) -> float:
    """One copy_ into a float32 tensor of ``num_bytes``, from float32 or (a cast) ``src_dtype``."""
    dst = torch.empty(num_bytes // 4, dtype=torch.float32)
    src = torch.ones(num_bytes // 4, dtype=src_dtype)
    return statistics.median(median_time(lambda: dst.copy_(src), max(repeats, 3)))


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
        return median_time(fill_all, 1)[0]
    finally:
        buffers.release()


class ApplyRecorder:
    """Wraps ``engine._call`` to collect the scheduler-side ``seconds`` of each weight update
    and how many tensors it cast."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.orig, self.seconds, self.num_cast = engine, engine._call, 0.0, 0

        def call(method: str, **kw: Any) -> Any:
            r = self.orig(method, **kw)
            if method.startswith("update_weights") and r.success and isinstance(r.result, dict):
                self.seconds += float(r.result.get("seconds", 0.0))
                self.num_cast += int(r.result.get("num_cast", 0))
            return r

        engine._call = call  # type: ignore[method-assign]

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


CAST = torch.bfloat16   # the cast row's trainer dtype (the engine is float32)


def configs(quick: bool) -> list[tuple[str, Optional[int], torch.dtype]]:
    buckets = [16 * MB, 256 * MB] if quick else [16 * MB, 64 * MB, 256 * MB, 1024 * MB]
    fp32 = torch.float32
    return ([("tensor", None, fp32), ("tensor", None, CAST)]
            + [("tensor", b, fp32) for b in buckets] + [("distributed", None, fp32)]
            + [("distributed", b, fp32) for b in buckets] + [("disk", None, fp32)])


def label(transport: str, bucket: Optional[int], dtype: torch.dtype = torch.float32) -> str:
    if transport == "disk":
        return "disk"
    lab = f"{transport}/{'none' if bucket is None else f'{bucket // MB}MB'}"
    return lab if dtype == torch.float32 else f"{lab}, bf16 -> fp32 cast"


def bench_model(name: str, spec: dict[str, Any], args: argparse.Namespace, threads: int
                ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    path = str(tiny_model_path("qwen2", **spec))
    trainer = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    total = nbytes(state_dict_items(trainer))
    print(f"[{name}] {total / 4 / 1e6:.1f}M params, {total / 1e9:.3f} GB fp32 "
          f"(model ready in {time.perf_counter() - t0:.1f}s)", flush=True)
    copy_s = memcpy_seconds(total, args.repeats)
    out: dict[str, Any] = {"model": name, "params": total // 4, "bytes": total, "spec": spec,
                           "memcpy_seconds": copy_s, "memcpy_gbps": total / copy_s / 1e9,
                           "cast_copy_seconds": memcpy_seconds(total, args.repeats, CAST),
                           "rows": [], "sleep_wake": []}
    half = [(n, t.to(CAST)) for n, t in state_dict_items(trainer)]   # a bf16 trainer's weights
    eng = Engine(model_path=path, scheduler_mode="process", dtype="float32", device="cpu",
                 max_total_tokens=args.max_total_tokens, num_threads=threads, random_seed=0)
    rec = ApplyRecorder(eng)
    try:
        for transport, bucket, dtype in configs(args.quick):
            lab = label(transport, bucket, dtype)
            source = trainer if dtype == torch.float32 else half
            pack_s = None
            if bucket is not None and transport == "tensor":  # its packing alone
                pack_s = pack_seconds(source, bucket)
            syncer = WeightSyncer(eng, transport=transport, bucket_bytes=bucket, backend="gloo")
            try:
                syncer.sync(source, version=f"{lab}-warm")
                rec.take()
                rec.num_cast = 0
                secs, applies, moved = [], [], 0
                for i in range(args.repeats):
                    rep = syncer.sync(source, version=f"{lab}-{i}")
                    secs.append(rep.seconds)
                    applies.append(rec.take())
                    moved = rep.bytes
            finally:
                syncer.close()
            assert eng.get_weight_version() == f"{lab}-{args.repeats - 1}"
            # the cast row really cast every tensor, the others none
            assert rec.num_cast == (0 if dtype == torch.float32 else len(half) * args.repeats)
            s = statistics.median(secs)
            row = {"label": lab, "transport": transport, "bucket_bytes": bucket,
                   "source_dtype": str(dtype).removeprefix("torch."), "bytes": moved,
                   "seconds": s, "all_seconds": secs, "gbps": moved / s / 1e9,
                   "engine_apply_seconds": statistics.median(applies), "pack_seconds": pack_s,
                   "ratio_to_memcpy": s / copy_s}
            out["rows"].append(row)
            print(f"  {lab:18s} {s:7.3f}s  {row['gbps']:6.2f} GB/s  x{row['ratio_to_memcpy']:.2f}"
                  f" memcpy  (engine apply {row['engine_apply_seconds']:.3f}s)", flush=True)
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
    return out


def chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    colors = {"tensor": "tab:blue", "distributed": "tab:orange", "disk": "tab:gray"}
    for ax, res in zip(axes[0], results):
        rows = res["rows"]
        ax.bar(range(len(rows)), [r["gbps"] for r in rows],
               color=[colors[r["transport"]] for r in rows])
        ax.axhline(res["memcpy_gbps"], color="red", ls="--",
                   label=f"memcpy {res['memcpy_gbps']:.1f} GB/s")
        for goal_t, k in GOALS.items():
            ax.axhline(res["memcpy_gbps"] / k, color=colors[goal_t], ls=":", lw=1,
                       label=f"{goal_t} goal (memcpy/{k:g})")
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=40, ha="right")
        ax.set_ylabel("GB/s (payload bytes / refit seconds)")
        ax.set_title(f"{res['model']} qwen2 fp32 ({res['bytes'] / 1e9:.2f} GB) refit on CPU")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="55M only, 2 bucket sizes, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None, help="timed syncs per row (default 3)")
    ap.add_argument("--models", default=None, help="comma list of " + ",".join(MODELS))
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    names = (args.models.split(",") if args.models else ["55M"] if args.quick else list(MODELS))
    threads = set_threads(args.threads)
    mach = measure_machine()
    results = [bench_model(n, MODELS[n], args, threads) for n in names]

    for res in results:
        rows = [[r["label"], f"{r['bytes'] / 1e6:.1f}", r["seconds"], r["gbps"],
                 r["engine_apply_seconds"], r["pack_seconds"] or "-", r["ratio_to_memcpy"]]
                for r in res["rows"]]
        print(f"\n## {res['model']} ({res['params'] / 1e6:.1f}M params, {res['bytes'] / 1e6:.1f}"
              f" MB), memcpy {res['memcpy_seconds']:.4f}s = {res['memcpy_gbps']:.2f} GB/s, "
              f"bf16 -> fp32 copy_ {res['cast_copy_seconds']:.4f}s")
        print(table(rows, ["transport/bucket", "MB moved", "s/refit", "GB/s", "engine apply s",
                           "pack s", "x memcpy"]))
        sw = [[w["tags"], f"{w['bytes_freed'] / 1e6:.1f}", w["release_seconds"],
               w["resume_seconds"], w["release_wall_seconds"], w["resume_wall_seconds"]]
              for w in res["sleep_wake"]]
        print(table(sw, ["tags", "MB freed", "release s", "resume s", "release wall s",
                         "resume wall s"]))

    verdicts = []
    for res in results:
        for transport, goal in GOALS.items():
            best = min((r for r in res["rows"] if r["transport"] == transport
                        and r["source_dtype"] == "float32"),
                       key=lambda r: r["ratio_to_memcpy"])
            met = best["ratio_to_memcpy"] <= goal
            verdicts.append({"model": res["model"], "transport": transport, "goal_x": goal,
                             "best": best["label"], "ratio": best["ratio_to_memcpy"], "met": met})
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = "bench_weight_sync" + ("_quick" if args.quick else "")
    png = RESULTS_DIR / f"{name}.png"
    chart(results, png)
    path = save_result(name, {
        "machine": mach, "mode": "quick" if args.quick else "full", "repeats": args.repeats,
        "goals_x_memcpy": GOALS, "models": results, "verdicts": verdicts, "chart": png.name})
    print(f"\nsaved {path} and {png}")
    for v in verdicts:
        print(f"[{v['model']}] {v['transport']} best ({v['best']}): refit / memcpy = "
              f"{v['ratio']:.2f}x (goal <= {v['goal_x']:g}x: {'MET' if v['met'] else 'NOT MET'})")


if __name__ == "__main__":
    main()
