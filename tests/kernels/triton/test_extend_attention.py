"""extend_attention (Triton) vs extend_attention_ref (PyTorch): ragged prefill over a prefix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout_engine_kernels.triton.decode_attention import decode_attention_ref  # noqa: E402
from rollout_engine_kernels.triton.extend_attention import (  # noqa: E402
    extend_attention,
    extend_attention_ref,
)

FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}  # fp32 inputs, fp32 math (IEEE dots) on both sides
LOW_PRECISION_TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16/fp16 on CUDA


def _inputs(builder, prefix_lens, extend_lens, num_q_heads, num_kv_heads, head_dim, layout,
            dtype, device, seed):  # fmt: skip
    kv_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pool = builder(kv_lens, num_kv_heads, head_dim, layout, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(extend_lens), num_q_heads, head_dim, generator=gen).to(device, dtype)
    qo_start = torch.tensor([0, *extend_lens[:-1]]).cumsum(0)

    def as_tensor(values):
        return torch.as_tensor(values, dtype=torch.int32, device=device)

    per_req = (as_tensor(prefix_lens), as_tensor(extend_lens), qo_start.to(device))
    return (q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, *per_req)


@pytest.mark.parametrize(
    ("layout", "num_q_heads", "num_kv_heads", "head_dim", "prefix_lens", "extend_lens"),
    [
        ("contiguous", 2, 2, 16, [0, 0], [7, 20]),  # plain prefill, no prefix
        ("permuted", 4, 2, 32, [0, 9, 20], [5, 17, 1]),  # mixed prefixes, decode-like row
        ("paged", 4, 1, 64, [16, 3], [33, 16]),  # group 4, page-aligned prefix
        ("paged", 6, 2, 40, [5, 0, 12], [3, 0, 18]),  # head_dim 40, an empty extend
    ],
)
def test_extend_attention_matches_ref(
    kv_pool_builder, device, layout, num_q_heads, num_kv_heads, head_dim, prefix_lens, extend_lens
):
    args = _inputs(kv_pool_builder, prefix_lens, extend_lens, num_q_heads, num_kv_heads,
                   head_dim, layout, torch.float32, device, seed=head_dim)  # fmt: skip
    out = extend_attention(*args, head_dim**-0.5)
    torch.testing.assert_close(out, extend_attention_ref(*args, head_dim**-0.5), **FP32_TOL)


def test_extend_last_token_equals_decode(kv_pool_builder, device):
    """The last new token of an extend sees exactly what a decode step at that length sees."""
    prefix_lens, extend_lens = [4, 30], [6, 3]
    q, k, v, r2t, rows, prefix, extend, qo_start = _inputs(
        kv_pool_builder, prefix_lens, extend_lens, 4, 2, 16, "paged", torch.float32, device, 11
    )
    out = extend_attention(q, k, v, r2t, rows, prefix, extend, qo_start, 0.25)
    last = qo_start + extend - 1
    decoded = decode_attention_ref(q[last], k, v, r2t, rows, prefix + extend, 0.25)
    torch.testing.assert_close(out[last], decoded, **FP32_TOL)


def test_extend_ref_matches_causal_sdpa(kv_pool_builder):
    """With no prefix, the reference equals causal SDPA over the request's own tokens."""
    q, k, v, r2t, rows, prefix, extend, qo_start = _inputs(
        kv_pool_builder, [0], [13], 4, 2, 16, "permuted", torch.float32, "cpu", 2
    )
    ref = extend_attention_ref(q, k, v, r2t, rows, prefix, extend, qo_start, 0.25)
    kv_loc = r2t[rows[0], :13].long()
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[kv_loc].transpose(0, 1)[None], v[kv_loc].transpose(0, 1)[None],
        is_causal=True, scale=0.25, enable_gqa=True,
    )  # fmt: skip
    torch.testing.assert_close(ref, expected[0].transpose(0, 1), **FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_attention_low_precision_cuda(kv_pool_builder, dtype):
    args = _inputs(kv_pool_builder, [0, 100, 37], [300, 64, 1], 8, 2, 128, "paged", dtype,
                   "cuda", seed=5)  # fmt: skip
    out = extend_attention(*args, 128**-0.5)
    torch.testing.assert_close(out, extend_attention_ref(*args, 128**-0.5), **LOW_PRECISION_TOL)
