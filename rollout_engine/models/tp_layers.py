"""The layers that talk across ranks (column-parallel projections are plain ``MergedLinear``s
of a rank's rows and need no communication).

    RowParallelLinear       x[:, my columns] @ W[:, my columns].T, summed over the ranks, + bias
    VocabParallelEmbedding  my rows of the table; other ids give zeros; summed over the ranks
    vocab_parallel_logits   logits of my vocabulary rows, gathered on rank 0 (only rank 0 samples)

The layers hold their parameters under ``nn.Linear`` / ``nn.Embedding``'s names (``weight``,
``bias``), so the memory saver and weight reads treat them as any other parameter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout_engine.models.layers import linear, linear_fp32_out
from rollout_engine.parallel.context import TPContext

__all__ = ["RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_logits"]


class RowParallelLinear(nn.Module):
    """A linear whose input features are split over the ranks (o_proj, down_proj): each rank
    multiplies its columns, the partial products are summed, the bias is added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext) -> None:
        super().__init__()
        self.group = tp.group
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + padded)`` of the embedding table (the tail past the vocabulary is
    padding); a token outside them embeds to zeros here and is filled in by its own rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext) -> None:
        super().__init__()
        self.group = tp.group
        self.start, self.num_real, padded = tp.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(out)   # x + 0 is exact: the same rows as one rank's


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TPContext,
                          vocab_size: int) -> Optional[torch.Tensor]:
    """Float32 logits of this rank's vocabulary rows (``weight``: its padded part of the LM
    head or of the tied embedding), gathered on rank 0 as ``[N, vocab_size]``; None elsewhere
    (only rank 0 samples)."""
    parts = tp.group.gather_to_first(linear_fp32_out(hidden, weight))
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size]
