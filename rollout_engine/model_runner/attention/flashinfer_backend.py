"""Attention through FlashInfer's paged-KV wrappers (CUDA, float16 / bfloat16 only).

Our pool is one slot per token, ``[num_slots + 1, num_kv_heads, head_dim]`` per layer; viewed as
``[num_pages, page_size=1, H, D]`` it is FlashInfer's NHD paged layout with one token per page,
so a request's page list is exactly its row of ``req_to_token``:

    kv_indptr:        0, L0, L0+L1, ...                     (cumsum of seq_lens)
    kv_indices:       table[r0, :L0] ++ table[r1, :L1] ++ ...  (int32 slot ids)
    kv_last_page_len: 1 for every request                    (every page is full)
    qo_indptr:        0, E0, E0+E1, ...                      (cumsum of extend_lens; extend only)

Planning happens once per forward, at the first layer (the scale and the query dtype are known
there); every layer then runs on the same plan. With a cached prefix, FlashInfer's causal mask
is aligned to the end of each request's keys, which is our ``prefix + new tokens`` semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.model_runner.attention.base import AttentionBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024
# GQA groups of at least this size decode faster on the tensor-core (prefill) kernels.
TENSOR_CORE_MIN_GROUP = 4


@dataclass
class _Meta:
    kv_indptr: torch.Tensor        # [B + 1] int32, host
    kv_indices: torch.Tensor       # [sum(seq_lens)] int32, device
    kv_last_page_len: torch.Tensor  # [B] int32, host
    qo_indptr: torch.Tensor        # [B + 1] int32, host
    planned_scale: Optional[float] = None


def kv_indices_from_table(table: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor, seq_lens_list: list[int]) -> torch.Tensor:
    """``table[r_b, :L_b]`` for every request b, concatenated, as int32 (no host sync)."""
    total = sum(seq_lens_list)
    device = table.device
    if total == 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    rows = torch.repeat_interleave(req_pool_indices, seq_lens, output_size=total)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    offsets = torch.repeat_interleave(starts, seq_lens, output_size=total)
    positions = torch.arange(total, device=device) - offsets
    return table[rows, positions].to(torch.int32)


def _indptr(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return out


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """FlashInfer runs on CUDA, in float16 or bfloat16 (its kernels have no float32 path)."""
    if device.type != "cuda":
        raise ValueError(f"attention_backend 'flashinfer' needs CUDA, the KV pool is on "
                         f"{device.type!r}; use 'torch_native' on CPU")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention_backend 'flashinfer' needs dtype float16 or bfloat16, "
                         f"got {dtype}; use attention_backend='triton' for float32")


class FlashInferBackend(AttentionBackend):
    """Decode: ``BatchDecodeWithPagedKVCacheWrapper``; extend (with or without a cached
    prefix): ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask."""

    def __init__(self, kv_pool, req_to_token) -> None:
        super().__init__(kv_pool, req_to_token)
        try:
            import flashinfer
        except ImportError as e:
            raise ValueError(
                "attention_backend 'flashinfer' needs the flashinfer-python package "
                "(pip install flashinfer-python); or choose attention_backend='triton'") from e
        check_supported(kv_pool.device, kv_pool.dtype)
        self._fi: Any = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: Optional[Any] = None  # built at the first decode: depends on the GQA group

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        indices = kv_indices_from_table(self.req_to_token.table, fb.req_pool_indices,
                                        fb.seq_lens, fb.seq_lens_list)
        fb.attn_metadata = _Meta(
            kv_indptr=_indptr(fb.seq_lens_list), kv_indices=indices,
            kv_last_page_len=torch.ones(len(fb.seq_lens_list), dtype=torch.int32),
            qo_indptr=_indptr(fb.extend_lens_list))

    def _decode_wrapper(self, num_q_heads: int) -> Any:
        if self._decode is None:
            group = num_q_heads // self.kv_pool.shape[1]
            self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=group >= TENSOR_CORE_MIN_GROUP)
        return self._decode

    def _plan(self, meta: _Meta, mode: ForwardMode, q: torch.Tensor, scaling: float) -> None:
        _, num_kv_heads, head_dim = self.kv_pool.shape
        num_q_heads = q.shape[1]
        common = dict(q_data_type=q.dtype, kv_data_type=self.kv_pool.dtype, sm_scale=scaling)
        if mode == ForwardMode.DECODE:
            self._decode_wrapper(num_q_heads).plan(
                meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, num_q_heads,
                num_kv_heads, head_dim, 1, **common)
        else:
            self._prefill.plan(
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                num_q_heads, num_kv_heads, head_dim, 1, causal=True, **common)
        meta.planned_scale = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, fb: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        meta = fb.attn_metadata
        assert isinstance(meta, _Meta), "init_forward_metadata must run before the layers"
        q = q.contiguous()
        if meta.planned_scale != scaling:
            self._plan(meta, fb.mode, q, scaling)
        paged = (pool.k_buffers[layer_id].unsqueeze(1), pool.v_buffers[layer_id].unsqueeze(1))
        wrapper = self._decode if fb.mode == ForwardMode.DECODE else self._prefill
        assert wrapper is not None
        return wrapper.run(q, paged)
