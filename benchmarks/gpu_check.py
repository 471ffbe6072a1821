"""The whole GPU path in one command, on a machine with a GPU (under 8 minutes on one H200).

    python benchmarks/gpu_check.py                   # CUDA: bf16 engine, real sizes
    python benchmarks/gpu_check.py --cpu-dry-run     # the same plumbing on CPU, tiny sizes
    python benchmarks/gpu_check.py --sections kernels,bandwidth   # a subset (a rerun)

Sections (each in its own try/except: a failure is a row of the table, not the end):

  parity     bf16 engine vs transformers bf16 on tiny qwen2/qwen3/llama (head_dim 64) and
             qwen3_moe/qwen2_moe, for the default backend with CUDA graphs (MoE: eager), the
             Triton backend and eager decode
             (rule: rollout_engine.testing.parity)
  kernels    every Triton kernel vs its ``*_ref``, max abs error, fp32 and bf16
  bandwidth  decode attention: K/V bytes read / time, against a large ``copy_``
  e2e        GRPO-shaped rollout tok/s, engine vs ``transformers.generate``, ~0.5B random qwen2
  sleep      bytes freed on the device (``torch.cuda.mem_get_info``) by
             ``release_memory_occupation``; same greedy tokens after wake
  refit      CUDA IPC ``update_weights_from_tensor`` GB/s from this (parent) process into a
             process-mode engine, direct and flattened buckets, vs a device memcpy

Writes ``benchmarks/results/gpu_check.json`` (``gpu_check_dry_run.json`` for a dry run) and
prints the table last. Nothing is downloaded: every model is built locally.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402
import gpu_sections  # noqa: E402
import torch  # noqa: E402
from gpu_sections import Ctx, Section  # noqa: E402

ARCHS = ("qwen2", "qwen3", "llama")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")   # eager decode (no CUDA graphs for MoE layers)


def _parity_path(arch: str, dry: bool, sizes: dict[str, Any]) -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path
    from rollout_engine.testing.tiny_moe import tiny_moe_path

    if arch in MOE_ARCHS:
        return str(tiny_moe_path(arch) if dry else tiny_moe_path(arch, **sizes))
    return str(tiny_model_path(arch) if dry else tiny_model_path(arch, **sizes))


# -- parity ---------------------------------------------------------------------------------------
def parity(ctx: Ctx) -> Section:
    from rollout_engine import Engine, EngineConfig
    from rollout_engine.testing.parity import (
        GPU_TINY_SIZES,
        LOGPROB_MAX_ERR,
        LOGPROB_MEAN_ERR,
        MIN_TOP2_GAP,
        engine_vs_hf,
        load_hf,
    )
    from rollout_engine.testing.tiny_model import tiny_model_path

    sec = Section()
    num_prompts, new_tokens = (2, 4) if ctx.dry else (8, 16)
    configs: list[tuple[str, dict[str, Any]]] = []
    for arch in ARCHS + MOE_ARCHS[:1 if ctx.dry else None]:
        configs.append((arch, {}))
    if not ctx.dry:
        default = EngineConfig(model_path=str(tiny_model_path(ARCHS[0], **GPU_TINY_SIZES)),
                               **ctx.engine_flags()).resolved_attention_backend()
        if default != "triton":
            configs.append((ARCHS[0], {"attention_backend": "triton"}))
        configs.append((ARCHS[0], {"disable_cuda_graph": True}))
    for arch, extra in configs:
        path = _parity_path(arch, ctx.dry, GPU_TINY_SIZES)
        flags = {**ctx.engine_flags(), "max_total_tokens": 8192, **extra}
        engine = Engine(model_path=path, **flags)
        try:
            backend = engine.config.resolved_attention_backend()
            hf = load_hf(path, ctx.torch_dtype, ctx.device)
            vocab = engine.tm.vocab_size
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(5, vocab, (n,), generator=g).tolist()
                       for n in [3, 17, 64, 150, 5, 33, 90, 240][:num_prompts]]
            reports = engine_vs_hf(engine, hf, prompts, new_tokens)
        finally:
            engine.shutdown()
        graphs = "eager" if extra.get("disable_cuda_graph") or ctx.dry else "graphs"
        name = f"parity {arch} [{backend}, {graphs}]"
        ok = all(r.ok for r in reports)
        compared = sum(r.compared_tokens for r in reports)
        total = len(reports) * new_tokens
        worst = max(r.logprob_max_err for r in reports)
        mean = sum(r.logprob_mean_err for r in reports) / len(reports)
        sec.row(name, "ok" if ok else "FAIL",
                f"{compared}/{total} tokens compared before a near tie, all equal"
                if ok else f"mismatch at {[r.first_mismatch for r in reports]}",
                f"logprob err max {worst:.3g} mean {mean:.3g}")
        sec.data[name] = [vars(r) for r in reports]
        sec.ok &= ok
    sec.data["rule"] = {"min_top2_gap": MIN_TOP2_GAP, "logprob_max_err": LOGPROB_MAX_ERR,
                        "logprob_mean_err": LOGPROB_MEAN_ERR}
    return sec


def kernel_errors(ctx: Ctx, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Max abs error of each Triton kernel against its ``*_ref`` on random inputs."""
    from rollout_engine_kernels.triton.decode_attention import (
        decode_attention,
        decode_attention_ref,
    )
    from rollout_engine_kernels.triton.extend_attention import (
        extend_attention,
        extend_attention_ref,
    )
    from rollout_engine_kernels.triton.logprob_gather import logprob_gather, logprob_gather_ref
    from rollout_engine_kernels.triton.rmsnorm import rmsnorm, rmsnorm_ref
    from rollout_engine_kernels.triton.rotary import (
        build_cos_sin_cache,
        compute_inv_freq,
        rotary,
        rotary_ref,
    )

    dev, dry = ctx.device, ctx.dry
    g = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    def err(a: Any, b: Any) -> tuple[float, float]:
        """(max abs error, max abs reference value)."""
        if isinstance(a, tuple):
            pairs = [err(x, y) for x, y in zip(a, b)]
            return max(p[0] for p in pairs), max(p[1] for p in pairs)
        return float((a.float() - b.float()).abs().max()), float(b.float().abs().max())

    hq, hkv, d = (4, 2, 16) if dry else (32, 8, 128)
    out: dict[str, tuple[float, float]] = {}
    lens = [7, 20] if dry else [1, 17, 300, 1000, 4096, 33, 64, 129]
    k, v, table, rows = gpu_sections.make_pool(lens, hkv, d, dtype, dev)
    q = randn(len(lens), hq, d)
    args = (q, k, v, table, rows, torch.tensor(lens, device=dev), d ** -0.5)
    out["decode_attention"] = err(decode_attention(*args), decode_attention_ref(*args))

    prefix, ext = ([0, 5], [6, 3]) if dry else ([0, 17, 100, 5, 1000], [33, 1, 64, 16, 200])
    lens = [p + e for p, e in zip(prefix, ext)]
    k, v, table, rows = gpu_sections.make_pool(lens, hkv, d, dtype, dev)
    qo_start = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=dev)
    args = (randn(sum(ext), hq, d), k, v, table, rows, torch.tensor(prefix, device=dev),
            torch.tensor(ext, device=dev), qo_start, d ** -0.5)
    out["extend_attention"] = err(extend_attention(*args), extend_attention_ref(*args))

    n, hidden = (4, 64) if dry else (256, 4096)
    x, w, res = randn(n, hidden), randn(hidden), randn(n, hidden)
    out["rmsnorm"] = err(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))
    out["rmsnorm+residual"] = err(rmsnorm(x, w, 1e-6, res), rmsnorm_ref(x, w, 1e-6, res))

    cache = build_cos_sin_cache(compute_inv_freq(d, 10000.0).to(dev), 4096)
    pos = torch.randint(0, 4096, (n,), generator=g).to(dev)
    qr, kr = randn(n, hq, d), randn(n, hkv, d)
    out["rotary"] = err(rotary(qr, kr, pos, cache), rotary_ref(qr, kr, pos, cache))

    b, vocab = (2, 2048) if dry else (64, 152064)
    logits = randn(b, vocab) * 4
    ids = torch.randint(0, vocab, (b,), generator=g).to(dev)
    temps = torch.rand(b, generator=g).to(dev) + 0.5
    out["logprob_gather"] = err(logprob_gather(logits, ids, temps),
                                logprob_gather_ref(logits, ids, temps))
    return out


