"""The attention backend contract."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.models.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Writes a forward's K/V into the pool and attends over each request's slots."""

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Precompute per-batch indexing once, before the layers run; stores it on ``fb``."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, fb: ForwardBatch) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` for the new tokens -> output ``[T, Hq, D]``.

        Stores k/v at ``fb.out_cache_loc`` of layer ``layer_id`` first; query t of request b
        sees every earlier position of b (cached prefix and new tokens up to itself).
        """

