"""What one forward pass needs, as tensors: the model runner's input type."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

import torch


class ForwardMode(Enum):
    EXTEND = "extend"   # prefill (or a chunk of it) on top of a possibly cached prefix
    DECODE = "decode"   # one new token per request


@dataclass
class ForwardBatch:
    """Flattened tokens of a batch plus the KV addressing the attention backend needs.

    For request b, the pool row ``req_pool_indices[b]`` holds slots for positions
    ``[0, seq_lens[b])``; this forward computes positions
    ``[prefix_lens[b], seq_lens[b])``, whose slots are ``out_cache_loc`` (in batch order).

        row b:  | prefix (KV cached) | extend (this forward) |
                0              prefix_lens[b]          seq_lens[b]
    """

    mode: ForwardMode
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    out_cache_loc: torch.Tensor      # [T] int64 slots to write this step's K/V into
    req_pool_indices: torch.Tensor   # [B] int64
    seq_lens: torch.Tensor           # [B] int64, after this forward
    prefix_lens: torch.Tensor        # [B] int64
    extend_lens: torch.Tensor        # [B] int64 (1 in decode)
    logits_indices: torch.Tensor     # [N] rows of the hidden states whose logits are needed
    seq_lens_list: list[int] = field(default_factory=list)
    prefix_lens_list: list[int] = field(default_factory=list)
    extend_lens_list: list[int] = field(default_factory=list)
    # rollout routing replay (R3), MoE models only (models/moe.py): ``[T, num MoE layers,
    # top_k]`` integer tensors. ``routing_out``: each MoE layer writes the experts it picked for
    # every token of this forward into its column; ``routing_in``: the layers use these experts
    # instead of their own top-k (the trainer's side).
    routing_out: Optional[torch.Tensor] = None
    routing_in: Optional[torch.Tensor] = None
    # the LoRA segments of this forward (models/lora.py: LoraBatch); None when no row has one
    lora: Optional[Any] = None
    # filled by the model runner
    attn_backend: Any = None
    attn_metadata: Optional[Any] = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])
