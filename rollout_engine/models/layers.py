"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, fused projections."""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from rollout_engine_kernels.cpu.fused_ops import FusedOps, load_fused_ops
from rollout_engine_kernels.cpu.small_gemm import load_small_gemm, use_small_gemm
from torch import nn

from rollout_engine.models import batch_invariant, weight_packs


def fused_ops_for(x: torch.Tensor) -> Optional[FusedOps]:
    """The compiled CPU ops (``rollout_engine_kernels.cpu.fused_ops``) when they apply to ``x``
    (float32 on CPU), else None: the PyTorch ops below are then used (and stay the reference
    for the fused ones)."""
    if not x.is_cpu or x.dtype is not torch.float32:
        return None
    return load_fused_ops()


ONEDNN_ENV = "ROLLOUT_ENGINE_ONEDNN"


@functools.cache
def _onednn_linear_ok() -> bool:
    """Whether float32 CPU linears go through oneDNN (``torch.ops.mkldnn._linear_pointwise``
    on the weight's packed copy, `weight_packs`, or the plain weight). On the 2-core
    development machine it runs the decode shapes at 210-230 GFLOP/s where ``F.linear`` (MKL)
    reaches 155-195. Off by ``ROLLOUT_ENGINE_ONEDNN=0``, or
    when this torch has no oneDNN, or when it disagrees with ``F.linear`` on a probe."""
    if os.environ.get(ONEDNN_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=gen) for s in ((3, 40), (24, 40), (24,)))
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-5))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def small_gemm_allowed() -> bool:
    """Whether `linear` may send float32 CPU products to the small-GEMM kernel at all (it
    does only on its oneDNN path); `use_small_gemm` then decides by shape."""
    return _onednn_linear_ok()


ONEDNN_EXACT_ROWS = 16
"""Row counts up to this go to oneDNN as they are; larger ones are padded (`onednn_rows`)."""


def onednn_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at in oneDNN: ``rows`` up to
    ``ONEDNN_EXACT_ROWS``, else rounded up to a multiple of 1/16 of its power of two (17-32 by
    1, 33-64 by 2, ..., 1025-2048 by 64): at most 1/16 more rows, 16 row counts an octave.

    oneDNN (and torch's ideep layer over it) builds and caches a primitive per distinct shape,
    ~0.7 MB each: prompts of every length and decode batches of every size each added ~3.6 MB
    to the scheduler process (100 prefill lengths: +360 MB, never given back). Bucketed, a
    decoder's products need at most ~5 x 16 primitives an octave of row counts."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << max(0, (rows - 1).bit_length() - 5)
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """``F.linear``; float32 on CPU without autograd by the small-GEMM kernel at the row
    counts where it is faster (a decode step's: ``small_gemm.use_small_gemm``), else by oneDNN
    (see ``_onednn_linear_ok``) on the weight's packed copy (``weight_packs``: made once,
    redone after the weight is written), at a bucketed row count (`onednn_rows`: the input
    padded with zero rows, the output a view of its first rows).

    oneDNN builds a primitive per shape (~0.5-3 ms, then cached), so long extends of a new
    length bucket pay that once per projection shape, against products of >= 1 GFLOP each,
    where on the 2-core AVX-512 EPYC oneDNN runs 380-440 GFLOP/s and MKL 150-190 (1,024-2,377
    rows, the 55M model's shapes): every row count goes to oneDNN."""
    f32 = torch.float32
    if not (x.is_cpu and x.dtype is f32 and weight.dtype is f32 and x.dim() >= 1
            and (bias is None or bias.dtype is f32)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    if batch_invariant.active():
        return batch_invariant.product(x, weight, bias)
    if not _onednn_linear_ok():
        return F.linear(x, weight, bias)
    flat = x.dim() == 2
    rows = x.numel() // max(1, x.shape[-1])
    packing = weight_packs.packing_ok()
    if use_small_gemm(rows, weight.shape[0], packing) and x.stride()[-1] == 1 \
            and weight.stride()[-1] == 1:
        op = load_small_gemm()
        if op is not None and op.fast:
            if flat:   # a decode step's products: no reshape round trip
                return op(x, weight, bias)
            out = op(x.reshape(rows, x.shape[-1]), weight, bias)
            return out.view(*x.shape[:-1], out.shape[-1])
    packed = weight_packs.packed(weight)
    w = weight if packed is None else packed
    padded = onednn_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    staged = flat.new_empty((padded, flat.shape[1]))
    staged[:rows].copy_(flat)
    staged[rows:].zero_()
    out = torch.ops.mkldnn._linear_pointwise(staged, w, bias, "none", [], "")[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) computed by ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """A token embedding table under ``nn.Embedding``'s parameter name (``weight``,
    ``[num_embeddings, embedding_dim]``), created uninitialised: the weight loader fills it.
    (``nn.Embedding`` draws a normal init, which on the meta device imports ``torch._dynamo``
    and with it Triton, a GPU-only package.)"""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: normalise in float32, scale by ``weight``, cast back."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    """HF Llama RMSNorm: normalise in float32, scale by ``weight``, cast back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1:
            return ops.rmsnorm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual stream) and its norm, as vLLM's
        ``fused_add_rms_norm``: on CPU in one pass, with ``residual`` updated in place."""
        ops = fused_ops_for(x)
        if (ops is not None and x.dim() == 2 and x.is_contiguous()
                and residual.is_contiguous() and residual.dtype == x.dtype):
            return ops.add_rmsnorm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return rms_norm_ref(residual, self.weight, self.eps), residual


def compute_inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """Inverse frequencies for RoPE, with Llama 3's frequency-dependent scaling when asked;
    float32 on the CPU whatever device context is active (the caller moves them)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (base ** (steps.float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")
    assert rope_scaling is not None
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF ``rotate_half``), cos/sin computed per call in float32."""

    def __init__(self, head_dim: int, base: float, rope_scaling: Optional[dict[str, Any]]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, base, rope_scaling),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos/sin: [T, 1, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def apply_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` rotated; on CPU in one pass, in place
        (q and k may be views into the qkv projection's output)."""
        ops = fused_ops_for(q)
        if (ops is not None and k.dtype == q.dtype and cos.dtype == q.dtype
                and sin.dtype == q.dtype and cos.is_contiguous() and sin.is_contiguous()
                and q.stride()[1:] == (q.shape[2], 1) and k.stride()[1:] == (k.shape[2], 1)):
            ops.rope(q, k, cos, sin)
            return q, k
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with a float32 result, for logits. With 16-bit inputs the product still
    accumulates in fp32 but is not rounded back to 16 bits (a bf16 logit near 12 can be off by
    0.03, which would show up in every returned logprob)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return linear(x, weight)
    if x.is_cuda and x.dim() == 2:
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)  # cuBLAS, fp32 output
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # a torch without the fp32-output GEMM overload: upcast instead
    return F.linear(x.float(), weight.float())


class MergedLinear(nn.Module):
    """One matmul for several HF projections stacked on the output dim (qkv, gate_up).

    ``shard_sizes`` lists the output rows of each stacked projection in order; the weight loader
    copies ``q_proj`` into rows ``[0, q)`` and so on.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.shard_sizes = list(shard_sizes)
        out = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[T, 2I]`` (gate then up) -> ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_ref``, on CPU in one pass without the temporaries."""
    ops = fused_ops_for(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return ops.silu_mul(gate_up)
    return silu_mul_ref(gate_up)
