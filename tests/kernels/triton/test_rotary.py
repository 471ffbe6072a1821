"""rotary (Triton) vs rotary_ref, and the frequency helpers vs Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout_engine_kernels.triton.rotary import (  # noqa: E402
    build_cos_sin_cache,
    compute_inv_freq,
    rotary,
    rotary_ref,
)

FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}  # fp32 q/k, fp32 math on both sides
FREQ_TOL = {"atol": 0.0, "rtol": 1e-6}  # same fp32 formula as transformers
LOW_PRECISION_TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16/fp16 q/k on CUDA
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, max_pos, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)
    return q, k, positions


def _hf_config(head_dim, base, rope_scaling):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": base, **(rope_scaling or {})},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("num_tokens", "num_q_heads", "num_kv_heads", "head_dim"),
    [(5, 2, 2, 16), (9, 4, 1, 32), (3, 6, 2, 64), (4, 3, 3, 24)],
)
def test_rotary_matches_ref(device, num_tokens, num_q_heads, num_kv_heads, head_dim):
    cache = build_cos_sin_cache(compute_inv_freq(head_dim, 10000.0), 64).to(device)
    q, k, positions = _inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, 64,
                              torch.float32, device, seed=head_dim)  # fmt: skip
    q_out, k_out = rotary(q, k, positions, cache)
    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q_out, q_ref, **FP32_TOL)
    torch.testing.assert_close(k_out, k_ref, **FP32_TOL)


def test_rotary_strided_views_of_fused_qkv(device):
    """q and k sliced from one [T, Hq + 2 * Hkv, D] projection are read through their strides."""
    cache = build_cos_sin_cache(compute_inv_freq(32, 10000.0), 40).to(device)
    qkv, _, positions = _inputs(6, 8, 1, 32, 40, torch.float32, device, seed=1)
    q, k = qkv[:, :4], qkv[:, 4:6]
    for out, ref in zip(
        rotary(q, k, positions, cache), rotary_ref(q, k, positions, cache), strict=True
    ):
        torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING])
def test_rotary_ref_matches_hf_llama(rope_scaling):
    """cache + rotary_ref reproduce HF LlamaRotaryEmbedding + apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim, base = 64, 500000.0
    hf_rope = LlamaRotaryEmbedding(_hf_config(head_dim, base, rope_scaling))
    q, k, positions = _inputs(7, 4, 2, head_dim, 3000, torch.float32, "cpu", seed=2)
    cos, sin = hf_rope(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = build_cos_sin_cache(compute_inv_freq(head_dim, base, rope_scaling), 3000)
    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), **FP32_TOL)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), **FP32_TOL)


@pytest.mark.parametrize("original_max_pos", [8192, 64])
def test_llama3_inv_freq_matches_transformers(original_max_pos):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {**LLAMA3_SCALING, "original_max_position_embeddings": original_max_pos}
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(128, 500000.0, scaling), "cpu")
    inv_freq = compute_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(inv_freq, expected, **FREQ_TOL)
    # All three regimes occur, so the comparison exercises each branch of the formula.
    default = compute_inv_freq(128, 500000.0)
    ratio = default / inv_freq
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_default_inv_freq_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(_hf_config(96, 1e4, None))
    torch.testing.assert_close(compute_inv_freq(96, 1e4, {"rope_type": "default"}), expected,
                               **FREQ_TOL)  # fmt: skip


def test_compute_inv_freq_rejects_unknown_rope_type():
    with pytest.raises(ValueError, match="yarn"):
        compute_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_low_precision_cuda(dtype):
    cache = build_cos_sin_cache(compute_inv_freq(128, 500000.0, LLAMA3_SCALING), 4096).cuda()
    q, k, positions = _inputs(300, 32, 8, 128, 4096, dtype, "cuda", seed=4)
    for out, ref in zip(
        rotary(q, k, positions, cache), rotary_ref(q, k, positions, cache), strict=True
    ):
        torch.testing.assert_close(out, ref, **LOW_PRECISION_TOL)
