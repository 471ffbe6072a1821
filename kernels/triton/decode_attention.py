"""Decode attention over the paged KV pool (one query token per request), flash-decoding style.

Each request's keys are split into ``num_kv_splits`` contiguous chunks of positions; stage 1
computes a softmax-normalised partial output and its log-sum-exp per chunk, stage 2 merges the
chunks. Splitting lets short batches still fill the GPU when contexts are long.

    positions 0 .......................... seq_len-1 of row req_pool_indices[b]
              |  split 0  |  split 1  | ... |  split S-1 (may be empty)
    slot of position p = req_to_token[row, p]  ->  k_buffer[slot, kv_head, :]
"""

from __future__ import annotations

import torch
from rollout_engine_kernels.triton._utils import kernel_device_ok, next_power_of_2

import triton
import triton.language as tl

__all__ = ["decode_attention", "decode_attention_ref"]

DEFAULT_NUM_KV_SPLITS = 8


@triton.jit
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, sm_scale,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_h = h // GROUP

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_loc = tl.load(ReqToToken + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + kv_loc[:, None] * stride_kn + kv_h * stride_kh + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(tl.float32)
        qk = tl.sum(q[None, :] * k, axis=1) * sm_scale
        qk = tl.where(mask_n, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new)
        v = tl.load(
            V + kv_loc[:, None] * stride_vn + kv_h * stride_vh + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new

    if end > start:
        mid = b * stride_mb + h * stride_mh + split * stride_ms
        tl.store(MidO + mid + offs_d, acc / l_i, mask=mask_d)
        tl.store(MidLse + b * stride_lb + h * stride_lh + split, m_i + tl.log(l_i))


@triton.jit
def _decode_merge_kernel(
    MidO, MidLse, SeqLens, Out,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, NUM_SPLITS):
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        # Empty splits wrote nothing; their MidO / MidLse entries are garbage.
        if end > start:
            o_s = tl.load(
                MidO + b * stride_mb + h * stride_mh + split * stride_ms + offs_d,
                mask=mask_d,
                other=0.0,
            )
            lse = tl.load(MidLse + b * stride_lb + h * stride_lh + split)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o_s
            l_i = l_i * alpha + w
            m_i = m_new

    out = acc / l_i
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def _check_shapes(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens) -> None:
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape:
        raise ValueError(
            f"expected q [B, Hq, D] and k/v buffers [num_slots, Hkv, D] of equal shape; got "
            f"q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}"
        )
    num_q_heads, num_kv_heads = q.shape[1], k_buffer.shape[1]
    if q.shape[2] != k_buffer.shape[2] or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) and "
            f"head_dim must match (q {q.shape[2]}, kv {k_buffer.shape[2]})"
        )
    if req_pool_indices.shape != (q.shape[0],) or seq_lens.shape != (q.shape[0],):
        raise ValueError(
            f"req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must both be [B] with B = {q.shape[0]}"
        )
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D, got shape {tuple(req_to_token.shape)}")


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
) -> torch.Tensor:
    """Attend one query per request to the first ``seq_lens[b]`` tokens of its row.

    q: [B, Hq, D]; k_buffer / v_buffer: [num_slots, Hkv, D] with Hq % Hkv == 0;
    req_to_token: [max_num_reqs, max_context_len] int32; req_pool_indices, seq_lens: [B] ints,
    every seq_lens[b] >= 1. Returns o: [B, Hq, D] in q's dtype (math in float32).
    """
    _check_shapes(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    kernel_device_ok(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
    batch, num_q_heads, head_dim = q.shape
    q = q.contiguous() if q.stride(2) != 1 else q
    k_buffer = k_buffer.contiguous()
    v_buffer = v_buffer.contiguous()
    req_to_token = req_to_token.contiguous()
    o = torch.empty_like(q)
    if batch == 0:
        return o

    mid_o = torch.empty(
        (batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d = next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_q_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        float(sm_scale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=num_q_heads // k_buffer.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=32, NUM_SPLITS=num_kv_splits,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, seq_lens, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits,
    )  # fmt: skip
    return o


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
) -> torch.Tensor:
    """Pure-PyTorch reference for :func:`decode_attention` (``num_kv_splits`` is ignored)."""
    _check_shapes(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
    group = q.shape[1] // k_buffer.shape[1]
    o = torch.empty_like(q)
    for b in range(q.shape[0]):
        row, seq_len = int(req_pool_indices[b]), int(seq_lens[b])
        kv_loc = req_to_token[row, :seq_len].long()
        k = k_buffer[kv_loc].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buffer[kv_loc].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * sm_scale
        o[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return o
