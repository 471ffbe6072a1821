"""Reference attention in plain PyTorch (SDPA over gathered slots); the CPU default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rollout_engine.model_runner.attention.base import AttentionBackend
from rollout_engine.model_runner.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _DecodeMeta:
    slot_index: torch.Tensor   # [B, L] slots, padded
    mask: torch.Tensor         # [B, 1, 1, L] True where the slot is a real token


@dataclass
class _ExtendMeta:
    slot_rows: list[torch.Tensor]           # per request: slots of positions [0, seq_len)
    masks: list[Optional[torch.Tensor]]     # per request: [E, L] causal mask, None if E == 1


class TorchNativeBackend(AttentionBackend):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = self.req_to_token.table
        if fb.mode == ForwardMode.DECODE:
            max_len = max(fb.seq_lens_list)
            idx = table[fb.req_pool_indices, :max_len]
            ar = torch.arange(max_len, device=idx.device)
            mask = (ar[None, :] < fb.seq_lens[:, None])[:, None, None, :]
            fb.attn_metadata = _DecodeMeta(idx, mask)
            return
        rows, masks = [], []
        for b, row in enumerate(fb.req_pool_indices.tolist()):
            seq_len, prefix = fb.seq_lens_list[b], fb.prefix_lens_list[b]
            rows.append(table[row, :seq_len])
            ext = seq_len - prefix
            if ext == 1:
                masks.append(None)
            else:
                q_pos = torch.arange(prefix, seq_len)[:, None]
                masks.append(torch.arange(seq_len)[None, :] <= q_pos)
        fb.attn_metadata = _ExtendMeta(rows, masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, fb: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        kbuf, vbuf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        meta = fb.attn_metadata
        if isinstance(meta, _DecodeMeta):
            keys = kbuf[meta.slot_index].transpose(1, 2)     # [B, Hkv, L, D]
            values = vbuf[meta.slot_index].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, values, attn_mask=meta.mask, scale=scaling,
                enable_gqa=True)
            return out[:, :, 0, :]
        assert isinstance(meta, _ExtendMeta)
        outs = []
        start = 0
        for b, slots in enumerate(meta.slot_rows):
            ext = fb.extend_lens_list[b]
            qb = q[start:start + ext].transpose(0, 1)[None]     # [1, Hq, E, D]
            keys = kbuf[slots].transpose(0, 1)[None]             # [1, Hkv, L, D]
            values = vbuf[slots].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                qb, keys, values, attn_mask=meta.masks[b], scale=scaling, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
            start += ext
        return torch.cat(outs, dim=0)
