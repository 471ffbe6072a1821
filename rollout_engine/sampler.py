"""Logits -> next tokens and logprobs, batched and seeded per request.

Randomness is counter-based: the uniform number behind output token ``k`` of a request is a hash
of ``(sampling_seed, k)``, and each row is sampled by inverse CDF from its own filtered
distribution. A request therefore draws the same sample whatever else is in the batch, and a
retracted request that is recomputed continues exactly where it stopped.

Every returned logprob is ``log_softmax(logits / T)`` over the full vocabulary, ``T`` the request's
temperature (``T = 0``, greedy, scores raw logits: ``T = 1``), computed before penalties and
top-k / top-p / min-p truncation: what a trainer recomputes from the same weights. ``top_k = 1``
samples greedily but keeps its temperature for the logprobs. ``_scaled`` is the one place where
a temperature becomes a divisor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on ``(seed, step)`` (53 random bits)."""
    return (splitmix64(splitmix64(seed) ^ step) >> 11) * (1.0 / (1 << 53))


def derive_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th parallel sample (``n > 1``) of a request seeded ``seed``."""
    return splitmix64(seed ^ splitmix64(index + 1)) & ((1 << 63) - 1)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one forward's sampled rows, as tensors."""

    temperatures: torch.Tensor      # [B] float32, the request's; 0 for greedy
    top_ps: torch.Tensor            # [B] float32
    top_ks: torch.Tensor            # [B] int64, vocab size for "all"
    min_ps: torch.Tensor            # [B] float32
    uniforms: torch.Tensor          # [B] float64
    # additive logit penalties and banned tokens; None when no row needs them
    logit_bias: Optional[torch.Tensor] = None       # [B, V] float32
    repetition_penalties: Optional[torch.Tensor] = None  # [B] float32
    repetition_mask: Optional[torch.Tensor] = None  # [B, V] bool: token seen in prompt or output
    top_logprobs_num: int = 0


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]                       # logprob of the chosen token
    top_logprobs: Optional[list[list[tuple[float, int]]]]  # when top_logprobs_num > 0


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``logits / T`` per row, ``T = 1`` where ``T == 0``. When every ``T`` is 1 it returns
    ``logits`` itself (``x / 1 == x`` exactly), saving a [B, V] pass and allocation: callers
    must not modify the result in place."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    if bool((t == 1).all()):
        return logits
    return logits / t[:, None]


def compute_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` with ``T = 1`` where ``T == 0`` (greedy)."""
    return torch.log_softmax(_scaled(logits, temperatures), dim=-1)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleOutput:
    """Choose one token per row of ``logits`` ([B, V] float32)."""
    logprobs = compute_logprobs(logits, sb.temperatures)
    logits = apply_penalties(logits, sb)
    greedy = greedy_rows(sb)
    all_greedy = bool(greedy.all())
    # argmax over [B, V] only when some row is greedy
    tokens = torch.argmax(logits, dim=-1) if all_greedy or bool(greedy.any()) else None
    if not all_greedy:
        sampled = _sample_filtered(logits, sb)
        tokens = sampled if tokens is None else torch.where(greedy, tokens, sampled)
    assert tokens is not None
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top = None
    if sb.top_logprobs_num > 0:
        vals, idx = logprobs.topk(sb.top_logprobs_num, dim=-1)
        top = [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
    return SampleOutput(tokens.tolist(), chosen.tolist(), top)


def greedy_rows(sb: SamplingBatch) -> torch.Tensor:
    """[B] bool: rows that take the argmax (``SamplingParams.is_greedy``: T = 0 or top_k = 1)."""
    return (sb.temperatures == 0) | (sb.top_ks == 1)


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    if sb.repetition_penalties is not None and sb.repetition_mask is not None:
        p = sb.repetition_penalties[:, None]
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(sb.repetition_mask, penalised, logits)
    if sb.logit_bias is not None:
        logits = logits + sb.logit_bias
    return logits


def filtered_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """softmax(logits / T) restricted by top-k, top-p and min-p, renormalised. [B, V]."""
    probs = torch.softmax(_scaled(logits, sb.temperatures), dim=-1)
    vocab = probs.shape[-1]
    need_sort = bool((sb.top_ks < vocab).any()) or bool((sb.top_ps < 1.0).any())
    if need_sort:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        keep = ranks < sb.top_ks[:, None]
        # top-p keeps the smallest head whose mass reaches p: a token stays if the mass before it < p
        before = sorted_p.cumsum(dim=-1) - sorted_p
        keep &= before < sb.top_ps[:, None]
        keep[:, 0] = True
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if bool((sb.min_ps > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * sb.min_ps[:, None]
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    # every path above leaves ``probs`` a fresh tensor of our own: normalise in place
    return probs.div_(probs.sum(dim=-1, keepdim=True))


_CDF_BLOCK = 128


_BLOCK = 256


def _sample_filtered(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Inverse-CDF sampling in two levels (blocks of the vocabulary, then tokens of one block),
    in float64, so no [B, V] float64 cumsum is ever built."""
    probs = filtered_probs(logits, sb)
    b, v = probs.shape
    nb = -(-v // _BLOCK)
    if nb * _BLOCK != v:
        probs_padded = torch.nn.functional.pad(probs, (0, nb * _BLOCK - v))
    else:
        probs_padded = probs
    padded = probs_padded.view(b, nb, _BLOCK)
    # float32 sums of 256 entries are exact to ~1e-7; the running total is kept in float64
    block_cdf = padded.sum(dim=-1).to(torch.float64).cumsum(dim=-1)          # [B, nb]
    target = sb.uniforms.to(torch.float64)[:, None] * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=nb - 1)   # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)),
                         torch.zeros_like(target))
    rows = padded[torch.arange(b, device=probs.device), block.squeeze(1)]     # [B, BLOCK]
    inner_cdf = rows.to(torch.float64).cumsum(dim=-1)
    inner = torch.searchsorted(inner_cdf, target - before, right=True).clamp_(max=_BLOCK - 1)
    idx = (block * _BLOCK + inner).squeeze(1).clamp_(max=v - 1)
    # rounding at a block's edge can land on a zero-probability token: never return one
    zero = probs.gather(1, idx[:, None]).squeeze(1) == 0
    if bool(zero.any()):
        idx = torch.where(zero, probs.argmax(dim=-1), idx)
    return idx
