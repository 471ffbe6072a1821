"""ScheduleBatch: the requests chosen for one step, and its lowering to tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from rollout_engine.host_lists import list_tensor
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode
from rollout_engine.penalties import Penalties, PenaltyCounts
from rollout_engine.sampler import SamplingBatch, compute_logprobs
from rollout_engine.sampling_seeds import seed_mix, uniforms_from_mix
from rollout_engine.scheduler.request import Req


@dataclass
class ScheduleBatch:
    """Requests of one step. In EXTEND, ``extend_lens[i]`` new tokens of ``reqs[i]`` are
    computed from ``reqs[i].kv_len``; in DECODE, one token each."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    # filled by to_forward_batch: which logits row belongs to what
    sample_rows: list[int] = field(default_factory=list)      # per req: row or -1
    # per req: [a, b) (empty for a decode step: no prompt logprobs are left to compute)
    input_logprob_rows: list[tuple[int, int]] = field(default_factory=list)
    input_logprob_targets: list[list[int]] = field(default_factory=list)

    def to_forward_batch(self, device: torch.device) -> ForwardBatch:
        if self.mode == ForwardMode.DECODE:
            fb = self._decode_forward_batch(device)
            if fb is not None:
                return fb
        ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        logits_idx: list[int] = []
        prefix_lens, seq_lens = [], []
        self.sample_rows, self.input_logprob_rows, self.input_logprob_targets = [], [], []
        for req, ext in zip(self.reqs, self.extend_lens):
            start, end = req.kv_len, req.kv_len + ext
            base = len(ids)
            all_ids = req.all_ids
            ids.extend(all_ids[start:end])
            positions.extend(range(start, end))
            out_loc.extend(req.slots[start:end])
            prefix_lens.append(start)
            seq_lens.append(end)
            # prompt logprobs: the logits at position p score token p + 1
            a, b = len(logits_idx), len(logits_idx)
            targets: list[int] = []
            if (self.mode == ForwardMode.EXTEND and req.wants_input_logprobs
                    and not req.input_logprobs_done()):
                lo = max(start, req.logprob_start_len - 1, 0)
                hi = min(end, len(req.input_ids) - 1)
                for p in range(lo, hi):
                    logits_idx.append(base + p - start)
                    targets.append(all_ids[p + 1])
                b = len(logits_idx)
            self.input_logprob_rows.append((a, b))
            self.input_logprob_targets.append(targets)
            if end == req.seq_len:  # the whole sequence is computed: sample the next token
                self.sample_rows.append(len(logits_idx))
                logits_idx.append(base + ext - 1)
            else:
                self.sample_rows.append(-1)

        def t(values: list[int]) -> torch.Tensor:
            return list_tensor(values, torch.int64, device)

        return ForwardBatch(
            mode=self.mode, input_ids=t(ids), positions=t(positions), out_cache_loc=t(out_loc),
            req_pool_indices=t([r.req_pool_idx for r in self.reqs]),  # type: ignore[misc]
            seq_lens=t(seq_lens), prefix_lens=t(prefix_lens), extend_lens=t(self.extend_lens),
            logits_indices=t(logits_idx), seq_lens_list=seq_lens, prefix_lens_list=prefix_lens,
            extend_lens_list=list(self.extend_lens))


    def _decode_forward_batch(self, device: torch.device) -> Optional[ForwardBatch]:
        """``to_forward_batch`` of a decode step (one token per request at ``kv_len``, each
        sampled) by whole-batch list comprehensions; None if any request is not in that
        shape (then the general loop handles it)."""
        reqs = self.reqs
        starts = [r.kv_len for r in reqs]
        seq_lens = [s + 1 for s in starts]
        if any(e != 1 for e in self.extend_lens) or any(
                len(r.all_ids) != n for r, n in zip(reqs, seq_lens)):
            return None
        n = len(reqs)
        self.sample_rows = list(range(n))
        # a running request's prompt logprobs were all computed by its prefill: none to record
        # (record_input_logprobs has no row to visit, instead of 256 empty ones a step)
        self.input_logprob_rows, self.input_logprob_targets = [], []
        # one [8, n] array (numpy converts nested lists ~3x faster than torch.tensor), rows
        # handed out as the batch's tensors
        table = np.array([[r.all_ids[s] for r, s in zip(reqs, starts)], starts,
                          [r.slots[s] for r, s in zip(reqs, starts)],
                          [r.req_pool_idx for r in reqs], seq_lens, starts, self.extend_lens,
                          self.sample_rows], dtype=np.int64)
        ids, positions, loc, rows, lens, prefix, ext, logits_idx = (
            torch.from_numpy(table).to(device).unbind(0))
        return ForwardBatch(
            mode=self.mode, input_ids=ids, positions=positions, out_cache_loc=loc,
            req_pool_indices=rows, seq_lens=lens, prefix_lens=prefix, extend_lens=ext,
            logits_indices=logits_idx, seq_lens_list=seq_lens, prefix_lens_list=starts,
            extend_lens_list=list(self.extend_lens))

    def record_input_logprobs(self, logits: torch.Tensor) -> None:
        """Append each request's prompt logprobs computed by this step's forward."""
        for req, (a, b), targets in zip(self.reqs, self.input_logprob_rows,
                                        self.input_logprob_targets):
            if not req.wants_input_logprobs or req.input_logprobs_done():
                continue
            if not req.input_logprobs and req.logprob_start_len == 0:
                req.input_logprobs.append(None)
                req.input_top_logprobs.append(None)
                req.input_token_ids_logprobs.append(None)
            if b == a:
                continue
            temps = [req.params.temperature] * (b - a)  # T = 0 -> 1 in the sampler
            lp = compute_logprobs(logits[a:b], torch.tensor(temps, device=logits.device))
            if req.wants_selected_ids:   # the first row's target is this input position
                first = max(req.logprob_start_len, 0) + len(req.input_logprobs)
                req.input_token_ids_logprobs.extend(selected_logprobs(
                    lp, [_selected_at(req, first + r) for r in range(b - a)]))
            tgt = torch.tensor(targets, device=logits.device)
            req.input_logprobs.extend(lp.gather(1, tgt[:, None]).squeeze(1).tolist())
            if req.top_logprobs_num:
                vals, idx = lp.topk(req.top_logprobs_num, dim=-1)
                req.input_top_logprobs.extend(
                    list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist()))


