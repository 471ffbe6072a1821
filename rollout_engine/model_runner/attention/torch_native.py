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
    slot_index: torch.Tensor   # [B * L] slots of each row, padded to L (flattened)
    mask: torch.Tensor         # [B, 1, 1, L] True where the slot is a real token
    max_len: int               # L
    k_gather: torch.Tensor     # [B * L, Hkv, D] scratch, reused by every layer of this forward
    v_gather: torch.Tensor


@dataclass
class _ExtendMeta:
    slot_rows: list[torch.Tensor]           # per request: slots of positions [0, seq_len)
    masks: list[Optional[torch.Tensor]]     # per request: [E, L] causal mask, None if E == 1


class TorchNativeBackend(AttentionBackend):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = self.req_to_token.table
        if fb.mode == ForwardMode.DECODE:
            max_len = max(fb.seq_lens_list)
            idx = table[fb.req_pool_indices, :max_len].reshape(-1)
            ar = torch.arange(max_len, device=idx.device)
            mask = (ar[None, :] < fb.seq_lens[:, None])[:, None, None, :]
            pool = self.kv_pool
            scratch = (idx.numel(), *pool.shape[1:])
            fb.attn_metadata = _DecodeMeta(
                idx, mask, max_len,
                torch.empty(scratch, dtype=pool.dtype, device=pool.device),
                torch.empty(scratch, dtype=pool.dtype, device=pool.device))
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
            # index_select into per-forward scratch: no fresh 10-100 MB allocation (page faults)
            # per layer, and much faster than advanced indexing on CPU
            bsz, hkv, hd = q.shape[0], kbuf.shape[1], kbuf.shape[2]
            shape = (bsz, meta.max_len, hkv, hd)
            keys = torch.index_select(kbuf, 0, meta.slot_index, out=meta.k_gather)
            values = torch.index_select(vbuf, 0, meta.slot_index, out=meta.v_gather)
            keys = keys.view(shape).transpose(1, 2)          # [B, Hkv, L, D]
            values = values.view(shape).transpose(1, 2)
            # GQA without repeating K/V: the G query heads of each KV head act as G queries
            # (query head h reads KV head h // G, as enable_gqa does)
            qg = q.reshape(bsz, hkv, q.shape[1] // hkv, hd)  # [B, Hkv, G, D]
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.mask,
                                                 scale=scaling)
            return out.reshape(bsz, q.shape[1], hd)
        assert isinstance(meta, _ExtendMeta)
        outs = []
        start = 0
        for b, slots in enumerate(meta.slot_rows):
            ext = fb.extend_lens_list[b]
            qb = q[start:start + ext].transpose(0, 1)[None]     # [1, Hq, E, D]
            keys = kbuf.index_select(0, slots).transpose(0, 1)[None]    # [1, Hkv, L, D]
            values = vbuf.index_select(0, slots).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                qb, keys, values, attn_mask=meta.masks[b], scale=scaling, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
            start += ext
        return torch.cat(outs, dim=0)
