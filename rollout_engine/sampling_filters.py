"""The sampling distribution's filters and its inverse CDF, over ``[B, V]`` in PyTorch ops
(``rollout_engine.sampler.sample_reference``; the one-pass CPU kernel covers the unfiltered
rows): min-p on the full row, top-k / top-p from ``torch.topk`` candidates (grown while a
top-p head is longer, a full stable sort past ``vocab / _SORT_FRACTION``), ties across a cut
kept by lowest id, and every row sampled by inverse CDF in vocabulary order, as over the
whole vocabulary."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["inverse_cdf", "plain_kept", "sample_plain", "sample_truncated"]


_BLOCK = 256


def sample_plain(dist: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor,
                  weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows without top-k / top-p: ``exp(dist)`` (no second softmax) times ``weights`` (a
    grammar's 0 / 1), min-p applied."""
    probs = dist.exp()
    if weights is not None:
        probs.mul_(weights)
    if bool((min_ps > 0).any()):
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
        probs.masked_fill_(probs < threshold, 0.0)
    return inverse_cdf(probs, uniforms)


def plain_kept(lp: torch.Tensor, min_p: float, weights: Optional[torch.Tensor]) -> list[int]:
    """The ids a row without top-k / top-p may sample (``sample_plain``'s nonzero mass)."""
    probs = lp.exp()
    if weights is not None:
        probs = probs * weights
    ok = probs > 0
    if min_p > 0:
        ok &= probs >= probs.max() * min_p
    return ok.nonzero().squeeze(1).tolist()


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF of unnormalised ``probs`` [B, V] in vocabulary order, in two levels (blocks
    of the vocabulary, then tokens of one block) in float64, so no [B, V] float64 cumsum is
    ever built."""
    b, v = probs.shape
    nb = -(-v // _BLOCK)
    padded = probs if nb * _BLOCK == v else torch.nn.functional.pad(probs, (0, nb * _BLOCK - v))
    padded = padded.view(b, nb, _BLOCK)
    # float32 sums of 256 entries are exact to ~1e-7; the running total is kept in float64
    block_cdf = padded.sum(dim=-1).to(torch.float64).cumsum(dim=-1)          # [B, nb]
    target = uniforms.to(torch.float64)[:, None] * block_cdf[:, -1:]
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


_TOP_P_CANDIDATES = 256   # first candidate count for rows with top-p but no top-k
_TOP_P_GROWTH = 4
_SORT_FRACTION = 8        # past vocab / this many candidates, a full sort is cheaper


def sample_truncated(dist: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                      min_ps: torch.Tensor, uniforms: torch.Tensor,
                      log_totals: Optional[torch.Tensor] = None,
                      kept_out: Optional[dict[int, list[int]]] = None) -> torch.Tensor:
    """Rows with top-k and / or top-p, from the ``c`` most likely candidates of each row.
    ``log_totals``: log of each row's total mass where it is not 1 (penalised rows).
    ``kept_out``: its rows (keys) receive the ids their row kept, ascending."""
    n, vocab = dist.shape
    tokens = torch.empty(n, dtype=torch.int64, device=dist.device)
    capped = top_ks < vocab
    want = int(top_ks[capped].max()) if bool(capped.any()) else 0
    todo = torch.arange(n, device=dist.device)
    if not bool(capped.all()):
        want = max(want, _TOP_P_CANDIDATES)
        # a top-p head holds at least p / p_max tokens: a flat row goes straight to the sort
        top = dist.amax(dim=-1).to(torch.float64)
        if log_totals is not None:
            top = top - log_totals
        flat = ~capped & (top_ps / top.exp() * _SORT_FRACTION >= vocab)
        if bool(flat.any()):
            _truncate(dist, flat.nonzero().squeeze(1), vocab, tokens, top_ks, top_ps, min_ps,
                      uniforms, log_totals, kept_out)
            todo = (~flat).nonzero().squeeze(1)
    _truncate(dist, todo, want, tokens, top_ks, top_ps, min_ps, uniforms, log_totals, kept_out)
    return tokens


def _truncate(dist: torch.Tensor, todo: torch.Tensor, want: int, tokens: torch.Tensor,
              top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
              uniforms: torch.Tensor, log_totals: Optional[torch.Tensor],
              kept_out: Optional[dict[int, list[int]]] = None) -> None:
    """Fill ``tokens[todo]`` from ``want + 1`` candidates per row, more while a top-p head
    is longer than that (and ``kept_out``'s rows with their kept ids)."""
    n, vocab = dist.shape
    while todo.numel():
        c = want + 1   # one past the largest cut: shows whether a tie crosses it
        whole = todo.numel() == n
        rows = dist if whole else dist.index_select(0, todo)
        if c * _SORT_FRACTION >= vocab:
            vals, ids = rows.sort(dim=-1, descending=True, stable=True)
        else:
            vals, ids = rows.topk(c, dim=-1)
        k, p, m_p, u = (t if whole else t[todo] for t in (top_ks, top_ps, min_ps, uniforms))
        lt = None if log_totals is None else (log_totals if whole else log_totals[todo])
        done, picked, mass, kept = _pick(rows, vals, ids, k, p, m_p, u, lt)
        tokens[todo[done]] = picked
        if kept_out:
            _record_kept(kept_out, todo[done], kept, vocab)
        if mass is None or bool(done.all()):
            return
        # the head's mass fell short of p: grow at least by the shortfall (the tail is flatter)
        short = (p[~done].to(torch.float64) / mass[~done].clamp(min=1e-30)).max()
        want = max(want * _TOP_P_GROWTH, int(c * float(short)) + 1)
        todo = todo[~done]


def _record_kept(kept_out: dict[int, list[int]], rows: torch.Tensor, kept: torch.Tensor,
                 vocab: int) -> None:
    """``kept``: per row of ``rows``, its kept ids ascending, padded with ``vocab``."""
    for i, row in enumerate(rows.tolist()):
        if row in kept_out:
            ids = kept[i]
            kept_out[row] = ids[ids < vocab].tolist()


def _pick_sorted(vals: torch.Tensor, ids: torch.Tensor, top_ks: torch.Tensor,
                 top_ps: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor,
                 log_totals: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    """``_pick`` over a full stable sort (ties already in id order), in float32 as a [B, V]
    pass must be; scattered back to vocabulary order for the inverse CDF."""
    n, vocab = vals.shape
    probs = (vals if log_totals is None else vals - log_totals[:, None].to(vals.dtype)).exp()
    before = probs.cumsum(dim=-1) - probs
    keep = (torch.arange(vocab, device=vals.device)[None, :] < top_ks[:, None]) & (
        before < top_ps[:, None])
    keep[:, 0] = True
    keep &= probs >= probs[:, :1] * min_ps[:, None]
    kept = torch.zeros_like(probs).scatter_(1, ids, probs.masked_fill_(~keep, 0.0))
    done = torch.ones(n, dtype=torch.bool, device=vals.device)
    kept_ids = torch.where(keep, ids, vocab).sort(dim=-1).values
    return done, inverse_cdf(kept, uniforms), None, kept_ids


def _pick(rows: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, top_ks: torch.Tensor,
          top_ps: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor,
          log_totals: Optional[torch.Tensor]
          ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Sample the rows whose kept set lies inside the candidates ``vals, ids`` ([n, c],
    descending). Returns (done [n] bool, their tokens, every row's candidate mass, None
    after a full sort, where every row is done; the done rows' kept ids, ascending, padded
    with the vocabulary size)."""
    n, c = vals.shape
    vocab = rows.shape[1]
    if c == vocab:
        return _pick_sorted(vals, ids, top_ks, top_ps, min_ps, uniforms, log_totals)
    logp = vals.to(torch.float64)
    probs = (logp if log_totals is None else logp - log_totals[:, None]).exp()   # normalised
    before = probs.cumsum(dim=-1) - probs
    pos = torch.arange(c, device=vals.device)[None, :]
    # top-p keeps the smallest head whose mass reaches p: a token stays if the mass before it < p
    keep = (pos < top_ks[:, None]) & (before < top_ps.to(torch.float64)[:, None])
    keep[:, 0] = True
    num_kept = keep.sum(dim=-1)
    done = num_kept < c
    mass = before[:, -1] + probs[:, -1]
    # a tie across the cut: the kept part of the tied group is its lowest ids (a stable sort)
    last = vals.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    after = vals.gather(1, num_kept.clamp(max=c - 1)[:, None]).squeeze(1)
    tied = done & (last == after)
    for r in tied.nonzero().squeeze(1).tolist():
        m = int(num_kept[r])
        first = int((vals[r, :m] > last[r]).sum())
        ids[r, first:m] = (rows[r] == last[r]).nonzero().squeeze(1)[:m - first]
    keep &= probs >= probs[:, :1] * min_ps.to(torch.float64)[:, None]
    keep, vals, ids, probs = keep[done], vals[done], ids[done], probs[done]
    # inverse CDF over the kept tokens in vocabulary order, as over the whole vocabulary
    ids = torch.where(keep, ids, vocab)
    ids, order = ids.sort(dim=-1)
    probs = torch.where(keep, probs, 0.0).gather(1, order)
    cdf = probs.cumsum(dim=-1)
    target = uniforms[done].to(torch.float64)[:, None] * cdf[:, -1:]
    j = torch.searchsorted(cdf, target, right=True)
    j = torch.minimum(j, keep.sum(dim=-1, keepdim=True) - 1)
    picked = ids.gather(1, j).squeeze(1)
    zero = probs.gather(1, j).squeeze(1) == 0  # rounding can only land past the last kept one
    if bool(zero.any()):
        picked = torch.where(zero, ids.gather(1, probs.argmax(dim=-1, keepdim=True)).squeeze(1),
                             picked)
    return done, picked, mass, ids
