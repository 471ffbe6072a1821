"""Attention in PyTorch (SDPA over gathered slots), the CPU default; decode uses the C++ paged
kernel of ``rollout_engine_kernels.cpu.paged_decode`` (K/V read in place, shared prefixes read
once) where it can.

The PyTorch decode path stays as the reference: ``use_kernel=False`` or the environment variable
``ROLLOUT_ENGINE_ATTN_KERNEL=0`` forces it, and it is taken whenever the kernel cannot be built
or does not cover the pool (not float32 on CPU, an unusual head_dim).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from rollout_engine_kernels.cpu import paged_decode as cpu_paged

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention.base import AttentionBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

KERNEL_ENV = "ROLLOUT_ENGINE_ATTN_KERNEL"


@dataclass
class _DecodeMeta:
    slot_index: torch.Tensor   # [B * L] slots of each row, padded to L (flattened)
    mask: torch.Tensor         # [B, 1, 1, L] True where the slot is a real token
    max_len: int               # L
    k_gather: torch.Tensor     # [B * L, Hkv, D] scratch, reused by every layer of this forward
    v_gather: torch.Tensor


@dataclass
class KernelDecodeMeta:
    plan: cpu_paged.DecodePlan    # rows, lengths and shared-prefix groups for the kernel


@dataclass
class _FreshRun:
    """Consecutive requests with no cached prefix and the same extend length: their tokens
    ``[start, start + num_reqs * ext_len)`` attend causally among themselves, read from this
    forward's k/v directly (nothing gathered back from the pool), in one SDPA call."""

    start: int
    num_reqs: int
    ext_len: int


@dataclass
class _GatheredGroup:
    """Requests extending a cached prefix by several tokens, padded into one SDPA call.

    Request b of the group reads its slots ``table[row_b, :L]`` (entries past its seq_len are
    stale but valid slots, masked out) and its queries are ``q[start_b : start_b + E_b]``
    padded to ``E`` by repeating its last token. GQA without repeating K/V: the G query heads
    of KV head h act as E x G queries of h, each row carrying its token's causal mask row::

        keys     [n, Hkv, L, D]       slots of positions 0 .. L-1 (one gather per layer)
        queries  [n, Hkv, E * G, D]   row i * G + g = head h * G + g of the i-th new token
        mask     [n, 1, E * G, L]     key j visible to new token i iff j <= prefix_b + i

    A padded query row (i >= E_b) still sees key 0, so no row is all -inf (no NaN); its
    output is dropped: ``real_rows`` picks the rows of real tokens out of the ``n * E``
    result rows, ``token_index`` says where they go in the batch.
    """

    num_reqs: int
    ext_len: int                       # E, the longest extend of the group
    seq_len: int                       # L, the longest sequence of the group
    q_index: torch.Tensor              # [n * E] token of each padded query row
    slot_index: torch.Tensor           # [n * L] slots, row-major
    visible: torch.Tensor              # [n, E, L] bool, the mask before the G repeat
    real_rows: Optional[torch.Tensor]  # [T'] rows of real tokens in [n * E]; None if no padding
    token_index: torch.Tensor          # [T'] where those rows go in the batch's output
    k_gather: torch.Tensor             # [n * L, Hkv, D] scratch, reused by every layer
    v_gather: torch.Tensor
    mask: Optional[torch.Tensor] = None   # [n, 1, E * G, L], built by the first layer

    def mask_for(self, groups_per_kv: int) -> torch.Tensor:
        if self.mask is None:
            self.mask = self.visible.repeat_interleave(groups_per_kv, dim=1)[:, None]
        return self.mask


# A group's padded attention may cost at most this much more than its requests unpadded
# (sum of E_b * L_b); requests sorted by length are cut into groups to stay under it.
_MAX_PAD_COST = 1.25


@dataclass
class _ExtendMeta:
    """An EXTEND batch split three ways (token ranges of the flattened q):

    - ``fresh``: runs of requests without a cached prefix (``_FreshRun``);
    - ``single``: requests extending by one token on top of a cached prefix (GRPO siblings
      admitted on a radix hit): decode rows for the paged kernel, ``single_tokens`` their q rows;
    - ``gathered``: the rest (a cached prefix plus several new tokens: a HiCache hit, a
      multi-turn history), in padded groups over their slots (``_GatheredGroup``).
    """

    fresh: list[_FreshRun]
    single_tokens: Optional[torch.Tensor]           # [S] token index of each single request
    single_plan: Optional[cpu_paged.DecodePlan]
    gathered: list[_GatheredGroup]


