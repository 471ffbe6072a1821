"""Extend (prefill) attention over the paged KV pool with a cached prefix.

The new tokens' K/V are already in the pool, so keys come from one place: row
``req_pool_indices[b]`` of ``req_to_token``. Query i of request b sits at absolute position
``prefix_len + i`` and sees every key position <= its own:

    key positions:  0 ........ prefix_len-1 | prefix_len ........ prefix_len+extend_len-1
                    (cached prefix: visible   | new tokens: causal, key j visible to query i
                     to every query)          |  iff j <= i)
    q / o rows:     qo_start[b] .. qo_start[b]+extend_len-1   (query i -> row qo_start[b]+i)
"""

from __future__ import annotations

import torch
from rollout_engine_kernels.triton._utils import kernel_device_ok, next_power_of_2

import triton
import triton.language as tl

__all__ = ["extend_attention", "extend_attention_ref"]

_BLOCK_M = 16  # tl.dot needs every dimension >= 16
_BLOCK_N = 16


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, QoStart, sm_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ot, stride_oh, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_h = h // GROUP

    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    prefix_len = tl.load(PrefixLens + b).to(tl.int32)
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    qo_start = tl.load(QoStart + b).to(tl.int64)
    if block_m * BLOCK_M >= extend_len:  # grid is sized for the longest extend
        return

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # absolute position of each query
    q = tl.load(
        Q + (qo_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys up to the last query of this block; beyond that everything is causally masked.
    end = prefix_len + tl.minimum((block_m + 1) * BLOCK_M, extend_len)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_loc = tl.load(ReqToToken + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + kv_loc[:, None] * stride_kn + kv_h * stride_kh + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
        # Key 0 is visible to every row (padded rows too), so m_i is finite after block 0.
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        v = tl.load(
            V + kv_loc[:, None] * stride_vn + kv_h * stride_vh + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=INPUT_PRECISION, out_dtype=tl.float32
        )
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        Out + (qo_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _check_shapes(q, k_buffer, v_buffer, req_to_token, per_req) -> None:
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and k/v buffers [num_slots, Hkv, D] of equal shape; got "
            f"q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}"
        )
    if q.shape[2] != k_buffer.shape[2] or q.shape[1] % k_buffer.shape[1] != 0:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k_buffer.shape[1]}) and "
            f"head_dim must match (q {q.shape[2]}, kv {k_buffer.shape[2]})"
        )
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D, got shape {tuple(req_to_token.shape)}")
    batch = per_req[0].shape
    if len(batch) != 1 or any(t.shape != batch for t in per_req):
        raise ValueError(
            "req_pool_indices, prefix_lens, extend_lens and qo_start must all be [B]; got "
            + ", ".join(str(tuple(t.shape)) for t in per_req)
        )


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention for new tokens over their cached prefix plus themselves.

    q: [T, Hq, D] (request b's queries at rows qo_start[b] .. qo_start[b]+extend_lens[b]-1);
    k_buffer / v_buffer: [num_slots, Hkv, D], already holding the new tokens' K/V;
    req_to_token: [max_num_reqs, max_context_len] int32; the four per-request tensors are [B].
    Returns o: [T, Hq, D] in q's dtype; rows not covered by any request are left unwritten.
    """
    per_req = (req_pool_indices, prefix_lens, extend_lens, qo_start)
    _check_shapes(q, k_buffer, v_buffer, req_to_token, per_req)
    kernel_device_ok(q, k_buffer, v_buffer, req_to_token, *per_req)
    num_tokens, num_q_heads, head_dim = q.shape
    q = q.contiguous() if q.stride(2) != 1 else q
    k_buffer = k_buffer.contiguous()
    v_buffer = v_buffer.contiguous()
    req_to_token = req_to_token.contiguous()
    o = torch.empty_like(q)
    batch = req_pool_indices.shape[0]
    if batch == 0 or num_tokens == 0:
        return o

    max_extend_len = int(extend_lens.max())  # host sync: sizes the grid
    grid = (batch, num_q_heads, triton.cdiv(max(max_extend_len, 1), _BLOCK_M))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        qo_start, float(sm_scale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), o.stride(0), o.stride(1), req_to_token.stride(0),
        GROUP=num_q_heads // k_buffer.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        # fp32 inputs: avoid TF32 so fp32 models keep fp32 accuracy.
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return o


def extend_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Pure-PyTorch reference for :func:`extend_attention` (uncovered rows are zero)."""
    per_req = (req_pool_indices, prefix_lens, extend_lens, qo_start)
    _check_shapes(q, k_buffer, v_buffer, req_to_token, per_req)
    group = q.shape[1] // k_buffer.shape[1]
    o = torch.zeros_like(q)
    for b in range(req_pool_indices.shape[0]):
        row, prefix_len = int(req_pool_indices[b]), int(prefix_lens[b])
        extend_len, start = int(extend_lens[b]), int(qo_start[b])
        if extend_len == 0:
            continue
        kv_loc = req_to_token[row, : prefix_len + extend_len].long()
        k = k_buffer[kv_loc].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buffer[kv_loc].float().repeat_interleave(group, dim=1)
        qb = q[start : start + extend_len].float()  # [E, Hq, D]
        scores = torch.einsum("ehd,lhd->hel", qb, k) * sm_scale
        q_pos = prefix_len + torch.arange(extend_len, device=q.device)
        k_pos = torch.arange(prefix_len + extend_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out = torch.einsum("hel,lhd->ehd", scores.softmax(dim=-1), v)
        o[start : start + extend_len] = out.to(q.dtype)
    return o
