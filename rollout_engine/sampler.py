"""Logits -> next tokens and logprobs, batched and seeded per request.

Randomness is counter-based (``sampling_seeds.py``): the uniform number behind output token ``k``
of a request is a hash of ``(sampling_seed, k)``, and each row is sampled by inverse CDF from its
own filtered distribution. A request therefore draws the same sample whatever else is in the batch, and a
retracted request that is recomputed continues exactly where it stopped.

Every returned logprob is ``log_softmax(logits / T)`` over the full vocabulary, ``T`` the request's
temperature (``T = 0``, greedy, scores raw logits: ``T = 1``), computed before penalties and
top-k / top-p / min-p truncation: what a trainer recomputes from the same weights. ``top_k = 1``
samples greedily but keeps its temperature for the logprobs. ``_scaled`` is the one place where
a temperature becomes a divisor.

On CPU, rows without top-k / top-p, penalties or a grammar are sampled by a compiled one-pass
kernel (``FusedOps.sample_rows``): token and logprob per row, nothing of ``[B, V]`` written.
Elsewhere (``sample_reference``), one pass over ``[B, V]`` where it can be: the logprobs are
computed once and, without penalties, are also the sampling distribution (``exp`` of them, not
a second softmax); top-k and top-p look only at ``torch.topk`` candidates
(``rollout_engine.sampling_filters``), keeping the set a stable descending sort keeps (ties go
to the lower id), sampled by inverse CDF in vocabulary order, as over the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from rollout_engine_kernels.cpu.fused_ops import load_fused_ops

from rollout_engine.constrained.matcher import TokenMask, masked_logprobs, masked_top_logprobs
from rollout_engine.penalties import Penalties, PenaltyCounts, penalised_logits, penalty_csr
from rollout_engine.sampling_filters import plain_kept, sample_plain, sample_truncated

__all__ = ["Penalties", "PenaltyCounts", "SampleOutput", "SamplingBatch", "compute_logprobs",
           "greedy_rows", "sample", "sample_reference"]

@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one forward's sampled rows, as tensors."""

    temperatures: torch.Tensor      # [B] float32, the request's; 0 for greedy
    top_ps: torch.Tensor            # [B] float32
    top_ks: torch.Tensor            # [B] int64, vocab size for "all"
    min_ps: torch.Tensor            # [B] float32
    uniforms: torch.Tensor          # [B] float64
    penalties: Optional[Penalties] = None
    top_logprobs_num: Union[int, list[int]] = 0      # per row, or one number for every row
    # grammar rows whose returned logprobs are the masked ones (return_masked_logprobs)
    masked_logprob_rows: list[int] = field(default_factory=list)
    # rows that want the set of tokens their sampling kept (top-k / top-p / min-p / grammar):
    # SampleOutput.kept (sampled by sample_reference, never the one-pass kernel)
    kept_rows: list[int] = field(default_factory=list)
    # what ``sample`` derives from the per-row parameters (not uniforms or penalties), kept
    # here for the next steps of the same rows: build_sampling_batch hands the same dict to
    # every step of an unchanged batch (None: derive afresh)
    derived: Optional[dict[str, Any]] = None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]                       # logprob of the chosen token
    # per row (empty for a row that asked for none); None when no row asked
    top_logprobs: Optional[list[list[tuple[float, int]]]]
    # row -> the ids its sampling kept, ascending (the rows of SamplingBatch.kept_rows)
    kept: dict[int, list[int]] = field(default_factory=dict)


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


def greedy_rows(sb: SamplingBatch) -> torch.Tensor:
    """[B] bool: rows that take the argmax (``SamplingParams.is_greedy``: T = 0 or top_k = 1)."""
    return (sb.temperatures == 0) | (sb.top_ks == 1)