# -- kernels --------------------------------------------------------------------------------------
def kernels(ctx: Ctx) -> Section:
    sec = Section()
    dtypes = [torch.float32] if ctx.dry else [torch.float32, torch.bfloat16]
    # (atol, rtol of the largest reference value): bf16 outputs are rounded to 8 bits
    tols = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 2e-2)}
    for dtype in dtypes:
        atol, rtol = tols[dtype]
        for name, (err, scale) in kernel_errors(ctx, dtype).items():
            ok = err <= atol + rtol * scale
            sec.row(f"kernel {name}", f"{err:.2e}",
                    f"{str(dtype).removeprefix('torch.')}, max abs ref {scale:.3g}",
                    "ok" if ok else f"FAIL (atol {atol:.0e} + rtol {rtol:.0e})")
            sec.data[f"{name}/{dtype}"] = {"max_abs_err": err, "max_abs_ref": scale}
            sec.ok &= ok
    return sec


SECTIONS: dict[str, Callable[[Ctx], Section]] = {
    "parity": parity,
    "kernels": kernels,
    "bandwidth": gpu_sections.bandwidth,
    "e2e": gpu_sections.e2e,
    "sleep": gpu_sections.sleep_wake,
    "refit": gpu_sections.refit,
}


def _failing(ctx: Ctx) -> Section:
    raise RuntimeError("failure injected by --fail")


