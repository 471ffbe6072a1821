"""Shared helpers for the benchmarks: machine description, rooflines, percentiles, JSON results.

Conventions (docs/BENCHMARKS.md): every speed claim is a ratio measured side by side
in one run, printed as the last line, and saved with the machine's description.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_THREADS = 2


def set_threads(n: int = DEFAULT_THREADS) -> int:
    """Pin torch's intra-op threads (both sides of a comparison use the same number)."""
    n = max(1, min(n, os.cpu_count() or 1))
    torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return n


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    want = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in want if w in have]
    except OSError:
        pass
    return []


def machine() -> dict[str, Any]:
    dev = "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": dev,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _best_time(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(m: int = 1024, k: int = 2048, n: int = 2048, reps: int = 5) -> float:
    """fp32 matmul rate of a ``[m, k] @ [k, n]`` product (best of ``reps``), GFLOP/s: the
    faster of MKL (``torch.matmul``) and oneDNN (``torch.ops.mkldnn._linear_pointwise``, what
    the engine's CPU linears use), so a roofline is never set by the slower library."""
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    out = torch.empty(m, n)
    t = _best_time(lambda: torch.matmul(a, b, out=out), reps)
    if torch.backends.mkldnn.is_available():
        w = b.t().contiguous()
        try:
            t = min(t, _best_time(
                lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), reps))
        except (AttributeError, RuntimeError):
            pass
    return 2.0 * m * k * n / t / 1e9


def matmul_bf16_gflops(reps: int = 5) -> float:
    """bf16 product rate (``F.linear``: oneDNN, fp32 accumulation), GFLOP/s, of the
    ``matmul_gflops`` shape. On an AVX2-only CPU oneDNN converts to fp32 and runs ~4-7x
    slower than fp32; a probe under 1 GFLOP/s (no bf16 kernel at all) is returned as it is,
    so the measurement takes a second, not minutes."""
    def rate(m: int, k: int, n: int, r: int) -> float:
        a = torch.randn(m, k).bfloat16()
        w = torch.randn(n, k).bfloat16()
        t = _best_time(lambda: torch.nn.functional.linear(a, w), r, warmup=1)
        return 2.0 * m * k * n / t / 1e9

    probe = rate(64, 512, 512, 2)
    return probe if probe < 1.0 else max(probe, rate(1024, 2048, 2048, reps))


def copy_gbps(nbytes: int = 256 * 1024 * 1024, reps: int = 5) -> float:
    """``dst.copy_(src)`` bandwidth, GB/s counting read + write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), reps)
    return 2.0 * nbytes / t / 1e9


def matmul_gflops_huge_pages() -> Optional[float]:
    """`matmul_gflops` in a child process whose torch allocator asks for transparent huge
    pages (``THP_MEM_ALLOC_ENABLE=1``, as the engine's scheduler process runs): a roofline
    must not be set slower than the engine's own memory makes matmuls. None if it fails."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch, common; "
            "torch.set_num_threads(int(sys.argv[2])); print(common.matmul_gflops())")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent),
                              str(torch.get_num_threads())], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"},
                             check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


def measure_machine() -> dict[str, Any]:
    """The machine, its fp32 matmul rate (the faster of this process's 4 KB pages and huge
    pages, each recorded) and its copy bandwidth."""
    plain, huge = matmul_gflops(), matmul_gflops_huge_pages()
    return {**machine(), "matmul_fp32_gflops": round(max(plain, huge or 0.0), 2),
            "matmul_fp32_gflops_4k_pages": round(plain, 2),
            "matmul_fp32_gflops_huge_pages": None if huge is None else round(huge, 2),
            "matmul_bf16_gflops": round(matmul_bf16_gflops(), 2),
            "copy_gbps": round(copy_gbps(), 2)}


def model_params(model_dir: str | os.PathLike) -> dict[str, int]:
    """Parameter counts of a Llama-family HF config (MoE: ``matmul`` counts the active
    experts a token runs through, ``total`` every expert).

    ``total`` counts a tied LM head twice (the convention behind "55M");
    ``matmul`` counts the weights a token multiplies (every linear layer and the LM head once,
    not the embedding lookup): ``2 * matmul`` FLOPs is the honest per-token cost.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, v, nl = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                       cfg["num_hidden_layers"])
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    attn = h * (nh * hd + 2 * nkv * hd) + nh * hd * h
    per_layer = attn + 3 * h * inter
    experts = int(cfg.get("num_experts") or 0)
    if experts:   # a MoE layer: the router and top_k experts act on each token
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(nl) if i not in dense and (i + 1) % step == 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        moe = (h * experts + 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]
               + 3 * h * shared + (h if shared else 0))
        matmul = (nl - moe_layers) * per_layer + moe_layers * (attn + moe) + v * h
        stored = 3 * h * cfg["moe_intermediate_size"] * experts
        return {"matmul": matmul, "total": matmul + v * h + moe_layers * (
            stored - 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]),
            "per_layer": attn + moe}
    matmul = nl * per_layer + v * h
    return {"matmul": matmul, "total": matmul + v * h, "per_layer": per_layer}


def compute_roofline_tok_s(gflops: float, params: int) -> float:
    """Tokens/s if every token cost ``2 * params`` FLOPs at the measured matmul rate."""
    return gflops * 1e9 / (2.0 * params)


def cpu_seconds(*pids: Optional[int]) -> float:
    """User + system CPU seconds used so far by this process and the processes ``pids``
    (e.g. the engine's scheduler process). Unlike wall time this barely moves when other
    jobs share the cores, so tokens per CPU-second is a contention-robust cross-check."""
    import psutil

    total = 0.0
    for pid in (None, *pids):
        if pid is not None and pid == os.getpid():
            continue
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p50(values: Sequence[float]) -> float:
    return percentile(values, 50)


def p90(values: Sequence[float]) -> float:
    return percentile(values, 90)


def p99(values: Sequence[float]) -> float:
    return percentile(values, 99)


def save_result(name: str, result: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (adds a timestamp); returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **result}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A small Markdown table."""
    cells = [header] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells[1:]])


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)
