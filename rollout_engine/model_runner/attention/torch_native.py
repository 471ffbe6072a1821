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
class _FreshRun:
    """Consecutive requests with no cached prefix and the same extend length: their tokens
    ``[start, start + num_reqs * ext_len)`` attend causally among themselves, read from this
    forward's k/v directly (nothing gathered back from the pool), in one SDPA call."""

    start: int
    num_reqs: int
    ext_len: int


@dataclass
class _ExtendMeta:
    """An EXTEND batch split three ways (token ranges of the flattened q):

    - ``fresh``: runs of requests without a cached prefix (``_FreshRun``);
    - ``single``: requests extending by one token on top of a cached prefix (GRPO siblings
      admitted on a radix hit): decode rows for the paged kernel, ``single_tokens`` their q rows;
    - ``gathered``: the rest (a cached prefix plus several new tokens), each over its slots.
    """

    fresh: list[_FreshRun]
    single_tokens: Optional[torch.Tensor]           # [S] token index of each single request
    single_plan: Optional[cpu_kernels.DecodePlan]
    gathered: list[tuple[int, int, torch.Tensor, Optional[torch.Tensor]]]
    # (start, ext, slots of positions [0, seq_len), [E, L] causal mask or None if E == 1)


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
        fb.attn_metadata = self._plan_extend(fb)

    def _plan_extend(self, fb: ForwardBatch) -> _ExtendMeta:
        table = self.req_to_token.table
        fresh: list[_FreshRun] = []
        singles: list[int] = []         # batch indices
        single_tokens: list[int] = []
        gathered = []
        start = 0
        for b, row in enumerate(fb.req_pool_indices.tolist()):
            seq_len, prefix = fb.seq_lens_list[b], fb.prefix_lens_list[b]
            ext = seq_len - prefix
            if prefix == 0:
                last = fresh[-1] if fresh else None
                if last and last.ext_len == ext and last.start + last.num_reqs * ext == start:
                    last.num_reqs += 1
                else:
                    fresh.append(_FreshRun(start, 1, ext))
            elif ext == 1 and self.decode_kernel is not None:
                singles.append(b)
                single_tokens.append(start)
            else:
                mask = None
                if ext > 1:
                    q_pos = torch.arange(prefix, seq_len)[:, None]
                    mask = torch.arange(seq_len)[None, :] <= q_pos
                gathered.append((start, ext, table[row, :seq_len], mask))
            start += ext
        plan = tokens = None
        if singles:
            idx = torch.tensor(singles, dtype=torch.int64)
            lens = fb.seq_lens.index_select(0, idx.to(fb.seq_lens.device)).cpu()
            plan = cpu_kernels.plan_decode(table, fb.req_pool_indices.cpu()[idx], lens,
                                           int(lens.max()), self.min_shared_len)
            tokens = torch.tensor(single_tokens, dtype=torch.int64)
        return _ExtendMeta(fresh, tokens, plan, gathered)

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
        return self._extend(q, k, v, kbuf, vbuf, meta, scaling)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kbuf: torch.Tensor,
                vbuf: torch.Tensor, meta: _ExtendMeta, scaling: float) -> torch.Tensor:
        hq, hkv, hd = q.shape[1], k.shape[1], q.shape[2]
        out = torch.empty_like(q)
        for run in meta.fresh:
            n, e = run.num_reqs, run.ext_len
            span = slice(run.start, run.start + n * e)
            qb, kb, vb = (t[span].view(n, e, -1, hd).transpose(1, 2) for t in (q, k, v))
            if e == 1:      # one token sees only itself
                res = vb.repeat_interleave(hq // hkv, dim=1)
            else:
                res = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scaling,
                                                     enable_gqa=True)
            out[span].view(n, e, hq, hd).copy_(res.transpose(1, 2))
        if meta.single_tokens is not None:
            assert self.decode_kernel is not None and meta.single_plan is not None
            rows = q.index_select(0, meta.single_tokens)
            res = cpu_kernels.paged_decode(self.decode_kernel, rows, kbuf, vbuf,
                                           self.req_to_token.table, meta.single_plan, scaling)
            out.index_copy_(0, meta.single_tokens, res)
        for start, ext, slots, mask in meta.gathered:
            qb = q[start:start + ext].transpose(0, 1)[None]     # [1, Hq, E, D]
            keys = kbuf.index_select(0, slots).transpose(0, 1)[None]    # [1, Hkv, L, D]
            values = vbuf.index_select(0, slots).transpose(0, 1)[None]
            res = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask,
                                                 scale=scaling, enable_gqa=True)
            out[start:start + ext] = res[0].transpose(0, 1)
        return out
