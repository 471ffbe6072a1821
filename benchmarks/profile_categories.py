"""How `profile_decode.py` reads a profiled step: each profiler event's self time goes to the
nearest label above it (the labels `profile_decode.instrument` sets), and a matmul op to its
projection by its weight's shape; the categories are its docstring's.

    categorize(events, arch) -> ms per category in one step
    summarize(profiles)      -> best and median per category over the profiled steps
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

MATMUL_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul",
              "mkldnn::_linear_pointwise")
ORDER = ["matmul qkv", "matmul o", "matmul gate_up", "matmul down", "lm_head", "attention",
         "norms", "rope", "activation", "residual", "embedding", "other ops",
         "python (model forward)", "sampler", "scheduler python"]

LABELS = {"forward", "sample", "attention", "lm_head", "norms", "rope", "activation",
          "matmul qkv", "matmul o", "matmul gate_up", "matmul down",   # these: small GEMM
          "other ops"}


def _label_of(e: Any) -> str:
    """The nearest label at or above event ``e`` ("" outside every label)."""
    p = e
    while p is not None and p.name not in LABELS:
        p = p.cpu_parent
    return "" if p is None else p.name


def _outer_op(e: Any) -> Any:
    """The outermost op above ``e`` below its label (``e`` itself if none)."""
    op, p = e, e.cpu_parent
    while p is not None and p.name not in LABELS:
        op, p = p, p.cpu_parent
    return op


def _projection(op: Any, arch: Any) -> str:
    """Which projection a matmul op computes, from its weight's shape."""
    shapes = [s for s in op.input_shapes if s]
    if op.name in ("aten::linear", "mkldnn::_linear_pointwise") and len(shapes) >= 2:
        out_f, in_f = shapes[1]
    elif op.name == "aten::addmm" and len(shapes) >= 3:
        in_f, out_f = shapes[2]
    elif len(shapes) >= 2:
        in_f, out_f = shapes[1][-2:]
    else:
        return "other ops"
    return projection_of(out_f, in_f, arch)


def projection_of(out_f: int, in_f: int, arch: Any) -> str:
    """Which projection of ``arch``'s layers a ``[out_f, in_f]`` weight belongs to ("other
    ops" if none)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    if out_f == q + 2 * kv:
        return "matmul qkv"
    if out_f == 2 * arch.intermediate_size:
        return "matmul gate_up"
    if in_f == arch.intermediate_size:
        return "matmul down"
    if in_f == q and out_f == arch.hidden_size:
        return "matmul o"
    return "other ops"


def categorize(events: Any, arch: Any) -> dict[str, float]:
    """ms of self time per category in one profiled step. A label's own self time (Python
    around its ops, a ctypes kernel) counts in its category."""
    out: dict[str, float] = defaultdict(float)
    names = {"forward": "python (model forward)", "sample": "sampler"}
    for e in events:
        label = _label_of(e)
        if not label:
            continue    # outside the forward and the sampler: in "scheduler python"
        if e.name in LABELS or label != "forward":
            cat = names.get(label, label) if e.name in LABELS else (
                "sampler" if label == "sample" else label)
        else:
            op = _outer_op(e)
            if op.name in MATMUL_OPS:
                cat = _projection(op, arch)
            elif op.name in ("aten::add", "aten::add_"):
                cat = "residual"
            elif op.name in ("aten::silu", "aten::mul"):
                cat = "activation"
            elif op.name == "aten::embedding":
                cat = "embedding"
            else:
                cat = "other ops"
        out[cat] += e.self_cpu_time_total / 1e3
    return dict(out)


def summarize(profiles: list[dict[str, float]]) -> dict[str, Any]:
    cats = [c for c in ORDER if any(c in p for p in profiles)]
    cats += sorted({c for p in profiles for c in p} - set(cats) - {"step", "batch", "tokens"})
    best = {c: min(p.get(c, 0.0) for p in profiles) for c in cats}
    med = {c: statistics.median(p.get(c, 0.0) for p in profiles) for c in cats}
    steps = [p["step"] for p in profiles]
    return {"num_steps": len(profiles), "best_ms": best, "median_ms": med,
            "step_best_ms": min(steps), "step_median_ms": statistics.median(steps),
            "sum_of_best_ms": sum(best.values())}