@torch.inference_mode()
def sample(logits: torch.Tensor, sb: SamplingBatch, mask: Optional[TokenMask] = None
           ) -> SampleOutput:
    """Choose one token per row of ``logits`` ([B, V] float32). With penalties, their entries
    of ``logits`` are changed in place while sampling and restored before returning (in
    inference mode: the runner's logits are inference tensors).

    ``mask`` (grammar rows): those rows sample only allowed tokens; their returned logprobs
    stay the unmasked ``log_softmax(logits / T)`` unless the row is in
    ``sb.masked_logprob_rows`` (then ``log_softmax`` over the allowed tokens only).

    On CPU (float32, the compiled ops loaded) the rows without top-k / top-p or a grammar
    (penalties included) are sampled by the one-pass kernel (``FusedOps.sample_rows``: no
    ``[B, V]`` logprobs, probabilities or CDF are built), always, whatever else is in the
    batch, so a seeded request draws the same token in any batch; ``sample_reference`` samples
    the rest (and is the oracle the kernel is tested against)."""
    b, vocab = logits.shape
    logits = logits.contiguous()
    # without penalties or a grammar mask, which rows the kernel takes and what it is given
    # follow from the per-row parameters alone: kept across the steps of the same rows
    derived = sb.derived if sb.penalties is None and mask is None else None
    if derived:
        greedy, fast = derived["greedy"], derived["fast"]
    else:
        greedy = greedy_rows(sb)
        truncated = ~greedy & ((sb.top_ks < vocab) | (sb.top_ps < 1))
        fast = _one_pass_rows(logits, sb, mask, truncated)
        if derived is not None:
            derived.update(greedy=greedy, fast=fast)
    if fast is None:
        return sample_reference(logits, sb, mask)
    ops, rows = fast
    nums = _per_row(sb.top_logprobs_num, b)
    if rows.numel() < b:   # the others need [B, V] passes: the kernel picks its rows' tokens
        tokens, chosen = _sample_one_pass(ops, logits, sb, greedy, rows, derived)
        out = sample_reference(logits, sb, mask, one_pass=(rows, tokens))
        # and keeps its rows' logprobs (those not asking for top logprobs, which take
        # log_softmax in either path): a row's logprob never depends on its neighbours
        for i, row in enumerate(rows.tolist()):
            if nums[row] == 0:
                out.logprobs[row] = float(chosen[i])
        return out
    tokens, chosen = _sample_one_pass(ops, logits, sb, greedy, rows, derived)
    asking = [i for i, k in enumerate(nums) if k > 0]
    top = None
    if asking:   # only these rows pay for a log_softmax; their logprob is read from it too
        idx = torch.tensor(asking, dtype=torch.int64)
        lp = compute_logprobs(logits.index_select(0, idx), sb.temperatures.index_select(0, idx))
        chosen[idx] = lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1)
        top = _top_rows(lp, asking, nums, b)
    return SampleOutput(tokens.tolist(), chosen.tolist(), top)


def _one_pass_rows(logits: torch.Tensor, sb: SamplingBatch, mask: Optional[TokenMask],
                   truncated: torch.Tensor) -> Optional[tuple[Any, torch.Tensor]]:
    """(the compiled ops, the rows they sample) when the one-pass kernel applies to any row,
    else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    ops = load_fused_ops()
    if ops is None:
        return None
    # top-k alone (no top-p) is a per-row cut the kernel applies; not on a penalised row,
    # whose cut is on the penalised logits
    ok = ~truncated | (sb.top_ps >= 1)
    if sb.penalties is not None:
        penalised = torch.zeros_like(ok)
        penalised[sb.penalties.rows] = True
        if sb.penalties.banned is not None:
            penalised[sb.penalties.banned[0]] = True
        ok &= ~(penalised & truncated)
    if mask is not None and mask.rows:
        ok[torch.tensor(mask.rows, dtype=torch.int64)] = False
    if sb.kept_rows:
        ok[torch.tensor(sb.kept_rows, dtype=torch.int64)] = False
    rows = ok.nonzero().squeeze(1)
    return (ops, rows) if rows.numel() else None


def _sample_one_pass(ops: Any, logits: torch.Tensor, sb: SamplingBatch, greedy: torch.Tensor,
                     rows: torch.Tensor, derived: Optional[dict[str, Any]] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's tokens and logprobs for batch ``rows`` (ascending) of ``logits``;
    ``derived``: where the per-row arguments are kept for later steps (``sample``)."""
    whole = rows.numel() == logits.shape[0]

    def pick(t: torch.Tensor) -> torch.Tensor:
        return (t if whole else t.index_select(0, rows)).contiguous()

    args = None if derived is None else derived.get("kernel_args")
    if args is None:
        t = pick(sb.temperatures)
        top_ks = pick(sb.top_ks)
        capped = bool((top_ks < logits.shape[1]).any())
        args = (torch.where(t > 0, t, torch.ones_like(t)), pick(sb.min_ps),
                pick(greedy.to(torch.uint8)), top_ks.clamp(min=1) if capped else None)
        if derived is not None:
            derived["kernel_args"] = args
    temps, min_ps, greedy_u8, top_ks = args
    return ops.sample_rows(pick(logits), temps, min_ps, pick(sb.uniforms.to(torch.float64)),
                           greedy_u8, penalty_csr(logits, sb.penalties, rows), top_ks)


