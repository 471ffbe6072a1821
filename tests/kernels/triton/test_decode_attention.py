"""decode_attention (Triton) vs decode_attention_ref (PyTorch) on ragged, paged KV layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout_engine_kernels.triton.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_ref,
)

FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}  # fp32 inputs, fp32 math on both sides
LOW_PRECISION_TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16/fp16 on CUDA


def _inputs(builder, seq_lens, num_q_heads, num_kv_heads, head_dim, layout, dtype, device, seed):
    pool = builder(seq_lens, num_kv_heads, head_dim, layout, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, pool, lens


@pytest.mark.parametrize(
    ("layout", "num_q_heads", "num_kv_heads", "head_dim", "seq_lens", "num_kv_splits"),
    [
        ("contiguous", 2, 2, 16, [5, 40], 1),
        ("permuted", 4, 1, 32, [1, 7, 33, 70], 4),  # group 4; splits empty for short rows
        ("paged", 4, 2, 64, [16, 3, 50], 8),
        ("paged", 6, 2, 24, [31, 1], 3),  # head_dim not a power of two, group 3
    ],
)
def test_decode_attention_matches_ref(
    kv_pool_builder, device, layout, num_q_heads, num_kv_heads, head_dim, seq_lens, num_kv_splits
):
    q, pool, lens = _inputs(
        kv_pool_builder, seq_lens, num_q_heads, num_kv_heads, head_dim, layout,
        torch.float32, device, seed=len(seq_lens) * head_dim,
    )  # fmt: skip
    args = (q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, lens)
    out = decode_attention(*args, head_dim**-0.5, num_kv_splits=num_kv_splits)
    ref = decode_attention_ref(*args, head_dim**-0.5)
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_decode_attention_strided_q(kv_pool_builder, device):
    """q sliced out of a fused qkv projection (row stride > Hq * D) is read correctly."""
    pool = kv_pool_builder([9, 20], 2, 16, "paged", device=device, seed=3)
    qkv = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4)).to(device)
    q = qkv[:, :4]
    lens = torch.tensor([9, 20], device=device)
    args = (q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, lens, 0.3)
    torch.testing.assert_close(decode_attention(*args), decode_attention_ref(*args), **FP32_TOL)


def test_decode_ref_matches_sdpa(kv_pool_builder):
    """The reference itself agrees with PyTorch SDPA on each request's gathered context."""
    seq_lens = [6, 19]
    q, pool, lens = _inputs(kv_pool_builder, seq_lens, 4, 2, 16, "permuted", torch.float32,
                            "cpu", seed=5)  # fmt: skip
    args = (q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, lens)
    ref = decode_attention_ref(*args, 0.25)
    for b, seq_len in enumerate(seq_lens):
        kv_loc = pool.req_to_token[pool.req_pool_indices[b], :seq_len].long()
        k = pool.k_buffer[kv_loc].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = pool.v_buffer[kv_loc].transpose(0, 1)[None]
        expected = F.scaled_dot_product_attention(q[b][None, :, None], k, v, scale=0.25,
                                                  enable_gqa=True)  # fmt: skip
        torch.testing.assert_close(ref[b], expected[0, :, 0], **FP32_TOL)


def test_decode_attention_rejects_bad_head_ratio(device):
    q = torch.randn(1, 3, 16, device=device)
    kv = torch.randn(4, 2, 16, device=device)
    r2t = torch.zeros(1, 4, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q, kv, kv, r2t, one * 0, one, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_low_precision_cuda(kv_pool_builder, dtype):
    q, pool, lens = _inputs(kv_pool_builder, [1, 100, 700, 33], 8, 2, 128, "paged", dtype,
                            "cuda", seed=7)  # fmt: skip
    args = (q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, lens)
    out = decode_attention(*args, 128**-0.5)
    torch.testing.assert_close(out, decode_attention_ref(*args, 128**-0.5), **LOW_PRECISION_TOL)
