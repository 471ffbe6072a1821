"""HiRadixCache invariants over both in-memory tiers, as code (called by check_integrity).

Device: as RadixCache (lock counts, sizes, unique page-aligned slots, every evictable device
leaf in the LRU heap), over the nodes that hold device slots. Host: every host slot is either
free in the host allocator or held by exactly one node, never both. Shape: each node holds at
least one tier; device-held and host-held nodes are each closed under ancestors; a node not on
the device is unlocked; a retired namespace keeps only locked (hence device) nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout_engine.memory.prefix_cache import CacheIntegrityError, CacheNamespace

if TYPE_CHECKING:
    from rollout_engine.memory.hicache.hiradix_cache import HiRadixCache

__all__ = ["check_hiradix"]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise CacheIntegrityError(f"HiRadixCache integrity: {message}")


def check_hiradix(cache: HiRadixCache) -> None:
    ps = cache.page_size
    evictable = protected = num_nodes = 0
    for node in cache._iter_nodes():
        where = f"{node!r} (key[:8]={node.key[:8]})"
        expected = node.num_own_locks + sum(c.lock_ref for c in node.children.values())
        _check(node.lock_ref == expected, f"{where}: lock_ref != own locks + children's")
        for child_key, child in node.children.items():
            _check(child.parent is node, f"{where}: child {child!r} has another parent")
            if node is cache.root:
                _check(isinstance(child_key, CacheNamespace), f"root child key {child_key!r}")
                _check(bool(child.children) or child.lock_ref > 0, f"empty ns {child_key} kept")
            else:
                _check(child_key == cache._child_key(child.key), f"{where}: child key mismatch")
        if not node.key:
            continue
        num_nodes += 1
        parent = node.parent
        assert parent is not None
        host = node.host_value  # type: ignore[attr-defined]
        _check(len(node.key) % ps == 0, f"{where}: key length not a multiple of {ps}")
        _check(node.value is not None or host is not None, f"{where}: held by no tier")
        for name, slots in (("device", node.value), ("host", host)):
            if slots is not None:
                _check(slots.dtype == torch.int64 and slots.shape == (len(node.key),),
                       f"{where}: {name} slots {slots.dtype} {tuple(slots.shape)}")
        if node.value is not None:
            _check(not parent.key or parent.value is not None,
                   f"{where}: on the device below a parent that is not")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        else:
            _check(node.lock_ref == 0, f"{where}: locked but not on the device")
        if host is not None:
            _check(not parent.key or parent.host_value is not None,  # type: ignore[attr-defined]
                   f"{where}: on the host below a parent that is not")
    for namespace in cache._retired():
        stack = list(cache.root.children[namespace].children.values())
        while stack:
            node = stack.pop()
            _check(node.lock_ref > 0, f"retired namespace {namespace} keeps unlocked {node!r}")
            stack.extend(node.children.values())
    _check(num_nodes == cache._num_nodes, f"node count {cache._num_nodes} != {num_nodes}")
    _check(evictable == cache._evictable_size, f"evictable {cache._evictable_size}!={evictable}")
    _check(protected == cache._protected_size, f"protected {cache._protected_size}!={protected}")
    _check_pages(cache.cached_slots(), ps, "device")
    host_slots = cache.host_slots()
    _check_pages(host_slots, ps, "host")
    held = {int(s) // ps for s in host_slots.tolist()[::ps]}
    free = cache.host.allocator.free_pages()
    _check(not (held & free), "a host page is both free and held by a node")
    _check(len(held) + len(free) == cache.host.allocator.num_pages,
           f"host pages leak: held {len(held)} + free {len(free)} != "
           f"{cache.host.allocator.num_pages}")
    in_heap = {id(n) for t, _, n in cache._leaf_heap if t == n.last_access}
    for node in cache._iter_nodes():
        if cache._is_evictable_leaf(node):
            _check(id(node) in in_heap, f"evictable leaf {node!r} missing from the LRU heap")


def _check_pages(slots: torch.Tensor, ps: int, tier: str) -> None:
    _check(slots.unique().numel() == slots.numel(), f"a {tier} slot is held twice")
    if ps > 1 and slots.numel():
        pages = slots.view(-1, ps)
        offsets = torch.arange(ps)
        aligned = (pages[:, 0] % ps == 0).all() and (pages - pages[:, :1] == offsets).all()
        _check(bool(aligned), f"{tier} slots are not whole, page-aligned pages")