def _selected_at(req: Req, position: int) -> list[int]:
    """The ids whose logprobs ``req`` asks for at input position ``position``."""
    if req.token_ids_positions is not None:
        return req.token_ids_positions[position]
    assert req.token_ids_logprob is not None
    return req.token_ids_logprob


def selected_logprobs(lp: torch.Tensor, ids: list[list[int]]
                      ) -> list[list[tuple[float, int]]]:
    """``[(lp[r, t], t) for t in ids[r]]`` for every row ``r`` of ``lp`` ([n, V] logprobs), in
    one gather."""
    rows = [r for r, row in enumerate(ids) for _ in row]
    flat = [t for row in ids for t in row]
    if not flat:
        return [[] for _ in ids]
    values = lp[torch.tensor(rows, device=lp.device), torch.tensor(flat, device=lp.device)]
    vals = iter(values.tolist())
    return [[(next(vals), t) for t in row] for row in ids]


def record_kept(kept: dict[int, list[int]], reqs: list[Req]) -> None:
    """Each asking request's kept nucleus for the token just sampled (``SampleOutput.kept``,
    by row of ``reqs``)."""
    for i, ids in kept.items():
        top_p_kept = reqs[i].top_p_kept
        assert top_p_kept is not None
        top_p_kept.append(ids)


def record_output_selected(logits: torch.Tensor, rows: list[int], reqs: list[Req]) -> None:
    """Each ``req`` that asks for chosen ids' logprobs: those of its new output token's
    position (``log_softmax(logits / T)`` of its ``rows`` entry, as its token logprob)."""
    asking = [(row, req) for row, req in zip(rows, reqs)
              if req.token_ids_logprob is not None and req.return_logprob]
    if not asking:
        return
    idx = torch.tensor([row for row, _ in asking], device=logits.device)
    temps = torch.tensor([req.params.temperature for _, req in asking], device=logits.device)
    lp = compute_logprobs(logits.index_select(0, idx), temps)
    for (_, req), entry in zip(asking, selected_logprobs(
            lp, [req.token_ids_logprob or [] for _, req in asking])):
        req.output_token_ids_logprobs.append(entry)


@dataclass
class _RowParams:
    """What ``build_sampling_batch`` takes from the requests' fixed parameters."""

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    seed_mix: np.ndarray
    top_logprobs_num: list[int]
    masked_logprob_rows: list[int]
    penalised: bool                  # any row with penalties or a min_new_tokens ban to check
    derived: dict = field(default_factory=dict)   # SamplingBatch.derived


