"""The W8A8 int8 linear on CPU (``int8_gemm.cpp``): activations quantized per token inside,
exact int32 sums over the int8 weight read in place (no packed copy), the float32 rescale of
the definition; bit for bit `int8_linear_ref`.

Why a kernel: without AVX512-VNNI, oneDNN's int8 GEMM (``torch.ops.onednn.qlinear_pointwise``)
saturates int16 pairs at full 8-bit activations, and exact only with them split in two 7-bit
halves (twice the work) it ran level with the float32 product at 16-256 rows and behind at
one row; ``torch._int_mm`` and ``_weight_int8pack_mm`` are reference loops on this CPU. Built
and loaded like the other CPU kernels (``build``: at first use, cached, one warning and None
when it cannot be built); ``fast`` is False where the build has no AVX2 (the scalar sums are
correct but slow). ``ROLLOUT_ENGINE_INT8_GEMM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch
from rollout_engine_kernels.cpu import build

SOURCE = Path(__file__).resolve().parent / "int8_gemm.cpp"
INT8_GEMM_ENV = "ROLLOUT_ENGINE_INT8_GEMM"

_I64, _P = ctypes.c_int64, ctypes.c_void_p


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The definition: ``x [M, K]`` float32 quantized per row (``amax / 127``, round half to
    even, clamp to 127), int sums exact (float64), ``(acc * s_x) * s_w`` in float32, + bias."""
    amax = x.abs().amax(dim=1, keepdim=True)
    s_x = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q_x = torch.round(x / s_x).clamp_(-127, 127)
    acc = (q_x.double() @ q.double().t()).float()
    out = (acc * s_x) * w_scale.reshape(1, -1).float()
    return out if bias is None else out + bias.float()


def quantize_rows_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: ``scale = amax / 127`` (1 for a zero row), ``round_half_even(w / scale)``
    clamped to [-127, 127] as int8; the scales ``[N, 1]``."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


class Int8Gemm:
    """The compiled kernel; `__call__` checks what the C side cannot see."""

    ABI = 3

    def __init__(self, library_path: str) -> None:
        lib = build.open_library(library_path, "rollout_engine_int8_gemm_abi", self.ABI)
        self.fast = bool(lib.rollout_engine_int8_gemm_fast())
        fn = lib.rollout_engine_int8_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I64]
        self._fn = fn
        quantize = lib.rollout_engine_int8_quantize_rows
        quantize.restype = ctypes.c_int
        quantize.argtypes = [_P, _I64, _I64, _I64, _P, _P]
        self._quantize = quantize

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``w [N, K]`` float32 on CPU (rows may be strided) -> (int8 ``[N, K]``, float32
        scales ``[N, 1]``) by the activations' rule per row: `quantize_rows_ref`, bit for
        bit."""
        if not (w.dtype is torch.float32 and w.is_cpu and w.dim() == 2 and w.shape[0] > 0
                and w.shape[1] > 0 and w.stride(1) == 1 and w.stride(0) >= w.shape[1]):
            raise ValueError(f"int8_gemm: quantize_rows takes a float32 CPU matrix with "
                             f"unit column stride, got {w.dtype} {tuple(w.shape)} {w.stride()}")
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, 1, dtype=torch.float32)
        self._quantize(w.data_ptr(), n, k, w.stride(0), q.data_ptr(), scale.data_ptr())
        return q, scale

    def __call__(self, x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [M, K]`` float32 (rows may be strided) against the int8 ``q [N, K]`` (rows may
        be strided) with float32 ``w_scale`` (``N`` values, contiguous) and ``bias [N]``: a new
        contiguous float32 ``[M, N]``."""
        f32 = torch.float32
        if not (x.dtype is f32 and q.dtype is torch.int8 and w_scale.dtype is f32
                and x.is_cpu and q.is_cpu and w_scale.is_cpu
                and (bias is None or (bias.dtype is f32 and bias.is_cpu))):
            raise ValueError("int8_gemm: x float32, q int8, scales and bias float32, on CPU")
        m, k = x.shape if x.dim() == 2 else (0, -1)
        n = q.shape[0] if q.dim() == 2 else 0
        xs, qs = x.stride(), q.stride()
        ok = (m > 0 and n > 0 and k > 0 and q.shape[1] == k and xs[-1] == 1 and qs[-1] == 1
              and xs[0] >= k and qs[0] >= k and w_scale.numel() == n
              and w_scale.is_contiguous()
              and (bias is None or (bias.shape == (n,) and bias.is_contiguous())))
        if not ok:
            raise ValueError(f"int8_gemm: x {tuple(x.shape)} {x.stride()}, q {tuple(q.shape)} "
                             f"{q.stride()}, scales {tuple(w_scale.shape)}, bias "
                             f"{None if bias is None else tuple(bias.shape)}")
        out = torch.empty(m, n, dtype=f32)
        self._fn(x.data_ptr(), m, k, xs[0], q.data_ptr(), n, qs[0], w_scale.data_ptr(),
                 None if bias is None else bias.data_ptr(), out.data_ptr(), n)
        return out


@functools.cache
def load_int8_gemm() -> Optional[Int8Gemm]:
    """The compiled kernel, or None: turned off or not buildable (one warning)."""
    return build.load_or_warn(
        # no fused multiply-add: the rescale and the bias are the definition's two roundings
        lambda: Int8Gemm(build.build_library(SOURCE, "rollout_engine_int8_gemm",
                                             ("-ffp-contract=off",))),
        "CPU int8 GEMM kernel", "using oneDNN's int8 product", INT8_GEMM_ENV)
