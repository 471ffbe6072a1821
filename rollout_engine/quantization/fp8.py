"""FP8 block-wise: e4m3 weights in ``BLOCK x BLOCK`` tiles with one float32 scale each
(``weight_scale_inv [ceil(N / 128), ceil(K / 128)]``: ``w ~= q * scale`` on the tile, DeepSeek's
and SGLang's layout; compressed-tensors' block strategy stores the same tensor as
``weight_scale``), activations per token and group of ``BLOCK`` input features, each group's
scale ``amax / 448`` found at run time.

On CPU this is emulated: a weight is quantized (or read quantized) and dequantized once, at
load or refit, into the model's dtype (`dequantize_blocks`), and each product's input is
quantized and dequantized per group (`fake_quant_groups`) before an ordinary product. A CUDA
path with an FP8 GEMM is not written.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "dequantize_blocks", "fake_quant_groups",
           "quantize_blocks", "scale_shape"]

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The block scales' shape of an ``[rows, cols]`` weight."""
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` zero-padded to whole tiles, as ``[N/B, B, K/B, B]``."""
    n, k = w.shape
    nb, kb = scale_shape(n, k)
    padded = w.new_zeros(nb * BLOCK, kb * BLOCK)
    padded[:n, :k] = w
    return padded.view(nb, BLOCK, kb, BLOCK)


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> (e4m3 ``[N, K]``, float32 ``weight_scale_inv``):
    per tile ``scale = amax / 448`` in float32 (1 for an all-zero tile), values
    ``w / scale`` rounded to e4m3 (nearest)."""
    n, k = weight.shape
    tiles = _tiles(weight.detach().to(torch.float32))
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    nb, kb = scale_shape(n, k)
    return (q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(),
            scale.reshape(nb, kb).contiguous())


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [N, K]`` (e4m3) times its tile's scale, in float32, then ``dtype``. Raises
    ValueError when ``scale_inv`` is not ``scale_shape(N, K)``."""
    n, k = q.shape
    if tuple(scale_inv.shape) != scale_shape(n, k):
        raise ValueError(f"block scales of shape {tuple(scale_inv.shape)} do not match a "
                         f"[{n}, {k}] weight in {BLOCK} x {BLOCK} blocks "
                         f"(expected {scale_shape(n, k)})")
    tiles = _tiles(q.to(torch.float32))
    out = tiles * scale_inv.to(torch.float32)[:, None, :, None]
    nb, kb = scale_shape(n, k)
    return out.view(nb * BLOCK, kb * BLOCK)[:n, :k].to(dtype).contiguous()


def fake_quant_groups(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` quantized to e4m3 per token and group of ``BLOCK`` features (the last
    group may be shorter) and dequantized, in ``x``'s dtype: what an FP8 product's input
    holds."""
    k = x.shape[-1]
    groups = -(-k // BLOCK)
    xf = x.to(torch.float32).reshape(-1, k)
    padded = xf.new_zeros(xf.shape[0], groups * BLOCK)
    padded[:, :k] = xf
    g = padded.view(-1, groups, BLOCK)
    amax = g.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    deq = (g / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32) * scale
    return deq.view(-1, groups * BLOCK)[:, :k].to(x.dtype).reshape(x.shape)
