"""A mixture-of-experts layer's experts on a decode step's few rows per expert, float32 on CPU
(``moe_experts.cpp``): every used expert's SwiGLU in one call, its weights read in place.

Grouped by expert, a decode batch gives each expert a handful of rows, and a product per
expert through torch costs more in dispatch than in arithmetic (128 experts x 3 products a
layer). The kernel reads each used expert's weights once, threads over (expert, block of
outputs). Each output is one sum in a fixed order (see the source): a row's result does not
depend on its expert's other rows or on threads.

Built and loaded like the other CPU kernels (``build``); ``ROLLOUT_ENGINE_MOE_KERNEL=0`` turns
it off (`load_moe_experts` then returns None and the caller keeps its torch path).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch
from rollout_engine_kernels.cpu import build

SOURCE = Path(__file__).resolve().parent / "moe_experts.cpp"
MOE_KERNEL_ENV = "ROLLOUT_ENGINE_MOE_KERNEL"
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class MoeExperts:
    """The compiled kernel; `__call__` checks what the C side cannot see."""

    ABI = 3

    def __init__(self, library_path: str) -> None:
        lib = build.open_library(library_path, "rollout_engine_moe_experts_abi", self.ABI)
        fn = lib.rollout_engine_moe_experts_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I64, _P, _P, _I64, _P, _I64, _P, _P]
        self._fn = fn
        sig = lib.rollout_engine_moe_sigmoid_f32
        sig.restype = None
        sig.argtypes = [_P, _P, _I64]
        self._sigmoid = sig

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.sigmoid`` of a contiguous float32 CPU tensor, every element by the same
        scalar code: an element's bits do not depend on where it sits in the tensor."""
        if not (x.dtype is torch.float32 and x.is_cpu and x.is_contiguous()):
            raise ValueError("moe_experts.sigmoid: x must be contiguous float32 on CPU")
        out = torch.empty_like(x)
        self._sigmoid(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def __call__(self, xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 offsets: torch.Tensor) -> torch.Tensor:
        """``xs [R, H]`` rows sorted by expert, expert e's run ``offsets[e] .. offsets[e+1]``
        (int64 ``[E + 1]``), through ``w13 [E, 2I, H]`` (gate rows then up rows) and
        ``w2 [E, H, I]``: each row's ``down(silu(gate) * up)``, a new ``[R, H]``."""
        f32 = torch.float32
        if not all(t.dtype is f32 and t.is_cpu and t.is_contiguous() for t in (xs, w13, w2)):
            raise ValueError("moe_experts: xs, w13 and w2 must be contiguous float32 on CPU")
        e, two_i, h = w13.shape
        r = xs.shape[0]
        ok = (xs.dim() == 2 and xs.shape[1] == h and two_i % 2 == 0
              and w2.shape == (e, h, two_i // 2) and offsets.dtype is torch.int64
              and offsets.shape == (e + 1,) and offsets.is_contiguous()
              and int(offsets[0]) == 0 and int(offsets[-1]) == r)
        if not ok:
            raise ValueError(f"moe_experts: xs {tuple(xs.shape)}, w13 {tuple(w13.shape)}, "
                             f"w2 {tuple(w2.shape)}, offsets {tuple(offsets.shape)}")
        act = torch.empty(r, two_i // 2, dtype=f32)
        ys = torch.empty(r, h, dtype=f32)
        self._fn(xs.data_ptr(), h, w13.data_ptr(), w2.data_ptr(), two_i // 2,
                 offsets.data_ptr(), e, act.data_ptr(), ys.data_ptr())
        return ys


@functools.cache
def load_moe_experts() -> Optional[MoeExperts]:
    """The compiled kernel, or None: turned off or not buildable (one warning)."""
    return build.load_or_warn(
        lambda: MoeExperts(build.build_library(SOURCE, "rollout_engine_moe_experts",
                                               ("-ffp-contract=off",))),
        "CPU MoE experts kernel", "using a product per expert", MOE_KERNEL_ENV)