def run_section(name: str, fn: Callable[[Ctx], Section], ctx: Ctx) -> dict[str, Any]:
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        sec = fn(ctx)
        status = sec.status()
        rows = sec.rows + [["note", "", note, ""] for note in sec.notes]
        out = {"status": status, "rows": rows, "data": sec.data, "notes": sec.notes}
    except Exception as e:  # noqa: BLE001 - one section's failure must not hide the rest
        traceback.print_exc()
        status = "error"
        out = {"status": status, "rows": [[name, "ERROR", f"{type(e).__name__}: {e}"[:160], ""]],
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    finally:
        gpu_sections.free_device_memory()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"   {name}: {status} in {out['seconds']} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the plumbing on CPU with tiny sizes (CUDA-only parts noted)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--fail", default="", metavar="SECTION",
                    help="make SECTION raise (checks that one failure does not hide the rest)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/gpu_check[_dry_run].json)")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if not args.cpu_dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or pass --cpu-dry-run")
    if args.cpu_dry_run:
        # the Triton kernels run in the interpreter; read when a kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        common.set_threads(2)
    ctx = Ctx(dry=args.cpu_dry_run)
    t0 = time.perf_counter()
    mach = common.machine()
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        mach.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sm_count=props.multi_processor_count, cuda=torch.version.cuda)
    print(f"machine: {mach}", flush=True)
    try:
        results = {name: run_section(name, _failing if name == args.fail else SECTIONS[name],
                                     ctx) for name in wanted}
    finally:
        ctx.close()
    total = time.perf_counter() - t0
    name = "gpu_check_dry_run" if ctx.dry else "gpu_check"
    payload = {"mode": "cpu-dry-run" if ctx.dry else "cuda", "machine": mach,
               "seconds": round(total, 1), "sections": results}
    if args.out:
        path = Path(args.out)
        path.write_text(json.dumps({"benchmark": name, **payload}, indent=2, default=str) + "\n")
    else:
        path = common.save_result(name, payload)
    rows = [[sec_name, *r] for sec_name, res in results.items() for r in res["rows"]]
    print(f"saved {path} ({total:.0f} s)")
    print(common.table(rows, ["section", "metric", "value", "detail", "note"]))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
