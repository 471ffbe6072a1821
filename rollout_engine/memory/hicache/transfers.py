"""Moves between the tiers of a HiRadixCache: device -> host backups, host -> device loads,
and host eviction. Functions over the cache (its tree state stays in one class); callers hold
the invariants of ``hiradix_cache.py``: host-held nodes closed under ancestors, the nodes of a
load in progress pinned (``cache._pinned``) so host eviction cannot take them."""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Optional

import torch

from rollout_engine.memory.radix_cache import TreeNode

if TYPE_CHECKING:
    from rollout_engine.memory.hicache.hiradix_cache import HiRadixCache, HiTreeNode

__all__ = ["alloc_host", "backup", "evict_host", "load"]


def backup(cache: HiRadixCache, node: HiTreeNode) -> bool:
    """Copy ``node`` (and its unbacked ancestors first) to the host, then queue its whole
    storage blocks. False if the host tier has no room."""
    chain = []
    n: TreeNode = node
    while n.key and n.host_value is None:  # type: ignore[attr-defined]
        chain.append(n)
        assert n.parent is not None
        n = n.parent
    for n in reversed(chain):
        host_slots = alloc_host(cache, len(n.key))
        if host_slots is None:
            return False
        cache.stats.bytes_to_host += cache.host.backup(n.value, host_slots)
        cache.stats.host_written_tokens += len(n.key)
        n.host_value = host_slots  # type: ignore[attr-defined]
        if cache.storage is not None:
            cache.storage.write_node(cache, n)
    return True


def alloc_host(cache: HiRadixCache, num_tokens: int) -> Optional[torch.Tensor]:
    """Host slots for ``num_tokens`` (whole pages), evicting host-only leaves if short."""
    pages = num_tokens // cache.page_size
    allocator = cache.host.allocator
    if not allocator.can_allocate(pages):
        evict_host(cache, pages * cache.page_size - allocator.available_size())
    slots = allocator.allocate(pages)
    return None if slots is None else torch.tensor(slots, dtype=torch.int64)


def evict_host(cache: HiRadixCache, num_tokens: int) -> int:
    """Drop LRU host-only leaves (and parents that become such) until ``num_tokens`` host
    slots are free; returns host tokens freed."""
    heap = [(n.last_access, id(n), n) for n in cache._iter_nodes() if cache._is_host_leaf(n)]
    heapq.heapify(heap)
    num_freed = 0
    while num_freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if not cache._is_host_leaf(node):
            continue
        parent = node.parent
        assert parent is not None
        num_freed += len(node.key)
        cache._detach(node, [])
        if cache._is_host_leaf(parent):
            heapq.heappush(heap, (parent.last_access, id(parent), parent))
        elif not parent.key:
            cache._drop_namespace_if_empty(parent)
    cache.stats.host_evicted_tokens += num_freed
    if num_freed:
        cache.version += 1
    return num_freed


def load(cache: HiRadixCache, device: list[HiTreeNode],
         hosts: list[HiTreeNode]) -> list[HiTreeNode]:
    """Copy ``hosts`` (host-only, in path order) into fresh device slots, as many whole nodes
    as the pool has room for; the device prefix is locked meanwhile."""
    t0 = time.perf_counter()
    anchor = device[-1] if device else None
    if anchor is not None:
        cache.inc_lock_ref(anchor)
    allocator = cache.allocator
    short = sum(len(n.key) for n in hosts) - allocator.available_size()  # type: ignore
    if short > 0:
        cache.evict(short)
    loaded = []
    for node in hosts:
        pages = allocator.allocate(len(node.key) // cache.page_size)  # type: ignore
        if pages is None:
            break
        slots = torch.tensor(pages, dtype=torch.int64)
        assert node.host_value is not None
        cache.stats.bytes_to_device += cache.host.load(node.host_value, slots)
        node.value = slots
        cache._evictable_size += len(node.key)
        loaded.append(node)
    if anchor is not None:
        cache.dec_lock_ref(anchor)
    if loaded:
        cache.version += 1
        cache.stats.num_loads += 1
        cache.stats.load_seconds += time.perf_counter() - t0
    return loaded
