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

from rollout_engine.memory.prefix_cache import CacheNamespace
from rollout_engine.memory.radix_integrity import check_book, check_links, check_pages, checker
from rollout_engine.memory.radix_node import TreeNode

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


_check = checker("HiRadixCache")


def check_hiradix(book: TreeBook) -> None:
    """Raise CacheIntegrityError naming the first invariant ``book`` breaks."""
    ps = book.page_size
    evictable = protected = num_nodes = 0
    for node in book.nodes:
        check_links(node, book.root, ps, _check)
        if not node.key:
            continue
        where = f"{node!r} (key[:8]={node.key[:8]})"
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
    check_book(book.root, book.retired, (num_nodes, evictable, protected),
               (book.num_nodes, book.evictable_size, book.protected_size),
               book.evictable_leaves, book.in_heap, _check)
    check_pages(book.device_slots, ps, "device", _check)
    check_pages(book.host_slots, ps, "host", _check)
    held = {int(s) // ps for s in book.host_slots.tolist()[::ps]}
    free = book.host_allocator.free_pages()
    _check(not (held & free), "a host page is both free and held by a node")
    _check(len(held) + len(free) == book.host_allocator.num_pages,
           f"host pages leak: held {len(held)} + free {len(free)} != "
           f"{book.host_allocator.num_pages}")
