"""The verify forward: its batch layout, and the rule that accepts proposed tokens.

Each request feeds its last accepted token (whose K/V is not computed yet, as in a decode step)
followed by its proposals, on top of its cached KV::

    positions:  kv_len      kv_len + 1   ...   kv_len + k
    input:      last token  draft[0]     ...   draft[k - 1]
    logits row: p_0         p_1          ...   p_k          (p_j: the target's next-token
                                                              distribution after draft[:j])

The acceptance rule. Output token ``n`` of a request is always ``F_n^-1(u_n)``: the target's
filtered distribution (temperature, top-k, top-p, min-p) sampled by inverse CDF with the
request's counter-based uniform ``u_n = uniform_for(seed, n)``, exactly as the non-speculative
sampler draws it. Walking the rows, token ``j`` is sampled from ``p_j``; while it equals
``draft[j]`` the next row's context is the true one and the walk goes on; the first token that
differs (or the token after the last proposal, or a finishing token) ends it. For a
deterministic proposal ``d`` (a point mass, as n-gram drafts are) this *is* rejection sampling:
``d`` is accepted with probability ``p(d)``, and a rejected row's token is distributed as ``p``
with ``d`` removed and renormalised. So the outputs are distributed exactly as the target's; more,
with the same seed they are the very tokens non-speculative decoding draws (greedy: the argmax),
and their logprobs are the verify forward's ``log_softmax(logits / T)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode
from rollout_engine.sampler import SampleOutput
from rollout_engine.sampling_seeds import uniform_for
from rollout_engine.scheduler.request import Req

__all__ = ["Accepted", "accept_walk", "verify_forward_batch", "verify_uniforms"]


def verify_forward_batch(reqs: list[Req], drafts: list[list[int]], device: torch.device
                         ) -> ForwardBatch:
    """An EXTEND forward of ``[last token] + draft`` per request, logits at every position.
    Each request must hold slots for positions ``[0, kv_len + len(draft) + 1)``."""
    ids: list[int] = []
    positions: list[int] = []
    out_loc: list[int] = []
    prefix_lens, seq_lens, extend_lens = [], [], []
    for req, draft in zip(reqs, drafts):
        start = req.kv_len
        ext = len(draft) + 1
        if req.seq_len != start + 1:
            raise RuntimeError(f"{req.rid}: verify needs exactly one uncomputed token, "
                               f"seq_len {req.seq_len} kv_len {start}")
        if len(req.slots) < start + ext:
            raise RuntimeError(f"{req.rid}: no KV slots reserved for its proposals")
        ids.append(req.all_ids[start])
        ids.extend(draft)
        positions.extend(range(start, start + ext))
        out_loc.extend(req.slots[start:start + ext])
        prefix_lens.append(start)
        seq_lens.append(start + ext)
        extend_lens.append(ext)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=t(ids), positions=t(positions),
        out_cache_loc=t(out_loc),
        req_pool_indices=t([r.req_pool_idx for r in reqs]),  # type: ignore[misc]
        seq_lens=t(seq_lens), prefix_lens=t(prefix_lens), extend_lens=t(extend_lens),
        logits_indices=t(list(range(len(ids)))), seq_lens_list=seq_lens,
        prefix_lens_list=prefix_lens, extend_lens_list=extend_lens)


def verify_uniforms(reqs: list[Req], drafts: list[list[int]], device: torch.device
                    ) -> torch.Tensor:
    """[rows] float64: row ``j`` of a request draws output token ``len(output_ids) + j`` with
    the same uniform the non-speculative sampler would use for it."""
    values = [uniform_for(req.seed, len(req.output_ids) + j)
              for req, draft in zip(reqs, drafts) for j in range(len(draft) + 1)]
    return torch.tensor(values, dtype=torch.float64, device=device)


@dataclass
class Accepted:
    """The tokens one request's verify rows give, before stop conditions cut them."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: Optional[list[list[tuple[float, int]]]]
    num_accepted: int      # proposals confirmed (the last token is the target's own)


def accept_walk(out: SampleOutput, first_row: int, draft: list[int]) -> Accepted:
    """Tokens sampled at rows ``first_row ..`` up to and including the first that is not the
    proposal (all ``len(draft) + 1`` when every proposal holds)."""
    n = 0
    while n < len(draft) and out.token_ids[first_row + n] == draft[n]:
        n += 1
    rows = slice(first_row, first_row + n + 1)
    top = None if out.top_logprobs is None else out.top_logprobs[rows]
    return Accepted(out.token_ids[rows], out.logprobs[rows], top, n)
