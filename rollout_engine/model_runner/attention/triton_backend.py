"""Attention through the Triton kernels of ``rollout_engine_kernels.triton`` (CUDA; on CPU
under TRITON_INTERPRET=1).

The kernels read K/V straight from the paged pool through ``req_to_token``, so no per-request
gather is materialised: decode uses the split-K flash-decoding kernel, extend the prefix-aware
causal kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_engine.model_runner.attention.base import AttentionBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _Meta:
    qo_start: torch.Tensor   # [B] start row of each request's new tokens


class TritonBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token) -> None:
        super().__init__(kv_pool, req_to_token)
        # imported here: the interpreter flag must be set before triton sees the kernels
        from rollout_engine_kernels.triton.decode_attention import decode_attention
        from rollout_engine_kernels.triton.extend_attention import extend_attention

        self._decode = decode_attention
        self._extend = extend_attention

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        starts = torch.zeros_like(fb.extend_lens)
        if fb.extend_lens.numel() > 1:
            starts[1:] = torch.cumsum(fb.extend_lens, 0)[:-1]
        fb.attn_metadata = _Meta(starts)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, fb: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        kbuf, vbuf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        table = self.req_to_token.table
        q = q.contiguous()
        if fb.mode == ForwardMode.DECODE:
            return self._decode(q, kbuf, vbuf, table, fb.req_pool_indices, fb.seq_lens, scaling)
        return self._extend(q, kbuf, vbuf, table, fb.req_pool_indices, fb.prefix_lens,
                            fb.extend_lens, fb.attn_metadata.qo_start, scaling)
