"""RMSNorm with an optional fused residual add, matching Hugging Face ``LlamaRMSNorm``.

Rounding follows the HF model exactly, so a bf16 engine stays token-exact with HF:

    new_residual = (x + residual).to(dtype)            # HF adds in the model dtype
    h            = new_residual.float()
    normed       = (h * rsqrt(mean(h^2) + eps)).to(dtype)
    out          = weight * normed                     # product rounded to the output dtype
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from rollout_engine_kernels.triton._utils import kernel_device_ok, next_power_of_2

import triton
import triton.language as tl

__all__ = ["rmsnorm", "rmsnorm_ref"]


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, NewR, eps,
    stride_x, stride_r, stride_o, stride_nr,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(NewR.dtype.element_ty)
        tl.store(NewR + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * normed).to(Out.dtype.element_ty), mask=mask)


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"expected x [N, H] and weight [H]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x in shape and dtype; got {tuple(residual.shape)} "
            f"{residual.dtype} vs {tuple(x.shape)} {x.dtype}"
        )


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMS-normalise each row of x [N, H] and scale by weight [H].

    Without ``residual`` returns ``out``; with it returns ``(out, x + residual)`` where
    ``out`` normalises the sum. Inputs are not modified.
    """
    _check_shapes(x, weight, residual)
    kernel_device_ok(x, weight, *([residual] if residual is not None else []))
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    if residual is None:
        r = new_r = x  # placeholders; HAS_RESIDUAL=False never touches them
    else:
        r = residual if residual.stride(1) == 1 else residual.contiguous()
        new_r = torch.empty_like(x)
    if x.shape[0] > 0:
        _rmsnorm_kernel[(x.shape[0],)](
            x, r, weight, out, new_r, float(eps),
            x.stride(0), r.stride(0), out.stride(0), new_r.stride(0),
            HIDDEN=x.shape[1], BLOCK_H=next_power_of_2(x.shape[1]),
            HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    return out if residual is None else (out, new_r)


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Pure-PyTorch reference for :func:`rmsnorm` (the HF ``LlamaRMSNorm.forward`` code)."""
    _check_shapes(x, weight, residual)
    if residual is not None:
        x = x + residual
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)
