"""Decode attention per layer on CPU: index_select + SDPA (the reference) vs the paged C++ kernel
without and with shared-prefix (cascade) attention, side by side in one run.

GRPO shape: batch B = 64 / 128 / 256 rows in groups of 8 samples that share their prompt's
128 KV slots (as the radix cache lays them out), each with 64-128 tokens of its own; the 55M
qwen2's attention (8 query heads, 2 KV heads, head_dim 64), float32, 2 torch threads. Slots are
placed the way the engine allocates them at page_size 1: each prompt's 128 slots consecutive,
then one slot per row per decode step (a row's own tokens B slots apart).

Each variant times ``TorchNativeBackend.forward`` of one layer (K/V write + attention; the
per-step ``init_forward_metadata`` is timed separately); variants are interleaved within every
repeat and the best time is kept (shared, noisy machines).

    python benchmarks/bench_attention.py --quick   # fewer repeats
    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --baseline 87cd69c   # + that commit's kernel (cascade)

The last line printed is the kernel / reference speedup at each batch (plain and cascade).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's engine, even if another checkout is the installed (editable) one
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common  # noqa: E402
import torch  # noqa: E402
from rollout_engine_kernels.cpu import build  # noqa: E402
from rollout_engine_kernels.cpu import paged_decode as cpu_paged  # noqa: E402

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool  # noqa: E402
from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend  # noqa: E402
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode  # noqa: E402

HQ, HKV, HEAD_DIM = 8, 2, 64
GROUP, PROMPT, OWN_MIN, OWN_MAX = 8, 128, 64, 128
VARIANTS = {  # name -> TorchNativeBackend keyword arguments
    "reference": {"use_kernel": False},
    "kernel": {"use_kernel": True, "min_shared_len": None},
    "cascade": {"use_kernel": True},
}


class BaselineOp:
    """The paged decode kernel of another commit (``--baseline REV``), compiled beside this
    one, called like ``PagedDecodeOp``; also a source from before the ABI check (ABI 1: no q
    row stride, q contiguous)."""

    def __init__(self, rev: str) -> None:
        import ctypes
        import subprocess
        import tempfile
        from pathlib import Path

        # the source's path at that revision (it moved out of the engine package)
        for rel in ("kernels/cpu/paged_decode.cpp",
                    "rollout_engine/model_runner/attention/csrc/paged_decode.cpp"):
            shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=os.path.dirname(_HERE),
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                break
        else:
            raise SystemExit(f"--baseline {rev}: no paged decode source at that revision")
        text = shown.stdout
        src = Path(tempfile.mkdtemp()) / "paged_decode_baseline.cpp"
        src.write_text(text)
        path = build.build_library(src, "rollout_engine_paged_decode_baseline")
        lib = ctypes.CDLL(path)
        self.abi = lib.rollout_engine_paged_decode_abi() if hasattr(
            lib, "rollout_engine_paged_decode_abi") else 1
        if self.abi == cpu_paged.PagedDecodeOp.ABI:
            self._op = cpu_paged.PagedDecodeOp(path)
            return
        if self.abi != 1:
            raise SystemExit(f"--baseline {rev}: kernel ABI {self.abi} is not supported here")
        fn = lib.rollout_engine_paged_decode_f32
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 10 + [ctypes.c_int64] * 9
                       + [ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64])
        self._fn, self._op = fn, None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                 *index_and_scale: object) -> torch.Tensor:
        if self._op is not None:
            return self._op(q, k, v, table, *index_and_scale)
        import ctypes

        *index, scale = index_and_scale
        q = q.contiguous()
        members, chunk_lens = index[3], index[5]
        out = torch.empty_like(q)
        err = ctypes.create_string_buffer(256)
        rc = self._fn(*(t.data_ptr() for t in (q, k, v, table, *index)), q.shape[0], q.shape[1],
                      k.shape[1], q.shape[2], k.shape[0], table.shape[0], table.shape[1],
                      members.numel(), chunk_lens.numel(), scale, out.data_ptr(), err, len(err))
        if rc:
            raise RuntimeError(err.value.decode(errors="replace"))
        return out


def grpo_batch(batch: int, gen: torch.Generator) -> tuple[KVPool, ReqToTokenPool, ForwardBatch]:
    """Pools and a decode ForwardBatch for ``batch // GROUP`` prompts x GROUP samples."""
    own = torch.randint(OWN_MIN, OWN_MAX + 1, (batch,), generator=gen)
    num_prompts = batch // GROUP
    decode_base = num_prompts * PROMPT
    num_slots = decode_base + OWN_MAX * batch + 1
    pool = KVPool(num_slots, 1, HKV, HEAD_DIM, torch.float32, torch.device("cpu"))
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    rtt = ReqToTokenPool(batch, PROMPT + OWN_MAX + 8, torch.device("cpu"))
    lens, loc = [], []
    for b in range(batch):
        prompt = list(range((b // GROUP) * PROMPT, (b // GROUP + 1) * PROMPT))
        n = int(own[b])
        rtt.write(b, 0, prompt + [decode_base + t * batch + b for t in range(n)])
        lens.append(PROMPT + n)
        loc.append(decode_base + (n - 1) * batch + b)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=t([0] * batch), positions=t([n - 1 for n in lens]),
        out_cache_loc=t(loc), req_pool_indices=t(list(range(batch))), seq_lens=t(lens),
        prefix_lens=t([n - 1 for n in lens]), extend_lens=t([1] * batch),
        logits_indices=t(list(range(batch))), seq_lens_list=lens,
        prefix_lens_list=[n - 1 for n in lens], extend_lens_list=[1] * batch)
    return pool, rtt, fb


def kv_bytes(fb: ForwardBatch, shared: bool) -> int:
    """K + V bytes one layer must read: every row's slots, or each shared prompt once."""
    tokens = sum(fb.seq_lens_list)
    if shared:
        tokens -= (GROUP - 1) * PROMPT * (fb.batch_size // GROUP)
    return 2 * tokens * HKV * HEAD_DIM * 4


def run_layer(backend: TorchNativeBackend, meta: object, fb: ForwardBatch, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    fb.attn_metadata = meta
    return backend.forward(q, k, v, 0, HEAD_DIM ** -0.5, fb)


_EVICT = torch.empty(0)


def evict_caches() -> None:
    """Write a buffer twice the last-level cache's size: the next call reads its KV from
    memory, as a real forward does (every layer's KV is another ~30 MB, read once a step), and
    a variant timed right after another that read the same KV gains nothing from it."""
    global _EVICT
    if _EVICT.numel() == 0:
        _EVICT = torch.empty(16 << 20)   # 64 MB of float32
    _EVICT.fill_(1.0)


def interleaved_best(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Best time of each function over ``reps`` rounds; each round runs them in a rotated
    order, each call after ``evict_caches`` (fair and cold: see there)."""
    for fn in fns.values():
        fn()
        fn()
    names = list(fns)
    best = {name: math.inf for name in fns}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            evict_caches()
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--baseline", metavar="REV",
                    help="also time this git revision's kernel (cascade plan), side by side")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    reps = 10 if args.quick else 40

    t0 = time.perf_counter()
    op = cpu_paged.load_paged_decode()
    load_s = time.perf_counter() - t0
    if op is None:
        sys.exit("the paged decode kernel did not build; nothing to compare")
    machine = common.measure_machine()
    print(f"{machine['cpu_model']} ({', '.join(machine['cpu_flags'])}), torch {machine['torch']},"
          f" {threads} threads; kernel load {load_s:.2f} s;"
          f" copy_ {machine['copy_gbps']} GB/s (read + write)")

    variants = dict(VARIANTS)
    baseline = None
    if args.baseline:
        baseline = BaselineOp(args.baseline)
        variants["baseline"] = {"use_kernel": True}
    gen = torch.Generator().manual_seed(0)
    rows, results = [], []
    for batch in args.batches:
        pool, rtt, fb = grpo_batch(batch, gen)
        q = torch.randn(batch, HQ, HEAD_DIM, generator=gen)
        k = torch.randn(batch, HKV, HEAD_DIM, generator=gen)
        v = torch.randn(batch, HKV, HEAD_DIM, generator=gen)
        backends = {name: TorchNativeBackend(pool, rtt, **kw) for name, kw in variants.items()}
        if baseline is not None:
            backends["baseline"].decode_kernel = baseline  # type: ignore[assignment]
        plan_fns = {n: functools.partial(b.init_forward_metadata, fb) for n, b in backends.items()}
        layer_fns = {}
        for name, backend in backends.items():
            plan_fns[name]()
            layer_fns[name] = functools.partial(run_layer, backend, fb.attn_metadata, fb, q, k, v)
        outs = {name: fn() for name, fn in layer_fns.items()}
        err = max(float((outs[n] - outs["reference"]).abs().max()) for n in variants
                  if n != "reference")
        layer_s = interleaved_best(layer_fns, reps)
        plan_s = interleaved_best(plan_fns, max(3, reps // 4))
        gbps = {n: kv_bytes(fb, n != "kernel") / layer_s[n] / 1e9 for n in variants
                if n != "reference"}
        speed = {n: layer_s["reference"] / layer_s[n] for n in ("kernel", "cascade")}
        rows.append([batch, round(sum(fb.seq_lens_list) / batch),
                     *(layer_s[n] * 1e3 for n in VARIANTS),
                     speed["kernel"], speed["cascade"],
                     *(plan_s[n] * 1e3 for n in VARIANTS), gbps["kernel"], gbps["cascade"], err])
        if baseline is not None:
            speed["cascade_vs_baseline"] = layer_s["baseline"] / layer_s["cascade"]
            rows[-1] += [layer_s["baseline"] * 1e3, speed["cascade_vs_baseline"]]
        results.append({"batch": batch, "mean_seq_len": sum(fb.seq_lens_list) / batch,
                        "layer_ms": {n: layer_s[n] * 1e3 for n in variants},
                        "metadata_ms": {n: plan_s[n] * 1e3 for n in variants},
                        "speedup_vs_reference": speed, "kv_read_gbps": gbps,
                        "max_abs_err_vs_reference": err})
    header = ["batch", "mean len", "ref ms", "kernel ms", "cascade ms", "kernel x", "cascade x",
              "ref meta ms", "kernel meta ms", "cascade meta ms", "kernel GB/s", "cascade GB/s",
              "max err"] + (["baseline ms", "cascade x baseline"] if baseline is not None else [])
    print(common.table(rows, header))
    name = "bench_attention" + ("" if threads == common.DEFAULT_THREADS else f"_t{threads}")
    path = common.save_result(name + ("_quick" if args.quick else ""), {
        "machine": machine, "threads": threads, "kernel_load_s": load_s, "reps": reps,
        "baseline": args.baseline,
        "shape": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "group": GROUP, "prompt": PROMPT,
                  "own": [OWN_MIN, OWN_MAX]},
        "results": results})
    print(f"saved {path}")
    print("speedup vs index_select + SDPA: " + ", ".join(
        f"B={r['batch']} kernel {r['speedup_vs_reference']['kernel']:.2f}x"
        f" cascade {r['speedup_vs_reference']['cascade']:.2f}x"
        + (f" (vs baseline {r['speedup_vs_reference']['cascade_vs_baseline']:.2f}x)"
           if baseline is not None else "") for r in results))


if __name__ == "__main__":
    main()
