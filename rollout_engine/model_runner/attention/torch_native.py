"""Attention in PyTorch (SDPA over gathered slots), the CPU default; decode uses the C++ paged
kernel of ``cpu_kernels`` (K/V read in place, shared prefixes read once) where it can.

The PyTorch decode path stays as the reference: ``use_kernel=False`` or the environment variable
``ROLLOUT_ENGINE_ATTN_KERNEL=0`` forces it, and it is taken whenever the kernel cannot be built
or does not cover the pool (not float32 on CPU, an unusual head_dim).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention import cpu_kernels
from rollout_engine.model_runner.attention.base import AttentionBackend
from rollout_engine.model_runner.forward_batch import ForwardBatch, ForwardMode

KERNEL_ENV = "ROLLOUT_ENGINE_ATTN_KERNEL"


@dataclass
class _DecodeMeta:
    slot_index: torch.Tensor   # [B * L] slots of each row, padded to L (flattened)
    mask: torch.Tensor         # [B, 1, 1, L] True where the slot is a real token
    max_len: int               # L
    k_gather: torch.Tensor     # [B * L, Hkv, D] scratch, reused by every layer of this forward
    v_gather: torch.Tensor


@dataclass
class _KernelDecodeMeta:
    plan: cpu_kernels.DecodePlan    # rows, lengths and shared-prefix groups for the kernel


@dataclass
class _ExtendMeta:
    slot_rows: list[torch.Tensor]           # per request: slots of positions [0, seq_len)
    masks: list[Optional[torch.Tensor]]     # per request: [E, L] causal mask, None if E == 1


class TorchNativeBackend(AttentionBackend):
    """SDPA over gathered slots; decode through the paged C++ kernel when available.

    ``use_kernel``: None reads ``ROLLOUT_ENGINE_ATTN_KERNEL`` (on unless "0").
    ``min_shared_len``: shortest shared prefix worth cascade attention; None disables it.
    """

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 use_kernel: Optional[bool] = None,
                 min_shared_len: Optional[int] = cpu_kernels.DEFAULT_MIN_SHARED_LEN) -> None:
        super().__init__(kv_pool, req_to_token)
        if use_kernel is None:
            use_kernel = os.environ.get(KERNEL_ENV, "1") != "0"
        supported = cpu_kernels.kernel_supports(kv_pool.dtype, kv_pool.device, kv_pool.shape[2])
        self.decode_kernel = cpu_kernels.load_paged_decode() if use_kernel and supported else None
        self.min_shared_len = min_shared_len

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = self.req_to_token.table
        if fb.mode == ForwardMode.DECODE and self.decode_kernel is not None:
            plan = cpu_kernels.plan_decode(table, fb.req_pool_indices, fb.seq_lens,
                                           max(fb.seq_lens_list), self.min_shared_len)
            fb.attn_metadata = _KernelDecodeMeta(plan)
            return
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
        if isinstance(meta, _KernelDecodeMeta):
            assert self.decode_kernel is not None
            return cpu_kernels.paged_decode(self.decode_kernel, q, kbuf, vbuf,
                                            self.req_to_token.table, meta.plan, scaling)
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
