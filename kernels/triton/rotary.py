"""Neox-style rotary position embedding (HF ``rotate_half``) plus its frequency tables.

For a head vector x split into halves x1 = x[:D/2], x2 = x[D/2:] and frequency i < D/2:

    out[i]       = x1[i] * cos(pos * inv_freq[i]) - x2[i] * sin(pos * inv_freq[i])
    out[i + D/2] = x2[i] * cos(pos * inv_freq[i]) + x1[i] * sin(pos * inv_freq[i])

``cos_sin_cache[pos]`` stores ``[cos(pos * inv_freq) | sin(pos * inv_freq)]`` (D/2 each, fp32).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from rollout_engine_kernels.triton._utils import kernel_device_ok, next_power_of_2

import triton
import triton.language as tl

__all__ = ["build_cos_sin_cache", "compute_inv_freq", "rotary", "rotary_ref"]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: Optional[dict[str, Any]] = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) for default or Llama 3.1 ("llama3") RoPE.

    ``rope_scaling`` is the model config's dict; ``None`` or rope_type "default" gives plain
    RoPE. Llama 3 keeps high frequencies, divides low ones by ``factor`` and blends between.
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(
            f"rope_scaling rope_type {rope_type!r} is not supported; use None, 'default' or 'llama3'"
        )
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' is missing {missing}")
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`; short ones kept as is.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """Table [max_pos, 2 * len(inv_freq)] fp32: row p is ``[cos(p*inv_freq) | sin(p*inv_freq)]``."""
    freqs = torch.outer(
        torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device), inv_freq.float()
    )
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@triton.jit
def _rotate_heads(
    X, Out, stride_xt, stride_xh, stride_ot, stride_oh, t, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    x_ptr = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o_ptr = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    dtype = Out.dtype.element_ty
    tl.store(o_ptr, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(o_ptr + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, QOut, KOut, Positions, CosSin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cache + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cache + HALF + offs_d, mask=mask_d, other=0.0).to(
        tl.float32
    )
    _rotate_heads(Q, QOut, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_Q_HEADS, BLOCK_HALF)  # fmt: skip
    _rotate_heads(K, KOut, stride_kt, stride_kh, stride_kot, stride_koh, t, cos, sin,
                  NUM_K_HEADS, HALF, BLOCK_K_HEADS, BLOCK_HALF)  # fmt: skip


def _check_shapes(q, k, positions, cos_sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [T, Hq, D] and k [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2 != 0 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"head_dim ({head_dim}) must be even and cos_sin_cache must be [max_pos, {head_dim}], "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [T] = [{q.shape[0]}], got {tuple(positions.shape)}")


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by ``positions`` [T]; returns new (q, k).

    Math is fp32; outputs keep the input dtypes. Every position must be < max_pos.
    """
    _check_shapes(q, k, positions, cos_sin_cache)
    kernel_device_ok(q, k, positions, cos_sin_cache)
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    num_tokens, half = q.shape[0], q.shape[2] // 2
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half,
            BLOCK_Q_HEADS=next_power_of_2(q.shape[1]), BLOCK_K_HEADS=next_power_of_2(k.shape[1]),
            BLOCK_HALF=next_power_of_2(half),
        )  # fmt: skip
    return q_out, k_out


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference for :func:`rotary`, written as HF ``apply_rotary_pos_emb``."""
    _check_shapes(q, k, positions, cos_sin_cache)
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + rotate_half(q32) * sin
    k_out = k32 * cos + rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
