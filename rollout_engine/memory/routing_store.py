"""The experts every KV slot's token was routed to (rollout routing replay, R3).

With ``--enable-return-routed-experts`` on a mixture-of-experts model, the store holds one row
per KV slot, ``[len(moe.moe_layers), top_k]`` expert ids in ``routing_dtype(moe)``. Every
forward of the target model hands its MoE layers a ``routing_out`` buffer
(``ForwardBatch.routing_out``); the runner then writes the buffer's rows to the store at the
forward's ``out_cache_loc`` in one ``index_copy_``. A token's routing therefore lives exactly as
long as its KV does and moves with nothing: a radix-cache hit reads the rows of the slots it
shares, a chunked prefill writes each chunk's slots, a retracted request's recompute writes its
new slots, and a speculative verify writes the slots of the tokens it kept (those it rejected are
overwritten with the KV). A finished request reads the rows of its slots before they are
released (``read``).

Without the flag, or on a dense model, the store is ``NoRoutingStore``: no buffer, no copy.
Only the process that runs the scheduler records (tensor-parallel rank 0: the ranks route
alike). The store is released and restored with the KV cache (``kv_cache`` tag); the hierarchical
cache, whose lower tiers would move KV without its routing, is refused with the flag (config).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Optional

import torch

from rollout_engine.models.forward_batch import ForwardBatch
from rollout_engine.models.moe import MoEArch, routing_bytes_per_token, routing_dtype
from rollout_engine.protocol.routed_experts import RoutedExperts

__all__ = ["NoRoutingStore", "RoutingStore", "SlotRoutingStore", "create_routing_store"]


class RoutingStore(ABC):
    """Per-KV-slot routing rows. The caller (the model runner and the scheduler, between and
    around forwards on the scheduler's thread) holds the slots it names."""

    bytes_per_token: int = 0   # memory of one slot's row

    @property
    def records(self) -> bool:
        """Whether forwards record their routing here."""
        return self.bytes_per_token > 0

    @abstractmethod
    def out_buffer(self, num_tokens: int) -> Optional[torch.Tensor]:
        """A ``[num_tokens, moe layers, top_k]`` buffer for a forward's ``routing_out``, or
        None (nothing is recorded)."""

    @abstractmethod
    def record(self, fb: ForwardBatch) -> None:
        """Copy ``fb.routing_out`` (filled by the forward) to the rows of ``fb.out_cache_loc``."""

    @abstractmethod
    def read(self, slots: Sequence[int]) -> RoutedExperts:
        """The rows of ``slots``, in order."""

    @abstractmethod
    def nbytes(self) -> int:
        """Memory held now."""

    @abstractmethod
    def release(self) -> None:
        """Free the rows (sleep, with the KV cache); nothing is recorded or read until
        ``allocate``."""

    @abstractmethod
    def allocate(self) -> None:
        """Bring the rows back (zeroed)."""


class NoRoutingStore(RoutingStore):
    """Routing is not recorded: the flag is off, or the model has no experts."""

    def out_buffer(self, num_tokens: int) -> Optional[torch.Tensor]:
        return None

    def record(self, fb: ForwardBatch) -> None:
        return None

    def read(self, slots: Sequence[int]) -> RoutedExperts:
        raise RuntimeError("routed experts are not recorded: start the engine with "
                           "enable_return_routed_experts on a mixture-of-experts model")

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        return None

    def allocate(self) -> None:
        return None


class SlotRoutingStore(RoutingStore):
    """``[num_slots, len(moe.moe_layers), top_k]`` rows on the KV pool's device (its rows
    include the pool's padding slot, which CUDA-graph padding writes and no request reads)."""

    def __init__(self, moe: MoEArch, num_layers: int, num_slots: int,
                 device: torch.device) -> None:
        self.moe = moe
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.device = device
        self.dtype = routing_dtype(moe)
        self.bytes_per_token = routing_bytes_per_token(moe)
        self.row_shape = (len(moe.moe_layers), moe.top_k)
        self.table: Optional[torch.Tensor] = None
        self.allocate()

    def out_buffer(self, num_tokens: int) -> Optional[torch.Tensor]:
        return torch.empty((num_tokens, *self.row_shape), dtype=self.dtype, device=self.device)

    def record(self, fb: ForwardBatch) -> None:
        if fb.routing_out is None or self.table is None:
            raise RuntimeError("a forward ran without its routing buffer or while the routing "
                               "store was released")
        self.table.index_copy_(0, fb.out_cache_loc, fb.routing_out)

    def read(self, slots: Sequence[int]) -> RoutedExperts:
        if self.table is None:
            raise RuntimeError("the routing store is released (the KV cache is asleep)")
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        rows = self.table.index_select(0, index).cpu().numpy()
        return RoutedExperts(data=rows.tobytes(), dtype=str(rows.dtype), rows=len(slots),
                             moe_layers=self.moe.moe_layers, num_layers=self.num_layers,
                             top_k=self.moe.top_k)

    def nbytes(self) -> int:
        return 0 if self.table is None else self.table.numel() * self.table.element_size()

    def release(self) -> None:
        self.table = None

    def allocate(self) -> None:
        self.table = torch.zeros((self.num_slots, *self.row_shape), dtype=self.dtype,
                                 device=self.device)


def create_routing_store(enabled: bool, moe: Optional[MoEArch], num_layers: int,
                         num_slots: int, device: torch.device) -> RoutingStore:
    """The store for a runner: real only with the flag on a model with experts."""
    if not enabled or moe is None:
        return NoRoutingStore()
    return SlotRoutingStore(moe, num_layers, num_slots, device)
