"""Float32 linear layers of a decode step's few rows on CPU (``small_gemm.cpp``).

oneDNN reorders a plain ``[N, K]`` weight on every call, which 32-64 rows (a decode batch)
cannot amortize; the kernel reads the weight in place and vectorizes over the rows instead
(see the source). Measured on the 2-core AVX-512 EPYC, the 55M model's shapes, interleaved
calls: 64 rows +9-37% over oneDNN (the LM head, 32000 x 512, 290 -> 395 GFLOP/s), 32-48 rows
+2-40%, 128 rows -2% to +13% (the LM head 353 -> 399), even with it or behind at 256 rows
(-1% to -13%), behind below 16 rows. Against oneDNN on a packed weight (``weight_packs``,
which spares it the reorder) only 32-64 rows stay here. `use_small_gemm` encodes both; each
computes an output as one sequential sum over k at these shapes (equal bit for bit at K = 512).

Built and loaded like the other CPU kernels (``build``: at first use, cached, one warning and
None when it cannot be built). Where the compiler does not target AVX-512 it is built on 8-lane
vectors, correct (and tested) but not faster, and ``fast`` is False: `linear` keeps oneDNN
there. ``ROLLOUT_ENGINE_SMALL_GEMM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from rollout_engine_kernels.cpu import build

SOURCE = Path(__file__).resolve().parent / "small_gemm.cpp"
SMALL_GEMM_ENV = "ROLLOUT_ENGINE_SMALL_GEMM"

MIN_ROWS, MAX_ROWS = 32, 128           # every product
WIDE_MIN_ROWS, WIDE_MAX_ROWS = 16, 128  # products with at least WIDE_OUTPUTS outputs (LM head)
WIDE_OUTPUTS = 8192

_I64, _P = ctypes.c_int64, ctypes.c_void_p


PACKED_MAX_ROWS = 64                   # against oneDNN on a packed weight (`weight_packs`)


def use_small_gemm(rows: int, outputs: int, packed: bool = False) -> bool:
    """Whether a product of ``rows`` rows and ``outputs`` outputs runs faster here than in
    oneDNN (see the module docstring for the measurements). Against oneDNN on a weight it
    packed once (``packed``) only 32-64 rows: there the kernel was level or ahead (the LM head
    at 64 rows 4.96 against 5.46 ms; engine batch 64 -4% tok/s with the packed products), at
    16 rows and 128-256 behind (the LM head 2.2 / 10.1 / 20.1 against 1.9 / 10.2 / 18.8 ms;
    engine batch 128 +4%)."""
    if packed:
        return MIN_ROWS <= rows <= PACKED_MAX_ROWS
    if MIN_ROWS <= rows <= MAX_ROWS:
        return True
    return outputs >= WIDE_OUTPUTS and WIDE_MIN_ROWS <= rows <= WIDE_MAX_ROWS


class SmallGemm:
    """The compiled kernel; `__call__` checks what the C side cannot see."""

    ABI = 2

    def __init__(self, library_path: str) -> None:
        lib = build.open_library(library_path, "rollout_engine_small_gemm_abi", self.ABI)
        # an AVX-512 build: faster than oneDNN where use_small_gemm says; elsewhere correct only
        self.fast = bool(lib.rollout_engine_small_gemm_fast())
        fn = lib.rollout_engine_small_gemm_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64]
        self._fn = fn

    @property
    def raw(self) -> Callable[..., int]:
        """The C function (x, M, K, ldx, w, N, ldw, bias or None, out, ldo), unchecked: for a
        caller that checked its operands itself (``models.cpu_decode``)."""
        return self._fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [M, K]`` (rows may be strided) times ``weight [N, K]`` (rows may be strided)
        transposed, plus ``bias [N]``: a new contiguous ``[M, N]``."""
        f32 = torch.float32
        if not (x.dtype is f32 and weight.dtype is f32 and x.is_cpu and weight.is_cpu
                and (bias is None or (bias.dtype is f32 and bias.is_cpu))):
            raise ValueError("small_gemm: tensors must be float32 on CPU")
        m, k = x.shape if x.dim() == 2 else (0, -1)
        n = weight.shape[0] if weight.dim() == 2 else 0
        xs, ws = x.stride(), weight.stride()
        ok = (m > 0 and n > 0 and k > 0 and weight.shape[1] == k and xs[-1] == 1
              and ws[-1] == 1 and xs[0] >= k and ws[0] >= k
              and (bias is None or (bias.shape == (n,) and bias.is_contiguous())))
        if not ok:
            raise ValueError(f"small_gemm: x {tuple(x.shape)} {x.stride()}, weight "
                             f"{tuple(weight.shape)} {weight.stride()}, bias "
                             f"{None if bias is None else tuple(bias.shape)}")
        out = torch.empty(m, n, dtype=torch.float32)
        self._fn(x.data_ptr(), m, k, xs[0], weight.data_ptr(), n, ws[0],
                 None if bias is None else bias.data_ptr(), out.data_ptr(), n)
        return out


@functools.cache
def load_small_gemm() -> Optional[SmallGemm]:
    """The compiled kernel, or None: turned off or not buildable (one warning); ``linear``
    uses it only where it is ``fast``."""
    return build.load_or_warn(
        lambda: SmallGemm(build.build_library(SOURCE, "rollout_engine_small_gemm")),
        "CPU small GEMM kernel", "using oneDNN", SMALL_GEMM_ENV)