class TorchNativeBackend(AttentionBackend):
    """SDPA over gathered slots; decode through the paged C++ kernel when available.

    ``use_kernel``: None reads ``ROLLOUT_ENGINE_ATTN_KERNEL`` (on unless "0").
    ``min_shared_len``: shortest shared prefix worth cascade attention; None disables it.
    ``batch_invariant``: every query token (decode and prefill alike) is one row of the paged
    kernel over its own slots, with no cascade, so its output depends on its own row only
    (``models/batch_invariant.py``); RuntimeError where the kernel is not available.
    """

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 use_kernel: Optional[bool] = None,
                 min_shared_len: Optional[int] = cpu_paged.DEFAULT_MIN_SHARED_LEN,
                 batch_invariant: bool = False) -> None:
        super().__init__(kv_pool, req_to_token)
        if use_kernel is None:
            use_kernel = os.environ.get(KERNEL_ENV, "1") != "0"
        supported = cpu_paged.kernel_supports(kv_pool.dtype, kv_pool.device, kv_pool.shape[2])
        self.decode_kernel = cpu_paged.load_paged_decode() if use_kernel and supported else None
        self.batch_invariant = batch_invariant
        if batch_invariant:
            if self.decode_kernel is None:
                raise RuntimeError("enable_deterministic_inference needs the paged attention "
                                   "kernel (float32 CPU pool, a supported head_dim, built, "
                                   f"{KERNEL_ENV} not 0)")
            min_shared_len = None
        self.min_shared_len = min_shared_len
        self._last_plan: Optional[tuple[int, cpu_paged.DecodePlan]] = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = self.req_to_token.table
        if fb.mode == ForwardMode.DECODE and self.decode_kernel is not None:
            fb.attn_metadata = KernelDecodeMeta(self._decode_plan(table, fb))
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

    def _decode_plan(self, table: torch.Tensor, fb: ForwardBatch) -> cpu_paged.DecodePlan:
        """``plan_decode``, or the last step's plan with this step's lengths when the batch has
        the same rows and none of their slots changed since (``ReqToTokenPool.generation``): a
        decode step only appends a fresh slot to each row, which leaves every shared prefix
        as it was (~0.5 ms a step at batch 64 not spent sorting the rows again)."""
        generation = self.req_to_token.generation
        last = self._last_plan
        if last is not None and last[0] == generation and torch.equal(last[1].rows,
                                                                      fb.req_pool_indices):
            plan = dataclasses.replace(last[1], seq_lens=fb.seq_lens.to(torch.int64).contiguous())
        else:
            plan = cpu_paged.plan_decode(table, fb.req_pool_indices, fb.seq_lens,
                                           max(fb.seq_lens_list), self.min_shared_len)
        self._last_plan = (generation, plan)
        return plan

    def _plan_extend(self, fb: ForwardBatch) -> _ExtendMeta:
        table = self.req_to_token.table
        if self.batch_invariant:   # every token a decode row over slots 0 .. its position
            rows, lens = [], []
            for row, seq_len, prefix in zip(fb.req_pool_indices.tolist(), fb.seq_lens_list,
                                            fb.prefix_lens_list):
                rows += [row] * (seq_len - prefix)
                lens += range(prefix + 1, seq_len + 1)
            lens_t = torch.tensor(lens, dtype=torch.int64)
            plan = cpu_paged.plan_decode(table, torch.tensor(rows, dtype=torch.int64), lens_t,
                                         max(lens), None)
            return _ExtendMeta([], torch.arange(len(lens), dtype=torch.int64), plan, [])
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
                gathered.append((start, prefix, seq_len, row))
            start += ext
        plan = tokens = None
        if singles:
            idx = torch.tensor(singles, dtype=torch.int64)
            lens = fb.seq_lens.index_select(0, idx.to(fb.seq_lens.device)).cpu()
            plan = cpu_paged.plan_decode(table, fb.req_pool_indices.cpu()[idx], lens,
                                           int(lens.max()), self.min_shared_len)
            tokens = torch.tensor(single_tokens, dtype=torch.int64)
        groups = [self._plan_group(table, g) for g in _split_groups(gathered)]
        return _ExtendMeta(fresh, tokens, plan, groups)

    def _plan_group(self, table: torch.Tensor, reqs: list[tuple[int, int, int, int]]
                    ) -> _GatheredGroup:
        """One padded SDPA call for ``reqs`` ((start, prefix_len, seq_len, row) each)."""
        pool = self.kv_pool
        hkv = pool.shape[1]
        n = len(reqs)
        ext_len = max(s - p for _, p, s, _ in reqs)
        seq_len = max(s for _, _, s, _ in reqs)
        starts = torch.tensor([r[0] for r in reqs], dtype=torch.int64)
        prefix = torch.tensor([r[1] for r in reqs], dtype=torch.int64)
        exts = torch.tensor([s - p for _, p, s, _ in reqs], dtype=torch.int64)
        ar_e = torch.arange(ext_len)
        q_index = starts[:, None] + torch.minimum(ar_e[None, :], exts[:, None] - 1)
        rows = torch.tensor([r[3] for r in reqs], dtype=torch.int64, device=table.device)
        slot_index = table[rows, :seq_len].reshape(-1)
        visible = torch.arange(seq_len)[None, None, :] <= (prefix[:, None] + ar_e)[:, :, None]
        real = (ar_e[None, :] < exts[:, None]).reshape(-1)
        real_rows = None if bool(real.all()) else real.nonzero().squeeze(1)
        token_index = q_index.reshape(-1) if real_rows is None else q_index.reshape(-1)[real_rows]
        scratch = (n * seq_len, hkv, pool.shape[2])
        dev = pool.device
        return _GatheredGroup(
            n, ext_len, seq_len, q_index.reshape(-1).to(dev), slot_index, visible.to(dev),
            None if real_rows is None else real_rows.to(dev), token_index.to(dev),
            torch.empty(scratch, dtype=pool.dtype, device=dev),
            torch.empty(scratch, dtype=pool.dtype, device=dev))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, fb: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        kbuf, vbuf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        meta = fb.attn_metadata
        if isinstance(meta, KernelDecodeMeta):
            assert self.decode_kernel is not None
            return cpu_paged.paged_decode(self.decode_kernel, q, kbuf, vbuf,
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
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kernel = self.decode_kernel
        causal = (getattr(kernel, "has_prefill_causal", False) and q.is_cpu
                  and q.dtype is torch.float32 and k.stride(0) == v.stride(0))
        for run in meta.fresh:
            n, e = run.num_reqs, run.ext_len
            span = slice(run.start, run.start + n * e)
            if causal and e > 1:    # the compiled causal kernel: ~4x SDPA on 16 x 128 tokens
                kernel.prefill_causal(q[span], k[span], v[span], n, scaling, out[span])
                continue
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
            res = cpu_paged.paged_decode(self.decode_kernel, rows, kbuf, vbuf,
                                           self.req_to_token.table, meta.single_plan, scaling)
            out.index_copy_(0, meta.single_tokens, res)
        for group in meta.gathered:
            out.index_copy_(0, group.token_index,
                            _gathered_attention(q, kbuf, vbuf, group, scaling))
        return out


def _gathered_attention(q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor,
                        group: _GatheredGroup, scaling: float) -> torch.Tensor:
    """Attention of ``group``'s new tokens over their slots: ``[T', Hq, D]`` in the order of
    ``group.token_index`` (see ``_GatheredGroup`` for the layout)."""
    n, e, seq_len = group.num_reqs, group.ext_len, group.seq_len
    hq, hkv, hd = q.shape[1], kbuf.shape[1], q.shape[2]
    g = hq // hkv
    keys = torch.index_select(kbuf, 0, group.slot_index, out=group.k_gather)
    values = torch.index_select(vbuf, 0, group.slot_index, out=group.v_gather)
    keys = keys.view(n, seq_len, hkv, hd).transpose(1, 2)               # [n, Hkv, L, D]
    values = values.view(n, seq_len, hkv, hd).transpose(1, 2)
    qg = q.index_select(0, group.q_index).view(n, e, hkv, g, hd)
    qg = qg.transpose(1, 2).reshape(n, hkv, e * g, hd)                  # [n, Hkv, E * G, D]
    res = F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask_for(g),
                                         scale=scaling)
    res = res.view(n, hkv, e, g, hd).transpose(1, 2).reshape(n * e, hq, hd)
    return res if group.real_rows is None else res.index_select(0, group.real_rows)


def _split_groups(reqs: list[tuple[int, int, int, int]]) -> list[list[tuple[int, int, int, int]]]:
    """Sort gathered requests ((start, prefix_len, seq_len, row)) by length and cut them into
    groups whose padded cost stays within ``_MAX_PAD_COST`` of their unpadded cost."""
    groups: list[list[tuple[int, int, int, int]]] = []
    cur: list[tuple[int, int, int, int]] = []
    real = max_ext = max_len = 0
    for req in sorted(reqs, key=lambda r: (r[2], r[2] - r[1])):
        ext, seq_len = req[2] - req[1], req[2]
        e, s = max(max_ext, ext), max(max_len, seq_len)
        if cur and (len(cur) + 1) * e * s > _MAX_PAD_COST * (real + ext * seq_len):
            groups.append(cur)
            cur, real, e, s = [], 0, ext, seq_len
        cur.append(req)
        real += ext * seq_len
        max_ext, max_len = e, s
    if cur:
        groups.append(cur)
    return groups
