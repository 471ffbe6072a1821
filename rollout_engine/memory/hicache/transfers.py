"""Moves between the tiers of a HiRadixCache: device -> host backups, host -> device loads,
and host eviction. Functions over the cache's public surface (``node.HostTree``; its tree state
stays in one class); callers hold the invariants of ``hiradix_cache.py``: host-held nodes
closed under ancestors, the nodes of a load in progress pinned (``HostTree.is_host_leaf`` is
False for them) so host eviction cannot take them.

Loads are bulk, once per step: each admission's ``load`` only allocates device slots and queues
its copy; ``PendingLoads.commit`` copies every queued row at once (``HostKVPool.load``: on CPU
a gather from the host rows and a scatter into the pool per layer and K/V; on CUDA one gather
into pinned memory, one non-blocking copy, a scatter per layer). Copies are not overlapped
with the forward layer by layer (SGLang's layer-wise load): on CPU there is no copy engine to
overlap with, a copy takes the same cores the forward would use."""

from __future__ import annotations

import heapq
import time
from typing import Optional

import torch

from rollout_engine.memory.hicache.host_pool import HostKVPool
from rollout_engine.memory.hicache.node import HiTreeNode, HostTree
from rollout_engine.memory.hicache.stats import HiCacheStats
from rollout_engine.memory.radix_node import TreeNode

__all__ = ["PendingLoads", "alloc_host", "backup_one", "evict_host", "load", "unbacked_chain"]


def unbacked_chain(node: HiTreeNode) -> list[HiTreeNode]:
    """``node`` and its ancestors without a host copy, root side first (the order a backup
    copies them in, keeping host-held nodes closed under ancestors)."""
    chain = []
    n: TreeNode = node
    while n.key and n.host_value is None:  # type: ignore[attr-defined]
        chain.append(n)
        assert n.parent is not None
        n = n.parent
    return chain[::-1]  # type: ignore[return-value]


def backup_one(cache: HostTree, node: HiTreeNode) -> bool:
    """Copy the device-held ``node``, whose parent is backed up, to fresh host slots. False
    (nothing changed) if the host tier has no room."""
    host_slots = cache.alloc_host(len(node.key))
    if host_slots is None:
        return False
    cache.stats.bytes_to_host += cache.host.backup(node.value, host_slots)
    cache.stats.host_written_tokens += len(node.key)
    node.host_value = host_slots
    return True


def alloc_host(cache: HostTree, num_tokens: int) -> Optional[torch.Tensor]:
    """Host slots for ``num_tokens`` (whole pages), evicting host-only leaves if short."""
    pages = num_tokens // cache.page_size
    allocator = cache.host.allocator
    if not allocator.can_allocate(pages):
        evict_host(cache, pages * cache.page_size - allocator.available_size())
    slots = allocator.allocate(pages)
    return None if slots is None else torch.tensor(slots, dtype=torch.int64)


def evict_host(cache: HostTree, num_tokens: int) -> int:
    """Drop LRU host-only leaves (and parents that become such) until ``num_tokens`` host
    slots are free; returns host tokens freed."""
    heap = [(n.last_access, id(n), n) for n in cache.host_leaves()]
    heapq.heapify(heap)
    num_freed = 0
    while num_freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if not cache.is_host_leaf(node):
            continue
        parent = node.parent
        assert parent is not None
        num_freed += len(node.key)
        cache.drop_host_leaf(node)
        if cache.is_host_leaf(parent):
            heapq.heappush(heap, (parent.last_access, id(parent), parent))  # type: ignore
    cache.stats.host_evicted_tokens += num_freed
    if num_freed:
        cache.version += 1
    return num_freed


def load(cache: HostTree, device: list[HiTreeNode],
         hosts: list[HiTreeNode]) -> list[HiTreeNode]:
    """Give ``hosts`` (host-only, in path order) fresh device slots, as many whole nodes as
    the pool has room for, and queue their copy (``cache.queue_load``: one bulk copy per step,
    before the forward); the device prefix is locked meanwhile."""
    t0 = time.perf_counter()
    anchor = device[-1] if device else None
    if anchor is not None:
        cache.inc_lock_ref(anchor)
    allocator = cache.allocator
    short = sum(len(n.key) for n in hosts) - allocator.available_size()  # type: ignore
    if short > 0:
        cache.evict(short)
    room = allocator.available_size()  # type: ignore
    loaded: list[HiTreeNode] = []
    num_tokens = 0
    for node in hosts:
        if num_tokens + len(node.key) > room:
            break
        loaded.append(node)
        num_tokens += len(node.key)
    if loaded:
        pages = allocator.allocate(num_tokens // cache.page_size)  # type: ignore
        assert pages is not None, "the allocator had room and refused it"
        slots = torch.tensor(pages, dtype=torch.int64)
        cache.attach_device_slots(loaded, slots)
        cache.queue_load(torch.cat([n.host_value for n in loaded]), slots)  # type: ignore
    if anchor is not None:
        cache.dec_lock_ref(anchor)
    cache.stats.load_seconds += time.perf_counter() - t0
    return loaded


class PendingLoads:
    """Host -> device copies queued by the step's admissions, done together (``commit``).
    Until then the device slots hold no valid KV: the cache commits before it frees any of
    them, and the scheduler before every forward."""

    def __init__(self) -> None:
        self.host: list[torch.Tensor] = []
        self.device: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self.host)

    def add(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.host.append(host_slots)
        self.device.append(device_slots)

    def overlaps(self, freed: torch.Tensor) -> bool:
        return bool(self.device) and bool(torch.isin(freed, torch.cat(self.device)).any())

    def commit(self, host: HostKVPool, stats: HiCacheStats) -> None:
        """Copy every queued row from ``host`` into the device pool; counted in ``stats``."""
        if not self.host:
            return
        t0 = time.perf_counter()
        host_slots, device_slots = torch.cat(self.host), torch.cat(self.device)
        self.host, self.device = [], []
        stats.bytes_to_device += host.load(host_slots, device_slots)
        stats.num_loads += 1
        stats.load_seconds += time.perf_counter() - t0