def sample_reference(logits: torch.Tensor, sb: SamplingBatch, mask: Optional[TokenMask] = None,
                     one_pass: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                     ) -> SampleOutput:
    """``sample`` in PyTorch ops over ``[B, V]`` (any device); see ``sample``. ``one_pass``:
    (rows, their tokens) already chosen by the one-pass kernel; those rows keep them."""
    b, vocab = logits.shape
    logits = logits.contiguous()
    scaled = _scaled(logits, sb.temperatures)
    logprobs = torch.log_softmax(scaled, dim=-1)
    greedy = greedy_rows(sb)
    truncated = ~greedy & ((sb.top_ks < vocab) | (sb.top_ps < 1))
    plain = ~greedy & ~truncated
    masked_lp = None if mask is None else masked_logprobs(logprobs, mask, sb.masked_logprob_rows)
    # [B, V] 0 / 1: what a grammar allows (1 on rows without one); a weight on probabilities,
    # never -inf in logprobs (exp of -inf takes a slow path), so logprobs stay unmasked
    keep = None if mask is None else mask.keep(b, vocab, logits.device)
    # logprobs is the sampling distribution too, except at penalty entries (patched in place,
    # undone before returning)
    restore: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    partial = torch.zeros(b, dtype=torch.bool, device=logits.device)   # row mass no longer 1
    if sb.penalties is not None:
        partial |= _penalise(logits, scaled, logprobs, sb, greedy, restore)
    if mask is not None:
        partial[torch.tensor(mask.rows, device=logits.device)] = True
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    idx = greedy.nonzero().squeeze(1)
    if idx.numel():
        tokens[idx] = (logits if idx.numel() == b else logits.index_select(0, idx)).argmax(-1)
    idx = plain.nonzero().squeeze(1)
    kept: dict[int, list[int]] = {}
    wanted = set(sb.kept_rows)
    if idx.numel():
        whole = idx.numel() == b
        rows_lp = logprobs if whole else logprobs.index_select(0, idx)
        w = None if keep is None else (keep if whole else keep.index_select(0, idx))
        m, u = (t if whole else t[idx] for t in (sb.min_ps, sb.uniforms))
        tokens[idx] = sample_plain(rows_lp, m, u, w)
        for i, row in enumerate(idx.tolist()):
            if row in wanted:
                kept[row] = plain_kept(rows_lp[i], float(m[i]), None if w is None else w[i])
    idx = truncated.nonzero().squeeze(1)
    if idx.numel():
        whole = idx.numel() == b
        rows_lp = logprobs if whole and keep is None else logprobs.index_select(0, idx)
        if keep is not None:   # top-k / top-p rank only allowed tokens: their own copy
            rows_lp.masked_fill_(keep.index_select(0, idx) == 0, float("-inf"))
        k, p, m, u = (t if whole else t[idx] for t in (sb.top_ks, sb.top_ps, sb.min_ps,
                                                        sb.uniforms))
        want = [i for i, row in enumerate(idx.tolist()) if row in wanted]
        local: Optional[dict[int, list[int]]] = {i: [] for i in want} if want else None
        tokens[idx] = sample_truncated(rows_lp, k, p, m, u, _log_totals(rows_lp, partial[idx]),
                                       kept_out=local)
        for i, ids in (local or {}).items():
            kept[int(idx[i])] = ids
    if one_pass is not None:
        tokens[one_pass[0]] = one_pass[1]
    if keep is not None:
        _allowed_only(tokens, logprobs, keep)
    for row in wanted - set(kept):   # greedy rows keep their one token
        kept[row] = [int(tokens[row])]
    for flat, idx, saved in reversed(restore):
        flat.index_copy_(0, idx, saved)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top = _top_logprobs(logprobs, sb)
    if masked_lp is not None:
        ids, sub = masked_lp
        chosen[ids] = sub.gather(1, tokens.index_select(0, ids)[:, None]).squeeze(1)
        if top is not None:
            masked_top_logprobs(top, ids.tolist(), sub, sb.top_logprobs_num)
    return SampleOutput(tokens.tolist(), chosen.tolist(), top, kept)


def _log_totals(dist: torch.Tensor, partial: torch.Tensor) -> Optional[torch.Tensor]:
    """log of each row's total mass where it is not 1 (penalised or grammar rows; top-p needs
    it), 0 elsewhere; None when every row sums to 1."""
    rows = partial.nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    totals = torch.zeros(dist.shape[0], dtype=torch.float64, device=dist.device)
    totals[rows] = torch.logsumexp(dist.index_select(0, rows).to(torch.float64), dim=-1)
    return totals