class SamplingRowsCache:
    """The last batch's ``_RowParams``, reused while the rows are the same requests (by
    identity, held here so none is recycled) in the same order: a decode step's batch is
    mostly the previous one, and building these is ~10 tensors and passes over the batch."""

    def __init__(self) -> None:
        self._reqs: list[Req] = []
        self._params: Optional[_RowParams] = None

    def get(self, reqs: list[Req], vocab_size: int, device: torch.device) -> _RowParams:
        same = self._params is not None and len(reqs) == len(self._reqs) and all(
            a is b for a, b in zip(reqs, self._reqs))
        if not same:
            self._params = _row_params(reqs, vocab_size, device)
            self._reqs = list(reqs)
        assert self._params is not None
        return self._params


def _row_params(reqs: list[Req], vocab_size: int, device: torch.device) -> _RowParams:
    params = [req.params for req in reqs]
    return _RowParams(
        # the request's own temperature: its logprobs use it
        temperatures=list_tensor([p.temperature for p in params], torch.float32, device),
        top_ps=list_tensor([p.top_p for p in params], torch.float32, device),
        top_ks=list_tensor([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
                            for p in params], torch.int64, device),
        min_ps=list_tensor([p.min_p for p in params], torch.float32, device),
        seed_mix=seed_mix([r.seed for r in reqs]),
        top_logprobs_num=[r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
        masked_logprob_rows=[i for i, r in enumerate(reqs)
                             if r.params.return_masked_logprobs and r.grammar is not None],
        penalised=any(uses_counts(r) or r.params.min_new_tokens > 0 for r in reqs))


def build_sampling_batch(reqs: list[Req], vocab_size: int, eos_ids: frozenset[int],
                         device: torch.device, counts: PenaltyCounts,
                         grammar_ended: frozenset[int] = frozenset(),
                         cache: Optional[SamplingRowsCache] = None) -> SamplingBatch:
    """Per-row tensors of the requests about to sample (in row order). A request that uses
    penalties takes a row of ``counts`` the first time it gets here. ``grammar_ended``: rows
    whose grammar allows only stop tokens; min_new_tokens does not ban EOS there (the grammar
    wins, or no token would be left). ``cache``: where the rows' fixed parameters are kept
    for the next call with the same requests."""
    rows = cache.get(reqs, vocab_size, device) if cache is not None else _row_params(
        reqs, vocab_size, device)
    return SamplingBatch(
        temperatures=rows.temperatures, top_ps=rows.top_ps, top_ks=rows.top_ks,
        min_ps=rows.min_ps,
        uniforms=uniforms_from_mix(rows.seed_mix, [len(r.output_ids) for r in reqs]).to(device),
        penalties=(_penalties(reqs, eos_ids, device, counts, grammar_ended)
                   if rows.penalised else None),
        top_logprobs_num=rows.top_logprobs_num,
        masked_logprob_rows=rows.masked_logprob_rows,
        derived=rows.derived if cache is not None else None,
        kept_rows=[i for i, r in enumerate(reqs) if r.top_p_kept is not None],
    )


def uses_counts(req: Req) -> bool:
    """Whether ``req``'s penalties need its token counts (a row of ``PenaltyCounts``)."""
    p = req.params
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


def _penalties(reqs: list[Req], eos_ids: frozenset[int], device: torch.device,
               counts: PenaltyCounts, grammar_ended: frozenset[int]) -> Optional[Penalties]:
    """Sparse penalty entries of the rows that have any, from the incrementally kept counts."""
    rows: list[int] = []          # batch row of each counted request
    pool_rows: list[int] = []
    params: list[tuple[float, float, float]] = []   # (repetition, frequency, presence)
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, r in enumerate(reqs):
        p = r.params
        if uses_counts(r):
            if r.penalty_row is None:
                r.penalty_row = counts.take(r.input_ids, r.output_ids)
            rows.append(i)
            pool_rows.append(r.penalty_row)
            params.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        if len(r.output_ids) < p.min_new_tokens and i not in grammar_ended:
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)))
            ban_rows.extend([i] * len(banned))
            ban_ids.extend(banned)
    if not rows and not ban_ids:
        return None

    def t(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return list_tensor(values, dtype, device)

    empty = t([])
    pen = Penalties(rows=empty, ids=empty)
    if rows:
        num, pen.ids, n = counts.entries(pool_rows)
        pen.rows = t(rows).repeat_interleave(num)
        rep, freq, pres = zip(*params)
        if any(v != 1.0 for v in rep):
            pen.repetition = t(list(rep), torch.float32).repeat_interleave(num)
        if any(freq) or any(pres):
            f, pr = (t(list(v), torch.float32).repeat_interleave(num) for v in (freq, pres))
            pen.bias = -(f * n + pr * (n > 0))
    if ban_ids:
        pen.banned = (t(ban_rows), t(ban_ids))
    return pen
