"""A request's KV between the pool and one contiguous buffer ``[layers, 2, tokens, heads, dim]``.

``gather`` writes the pool rows of ``slots`` straight into the buffer (a shared-memory segment on
the prefill side: no staging copy on CPU); ``scatter`` writes a buffer's rows into ``slots`` of
the decode side's pool.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_engine.memory.kv_pool import KVPool


def layout(pool: KVPool) -> dict[str, Any]:
    """What must agree between the two servers for their KV to be interchangeable."""
    _, heads, dim = pool.shape
    return {"layers": pool.num_layers, "heads": heads, "dim": dim,
            "dtype": str(pool.dtype).removeprefix("torch.")}


def shape(pool: KVPool, tokens: int) -> tuple[int, ...]:
    _, heads, dim = pool.shape
    return (pool.num_layers, 2, tokens, heads, dim)


def nbytes(pool: KVPool, tokens: int) -> int:
    n = pool.dtype.itemsize
    for d in shape(pool, tokens):
        n *= d
    return n


def gather(pool: KVPool, slots: list[int], out: torch.Tensor) -> None:
    """``out[l, 0 | 1, i] = K | V of layer l at slots[i]``."""
    idx = torch.tensor(slots, dtype=torch.int64, device=pool.device)
    same = out.device == pool.device
    for layer in range(pool.num_layers):
        for j, buffers in enumerate((pool.k_buffers, pool.v_buffers)):
            if same:
                torch.index_select(buffers[layer], 0, idx, out=out[layer, j])
            else:
                out[layer, j].copy_(buffers[layer].index_select(0, idx))


def scatter(pool: KVPool, slots: list[int], src: torch.Tensor) -> None:
    """``K | V of layer l at slots[i] = src[l, 0 | 1, i]``."""
    idx = torch.tensor(slots, dtype=torch.int64, device=pool.device)
    for layer in range(pool.num_layers):
        for j, buffers in enumerate((pool.k_buffers, pool.v_buffers)):
            buffers[layer].index_copy_(0, idx, src[layer, j].to(pool.device))
