"""``logprobs_mode = "processed_logprobs"``: the returned logprobs are those of the
distribution after the sampling transforms, as vLLM defines them (its ``v1/sample/sampler.py``,
``ops/penalties.py``, ``logits_processor/builtin.py``, ``ops/topk_topp_sampler.py``):

    x  = logits (float32); a grammar's disallowed tokens -inf
    x  = min_new_tokens bans (-inf), then the penalties: repetition (prompt and output tokens:
         x / r if x > 0 else x * r), frequency and presence (output tokens: x -= f * count +
         p * [count > 0])
    greedy row (T == 0): log_softmax(x)             (vLLM resets its min-p / top-k / top-p)
    other rows:
    s  = x / T
    s  = min-p: -inf where softmax(s) < min_p * max(softmax(s))
    s  = top-k: -inf where s < the k-th largest s (ties kept)
    s  = top-p: over s sorted ascending, -inf where the cumulative softmax <= 1 - p (the
         largest always kept)
    log_softmax(s)                                  (masked tokens: -inf)

In this mode a sampled row draws its token from this distribution (vLLM samples what it
reports: its order of min-p, top-k and top-p keeps a smaller set than the default sampler's
when they are combined), by inverse CDF with the row's own uniform, so seeded requests stay
reproducible and batch-invariant; greedy rows keep the argmax. One extra pass over the batch's
``[B, V]`` logits, every step of this mode only: the default ``raw_logprobs`` path pays
nothing. ``processed_logprobs_ref`` is the definition written for one
row at a time, the oracle the batched version is tested against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from rollout_engine.constrained.matcher import TokenMask
from rollout_engine.penalties import penalised_logits
from rollout_engine.sampler import SampleOutput, SamplingBatch, greedy_rows

__all__ = ["processed_logprobs", "processed_logprobs_ref", "with_processed_logprobs"]


def _penalised(logits: torch.Tensor, sb: SamplingBatch, mask: Optional[TokenMask]
               ) -> torch.Tensor:
    """A float32 copy of ``logits`` with the grammar mask, bans and penalties applied."""
    b, vocab = logits.shape
    x = logits.to(torch.float32).clone()
    if mask is not None and mask.rows:
        x.masked_fill_(mask.keep(b, vocab, x.device) == 0, float("-inf"))
    pen = sb.penalties
    if pen is not None:
        flat = x.view(-1)
        if pen.banned is not None:
            flat.index_fill_(0, pen.banned[0] * vocab + pen.banned[1], float("-inf"))
        if pen.rows.numel():
            idx = pen.rows * vocab + pen.ids
            flat.index_copy_(0, idx, penalised_logits(flat.index_select(0, idx), pen))
    return x


def processed_logprobs(logits: torch.Tensor, sb: SamplingBatch,
                       mask: Optional[TokenMask] = None) -> torch.Tensor:
    """[B, V] float32: vLLM's processed logprobs of every row of ``logits`` (module doc)."""
    x = _penalised(logits, sb, mask)
    b, vocab = x.shape
    rand = sb.temperatures > 0
    if not bool(rand.any()):
        return torch.log_softmax(x, dim=-1)
    t = torch.where(rand, sb.temperatures, torch.ones_like(sb.temperatures))
    s = x / t[:, None]
    rows = (rand & (sb.min_ps > 0)).nonzero().squeeze(1)
    if rows.numel():
        sub = s.index_select(0, rows)
        probs = torch.softmax(sub, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * sb.min_ps.index_select(0, rows)[:, None]
        s.index_copy_(0, rows, sub.masked_fill_(probs < floor, float("-inf")))
    rows = (rand & (sb.top_ks < vocab)).nonzero().squeeze(1)
    if rows.numel():
        sub = s.index_select(0, rows)
        k = sb.top_ks.index_select(0, rows).clamp(1, vocab)
        kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        s.index_copy_(0, rows, sub.masked_fill_(sub < kth, float("-inf")))
    rows = (rand & (sb.top_ps < 1)).nonzero().squeeze(1)
    if rows.numel():
        sub = s.index_select(0, rows)
        ordered, order = sub.sort(dim=-1, descending=False)
        cum = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - sb.top_ps.index_select(0, rows)[:, None]
        drop[:, -1] = False
        ordered.masked_fill_(drop, float("-inf"))
        s.index_copy_(0, rows, sub.scatter_(1, order, ordered))
    return torch.log_softmax(s, dim=-1)


def processed_logprobs_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           min_p: float, penalised: Optional[dict[int, float]] = None,
                           ) -> torch.Tensor:
    """One row's processed logprobs, step by step (``penalised``: token -> its logit after
    bans and penalties, replacing ``logits[token]``)."""
    x = logits.to(torch.float32).clone()
    for tok, value in (penalised or {}).items():
        x[tok] = value
    if temperature == 0:
        return torch.log_softmax(x, dim=-1)
    s = x / temperature
    if min_p > 0:
        p = torch.softmax(s, dim=-1)
        s[p < min_p * p.max()] = float("-inf")
    if 0 < top_k < s.numel():
        s[s < torch.sort(s, descending=True).values[top_k - 1]] = float("-inf")
    if top_p < 1:
        ordered, order = torch.sort(s)
        cum = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
        for j in range(s.numel() - 1):
            if cum[j] <= 1 - top_p:
                s[order[j]] = float("-inf")
    return torch.log_softmax(s, dim=-1)


def with_processed_logprobs(out: SampleOutput, logits: torch.Tensor, sb: SamplingBatch,
                            mask: Optional[TokenMask] = None) -> SampleOutput:
    """``out`` with the processed distribution's tokens (sampled rows redrawn from it with
    their own uniforms; greedy rows as sampled), logprobs and top logprobs."""
    lp = processed_logprobs(logits, sb, mask)
    tokens = torch.tensor(out.token_ids, dtype=torch.int64, device=lp.device)
    rows = (~greedy_rows(sb)).nonzero().squeeze(1)
    if rows.numel():
        cum = lp.index_select(0, rows).to(torch.float64).exp_().cumsum_(dim=-1)
        target = sb.uniforms.index_select(0, rows).to(cum) * cum[:, -1]
        picked = torch.searchsorted(cum, target[:, None], right=True).squeeze(1)
        tokens.index_copy_(0, rows, picked.clamp_(max=lp.shape[1] - 1))
    chosen = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
    top = out.top_logprobs
    if top is not None:
        nums = sb.top_logprobs_num
        per_row = [nums] * len(top) if isinstance(nums, int) else nums
        k = min(max(per_row), lp.shape[1])
        vals, idx = lp.topk(k, dim=-1)
        top = [list(zip(v[:n], t[:n])) if n > 0 else []
               for n, v, t in zip(per_row, vals.tolist(), idx.tolist())]
    return replace(out, token_ids=tokens.tolist(), logprobs=chosen, top_logprobs=top)
