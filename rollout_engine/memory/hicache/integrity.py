"""HiRadixCache invariants over both in-memory tiers, as code (called by check_integrity).

Device: as RadixCache (lock counts, sizes, unique page-aligned slots, every evictable device
leaf in the LRU heap), over the nodes that hold device slots. Host: every host slot is either
free in the host allocator or held by exactly one node, never both. Shape: each node holds at
least one tier; device-held and host-held nodes are each closed under ancestors; a node not on
the device is unlocked; a retired namespace keeps only locked (hence device) nodes.

The cache hands its bookkeeping over as a ``TreeBook``; nothing here reads its private state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout_engine.memory.prefix_cache import CacheIntegrityError, CacheNamespace
from rollout_engine.memory.radix_node import TreeNode, child_key

__all__ = ["TreeBook", "check_hiradix"]


@dataclass(frozen=True)
class TreeBook:
    """A HiRadixCache's tree and what its bookkeeping says of it, at one moment."""

    root: TreeNode
    nodes: list[TreeNode]                  # every node, root and namespace roots included
    retired: list[CacheNamespace]          # namespaces of retired weight generations
    num_nodes: int                         # token-holding nodes, as counted
    evictable_size: int                    # device tokens of unlocked nodes, as counted
    protected_size: int                    # device tokens of locked nodes, as counted
    page_size: int
    in_heap: set[int]                      # ids of the nodes with a live LRU heap entry
    evictable_leaves: list[TreeNode]       # the nodes device eviction may take now
    device_slots: torch.Tensor             # every node's device slots, concatenated
    host_slots: torch.Tensor               # every node's host slots, concatenated
    host_allocator: Any                    # the host tier's page allocator


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise CacheIntegrityError(f"HiRadixCache integrity: {message}")


def check_hiradix(book: TreeBook) -> None:
    """Raise CacheIntegrityError naming the first invariant ``book`` breaks."""
    ps = book.page_size
    evictable = protected = num_nodes = 0
    for node in book.nodes:
        where = f"{node!r} (key[:8]={node.key[:8]})"
        expected = node.num_own_locks + sum(c.lock_ref for c in node.children.values())
        _check(node.lock_ref == expected, f"{where}: lock_ref != own locks + children's")
        for key, child in node.children.items():
            _check(child.parent is node, f"{where}: child {child!r} has another parent")
            if node is book.root:
                _check(isinstance(key, CacheNamespace), f"root child key {key!r}")
                _check(bool(child.children) or child.lock_ref > 0, f"empty ns {key} kept")
            else:
                _check(key == child_key(child.key, ps), f"{where}: child key mismatch")
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
    for namespace in book.retired:
        stack = list(book.root.children[namespace].children.values())
        while stack:
            node = stack.pop()
            _check(node.lock_ref > 0, f"retired namespace {namespace} keeps unlocked {node!r}")
            stack.extend(node.children.values())
    _check(num_nodes == book.num_nodes, f"node count {book.num_nodes} != {num_nodes}")
    _check(evictable == book.evictable_size, f"evictable {book.evictable_size}!={evictable}")
    _check(protected == book.protected_size, f"protected {book.protected_size}!={protected}")
    _check_pages(book.device_slots, ps, "device")
    _check_pages(book.host_slots, ps, "host")
    held = {int(s) // ps for s in book.host_slots.tolist()[::ps]}
    free = book.host_allocator.free_pages()
    _check(not (held & free), "a host page is both free and held by a node")
    _check(len(held) + len(free) == book.host_allocator.num_pages,
           f"host pages leak: held {len(held)} + free {len(free)} != "
           f"{book.host_allocator.num_pages}")
    for node in book.evictable_leaves:
        _check(id(node) in book.in_heap, f"evictable leaf {node!r} missing from the LRU heap")


def _check_pages(slots: torch.Tensor, ps: int, tier: str) -> None:
    _check(slots.unique().numel() == slots.numel(), f"a {tier} slot is held twice")
    if ps > 1 and slots.numel():
        pages = slots.view(-1, ps)
        offsets = torch.arange(ps)
        aligned = (pages[:, 0] % ps == 0).all() and (pages - pages[:, :1] == offsets).all()
        _check(bool(aligned), f"{tier} slots are not whole, page-aligned pages")
