"""What one tensor-parallel rank is: its index, its group, its slice of every sharded dimension.

    attention heads   q heads split evenly; KV heads split evenly, or, when there are fewer KV
                      heads than ranks, each rank keeps the one KV head its q heads read
    MLP               intermediate_size split evenly (gate_up column-, down row-parallel)
    vocabulary        ceil(vocab / tp) rows per rank; the last rank's tail is padding, never
                      looked up and cut from the gathered logits

The scheduler builds its model runner itself, so rank 0's context reaches the runner through
``installed`` (a scoped install that refuses nesting); the other ranks pass theirs directly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

__all__ = ["Shard", "TPContext", "WeightCommit", "check_tp_size", "current_tp", "installed",
           "replicated_checksum"]


@dataclass(frozen=True)
class Shard:
    """The slice ``[start, start + length)`` along ``dim`` of a full checkpoint tensor of shape
    ``full_shape`` that one rank holds."""

    dim: int
    start: int
    length: int
    full_shape: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.length)


class WeightCommit(Protocol):
    """All-or-nothing weight updates across the ranks (``leader.LeaderCommit`` on rank 0,
    ``worker.WorkerCommit`` elsewhere): every rank calls ``agree`` once it has checked its part
    of an update (``error``: why it cannot apply it, or None) and before writing anything."""

    def agree(self, error: Optional[str]) -> None:
        """Return when every rank may write; raise ValueError (naming the rank) when one
        cannot. With ``error`` set the caller raises its own error afterwards."""


@dataclass
class TPContext:
    rank: int
    size: int
    group: Any                        # group.TPGroup
    commit: Optional[WeightCommit] = None   # set once the first load is done
    leader: Any = None                # rank 0: leader.Leader (sends each forward's inputs)

    # -- slices ----------------------------------------------------------------------------
    def split(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's equal part of ``n`` (divisible by ``size``)."""
        part = n // self.size
        return self.rank * part, part

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, number of KV heads) this rank holds."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1   # replicated: the one our q heads read

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, real rows, padded rows) of this rank's part of the vocabulary."""
        padded = -(-vocab_size // self.size)
        start = self.rank * padded
        return start, max(0, min(padded, vocab_size - start)), padded


def replicated_checksum(model: Any) -> int:
    """An exact fingerprint of the weights every rank holds whole (norms, row-parallel
    biases): the sum of their raw 32-bit words. Ranks that differ here serve mixed weights."""
    shards = model.tp_shards()
    total = 0
    for name, (param, row0, rows) in sorted(model.weight_map().items()):
        if name in shards or param.numel() == 0:
            continue
        part = param.data if param.dim() == 0 else param.data.narrow(0, row0, rows)
        raw = part.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = (-raw.numel()) % 4
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        total += int(raw.view(torch.int32).to(torch.int64).sum().item())
    return total


def check_tp_size(tp_size: int, hf_config: dict[str, Any]) -> Optional[str]:
    """Why ``tp_size`` cannot shard this model (a message naming the dimension), or None."""
    if tp_size == 1:
        return None
    heads = hf_config.get("num_attention_heads", 0)
    kv = hf_config.get("num_key_value_heads") or heads
    inter = hf_config.get("intermediate_size", 0)
    if heads % tp_size:
        return f"must divide num_attention_heads ({heads}), got {tp_size}"
    if kv % tp_size and tp_size % kv:
        return (f"must divide num_key_value_heads ({kv}) or be a multiple of it (KV heads are "
                f"then replicated), got {tp_size}")
    if inter % tp_size:
        return f"must divide intermediate_size ({inter}), got {tp_size}"
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):   # MoE experts
        size = hf_config.get(key) or 0
        if hf_config.get("num_experts") and size % tp_size:
            return f"must divide {key} ({size}), got {tp_size}"
    return None


_CURRENT: contextvars.ContextVar[Optional[TPContext]] = contextvars.ContextVar(
    "rollout_engine_tp", default=None)


@contextlib.contextmanager
def installed(ctx: TPContext) -> Iterator[TPContext]:
    """Make ``ctx`` the context ``current_tp`` returns while the scheduler is built."""
    if _CURRENT.get() is not None:
        raise RuntimeError("a tensor-parallel context is already installed")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_tp() -> Optional[TPContext]:
    return _CURRENT.get()