def _allowed_only(tokens: torch.Tensor, logprobs: torch.Tensor, keep: torch.Tensor) -> None:
    """Greedy grammar rows, and any row whose allowed tokens all underflowed to probability 0:
    the most likely allowed token instead."""
    bad = (keep.gather(1, tokens[:, None]).squeeze(1) == 0).nonzero().squeeze(1)
    if bad.numel():
        lp = logprobs.index_select(0, bad).masked_fill_(keep.index_select(0, bad) == 0,
                                                        float("-inf"))
        tokens[bad] = lp.argmax(-1)


def _penalise(logits: torch.Tensor, scaled: torch.Tensor, logprobs: torch.Tensor,
              sb: SamplingBatch, greedy: torch.Tensor,
              restore: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Write the penalised values of ``sb.penalties``' entries into ``logprobs`` (and into
    ``logits`` for greedy rows), appending to ``restore`` what undoes it; returns [B] bool, the
    rows with penalties. Nothing else of [B, V] is touched: no second softmax.

    log_softmax computes ``(s - m) - log_sum`` with the row's max ``m``; an entry gets the same
    expression of its penalised ``s``, so it ties with an unpenalised token exactly where the
    penalised softmax would (ties go to the lower id). The row no longer sums to 1: sampling
    by inverse CDF needs no normalising, top-p gets the row's total."""
    pen = sb.penalties
    assert pen is not None
    b, vocab = logits.shape
    penalised = torch.zeros(b, dtype=torch.bool, device=logits.device)
    penalised[pen.rows] = True
    if pen.banned is not None:
        penalised[pen.banned[0]] = True
    # the row constants: lp at the max of s is -log_sum exactly
    prows = penalised.nonzero().squeeze(1)
    if prows.numel() * 2 < b:   # few penalised rows: read only theirs
        top, at = scaled.index_select(0, prows).max(dim=-1, keepdim=True)
        lp_max = logprobs.index_select(0, prows).gather(1, at).squeeze(1)
        m = scaled.new_zeros(b).index_copy_(0, prows, top.squeeze(1))
        log_sum = logprobs.new_zeros(b).index_copy_(0, prows, -lp_max)
    else:
        top, at = scaled.max(dim=-1, keepdim=True)
        m, log_sum = top.squeeze(1), -logprobs.gather(1, at).squeeze(1)
    greedy_too = bool((greedy & penalised).any())
    lp_flat, x_flat = logprobs.view(-1), logits.view(-1)

    def patch(flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
        restore.append((flat, idx, flat.index_select(0, idx)))
        flat.index_copy_(0, idx, values)

    if pen.rows.numel():
        idx = pen.rows * vocab + pen.ids
        x = penalised_logits(x_flat.index_select(0, idx), pen)
        s = x
        if scaled is not logits:   # as _scaled: a row with T = 1 divides by 1, exactly
            t = sb.temperatures.index_select(0, pen.rows)
            s = x / torch.where(t > 0, t, torch.ones_like(t))
        patch(lp_flat, idx, (s - m.index_select(0, pen.rows)) - log_sum.index_select(0, pen.rows))
        if greedy_too:
            patch(x_flat, idx, x)
    if pen.banned is not None:
        idx = pen.banned[0] * vocab + pen.banned[1]
        patch(lp_flat, idx, torch.full_like(idx, float("-inf"), dtype=logprobs.dtype))
        if greedy_too:
            patch(x_flat, idx, torch.full_like(idx, float("-inf"), dtype=logits.dtype))
    return penalised


def _per_row(nums: Union[int, list[int]], b: int) -> list[int]:
    return [nums] * b if isinstance(nums, int) else nums


def _top_logprobs(logprobs: torch.Tensor, sb: SamplingBatch
                  ) -> Optional[list[list[tuple[float, int]]]]:
    """Top logprobs of the rows that ask for them (only those rows pay for topk)."""
    b = logprobs.shape[0]
    nums = _per_row(sb.top_logprobs_num, b)
    asking = [i for i, k in enumerate(nums) if k > 0]
    if not asking:
        return None
    return _top_rows(logprobs if len(asking) == b else logprobs[asking], asking, nums, b)


def _top_rows(rows: torch.Tensor, asking: list[int], nums: list[int], b: int
              ) -> list[list[tuple[float, int]]]:
    """Per batch row, the top ``nums[i]`` of ``rows`` (the logprobs of the ``asking`` rows, in
    order); empty for the others."""
    k = min(max(nums), rows.shape[1])
    vals, idx = rows.topk(k, dim=-1)
    top: list[list[tuple[float, int]]] = [[] for _ in range(b)]
    for i, v, t in zip(asking, vals.tolist(), idx.tolist()):
        top[i] = list(zip(v[:nums[i]], t[:nums[i]]))
    return top
