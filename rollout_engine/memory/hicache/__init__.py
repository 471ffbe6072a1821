"""Hierarchical KV cache (SGLang's HiCache): host tier L2 and storage tier L3 under the radix
tree. ``create_prefix_cache`` picks the cache the flags ask for.

One scheduler step, as the tiers see it::

    arrival    prefetch(rid)        L3 blocks after what the tree holds: query + io threads
    admission  prefetch_pending     by policy, the request waits aside; later ones go ahead
               load_back            L3 blocks -> host; host-only nodes get device slots, copy
                                    queued (no data moves yet)
    forward    commit_loads         every queued row of the step: one gather from the host
                                    buffer, one scatter per layer and K/V, then the forward
    after      insert / evict       write_through backs new nodes up; eviction keeps backed-up
                                    nodes host-only

Loads are not overlapped with the forward layer by layer. SGLang does that on CUDA (a copy
stream fills layer i while layer i - 1 computes); on CPU there is no copy engine, a copy runs
on the cores the forward needs, so overlapping could only slow both. The bulk copy per step is
the structure a layer-wise CUDA path would split per layer (``transfers.PendingLoads``)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

from rollout_engine.memory.hicache.hiradix_cache import HiRadixCache
from rollout_engine.memory.hicache.host_pool import HostKVPool, host_pool_slots
from rollout_engine.memory.hicache.storage import create_storage
from rollout_engine.memory.hicache.tiers import StorageTier
from rollout_engine.memory.kv_pool import KVPool, PageAllocator
from rollout_engine.memory.prefix_cache import BasePrefixCache, NoPrefixCache
from rollout_engine.memory.radix_cache import RadixCache

__all__ = ["HiRadixCache", "HostKVPool", "create_prefix_cache", "model_identity",
           "weights_fingerprint"]

# SGLang's file backend reads its directory from this variable; so do we when no flag names one
_SGLANG_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def create_prefix_cache(config: Any, allocator: PageAllocator, kv_pool: KVPool,
                        model: nn.Module) -> BasePrefixCache:
    """NoPrefixCache (disable_radix_cache), RadixCache, or HiRadixCache
    (enable_hierarchical_cache) with a host pool and, by hicache_storage_backend, storage."""
    ps = config.page_size
    if config.disable_radix_cache:
        return NoPrefixCache(page_size=ps)
    if not config.enable_hierarchical_cache:
        return RadixCache(allocator, page_size=ps)
    _, heads, dim = kv_pool.shape
    per_token = 2 * kv_pool.num_layers * heads * dim * torch.empty(
        (), dtype=kv_pool.dtype).element_size()
    slots = host_pool_slots(allocator.num_slots, ps, config.hicache_ratio, config.hicache_size,
                            per_token)
    host = HostKVPool(kv_pool, slots, ps)
    storage = None
    backend = create_storage(
        config.hicache_storage_backend,
        config.hicache_storage_dir or os.environ.get(_SGLANG_DIR_ENV) or None,
        int(config.hicache_storage_max_gb * 2**30))
    if backend is not None:
        prefix = model_identity(config, kv_pool)
        storage = StorageTier(backend, host, lambda: prefix + weights_fingerprint(model),
                              config.hicache_storage_block_tokens,
                              config.hicache_storage_prefetch_policy)
    return HiRadixCache(allocator, host, config.hicache_write_policy, storage, page_size=ps,
                        flush_storage=config.hicache_storage_flush)


def model_identity(config: Any, kv_pool: KVPool) -> bytes:
    """What besides the weights decides a block's bytes: the model's config.json, the KV
    dtype and shape, and the block length."""
    with open(os.path.join(config.model_path, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return (f"model={digest}|dtype={kv_pool.dtype}|layers={kv_pool.num_layers}|"
            f"kv={kv_pool.shape[1:]}|block={config.hicache_storage_block_tokens}|").encode()


@torch.no_grad()
def weights_fingerprint(model: nn.Module) -> bytes:
    """A content hash of the weights now loaded: per parameter its name, shape, dtype, the sum
    of its raw bits as int32 words (exact and order-free, so any one changed element changes it;
    ~10 ms per 40M parameters on CPU, where a float64 sum takes ~0.4 s) and 64 strided elements.
    Two engines on the same checkpoint agree (a restart finds its blocks); a refit to other
    weights changes it. Computed once per weight generation, when storage is first used."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        if flat.numel() == 0:
            continue
        stride = max(1, flat.numel() // 64)
        summary = torch.cat([_bits_sum(flat).view(1), flat[::stride][:64].to(torch.float64)])
        h.update(summary.cpu().numpy().tobytes())
    return b"weights=" + h.hexdigest().encode()


def _bits_sum(flat: torch.Tensor) -> torch.Tensor:
    """Wrapping int32 sum of the tensor's bytes read as int32 words (float64 for the digest)."""
    if (flat.numel() * flat.element_size()) % 4 == 0:
        try:
            return flat.view(torch.int32).sum(dtype=torch.int32).to(torch.float64)
        except RuntimeError:   # storage offset not 4-byte aligned
            pass
    return flat.float().sum().to(torch.float64)
