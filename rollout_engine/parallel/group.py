"""The process group of one engine's tensor-parallel ranks and the collectives the model uses.

Built straight on a c10d backend (gloo on CPU, nccl on CUDA: the same calls), outside torch's
process-wide registry, as the weight-update groups are: a colocated trainer's own
torch.distributed state is never touched. Every collective of a forward carries ``op_timeout_s``
(``--dist-timeout``), so a rank that stops answering fails the step instead of hanging it; a
rank that exits closes its connections and fails it at once. Joining and ``min_int`` (start-up,
while the ranks load at their own pace) wait up to the group's longer start timeout.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "join_tp_group"]

_STORE_PREFIX = "rollout_engine_tp/"


class TPGroup:
    """Rank ``rank`` of ``size``: sum-all-reduce, gather to rank 0, min of an int."""

    def __init__(self, rank: int, size: int, backend: Any, device: torch.device,
                 op_timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self.backend = backend
        self.device = device
        self.op_timeout_s = op_timeout_s
        op_timeout = datetime.timedelta(seconds=op_timeout_s)
        self._sum_opts = dist.AllreduceOptions()
        self._sum_opts.timeout = op_timeout
        self._gather_opts = dist.GatherOptions()
        self._gather_opts.rootRank = 0
        self._gather_opts.timeout = op_timeout
        self._min_opts = dist.AllreduceOptions()
        self._min_opts.reduceOp = dist.ReduceOp.MIN

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        self.backend.allreduce([t], self._sum_opts).wait()
        return t

    def gather_to_first(self, t: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's ``t`` (same shape and dtype) on rank 0, in rank order; None elsewhere."""
        t = t.contiguous()
        out = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        self.backend.gather(out, [t], self._gather_opts).wait()
        return out[0] if self.rank == 0 else None

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.backend.allreduce([t], self._min_opts).wait()
        return int(t.item())

    def shutdown(self) -> None:
        stop = getattr(self.backend, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except RuntimeError:
                pass   # already torn down by a peer's failure


def join_tp_group(store: Any, rank: int, size: int, device: torch.device,
                  timeout_s: float, op_timeout_s: float) -> TPGroup:
    """Join the group on ``store`` (rank 0's TCPStore); blocks until every rank has joined
    (at most ``timeout_s``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(_STORE_PREFIX, store)
    backend: Any
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        backend = dist.ProcessGroupGloo(prefixed, rank, size, opts)
    return TPGroup(rank, size, backend, device, op_timeout_s)
