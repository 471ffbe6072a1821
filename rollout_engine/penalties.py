"""Penalties for the sampler: repetition / frequency / presence entries and the min_new_tokens
ban (``Penalties``, one step's sparse entries), built from each request's incrementally kept
token counts (``PenaltyCounts``, one device row per penalised request). ``sampler.sample``
applies them to the sampling distribution only, never to the returned logprobs;
``penalty_csr`` hands them to the one-pass kernel as per-row CSR.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Penalties", "PenaltyCounts"]


@dataclass
class Penalties:
    """Penalties as sparse entries, each ``(row, id)`` at most once per list; they shape the
    sampling distribution only, never the returned logprobs. An entry's logit ``x`` becomes
    ``x / r`` if ``x > 0`` else ``x * r`` (``repetition``), then gets ``bias`` added (frequency
    and presence: ``-(f * count + p * [count > 0])``); ``banned`` ids (``min_new_tokens``) get
    ``-inf``."""

    rows: torch.Tensor                          # [N] int64 batch rows
    ids: torch.Tensor                           # [N] int64 token ids
    repetition: Optional[torch.Tensor] = None   # [N] float32 (1: none)
    bias: Optional[torch.Tensor] = None         # [N] float32
    banned: Optional[tuple[torch.Tensor, torch.Tensor]] = None   # (batch rows, ids)


class PenaltyCounts:
    """Token counts of the requests that use penalties, one device row each: taken when such a
    request first samples, updated in place as its tokens are appended (``record``), given back
    when it ends. Besides the dense counts a row lists its distinct tokens (prompt and output,
    in order of first sight), so a step reads its penalty entries without scanning the
    vocabulary. Rows grow by doubling up to the most such requests alive at once; the tensors
    are dropped whenever no request holds a row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._reset()

    def _reset(self) -> None:
        v, dev = self.vocab_size, self.device
        self.counts = torch.zeros((0, v), dtype=torch.float32, device=dev)  # output tokens
        self.seen = torch.zeros((0, v), dtype=torch.bool, device=dev)       # prompt or output
        self.ids = torch.zeros((0, 64), dtype=torch.int64, device=dev)      # distinct, padded
        self.num_ids = torch.zeros(0, dtype=torch.int64, device=dev)
        self.free_rows: list[int] = []

    @property
    def num_used(self) -> int:
        return self.counts.shape[0] - len(self.free_rows)

    def _grow(self, rows: int = 0, width: int = 0) -> None:
        old_rows, old_width = self.ids.shape
        new_rows, new_width = max(rows, old_rows), max(width, old_width)
        ids = self.ids.new_zeros(new_rows, new_width)
        ids[:old_rows, :old_width] = self.ids
        self.ids = ids
        if new_rows > old_rows:
            extra = new_rows - old_rows
            self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(extra, self.vocab_size)])
            self.num_ids = torch.cat([self.num_ids, self.num_ids.new_zeros(extra)])
            self.free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self.free_rows

    def take(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A row counting ``output_ids`` and listing ``prompt_ids + output_ids`` as seen."""
        if not self.free_rows:
            self._grow(rows=max(2 * self.counts.shape[0], 8))
        row = self.free_rows.pop()
        distinct = list(dict.fromkeys(prompt_ids + output_ids))
        if len(distinct) > self.ids.shape[1]:
            self._grow(width=max(2 * self.ids.shape[1], len(distinct)))
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.num_ids[row] = len(distinct)
        if distinct:
            ids = torch.tensor(distinct, dtype=torch.int64, device=self.device)
            self.ids[row, :len(distinct)] = ids
            self.seen[row, ids] = True
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
            self.counts[row].index_add_(0, out, torch.ones(len(output_ids), device=self.device))
        return row

    def give_back(self, row: int) -> None:
        self.free_rows.append(row)
        if self.num_used == 0:
            self._reset()

    def record(self, rows: list[int], tokens: list[int]) -> None:
        """Token ``tokens[i]`` was appended to the request holding ``rows[i]`` (rows distinct)."""
        r = torch.tensor(rows, dtype=torch.int64, device=self.device)
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        self.counts[r, t] += 1
        new = ~self.seen[r, t]
        r, t = r[new], t[new]
        if r.numel():
            pos = self.num_ids[r]
            width = int(pos.max()) + 1
            if width > self.ids.shape[1]:
                self._grow(width=2 * width)
            self.ids[r, pos] = t
            self.num_ids[r] = pos + 1
            self.seen[r, t] = True

    def entries(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(num, ids, counts)``: the seen ids of the rows ``rows``, row after row (``num[i]``
        of them for ``rows[i]``), and their output counts."""
        r = torch.tensor(rows, dtype=torch.int64, device=self.device)
        num = self.num_ids.index_select(0, r)
        width = int(num.max()) if rows else 0
        listed = torch.arange(width, device=self.device)[None, :] < num[:, None]
        ids = self.ids.index_select(0, r)[:, :width].masked_select(listed)
        flat = r.repeat_interleave(num) * self.vocab_size + ids
        return num, ids, self.counts.view(-1).index_select(0, flat)


def penalty_csr(logits: torch.Tensor, pen: Optional[Penalties], rows: torch.Tensor
                ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``pen`` (a sampling batch's penalties) of ``rows`` as the one-pass kernel takes them: (offsets, ids, penalised logits)
    by kernel row, bans (-inf) after the penalties of their row so that they win. The
    scheduler lists both by row already (``build_sampling_batch``): then nothing is sorted."""
    if pen is None:
        return None
    b, vocab = logits.shape
    n = rows.numel()
    parts = []
    if pen.rows.numel():
        x = logits.view(-1).index_select(0, pen.rows * vocab + pen.ids)
        parts.append((pen.rows, pen.ids, penalised_logits(x, pen)))
    if pen.banned is not None:
        parts.append((*pen.banned, torch.full(pen.banned[1].shape, float("-inf"))))
    if not parts:
        return None
    if n < b:   # batch rows -> kernel rows, dropping the rows the kernel does not sample
        where = torch.full((b,), -1, dtype=torch.int64)
        where[rows] = torch.arange(n)
        kept = []
        for at, ids, values in parts:
            at = where[at]
            keep = at >= 0
            kept.append((at[keep], ids[keep], values[keep]))
        parts = kept
    return merge_by_row(parts, n)


def merge_by_row(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], n: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR over ``n`` rows of the ``(row, id, value)`` entries of ``parts``: within a row, the
    first part's entries, then the next part's, each in its own order. Parts listed by row
    (as the scheduler builds them) are placed without a sort."""
    counts = [torch.bincount(at, minlength=n) for at, _, _ in parts]
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = sum(counts).cumsum(0)  # type: ignore[union-attr]
    if len(parts) == 1 and bool((parts[0][0][1:] >= parts[0][0][:-1]).all()):
        _, ids, values = parts[0]            # already in place
        return offsets, ids.contiguous(), values.to(torch.float32).contiguous()
    total = int(offsets[-1])
    ids_out = torch.empty(total, dtype=torch.int64)
    values_out = torch.empty(total, dtype=torch.float32)
    base = offsets[:-1].clone()
    for (at, ids, values), count in zip(parts, counts):
        if not bool((at[1:] >= at[:-1]).all()):
            at, order = at.sort(stable=True)
            ids, values = ids[order], values[order]
        first = count.cumsum(0) - count          # where each row starts within this part
        pos = base[at] + torch.arange(at.numel()) - first[at]
        ids_out[pos] = ids
        values_out[pos] = values.to(torch.float32)
        base += count
    return offsets, ids_out, values_out


def penalised_logits(x: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Logits ``x`` of ``pen``'s entries after their penalties (repetition, then the bias)."""
    if pen.repetition is not None:
        x = torch.where(x > 0, x / pen.repetition, x * pen.repetition)
    if pen.bias is not None:
        x = x + pen.bias
    return x
