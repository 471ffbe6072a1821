"""int8 W8A8: per-output-row symmetric int8 weights, per-token symmetric int8 activations,
int32 accumulation, ``out = acc * s_x[token] * s_w[row]`` in float32.

``int8_linear_ref`` is the definition (the int32 sums formed exactly in float64). On CPU in
float32 the product is the kernel ``rollout_engine_kernels.cpu.int8_gemm`` (`cpu_kernel`): the
weight read in place, exact int32 sums by AVX2's ``vpmaddwd`` on widened int8, bit for bit the
definition. Measured on the 2-core AVX2 EPYC (one thread, best of 9, the Qwen2.5-0.5B and
[2048 x 2048] shapes), against oneDNN float32 on its packed weight: 2.9-4.7x at one row (a
quarter of the weight bytes), 1.3-2.0x at 16 rows, 1.0-1.4x at 64, level at 256. Where it
is not built, ``int8_linear`` is oneDNN's int8 GEMM (``torch.ops.onednn``) on the weight
packed once (``prepack``), which ran level with float32 at 16-256 rows and behind at one row
(the halves below cost it half its speed); elsewhere the reference.

Why oneDNN's activations go in two halves. Without AVX512-VNNI, oneDNN forms u8 x s8 products
with ``vpmaddubsw``, which adds two of them into a saturating int16: with 8-bit activations (0..255
after the zero point) two products can pass 32767 and the sum is clipped (5-7% relative error
measured at [64 x 2048 x 2048]). An activation ``q`` in [-127, 127] is split as
``lo = floor(q / 2)``, ``hi = q - lo``: both lie in [-64, 64], 0..128 with the zero point 64,
so no pair passes 32512, every int32 sum is exact, and ``acc = acc(lo) + acc(hi)``. Both halves
are one call of twice the rows.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

try:   # the kernel ships with the kernels package; an older install has none
    from rollout_engine_kernels.cpu.int8_gemm import load_int8_gemm
except ImportError:   # pragma: no cover - depends on the installed kernels
    load_int8_gemm = None

__all__ = ["Int8Weight", "cpu_kernel", "int8_linear", "int8_linear_ref", "int8_product_ok",
           "kernel_linear", "prepack", "quantize_tokens_int8", "quantize_weight_int8"]

QMAX = 127
_ZERO_POINT = 64


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> (int8 ``[N, K]``, float32 scale ``[N, 1]``):
    ``scale = amax(|row|) / 127`` computed in float32 (1 for an all-zero row), values
    ``round(w / scale)`` (half to even) clamped to [-127, 127]. On CPU by the compiled
    kernel's one pass a row where it is built (the same bits)."""
    w = weight.detach().to(torch.float32)
    kernel = cpu_kernel() if w.is_cpu and w.dim() == 2 and w.numel() else None
    if kernel is not None:
        return kernel.quantize_rows(w if w.stride(-1) == 1 else w.contiguous())
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_tokens_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> (int8-valued int16 ``[T, K]``, float32 per-token scale ``[T, 1]``), the
    same rule as the weights' per row."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int16), scale


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The definition: ``x [..., K]`` quantized per token, int sums exact (float64),
    ``acc * s_x * s_w`` rounded to float32, plus ``bias``; the result in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_tokens_int8(rows)
    acc = xq.to(torch.float64) @ q.to(torch.float64).t()
    out = (acc.to(torch.float32) * xs) * scale.reshape(1, -1).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


class Int8Weight:
    """An int8 weight ``[N, K]`` and its float32 row scales ``[N]`` as oneDNN takes them
    (``prepack``)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
        self.scale = scale.reshape(-1).to(torch.float32).contiguous()
        self.zero_points = torch.zeros(q.shape[0], dtype=torch.int64)
        self.rows = q.shape[0]


def prepack(q: torch.Tensor, scale: torch.Tensor) -> Optional[Int8Weight]:
    """The packed form of ``q`` for `int8_linear`, or None where the fast product does not
    apply (not on CPU, or this torch's oneDNN fails the probe)."""
    if not (q.is_cpu and int8_product_ok()):
        return None
    return Int8Weight(q, scale)


def _onednn(xu: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(
        xu, 1.0, _ZERO_POINT, w.packed, w.scale, w.zero_points, None, 1.0, 0,
        torch.float32, "none", [], "")


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """`int8_linear_ref` on the packed weight ``w`` (module docstring): the same int32 sums;
    the float32 rescale in another order (``(acc_lo * s_w + acc_hi * s_w) * s_x``), so the
    two agree to a few float32 ulps, not bit for bit."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_tokens_int8(rows)
    lo = torch.div(xq, 2, rounding_mode="floor")
    halves = torch.cat((lo, xq.sub_(lo))).add_(_ZERO_POINT).to(torch.uint8)
    both = _onednn(halves, w)
    t = rows.shape[0]
    out = both[:t].add_(both[t:]).mul_(xs)
    if bias is not None:
        out.add_(bias.to(torch.float32))
    return out.to(x.dtype).reshape(*x.shape[:-1], w.rows)


@functools.cache
def cpu_kernel() -> Optional[Any]:
    """The compiled W8A8 kernel where it is built for AVX2 (``fast``), else None."""
    kernel = load_int8_gemm() if load_int8_gemm is not None else None
    return kernel if kernel is not None and kernel.fast else None


def kernel_linear(kernel: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`int8_linear_ref` of float32 CPU ``x [..., K]`` by the compiled ``kernel``
    (`cpu_kernel`), bit for bit."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = kernel(rows, q, scale.reshape(-1), bias)
    return out.view(*x.shape[:-1], q.shape[0])


@functools.cache
def int8_product_ok() -> bool:
    """Whether this torch's oneDNN int8 product runs and equals the reference on a probe
    (exactly in the int32 sums: within float32 rounding of the rescale)."""
    try:
        gen = torch.Generator().manual_seed(0)
        x, weight = torch.randn(5, 64, generator=gen), torch.randn(24, 64, generator=gen)
        q, s = quantize_weight_int8(weight)
        got = int8_linear(x, Int8Weight(q, s))
        return bool(torch.allclose(got, int8_linear_ref(x, q, s), rtol=1e-5, atol=1e-6))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
