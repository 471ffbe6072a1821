"""Fused ``log_softmax(logits / temperature)[token_id]`` per row, without a [B, V] temporary.

One program per row streams the vocabulary once with an online max / sum-exp:

    logprob[b] = logits[b, ids[b]] / T[b] - (m + log(sum_v exp(logits[b, v] / T[b] - m)))
"""

from __future__ import annotations

import torch
from rollout_engine_kernels.triton._utils import kernel_device_ok

import triton
import triton.language as tl

__all__ = ["logprob_gather", "logprob_gather_ref"]

_BLOCK_V = 1024


@triton.jit
def _logprob_gather_kernel(
    Logits, TokenIds, Temperatures, Out, stride_l, vocab_size, BLOCK_V: tl.constexpr
):
    b = tl.program_id(0)
    row = Logits + b.to(tl.int64) * stride_l
    inv_t = 1.0 / tl.load(Temperatures + b).to(tl.float32)

    m_i = -float("inf")
    s_i = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        x = x * inv_t
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m_i = m_new

    token_id = tl.load(TokenIds + b).to(tl.int64)
    target = tl.load(row + token_id).to(tl.float32) * inv_t
    tl.store(Out + b, target - m_i - tl.log(s_i))


def _check_shapes(logits, token_ids, temperatures) -> None:
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"expected logits [B, V] and token_ids [B]; got {tuple(logits.shape)}, "
            f"{tuple(token_ids.shape)}"
        )
    if temperatures.shape != (logits.shape[0],):
        raise ValueError(
            f"temperatures must be [B] = [{logits.shape[0]}], got {tuple(temperatures.shape)}"
        )


def logprob_gather(
    logits: torch.Tensor, token_ids: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """Log-probability [B] (fp32) of ``token_ids[b]`` under ``softmax(logits[b] / T[b])``.

    logits: [B, V] any float dtype; token_ids: [B] ints in [0, V); temperatures: [B], > 0
    (pass 1.0 for greedy rows to get the untempered distribution).
    """
    _check_shapes(logits, token_ids, temperatures)
    kernel_device_ok(logits, token_ids, temperatures)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0] > 0:
        _logprob_gather_kernel[(logits.shape[0],)](
            logits, token_ids, temperatures, out, logits.stride(0), logits.shape[1],
            BLOCK_V=_BLOCK_V,
        )  # fmt: skip
    return out


def logprob_gather_ref(
    logits: torch.Tensor, token_ids: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """Pure-PyTorch reference for :func:`logprob_gather`."""
    _check_shapes(logits, token_ids, temperatures)
    scaled = logits.float() / temperatures.float()[:, None]
    return scaled.log_softmax(dim=-1).gather(1, token_ids.long()[:, None]).squeeze(1)
